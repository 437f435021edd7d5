// Host reference of the Aggregator stage over one row of candidate scores.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// One row's view of F: the history of each candidate, read and written in place.
// S <- combine(F, S) for t < history; then F <- S for all t.
template <TemporalAggregator A>
void apply_temporal(const A& a, std::span<float> s, std::span<float> f, std::int32_t history) {
  if (a.max_norm) {
    float m = 0.0f;
    for (float v : s) m = std::max(m, v);
    if (m > 0.0f)
      for (float& v : s) v /= m;
  }
  const auto h = std::min<std::size_t>(static_cast<std::size_t>(std::max(history, 0)), s.size());
  for (std::size_t t = 0; t < h; ++t) s[t] = a.combine(f[t], s[t]);
  std::copy(s.begin(), s.end(), f.begin());
}

// Pooling with clipped windows: out[t] = finish(fold over [t - k/2, t + k/2] clipped).
template <SpatialAggregator A>
void apply_pool(const A& a, std::span<float> s) {
  const std::int32_t n = static_cast<std::int32_t>(s.size()), r = a.kernel / 2;
  const std::vector<float> in(s.begin(), s.end());
  for (std::int32_t t = 0; t < n; ++t) {
    const std::int32_t lo = std::max(0, t - r), hi = std::min(n - 1, t + r);
    float acc = a.identity();
    for (std::int32_t u = lo; u <= hi; ++u) acc = a.reduce(acc, in[u]);
    s[t] = a.finish(acc, hi - lo + 1);
  }
}

}  // namespace host
KVP_NAMESPACE_END
