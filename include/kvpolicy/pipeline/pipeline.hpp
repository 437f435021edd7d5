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

KVP_NAMESPACE_END
