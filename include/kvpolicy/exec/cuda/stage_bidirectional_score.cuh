// Stage kind: bidirectional window scorers (Kara, scorer::bidirectional_window): the
// window's own queries against the keys of W \ U, on tensor cores for 16-bit caches
// with a group sum or mean (bidirectional_score_mma_kernel), else in fp32.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/bidirectional_score_kernel.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/stage_attention_score.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct bidirectional_score_stage {
  struct plan_type : launch_plan {
    bool mma = false;
  };

  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows, bool) {
    plan_type pl;
    const auto& s = c.p.scorer;
    const std::int32_t n = s.window - s.buffer, d = c.cache.head_dim;
    pl.mma = c.mma_scores() && d <= 256 && (s.group == group_reduce::sum || s.group == group_reduce::mean);
    if (pl.mma) {
      pl.smem = bidirectional_mma_smem_bytes(n, d);
      pl.kernel = "bidirectional_score_mma_kernel";
    } else {
      pl.smem = bidirectional_smem_floats(n, c.group_size(), d) * sizeof(float);
      pl.kernel = "bidirectional_score_kernel";
    }
    pl.grid_x = static_cast<unsigned>(rows);
    return pl;
  }

  template <class P>
  static void check(const stage_context<P>& c, const plan_type& pl) {
    const auto& s = c.p.scorer;
    require(pl.smem <= c.dev.smem_per_block, "pipeline.scorer.window",
            "is {} (buffer {}); the {} keys of {} dims the scorer holds exceed {} bytes of shared memory", s.window,
            s.buffer, s.window - s.buffer, c.cache.head_dim, c.dev.smem_per_block);
    check_query_rows(c.queries);
  }

  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const score_launch& a) {
    using S = typename P::scorer_type;
    if (!pl.mma) {
      cuda::launch(pl, a.stream, a.programmatic, bidirectional_score_kernel<S>, c.p.scorer, c.cache, c.queries, a.rs,
                   a.scores, a.ready_out);
      return;
    }
    with_mma_types(c.cache, [&]<dtype Elem, int HeadDim>() {
      cuda::launch(pl, a.stream, a.programmatic, bidirectional_score_mma_kernel<S, Elem, HeadDim>, c.p.scorer, c.cache,
                   c.queries, a.rs, a.scores, a.ready_out);
    });
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
