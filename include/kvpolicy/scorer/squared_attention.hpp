// KV-Compress L2 metric (sec. 4.3): squared attention probabilities, summed.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/scorer/reductions.hpp"

KVP_NAMESPACE_BEGIN
namespace scorer {

struct squared_attention {
  std::int32_t window = 32;
  group_reduce group = group_reduce::sum;
  window_reduce reduce = window_reduce::sum;
  bool causal = true;
  // Excluded distance v: a query at p_j adds nothing to keys with p_j - t < v
  // (it still takes part in the softmax).
  std::int32_t excluded_distance = 0;

  KVP_HOST_DEVICE constexpr float transform(float p) const noexcept { return p * p; }
  KVP_HOST_DEVICE constexpr bool visible(std::int32_t pj, std::int32_t t) const noexcept {
    return !causal || t <= pj;
  }
  // Every key below this is visible to the query at pj (the concept's optional hint).
  KVP_HOST_DEVICE constexpr std::int32_t visible_end(std::int32_t pj) const noexcept {
    return causal ? pj + 1 : INT32_MAX;  // a macro: numeric_limits is host-only under nvcc
  }
  KVP_HOST_DEVICE constexpr bool contributes(std::int32_t pj, std::int32_t t) const noexcept {
    return pj - t >= excluded_distance;
  }
  KVP_HOST_DEVICE constexpr std::int32_t key_end(std::int32_t T) const noexcept { return T; }
};

}  // namespace scorer
KVP_NAMESPACE_END
