// The policy concepts. Each names the exact expressions an executor calls; a type
// that provides them composes with every other stage and runs on host and device.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/none.hpp"
#include "kvpolicy/core/row_ref.hpp"
#include "kvpolicy/redundancy/redundancy.hpp"
#include "kvpolicy/scorer/reductions.hpp"
#include "kvpolicy/select/selector_row.hpp"

KVP_NAMESPACE_BEGIN

// Every policy is a small value passed by copy into kernels.
template <class P>
concept Policy = std::is_trivially_copyable_v<P> && std::is_default_constructible_v<P>;

// Scores from the observation queries. Given `const S s; float p; int32_t j, t, T;`:
//   s.window            -> int32_t        queries of the window
//   s.group             -> group_reduce   over the GQA group
//   s.reduce            -> window_reduce  over the window
//   s.transform(p)      -> float          applied to each probability
//   s.visible(j, t)     -> bool           softmax mask: query at position j sees key t
//   s.contributes(j, t) -> bool           after the softmax: the query adds to key t
//   s.key_end(T)        -> int32_t        candidates are keys [0, key_end(T))
// Optional, a hint for kernels:
//   s.visible_end(j)    -> int32_t        every key t < visible_end(j) is visible to j,
//                                         so tiles below it skip the mask test
template <class S>
concept AttentionScorer = Policy<S> && requires(const S& s, float p, std::int32_t i) {
  { s.window } -> std::convertible_to<std::int32_t>;
  { s.group } -> std::convertible_to<group_reduce>;
  { s.reduce } -> std::convertible_to<window_reduce>;
  { s.transform(p) } -> std::same_as<float>;
  { s.visible(i, i) } -> std::same_as<bool>;
  { s.contributes(i, i) } -> std::same_as<bool>;
  { s.key_end(i) } -> std::same_as<std::int32_t>;
};

// Scores from each key alone (e.g. key norm). Given `const S s; row_ref k; int32_t t, T;
// head_index h;`, one of:
//   s.key_score(k, t, T)    -> float   score of the key k at position t of T
//   s.key_score(k, t, T, h) -> float   ... of the row's (layer, KV head) h
template <class S>
concept KeyScorer = Policy<S> && (requires(const S& s, row_ref k, std::int32_t t) {
                      { s.key_score(k, t, t) } -> std::same_as<float>;
                    } || requires(const S& s, row_ref k, std::int32_t t, head_index h) {
                      { s.key_score(k, t, t, h) } -> std::same_as<float>;
                    });

template <class S>
concept Scorer = std::same_as<S, none> || AttentionScorer<S> || KeyScorer<S>;

// Across compressions, through the score cache F. Given `const A a; float f, s;`:
//   a.combine(f, s) -> float   new score of a token with history f and current score s
//   a.max_norm      -> bool    divide S by its per-head max first
template <class A>
concept TemporalAggregator = Policy<A> && requires(const A& a, float f) {
  { a.combine(f, f) } -> std::same_as<float>;
  { a.max_norm } -> std::convertible_to<bool>;
};

// Along the token axis. Given `const A a; float x; int32_t n;`:
//   a.kernel, a.first_only               window width (odd); pool only on the first compression
//   a.identity(), a.reduce(x, x), a.finish(x, n) -> float   a fold over each clipped window of n
template <class A>
concept SpatialAggregator = Policy<A> && requires(const A& a, float x, std::int32_t n) {
  { a.kernel } -> std::convertible_to<std::int32_t>;
  { a.first_only } -> std::convertible_to<bool>;
  { a.identity() } -> std::same_as<float>;
  { a.reduce(x, x) } -> std::same_as<float>;
  { a.finish(x, n) } -> std::same_as<float>;
};

namespace detail {
template <class A>
struct is_then : std::false_type {};
template <template <class, class> class T, class A, class B>
  requires requires(T<A, B> t) { t.first; t.second; }
struct is_then<T<A, B>> : std::true_type {};
}  // namespace detail

template <class A>
concept Aggregator = std::same_as<A, none> || TemporalAggregator<A> || SpatialAggregator<A> ||
                     (detail::is_then<A>::value && Policy<A> && requires(const A& a) {
                       requires(TemporalAggregator<decltype(a.first)> || SpatialAggregator<decltype(a.first)>);
                       requires(TemporalAggregator<decltype(a.second)> || SpatialAggregator<decltype(a.second)>);
                     });

// Key redundancy. Given `const R r; float s, x;`:
//   R::pairs                      redundancy::scope   which pairs are compared
//   r.theta, r.tau, r.eps -> float   similarity threshold, softmax temperature, norm epsilon
//   r.combine(s, x)  -> float     the score after combining score s with redundancy x
template <class R>
concept Redundancy = std::same_as<R, none> || (Policy<R> && requires(const R& r, float s) {
                       { R::pairs } -> std::convertible_to<redundancy::scope>;
                       { r.theta } -> std::convertible_to<float>;
                       { r.tau } -> std::convertible_to<float>;
                       { r.eps } -> std::convertible_to<float>;
                       { r.combine(s, s) } -> std::same_as<float>;
                     });

// Scores -> keep mask. A selector ranks the tokens of a row and keeps a count of the
// top ones. Given `const S s; float x; int32_t t, T, k;`:
//   s.rank_key(x, t, T) -> float    tokens are kept by descending key; ties go to the larger t
template <class S>
concept RankingSelector = Policy<S> && requires(const S& s, float x, std::int32_t t) {
  { s.rank_key(x, t, t) } -> std::same_as<float>;
};

// The count known before any score (every head alike, or per head). Given also
// `head_index h;`, one of:
//   s.keep_count(T, k)     -> int32_t  how many to keep, given the batch item's budget k
//   s.keep_count(T, k, h)  -> int32_t  ... in the row's (layer, KV head) h
template <class S>
concept BudgetSelector = RankingSelector<S> && (requires(const S& s, std::int32_t t) {
                           { s.keep_count(t, t) } -> std::same_as<std::int32_t>;
                         } || requires(const S& s, std::int32_t t, head_index h) {
                           { s.keep_count(t, t, h) } -> std::same_as<std::int32_t>;
                         });

// The count read off the row's scores (top-p mass, a calibrated temperature). Given
// the row `row` of select/selector_row.hpp:
//   s.row_keep_count(row, k) -> int32_t  how many to keep; the executor keeps at least
//                                        the protected tokens and at most the row
template <class S>
concept ScoreDependentSelector =
    RankingSelector<S> && requires(const S& s, const detail::selector_row_archetype& row, std::int32_t k) {
      { s.row_keep_count(row, k) } -> std::same_as<std::int32_t>;
    };

// A pattern read off the candidates' scores, not the top of a count (Token2Chunk):
// how many it keeps is known before the scores, which ones are not a rank cut.
// Given `const S s; int32_t n, k; std::span<const float> a; std::span<uint8_t> keep;`:
//   s.region_keep(n, k)         -> int32_t  candidates kept of n, for the item's budget k
//   s.keep_pattern(a, k, keep)               host: keep[t] for the candidates t < a.size()
// The GPU runs a pattern selector through its own stage kind (stage_kinds.cuh).
template <class S>
concept PatternSelector =
    Policy<S> && requires(const S& s, std::int32_t n, std::span<const float> a, std::span<std::uint8_t> keep) {
      { s.region_keep(n, n) } -> std::same_as<std::int32_t>;
      s.keep_pattern(a, n, keep);
    };

template <class S>
concept Selector = std::same_as<S, none> || BudgetSelector<S> || ScoreDependentSelector<S> || PatternSelector<S>;

// Keep mask -> moved tokens. Given `const L l; int32_t i;`:
//   L::moves_tokens        -> bool     whether kept tokens are moved
//   l.destination(i)       -> int32_t  logical position of the i-th kept token
// or, instead of destination, L::fills_holes (true): the kept tokens past the kept
// count fill the evicted slots below it (layout::fill).
template <class L>
concept Layout = std::same_as<L, none> ||
                 (Policy<L> && requires { { L::moves_tokens } -> std::convertible_to<bool>; } &&
                  (requires(const L& l, std::int32_t i) {
                    { l.destination(i) } -> std::same_as<std::int32_t>;
                  } || requires { requires L::fills_holes; }));

KVP_NAMESPACE_END
