// Which GPU stage kind runs each stage of a pipeline: one trait per pipeline slot,
// from the concept the policy satisfies to the kind that runs it. A policy that fits
// an existing kind runs with no change here; a new kind is a new stage file (its
// plan, check, reserve and launch, as stage_block_redundancy.cuh) and one
// specialisation below (docs/extending.md, "Stage kinds").
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/none.hpp"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/select_count.cuh"
#include "kvpolicy/exec/cuda/stage_attention_score.cuh"
#include "kvpolicy/exec/cuda/stage_bidirectional_score.cuh"
#include "kvpolicy/exec/cuda/stage_block_redundancy.cuh"
#include "kvpolicy/exec/cuda/stage_compact.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/stage_fill.cuh"
#include "kvpolicy/exec/cuda/stage_full_redundancy.cuh"
#include "kvpolicy/exec/cuda/stage_key_score.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/redundancy/redundancy.hpp"
#include "kvpolicy/scorer/bidirectional_window.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The stage that is not there (a `none` slot): plans nothing, launches nothing.
struct no_stage {
  using plan_type = launch_plan;
  struct buffers {};
  template <class P>
  static plan_type plan(const stage_context<P>&, std::int64_t, bool) {
    return {};
  }
  template <class P>
  static void check(const stage_context<P>&, const plan_type&) {}
  template <class P>
  static buffers reserve(const stage_context<P>&, const plan_type&, workspace_builder&, std::int64_t) {
    return {};
  }
  template <class P>
  static bool computes_statistics(const stage_context<P>&) {
    return false;
  }
  template <class P>
  static std::int64_t statistics_per_row(const stage_context<P>&) {
    return 0;
  }
  static bool hands_rows_on(const plan_type&) { return false; }
  template <class P, class... Args>
  static void launch(const stage_context<P>&, const Args&...) {}
};

template <class S>
struct score_stage_of {
  static_assert(no_kind_for<S>,
                "kvpolicy: this scorer fits no GPU stage kind: it must satisfy kvp::AttentionScorer or "
                "kvp::KeyScorer (docs/extending.md, \"Stage kinds\")");
};
template <>
struct score_stage_of<none> {
  using type = no_stage;
};
template <class S>
  requires AttentionScorer<S>
struct score_stage_of<S> {
  using type = attention_score_stage;
};
template <class S>
  requires(KeyScorer<S> && !AttentionScorer<S>)
struct score_stage_of<S> {
  using type = key_score_stage;
};
// All of the window's queries, not a few observation queries: a kind of its own.
template <>
struct score_stage_of<scorer::bidirectional_window> {
  using type = bidirectional_score_stage;
};

template <class R>
struct redundancy_stage_of {
  static_assert(no_kind_for<R>,
                "kvpolicy: this redundancy fits no GPU stage kind: it must satisfy kvp::Redundancy with pairs "
                "redundancy::scope::block or redundancy::scope::full (docs/extending.md, \"Stage kinds\")");
};
template <>
struct redundancy_stage_of<none> {
  using type = no_stage;
};
template <class R>
  requires(Redundancy<R> && !std::same_as<R, none> && R::pairs == redundancy::scope::block)
struct redundancy_stage_of<R> {
  using type = block_redundancy_stage;
};
template <class R>
  requires(Redundancy<R> && !std::same_as<R, none> && R::pairs == redundancy::scope::full)
struct redundancy_stage_of<R> {
  using type = full_redundancy_stage;
};

// Selectors run inside the epilogue: their trait, select_kind_of, is beside their
// kinds in select_count.cuh.

template <class L>
struct layout_stage_of {
  static_assert(no_kind_for<L>,
                "kvpolicy: this layout fits no GPU stage kind: it must satisfy kvp::Layout (docs/extending.md, "
                "\"Stage kinds\")");
};
template <>
struct layout_stage_of<none> {
  using type = no_stage;
};
template <class L>
  requires(Layout<L> && !std::same_as<L, none> && !fills_holes<L>())
struct layout_stage_of<L> {
  // In place, front to back: every layout whose destination(i) never passes its source.
  using type = std::conditional_t<L::moves_tokens, compact_stage, no_stage>;
};
template <class L>
  requires(Layout<L> && !std::same_as<L, none> && fills_holes<L>())
struct layout_stage_of<L> {
  using type = fill_stage;
};

template <class S>
using score_stage_t = typename score_stage_of<S>::type;
template <class R>
using redundancy_stage_t = typename redundancy_stage_of<R>::type;
template <class L>
using layout_stage_t = typename layout_stage_of<L>::type;

}  // namespace cuda
KVP_NAMESPACE_END
