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
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/exec/host/selector_row.hpp"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"
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

// Scores that are NaN or infinite among the candidates (before protect): what an
// engine logs, since they rank by the rule of docs/pipeline.md, not by their value.
inline std::int32_t count_nonfinite(std::span<const float> candidates) {
  return static_cast<std::int32_t>(
      std::count_if(candidates.begin(), candidates.end(), [](float x) { return !std::isfinite(x); }));
}

// The final scores before protect, as a selector that sees protected scores reads
// them (row_token::before_protect): `s` as it was, -inf past the candidates (no score)
// and where the head dropped the token (`alive`, empty: none dropped).
inline std::vector<float> scores_before_protect(std::span<const float> s, std::int32_t candidates,
                                                std::span<const std::uint8_t> alive) {
  std::vector<float> out(s.begin(), s.end());
  for (std::size_t t = 0; t < out.size(); ++t)
    if (static_cast<std::int32_t>(t) >= candidates || (!alive.empty() && !alive[t]))
      out[t] = -std::numeric_limits<float>::infinity();
  return out;
}

// How many tokens a row keeps. `s`: the final scores (after protect), `raw`: the
// scorer's before aggregation, `before_protect`: the final scores before protect
// (scores_before_protect; empty unless the selector sees protected scores); `must`:
// the protected tokens; `live`: the tokens the head still holds (cautious update; the
// row's T without a live view), which bound it.
template <Selector Sel>
std::int32_t keep_count(const Sel& sel, std::span<const float> s, std::span<const float> raw,
                        std::span<const float> before_protect, std::int32_t candidates, std::int32_t must,
                        std::int32_t budget, head_index head, std::int32_t slot, std::int32_t live) {
  if constexpr (std::same_as<Sel, none>) {
    return live;
  } else if constexpr (ScoreDependentSelector<Sel>) {
    const std::int32_t n =
        sel.row_keep_count(selector_row(s, raw, candidates, must, head, slot, before_protect), budget);
    return std::clamp(n, must, live);
  } else {
    return std::min(budget_keep_count(sel, live, budget, head), live);  // a budget past the held tokens
  }
}

// keep[t] = 1 for the `count` tokens of highest rank; every token without a selector.
// `alive` (empty: every token): tokens a head dropped before rank below all others.
template <Selector Sel>
std::vector<std::uint8_t> select_top(const Sel& sel, std::span<const float> s, std::int32_t count,
                                     std::span<const std::uint8_t> alive = {}) {
  const auto T = static_cast<std::int32_t>(s.size());
  if constexpr (std::same_as<Sel, none>) {
    if (!alive.empty()) return std::vector<std::uint8_t>(alive.begin(), alive.end());
    return std::vector<std::uint8_t>(static_cast<std::size_t>(T), 1);
  } else {
    std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 0);
    std::vector<float> key(static_cast<std::size_t>(T));
    for (std::int32_t t = 0; t < T; ++t) key[t] = sel.rank_key(s[t], t, T);
    const auto held = [&](std::int32_t t) { return alive.empty() || alive[t] != 0; };
    std::vector<std::int32_t> order(static_cast<std::size_t>(T));
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + count, order.end(), [&](std::int32_t a, std::int32_t b) {
      return held(a) != held(b) ? held(a) : ranks_before(key[a], a, key[b], b);
    });
    for (std::int32_t i = 0; i < count; ++i) keep[order[i]] = 1;
    return keep;
  }
}

}  // namespace host
KVP_NAMESPACE_END
