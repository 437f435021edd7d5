// Lightning redundancy and the window attention score in one grid of tasks, so that
// a row is scored while its keys, just read by its lightning blocks, are still in L2,
// and the score's memory-bound pass runs beside other rows' arithmetic-bound
// lightning on the same SMs. The two kernels apart read the keys from DRAM twice, and
// the score kernel starts only in lightning's last wave, since a row's cache blocks
// are scheduled a whole grid row apart.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/lightning_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/lightning_score_tasks.hpp"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The next ticket of `counter` (zeroed before the launch), for the whole block.
__device__ inline std::uint32_t take_ticket(std::uint32_t* counter) {
  __shared__ std::uint32_t ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(counter, 1u);
  __syncthreads();
  return ticket;
}

// One block per task (tasks.count() blocks), with the shared memory of the larger
// of the two (lightning_mma_smem_bytes, attention_mma_smem_bytes) and lightning's
// register cap (the two inlined: ptxas -v, d 128, 76 bytes of spill stores where
// lightning alone has none; the score task or both as calls measured slower still).
// Lightning writes its statistics to block_stats and raises rows_done
// per cache block; the score tasks wait for their row's count, as
// attention_score_mma_kernel does with stats_ready, and publish score_ready.
template <class P, dtype Elem, int HeadDim, bool ScoreWgmma>
__global__ void __launch_bounds__(row_threads, 3)
    lightning_score_kernel(P p, paged_kv_view cache, query_window_view q, row_space rs, float* red_out, float* scores,
                           float2* block_stats, std::int32_t* rows_done, std::int32_t* score_ready,
                           lightning_score_tasks tasks, std::uint32_t* ticket) {
  const auto task = tasks[take_ticket(ticket)];
  if (!task.score)
    lightning_mma_block<P, Elem, HeadDim, true, statistics_max_head_dim>(p, cache, rs, red_out, q, block_stats,
                                                                         rows_done, task.row, task.part, tasks.blocks);
  else
    attention_score_mma_block<typename P::scorer_type, Elem, HeadDim, ScoreWgmma>(
        p.scorer, cache, q, rs, scores, score_ready, block_stats, static_cast<std::int32_t>(tasks.splits), rows_done,
        task.row * tasks.splits + task.part);
}

}  // namespace cuda
KVP_NAMESPACE_END
