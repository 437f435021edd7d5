// Host reference of protect and select over one row of scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/select/protect.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// Sinks, the window and the non-candidates [candidates, T) get +inf.
inline void apply_protect(const protect& p, std::span<float> s, std::int32_t candidates) {
  const auto T = static_cast<std::int32_t>(s.size());
  for (std::int32_t t = 0; t < T; ++t)
    if (p.covers(t, T) || t >= candidates) s[t] = std::numeric_limits<float>::infinity();
}

// keep[t] = 1 for the keep_count(T, budget) tokens of highest rank.
template <Selector Sel>
std::vector<std::uint8_t> select_keep(const Sel& sel, std::span<const float> s, std::int32_t budget) {
  const auto T = static_cast<std::int32_t>(s.size());
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 0);
  const std::int32_t k = sel.keep_count(T, budget);
  std::vector<float> key(static_cast<std::size_t>(T));
  for (std::int32_t t = 0; t < T; ++t) key[t] = sel.rank_key(s[t], t, T);
  std::vector<std::int32_t> order(static_cast<std::size_t>(T));
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + k, order.end(),
                   [&](std::int32_t a, std::int32_t b) { return ranks_before(key[a], a, key[b], b); });
  for (std::int32_t i = 0; i < k; ++i) keep[order[i]] = 1;
  return keep;
}

}  // namespace host
KVP_NAMESPACE_END
