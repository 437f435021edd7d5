// SnapKV / Zipage C.2 / G-KV window attention: how much the last w queries attend to each key.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/scorer/reductions.hpp"

KVP_NAMESPACE_BEGIN
namespace scorer {

// score(t) = window_reduce_j group_reduce_g softmax_t(q_{j,g} . k_t / sqrt(d)).
// The query of window entry j sits at position p_j = T - window + j; inside the
// window a key t > p_j is masked before the softmax (causal).
struct window_attention {
  std::int32_t window = 16;
  group_reduce group = group_reduce::max;
  window_reduce reduce = window_reduce::mean;
  bool causal = true;
  // R-KV variant: only the T - window keys before the window are scored (and are
  // the only candidates); the window is kept whole.
  bool keys_before_window = false;

  // Applied to each probability before the reductions.
  KVP_HOST_DEVICE constexpr float transform(float p) const noexcept { return p; }
  // Softmax mask: does the query at position pj see key t?
  KVP_HOST_DEVICE constexpr bool visible(std::int32_t pj, std::int32_t t) const noexcept {
    return !causal || t <= pj;
  }
  // Every key below this is visible to the query at pj (the concept's optional hint).
  KVP_HOST_DEVICE constexpr std::int32_t visible_end(std::int32_t pj) const noexcept {
    return causal ? pj + 1 : INT32_MAX;  // a macro: numeric_limits is host-only under nvcc
  }
  // After the softmax: does the query at pj add to key t's score?
  KVP_HOST_DEVICE constexpr bool contributes(std::int32_t, std::int32_t) const noexcept { return true; }
  // Candidates are keys [0, key_end(T)).
  KVP_HOST_DEVICE constexpr std::int32_t key_end(std::int32_t T) const noexcept {
    return keys_before_window ? T - window : T;
  }
};

// H2O: the same probabilities summed over the window; pair with aggregate::accumulate
// so the score is the running sum over every query ever observed.
struct h2o : window_attention {
  constexpr h2o() noexcept : window_attention{16, group_reduce::max, window_reduce::sum, true, false} {}
};

}  // namespace scorer
KVP_NAMESPACE_END
