// Lightning redundancy on tensor cores for f16/bf16 caches: the b x b Gram matrix of
// one cache block, a warp's share in 16 x 64 tiles (wgmma on sm_90a, where each
// warpgroup takes 64 rows and its descriptors stay in uniform registers; mma.sync
// elsewhere), scaled by the inverse norms in fp32 and reduced to row sums and newest
// similar neighbours without leaving registers (fold_tile: the diagonal by weight,
// not by a test per column).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/block_statistics.cuh"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/gram_tile.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/redundancy_kernel.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/exec/cuda/wgmma.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Shared memory, in bytes, enough for either path: the block's keys (16-bit; mma.sync:
// [round16(b)][d + 8]; wgmma: round64(b) rows in core matrices), and per key its
// inverse norm, row sum and dropped similarities (dropped_sums, 64-bit).
KVP_HOST_DEVICE constexpr std::size_t lightning_mma_smem_bytes(std::int32_t block, std::int32_t d) {
  const std::size_t padded = static_cast<std::size_t>(round16(block)) * (std::size_t(d) + 8) * 2;
  const std::size_t core = static_cast<std::size_t>(round64(block)) * std::size_t(d) * 2;
  return (padded > core ? padded : core) + 4 * static_cast<std::size_t>(round64(block)) * 4;
}

// One block of lightning on tensor cores: the (row, cache block) of blockIdx, with
// blockDim.x / 128 warpgroups. HeadDim: the head dim as a constant (64 and 128, from
// the executor), or 0 to read it at run time, as for attention_score_mma_kernel.
// Given stats_out (a head dim of at most StatisticsMaxHeadDim and an attention scorer
// whose reduces run in the fragments), the block also writes its keys' softmax
// statistics for the row's window queries, at [row][blockIdx.y][block_statistics_count],
// for the score kernel that follows. Statistics: whether the block has that code at all.
// rows_done: null, or a count per row that each block raises once its outputs are
// written (publish_row_part), for a score kernel that waits for rows, not the grid.
template <class P, dtype Elem, int HeadDim, bool Statistics, int StatisticsMaxHeadDim>
__device__ __forceinline__ void lightning_mma_block(const P& p, const paged_kv_view& cache, const row_space& rs,
                                                    float* red_out, const query_window_view& q, float2* stats_out,
                                                    std::int32_t* rows_done) {
  extern __shared__ uint4 smem16[];
  allow_dependents();  // the score kernel may start in this kernel's last wave
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const std::int32_t b = cache.block_size, pos0 = static_cast<std::int32_t>(blockIdx.y) * b;
  if (pos0 >= n) return;
  const std::int32_t count = min(b, n - pos0), d = HeadDim > 0 ? HeadDim : cache.head_dim;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const float theta = p.redundancy.theta;
#if KVP_CUDA_WGMMA
  // Warpgroups take 64-row tiles (a warp 16 rows of them); keys in wgmma's layout.
  const std::int32_t rows = round64(count), first_tile = warp_uniform(warp / 4) * 64, tile_step = warps / 4 * 64;
  const std::int32_t warp_row = warp % 4 * 16;
  const core_matrices at{d};
#else
  // Warps take 16-row tiles; keys padded for ldmatrix.
  const std::int32_t rows = round16(count), first_tile = warp * 16, tile_step = warps * 16, warp_row = 0;
  const padded_rows at{d + 8};
#endif

  auto* keys = reinterpret_cast<std::uint16_t*>(smem16);
  auto* inv = reinterpret_cast<float*>(keys + at(rows, 0));
  float* rowsum = inv + rows;
  const dropped_sums<> dropped{reinterpret_cast<unsigned long long*>(rowsum + rows)};  // rows: a multiple of 16
  dropped.clear(count);

  // Rows past count are zero, so the tiles past it add nothing.
  key_tile_loader(cache, rc.layer, it.seq, rc.head, at).copy(cache, keys, rows, count, pos0);
  cp_async_commit();
  // The softmax statistics' first queries load while the keys are in flight.
  using S = typename P::scorer_type;
  constexpr bool with_statistics = Statistics && AttentionScorer<S>;
  [[maybe_unused]] auto statistics = [&] {
    if constexpr (with_statistics) {
      const std::int32_t G = q.num_q_heads / cache.num_kv_heads;
      float2* out = stats_out && d <= StatisticsMaxHeadDim
                        ? stats_out + (row * gridDim.y + blockIdx.y) * block_statistics_count(p.scorer.window, G)
                        : nullptr;
      return block_statistics<Elem, HeadDim, S, StatisticsMaxHeadDim>(p.scorer, q, rc.layer, it.query_slot, rc.head, G,
                                                                      T, d, out);
    } else {
      return 0;
    }
  }();
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();
  if constexpr (with_statistics) statistics.run(keys, at, pos0, count);
  inverse_norms_16<Elem, HeadDim>(keys, inv, count, d, at, p.redundancy.eps);
  __syncthreads();

  for (std::int32_t t0 = first_tile; t0 < rows; t0 += tile_step) {
    // This warp's 16 rows of the tile, and the lane's two of them.
    const std::int32_t m0 = t0 + warp_row;
    const std::int32_t u[2] = {m0 + lane / 4, m0 + lane / 4 + 8};
    similarity_rows st;
    st.set_rows(u[0] < count ? inv[u[0]] : 0.0f, u[1] < count ? inv[u[1]] : 0.0f, theta);
#if KVP_CUDA_WGMMA
    // One 64-column tile at a time. Two 32-column MMAs, one running while the other
    // is folded, were slower (bench/results/README.md); a group left in flight across
    // iterations makes ptxas serialise every MMA (C7514).
    for (std::int32_t v0 = 0; v0 < rows; v0 += gram_tile_columns) {
      float acc[8][4];  // the first wgmma overwrites it (scale-d 0)
      wgmma_gram<Elem, gram_tile_columns>(acc, keys + at(t0, 0), keys + at(v0, 0), d);
      fold_tile(st, acc, inv + v0, v0, count - v0, m0 - v0, theta);
    }
#else
    for (std::int32_t v0 = 0; v0 < rows; v0 += gram_tile_columns) {
      float acc[8][4] = {};
      gram_tile<Elem>(acc, keys + at(m0, 0), keys + at(v0, 0), rows - v0, d, at.pitch);
      fold_tile(st, acc, inv + v0, v0, count - v0, m0 - v0, theta);
    }
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      reduce_column<4>(st.sum[h], st.near[h], st.near_c[h]);  // the quad holds one row
      st.finish(h);
      if (lane % 4 == 0 && u[h] < count) {
        rowsum[u[h]] = st.sum[h];
        if (st.near[h] >= 0) dropped.add(st.near[h], st.near_c[h]);
      }
    }
  }
  __syncthreads();
  const float inv_n = 1.0f / static_cast<float>(b);
  for (std::int32_t t = threadIdx.x; t < count; t += blockDim.x)
    red_out[row * rs.max_tokens + pos0 + t] = (rowsum[t] - dropped.of(t)) * inv_n / p.redundancy.tau;
  if (rows_done) publish_row_part(rows_done, static_cast<std::uint32_t>(row));
}

// The lightning kernel under the register budget of a tuning policy (tuning.cuh:
// lightning_three, lightning_pair, lightning_wide): Tuning::threads per block, registers
// capped for Tuning::blocks_per_sm blocks per SM, and room for the statistics' query
// fragments up to Tuning::statistics_max_head_dim. Built for a run-time head dim
// under the cap of three blocks, those fragments spill registers, so the executor
// also builds that kernel without the statistics (Statistics false) and takes it
// where none are asked for.
template <class P, dtype Elem, int HeadDim, bool Statistics, class Tuning>
__global__ void __launch_bounds__(Tuning::threads, Tuning::blocks_per_sm)
    lightning_mma_kernel(P p, paged_kv_view cache, row_space rs, float* red_out, query_window_view q,
                         float2* stats_out, std::int32_t* rows_done) {
  lightning_mma_block<P, Elem, HeadDim, Statistics, Tuning::statistics_max_head_dim>(p, cache, rs, red_out, q,
                                                                                     stats_out, rows_done);
}

}  // namespace cuda
KVP_NAMESPACE_END
