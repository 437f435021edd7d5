// StreamingLLM: keep the first `sinks` tokens and the most recent ones, ignore scores.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace select {

struct sinks_recent {
  std::int32_t sinks = 4;

  // Position is the rank: sinks first, then recency. Scores are ignored, except the
  // +inf of protect (SPEC: window and sink tokens are always kept): protected tokens
  // rank first, then this selector's sinks, then recency, so nothing protected is
  // evicted when protect's sinks or window differ from this selector's.
  KVP_HOST_DEVICE constexpr float rank_key(float score, std::int32_t t, std::int32_t) const noexcept {
    if (score == __builtin_huge_valf()) return score;
    return t < sinks ? __FLT_MAX__ : static_cast<float>(t);
  }
  KVP_HOST_DEVICE constexpr std::int32_t keep_count(std::int32_t, std::int32_t budget) const noexcept {
    return budget;
  }
};

}  // namespace select
KVP_NAMESPACE_END
