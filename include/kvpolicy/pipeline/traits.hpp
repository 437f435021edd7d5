// Compile-time questions an executor asks of a pipeline's stages.
#pragma once

#include <concepts>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/row_ref.hpp"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN

// Candidates of a row of T tokens: keys [0, candidate_end) get a score; the rest
// are kept as they are.
template <Scorer S>
KVP_HOST_DEVICE constexpr std::int32_t candidate_end(const S& s, std::int32_t T) noexcept {
  if constexpr (AttentionScorer<S>) {
    return s.key_end(T);
  } else {
    return T;
  }
}

template <Scorer S>
KVP_HOST_DEVICE constexpr std::int32_t scorer_window(const S& s) noexcept {
  if constexpr (AttentionScorer<S>) {
    return s.window;
  } else {
    return 0;
  }
}

// Whether an aggregator (or either half of a `then`) reads and writes F.
template <class A>
constexpr bool uses_score_cache() noexcept {
  if constexpr (TemporalAggregator<A>) {
    return true;
  } else if constexpr (detail::is_then<A>::value) {
    return uses_score_cache<decltype(A{}.first)>() || uses_score_cache<decltype(A{}.second)>();
  } else {
    return false;
  }
}

// Whether a layout moves kept tokens (and so shortens the sequence); `none` does not.
template <Layout L>
KVP_HOST_DEVICE constexpr bool moves_tokens() noexcept {
  if constexpr (std::same_as<L, none>) {
    return false;
  } else {
    return L::moves_tokens;
  }
}

// Whether a layout runs over each item's window only (batch_item::window_begin).
template <Layout L>
KVP_HOST_DEVICE constexpr bool window_only() noexcept {
  if constexpr (requires { L::window_only; }) {
    return L::window_only;
  } else {
    return false;
  }
}

// Whether a layout fills the evicted slots below the kept count (layout::fill)
// instead of moving the i-th kept token to destination(i).
template <Layout L>
KVP_HOST_DEVICE constexpr bool fills_holes() noexcept {
  if constexpr (requires { requires L::fills_holes; }) {
    return true;
  } else {
    return false;
  }
}

// A key scorer's score of the key k at position t of T in the row of head h, by the
// hook's form (with or without the head index).
template <KeyScorer S>
KVP_HOST_DEVICE constexpr float key_score_of(const S& s, const row_ref& k, std::int32_t t, std::int32_t T,
                                             head_index h) noexcept {
  if constexpr (requires { s.key_score(k, t, T, h); }) {
    return s.key_score(k, t, T, h);
  } else {
    return s.key_score(k, t, T);
  }
}

// A budget selector's keep count for the row of head h, by the hook's form.
template <BudgetSelector Sel>
KVP_HOST_DEVICE constexpr std::int32_t budget_keep_count(const Sel& s, std::int32_t T, std::int32_t budget,
                                                         head_index h) noexcept {
  if constexpr (requires { s.keep_count(T, budget, h); }) {
    return s.keep_count(T, budget, h);
  } else {
    return s.keep_count(T, budget);
  }
}

// Whether every row of a batch item keeps the same count, whatever its head and
// scores: then one count is the item's new length, known from any of its rows.
template <Selector Sel>
inline constexpr bool uniform_counts =
    std::same_as<Sel, none> || PatternSelector<Sel> ||
    (BudgetSelector<Sel> && !ScoreDependentSelector<Sel> &&
     !requires(const Sel& s, std::int32_t t, head_index h) { s.keep_count(t, t, h); });

// Tokens a row always keeps: sinks, the protected window and the non-candidates.
KVP_HOST_DEVICE constexpr std::int32_t protected_count(std::int32_t T, std::int32_t candidates, std::int32_t sinks,
                                                       std::int32_t window) noexcept {
  const std::int32_t tail_begin = (T - window) < candidates ? (T - window) : candidates;
  const std::int32_t tail = T - (tail_begin > 0 ? tail_begin : 0);
  const std::int32_t head = sinks < T - tail ? sinks : T - tail;
  return head + tail;
}

KVP_NAMESPACE_END
