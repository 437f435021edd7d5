// Stage kind: layouts that fill the evicted slots below the kept count
// (layout::fill): fill_kernel, one block per row, its moves numbered in a scratch
// of the workspace.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/fill_kernel.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/stage_compact.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct fill_stage {
  using plan_type = launch_plan;
  struct buffers {
    std::size_t pairs = 0;  // [rows][2][fill_pairs_per_row]: holes, then movers
  };

  template <class P>
  static plan_type plan(const stage_context<P>&, std::int64_t rows, bool) {
    plan_type pl;
    pl.kernel = "fill_kernel";
    pl.grid_x = static_cast<unsigned>(rows);
    return pl;
  }
  template <class P>
  static void check(const stage_context<P>&, const plan_type&) {}
  template <class P>
  static buffers reserve(const stage_context<P>& c, const plan_type&, workspace_builder& ws, std::int64_t rows) {
    return {ws.take(static_cast<std::size_t>(rows) * 2 * static_cast<std::size_t>(fill_pairs_per_row(c.max_tokens)) *
                    sizeof(std::int32_t))};
  }
  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const buffers& w, const layout_launch& a,
                     std::byte* ws, std::int64_t row0) {
    const score_view moved_f = uses_score_cache<typename P::aggregate_type>() ? c.f : score_view{};
    const std::int32_t pitch = fill_pairs_per_row(c.max_tokens);
    auto* pairs = rows_of<std::int32_t>(ws, w.pairs, row0, 2 * std::int64_t{pitch});
    const auto kernel = c.cache.positions.empty() ? fill_kernel<false> : fill_kernel<true>;
    cuda::launch(pl, a.stream, a.programmatic, kernel, c.cache, moved_f, a.rs, a.keep, pairs, pitch, a.ready_in);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
