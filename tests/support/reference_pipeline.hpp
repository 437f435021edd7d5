// A whole pipeline's scores by the independent reference formulas (reference.hpp):
// score -> temporal aggregate -> pool -> redundancy combine -> protect, for one
// (sequence, layer, KV head) row. Parameters are read from a kvp::pipeline value (so a
// preset with overridden fields is followed), the arithmetic is the reference's own.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "support/reference.hpp"
#include "support/test_cache.hpp"

namespace kvp_test::ref {

struct pipeline_params {
  bool attention = false;  // else every score 0 (no scorer)
  attention_params attn;
  enum class temporal_kind { none, global, accumulate } temporal = temporal_kind::none;
  global_op mode = global_op::max;
  double alpha = 1.0;
  bool max_norm = false;
  bool pool = false, pool_max = true, pool_first_only = false;
  i32 kernel = 1;
  bool redundancy = false, weighted = true;
  redundancy_params red;  // red.block: set from the cache's block size for lightning
  bool lightning = false;
  double lambda = 0.0;
  i32 protect_window = 0, sinks = 0;
};

namespace detail {
template <class A>
void read_aggregate(const A& a, pipeline_params& out) {
  namespace agg = kvp::aggregate;
  if constexpr (std::is_same_v<A, agg::global_score>) {
    out.temporal = pipeline_params::temporal_kind::global;
    out.mode = static_cast<global_op>(a.mode);
    out.alpha = a.alpha;
    out.max_norm = a.max_norm;
  } else if constexpr (std::is_same_v<A, agg::accumulate>) {
    out.temporal = pipeline_params::temporal_kind::accumulate;
  } else if constexpr (std::is_same_v<A, agg::pool>) {
    out.pool = true;
    out.pool_max = a.mode == agg::pool_mode::max;
    out.pool_first_only = a.first_only;
    out.kernel = a.kernel;
  } else if constexpr (kvp::detail::is_then<A>::value) {
    read_aggregate(a.first, out);
    read_aggregate(a.second, out);
  }
}
}  // namespace detail

template <class P>
pipeline_params params_of(const P& p) {
  pipeline_params out;
  using S = typename P::scorer_type;
  if constexpr (std::is_base_of_v<kvp::scorer::window_attention, S>) {
    out.attention = true;
    out.attn.window = p.scorer.window;
    out.attn.group = static_cast<group_op>(p.scorer.group);
    out.attn.reduce = static_cast<window_op>(p.scorer.reduce);
    out.attn.causal = p.scorer.causal;
    out.attn.keys_before_window = p.scorer.keys_before_window;
  } else if constexpr (std::is_same_v<S, kvp::scorer::squared_attention>) {
    out.attention = true;
    out.attn.window = p.scorer.window;
    out.attn.group = static_cast<group_op>(p.scorer.group);
    out.attn.reduce = static_cast<window_op>(p.scorer.reduce);
    out.attn.causal = p.scorer.causal;
    out.attn.squared = true;
    out.attn.excluded_distance = p.scorer.excluded_distance;
  }
  detail::read_aggregate(p.aggregate, out);
  using R = typename P::redundancy_type;
  if constexpr (!std::is_same_v<R, kvp::none>) {
    out.redundancy = true;
    out.lightning = R::pairs == kvp::redundancy::scope::block;
    out.red.theta = p.redundancy.theta;
    out.red.tau = p.redundancy.tau;
    out.red.eps = p.redundancy.eps;
    out.lambda = p.redundancy.lambda;
    out.weighted = p.redundancy.form == kvp::redundancy::combine_form::weighted;
  }
  out.protect_window = p.protect.window;
  out.sinks = p.protect.sinks;
  return out;
}

struct row_result {
  vec final_scores;  // T entries, +inf where protected or not a candidate
  vec f;             // F after the aggregator, before any move (T entries; 0 past the candidates)
  bool near_threshold = false;  // a cosine within 1e-6 of theta: fp32 may decide otherwise
};

// keys [T][d]; queries [w][G][d] (the scorer's window); f_before [T].
inline row_result expected_row(const pipeline_params& pp, const std::vector<float>& keys,
                               const std::vector<float>& queries, const std::vector<float>& f_before, i32 history,
                               i32 T, i32 d, i32 G, i32 block_size) {
  row_result out;
  const i32 n = pp.attention && pp.attn.keys_before_window ? T - pp.attn.window : T;
  vec s = pp.attention ? window_scores(keys, queries, T, d, G, pp.attn) : vec(static_cast<std::size_t>(n), 0.0);
  out.f.assign(static_cast<std::size_t>(T), 0.0);
  const vec f(f_before.begin(), f_before.begin() + n);
  if (pp.temporal == pipeline_params::temporal_kind::global) {
    s = global_score(s, f, history, pp.mode, pp.alpha, pp.max_norm).first;
  } else if (pp.temporal == pipeline_params::temporal_kind::accumulate) {
    for (i32 t = 0; t < std::min(history, n); ++t) s[t] = f[t] + s[t];
  }
  if (pp.temporal != pipeline_params::temporal_kind::none)
    for (i32 t = 0; t < n; ++t) out.f[t] = s[t];
  if (pp.pool && (!pp.pool_first_only || history == 0)) s = pool(s, pp.kernel, pp.pool_max);
  if (pp.redundancy) {
    redundancy_params rp = pp.red;
    rp.block = pp.lightning ? block_size : 0;
    const vec r = redundancy(keys, n, d, rp);
    out.near_threshold = theta_margin(keys, n, d, rp) < 1e-6;
    for (i32 t = 0; t < n; ++t) s[t] = pp.weighted ? pp.lambda * s[t] - (1 - pp.lambda) * r[t] : s[t] - pp.lambda * r[t];
  }
  out.final_scores.assign(static_cast<std::size_t>(T), inf);
  for (i32 t = 0; t < n; ++t)
    if (!(t < pp.sinks || t >= T - pp.protect_window)) out.final_scores[t] = s[t];
  return out;
}

// The reference row of (layer, seq, head) of a test cache: keys, the slot's queries of
// the scorer's window, F of the sequence's tokens.
inline row_result expected_row(const pipeline_params& pp, const test_cache& tc, i32 layer, i32 seq, i32 slot,
                               i32 head, i32 history) {
  const i32 T = tc.length(seq), d = tc.head_dim(), G = tc.q_heads() / tc.kv_heads();
  std::vector<float> q;
  if (pp.attention)
    for (i32 j = 0; j < pp.attn.window; ++j)
      for (i32 g = 0; g < G; ++g) {
        const auto row = tc.query(layer, slot, tc.window() - pp.attn.window + j, head * G + g);
        q.insert(q.end(), row.begin(), row.end());
      }
  std::vector<float> f;
  for (i32 t = 0; t < T; ++t) f.push_back(const_cast<test_cache&>(tc).f(layer, seq, t, head));
  return expected_row(pp, tc.keys(layer, seq, head), q, f, history, T, d, G, tc.block_size());
}

}  // namespace kvp_test::ref
