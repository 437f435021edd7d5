// Uniform top-k (Zipage, R-KV, SnapKV): every KV head keeps the batch item's budget.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace select {

// A selector ranks tokens by rank_key, descending; equal keys go to the more recent
// token, so host and device agree bit for bit. It keeps keep_count tokens.
struct top_k {
  KVP_HOST_DEVICE constexpr float rank_key(float score, std::int32_t, std::int32_t) const noexcept { return score; }
  KVP_HOST_DEVICE constexpr std::int32_t keep_count(std::int32_t, std::int32_t budget) const noexcept {
    return budget;
  }
};

}  // namespace select
KVP_NAMESPACE_END
