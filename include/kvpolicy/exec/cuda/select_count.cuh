// Selector kinds on the device: how many tokens a row keeps. The epilogue asks the
// kind its selector maps to (stage_kinds.cuh), then keeps that many by
// block_kth_largest.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/none.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/selector_row.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What a row's count may read.
struct count_inputs {
  const float* s;       // final scores (after protect)
  const float* raw;     // the scorer's scores before aggregation (global memory), or null
  std::int32_t T, candidates, protected_tokens, budget;
  head_index head;
  std::int32_t slot;  // the item's query_slot
};

// No selector: every token is kept.
struct keep_all_count {
  struct storage {};
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel&, const count_inputs& in, storage&) {
    return in.T;
  }
};

// BudgetSelector: the count from the length and the budget (and the head).
struct budget_count {
  struct storage {};
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel& sel, const count_inputs& in, storage&) {
    return budget_keep_count(sel, in.T, in.budget, in.head);
  }
};

// ScoreDependentSelector: the count from the row (block_selector_row), at least the
// protected tokens and at most the row.
struct score_dependent_count {
  using storage = selector_row_storage;
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel& sel, const count_inputs& in, storage& sh) {
    const block_selector_row row(in.s, in.raw, in.T, in.candidates, in.protected_tokens, in.head, in.slot, sh);
    const std::int32_t n = sel.row_keep_count(row, in.budget);
    return n < in.protected_tokens ? in.protected_tokens : (n > in.T ? in.T : n);
  }
};

// A trait's primary template fails with this: the policy fits no kind.
template <class T>
inline constexpr bool no_kind_for = false;

template <class Sel>
struct select_kind_of {
  static_assert(no_kind_for<Sel>,
                "kvpolicy: this selector fits no GPU selector kind: it must satisfy kvp::BudgetSelector or "
                "kvp::ScoreDependentSelector (docs/extending.md, \"Stage kinds\")");
};
template <>
struct select_kind_of<none> {
  using type = keep_all_count;
};
template <class Sel>
  requires ScoreDependentSelector<Sel>
struct select_kind_of<Sel> {
  using type = score_dependent_count;
};
template <class Sel>
  requires(BudgetSelector<Sel> && !ScoreDependentSelector<Sel>)
struct select_kind_of<Sel> {
  using type = budget_count;
};
template <class Sel>
using select_kind_t = typename select_kind_of<Sel>::type;

}  // namespace cuda
KVP_NAMESPACE_END
