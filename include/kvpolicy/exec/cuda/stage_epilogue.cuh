// The epilogue stage: aggregate, redundancy combine, protect and select for every
// pipeline (epilogue_kernel; the selector's kind is a device function inside it,
// select_count.cuh). One block per row, the row in shared memory where it fits.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/epilogue_kernel.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct epilogue_launch {
  cudaStream_t stream;
  bool programmatic;
  row_space rs;
  std::int64_t row0;
  const float* scores_in;
  const float* red_in;
  epilogue_out out;
  const std::int32_t* ready_in;
  std::int32_t* ready_out;
  std::byte* workspace;
};

struct epilogue_stage {
  struct plan_type : launch_plan {
    bool rows_in_shared = true;  // else the row and its pooling copy live in the workspace
  };
  struct buffers {
    std::size_t rows_global = 0;
  };

  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows) {
    plan_type pl;
    const std::size_t row_bytes = epilogue_smem_floats<typename P::select_type>(c.max_tokens) * sizeof(float);
    pl.rows_in_shared = row_bytes <= c.dev.smem_per_block;
    pl.kernel = pl.rows_in_shared ? "epilogue_kernel" : "epilogue_kernel<rows in global memory>";
    pl.grid_x = static_cast<unsigned>(rows);
    pl.smem = pl.rows_in_shared ? row_bytes : 0;
    return pl;
  }
  template <class P>
  static buffers reserve(const stage_context<P>& c, const plan_type& pl, workspace_builder& ws, std::int64_t rows) {
    buffers b;
    constexpr std::size_t arrays = epilogue_row_arrays<typename P::select_type>;
    if (!pl.rows_in_shared) b.rows_global = ws.take(arrays * static_cast<std::size_t>(rows) * c.max_tokens * sizeof(float));
    return b;
  }
  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const buffers& b, const epilogue_launch& a) {
    // The group's regions (the rows, their pooling copies, the scores before protect)
    // of its rows each.
    constexpr std::size_t arrays = epilogue_row_arrays<typename P::select_type>;
    float* rows_global =
        pl.rows_in_shared ? nullptr : rows_of<float>(a.workspace, b.rows_global, a.row0, arrays * c.max_tokens);
    cuda::launch(pl, a.stream, a.programmatic, epilogue_kernel<P>, c.p, c.cache, c.f, a.rs, a.scores_in, a.red_in,
                 rows_global, a.out, a.ready_in, a.ready_out);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
