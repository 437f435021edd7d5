// The row a score-dependent selector sees: one (sequence, layer, KV head) of the
// batch, its tokens' scores, and the few collective operations a count is made of.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN

// A token of the row, as the functions handed to the row's operations see it.
struct row_token {
  float score;     // the final score: after aggregation, redundancy and protect (+inf where protected)
  float raw;       // the scorer's own score, before aggregation (0 without a scorer)
  std::int32_t t;  // position in the row
  // The final score before protect: a protected token's own score, which a selector
  // that sees protected scores (Sel::sees_protected_scores) reads; -inf for tokens
  // past the candidates (no score) and for tokens a head dropped; = score elsewhere.
  float before_protect;
};

// Whether a selector reads row_token::before_protect: the executors then keep the
// scores protect replaces (calibrated top-p over the whole row).
template <class Sel>
inline constexpr bool sees_protected_scores = requires { requires Sel::sees_protected_scores; };

// What `row_keep_count(row, k)` may call on its row (a host loop or a whole thread
// block run it, kvp::host::selector_row and kvp::cuda::block_selector_row). On the
// device every thread of the row's block calls each operation and gets the same
// result: a selector's control flow must depend only on those results (it then
// naturally does), never on which thread runs it.
//
//   row.size()                              -> int32_t     T, the tokens of the row
//   row.candidates()                        -> int32_t     tokens that have a score ([0, candidates))
//   row.protected_count()                   -> int32_t     tokens protect always keeps (+inf)
//   row.head()                              -> head_index  the row's layer and KV head
//   row.slot()                              -> int32_t     the batch item's query_slot: the request's
//                                                          own slot, for state kept between compressions
//   row.sum(f)                              -> float       sum over the row of f(row_token) (a float)
//   row.max(f)                              -> float       max over the row of f(row_token), -inf if empty
//   row.top(key, n)                         -> rank_cut    the n tokens of largest key(row_token),
//                                                          ties to the more recent (rank_order.hpp)
//   row.fewest_reaching(key, weight, mass)  -> int32_t     the fewest tokens, taken by descending key,
//                                                          whose weights (each >= 0) add up to at least
//                                                          mass; size() when all of them fall short
//   row.once(f)                             -> void        f() once for the row (one thread on the
//                                                          device): a write of state the engine keeps,
//                                                          which the row's later operations do not read
//
// Sums are fp32 in an order each executor chooses, so a count that a sum decides can
// differ between executors where the sum lies within rounding of its target: the
// same near-tie as two equal scores (docs/cuda.md). Functions are called as
// f(const row_token&) and must be KVP_HOST_DEVICE (lambdas: [=] KVP_HOST_DEVICE ...
// need nvcc's --extended-lambda; a small struct with an operator() needs nothing).
namespace detail {
struct selector_row_archetype {
  std::int32_t size() const;
  std::int32_t candidates() const;
  std::int32_t protected_count() const;
  head_index head() const;
  std::int32_t slot() const;
  template <class F>
  float sum(F&&) const;
  template <class F>
  void once(F&&) const;
  template <class F>
  float max(F&&) const;
  template <class Key>
  rank_cut top(Key&&, std::int32_t) const;
  template <class Key, class Weight>
  std::int32_t fewest_reaching(Key&&, Weight&&, float) const;
};
}  // namespace detail

KVP_NAMESPACE_END
