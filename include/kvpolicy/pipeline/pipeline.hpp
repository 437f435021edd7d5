// pipeline<Scorer, Aggregator, Redundancy, Selector, Layout>: one compression policy as a value.
#pragma once

#include "kvpolicy/config.hpp"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/select/protect.hpp"

KVP_NAMESPACE_BEGIN

// Stages run in SPEC order: score -> aggregate (temporal, then spatial) ->
// redundancy combine -> protect -> select -> layout. Any stage may be `none`.
template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L>
struct pipeline {
  using scorer_type = S;
  using aggregate_type = A;
  using redundancy_type = R;
  using select_type = Sel;
  using layout_type = L;

  S scorer{};
  A aggregate{};
  R redundancy{};
  Sel select{};
  L layout{};
  kvp::protect protect{};
};

// The same stages with another layout: `with_layout(presets::zipage{}, layout::fill{})`.
template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L, Layout L2>
constexpr pipeline<S, A, R, Sel, L2> with_layout(const pipeline<S, A, R, Sel, L>& p, L2 layout) noexcept {
  return {p.scorer, p.aggregate, p.redundancy, p.select, layout, p.protect};
}

KVP_NAMESPACE_END
