// Stage kind: key scorers (KeyScorer), a score per key from the key alone, one
// thread per token (key_score_kernel).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/score_kernel.cuh"
#include "kvpolicy/exec/cuda/stage_attention_score.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct key_score_stage {
  using plan_type = launch_plan;

  template <class P>
  static plan_type plan(const stage_context<P>&, std::int64_t rows, bool) {
    plan_type pl;
    pl.kernel = "key_score_kernel";
    pl.grid_x = static_cast<unsigned>(rows);
    return pl;
  }
  template <class P>
  static void check(const stage_context<P>&, const plan_type&) {}
  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const score_launch& a) {
    cuda::launch(pl, a.stream, a.programmatic, key_score_kernel<typename P::scorer_type>, c.p.scorer, c.cache, a.rs,
                 a.scores, a.ready_out);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
