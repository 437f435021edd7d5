// Kara eq. 4: bidirectional attention among the tokens of a window.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/scorer/reductions.hpp"

KVP_NAMESPACE_BEGIN
namespace scorer {

// score(t) = sum_j group_reduce_g softmax_t(q_{j,g} . k_t / sqrt(d)) over the `window`
// queries of the window and its keys t in [0, window - buffer): every query sees
// every key (no causal mask), the buffer's keys are not scored and are kept.
// Runs over the window of each sequence (batch_item::window_begin, with
// layout::window_compact), so position 0 is the window's first token; the query
// slot holds the window's own queries, oldest first. GQA: Kara's paper does not say
// how a group combines; sum is the default (SPEC.md, "Bidirectional window").
struct bidirectional_window {
  std::int32_t window = 768;  // |W|: queries, and tokens of the window
  std::int32_t buffer = 32;   // |U|: the window's newest tokens, never evicted
  group_reduce group = group_reduce::sum;
  window_reduce reduce = window_reduce::sum;  // colsum over the queries

  KVP_HOST_DEVICE constexpr float transform(float p) const noexcept { return p; }
  KVP_HOST_DEVICE constexpr bool visible(std::int32_t, std::int32_t) const noexcept { return true; }
  KVP_HOST_DEVICE constexpr std::int32_t visible_end(std::int32_t) const noexcept { return INT32_MAX; }
  KVP_HOST_DEVICE constexpr bool contributes(std::int32_t, std::int32_t) const noexcept { return true; }
  // The compressible region W \ U: the first window - buffer tokens of the window.
  KVP_HOST_DEVICE constexpr std::int32_t key_end(std::int32_t) const noexcept { return window - buffer; }
};

}  // namespace scorer
KVP_NAMESPACE_END
