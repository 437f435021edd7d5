// Stage kind: layouts whose i-th kept token moves to destination(i) <= its position
// (layout::compact and any layout with that contract): an in-place, front-to-back,
// order-keeping move of K, V and F (compact_kernel).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/compact_kernel.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct layout_launch {
  cudaStream_t stream;
  bool programmatic;
  row_space rs;
  const std::uint8_t* keep;         // [rows][max_tokens]
  const std::int32_t* ready_in;     // null, or the epilogue's row hand-off flags
  prefix_targets targets;           // the launch group's shared prefixes' targets (or none)
  const float* f_stash;             // [rows][max_tokens]: F of the shared prefixes' tokens, or null
};

struct compact_stage {
  struct plan_type : launch_plan {
    std::int32_t slices = 1;  // blocks per row, each a column slice of its K and V bytes
    std::int32_t chunk = 0;   // tokens staged at once
  };
  struct buffers {};

  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows, bool) {
    plan_type pl;
    const std::int64_t row_bytes = c.cache.row_bytes();
    pl.slices = c.opt.split_rows ? compact_slices(rows, row_bytes,
                                                  std::int64_t{compact_tuning::blocks_per_sm} * c.dev.multiprocessors)
                                 : 1;
    const std::int64_t slice_bytes = row_bytes / pl.slices;
    pl.chunk = compact_chunk(slice_bytes, compact_tuning::staging_limit(c.dev));
    pl.kernel = "compact_kernel";
    pl.grid_x = static_cast<unsigned>(rows * pl.slices);
    pl.smem = compact_staging_bytes(pl.chunk, slice_bytes);
    return pl;
  }
  template <class P>
  static void check(const stage_context<P>& c, const plan_type&) {
    require(compact_chunk(c.cache.row_bytes(), compact_tuning::staging_limit(c.dev)) >= 1, "cache.head_dim",
            "is {}; a row of {} bytes is too long for the compaction's staging buffer", c.cache.head_dim,
            c.cache.row_bytes());
  }
  template <class P>
  static buffers reserve(const stage_context<P>&, const plan_type&, workspace_builder&, std::int64_t) {
    return {};
  }
  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const buffers&, const layout_launch& a,
                     std::byte*, std::int64_t) {
    // F moves with its tokens only when the pipeline keeps scores in it.
    const score_view moved_f = uses_score_cache<typename P::aggregate_type>() ? c.f : score_view{};
    const auto kernel =
        a.targets.empty() && c.cache.positions.empty() ? compact_kernel<P, false> : compact_kernel<P, true>;
    cuda::launch(pl, a.stream, a.programmatic, kernel, c.p, c.cache, moved_f, a.rs, a.keep, pl.chunk, pl.slices,
                 a.ready_in, a.targets, a.f_stash);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
