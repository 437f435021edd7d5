// Lightning redundancy with one thread block per row (item, layer, KV head) instead of
// one per (row, cache block): the row's cache blocks stream through two shared-memory
// key buffers, so the next block's keys are in flight while the current block is
// compared, and on sm_90a each warpgroup issues the Gram tile of its next 64 columns
// before folding the current one, so the tensor cores and the fold overlap. The
// arithmetic is lightning_mma_kernel's, tile for tile and in the same order, so the
// results are its results to the bit.
//
// Experimental (cuda_executor::lightning_per_row, off by default): not yet run on a GPU.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/gram_tile.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/redundancy_kernel.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/wgmma.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// A warp's 16 rows [m0, m0 + 16) of one block's Gram matrix (count real keys, inverse
// norms `inv`), folded tile by tile, then stored as each row's sum and newest neighbour.
struct similarity_strip {
  std::int32_t m0, count;
  std::int32_t u[2];  // the lane's two rows
  similarity_rows st;

  __device__ similarity_strip(std::int32_t first_row, std::int32_t keys, const float* inv)
      : m0(first_row), count(keys) {
    const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
    u[0] = m0 + lane / 4;
    u[1] = m0 + lane / 4 + 8;
    st.inv[0] = u[0] < count ? inv[u[0]] : 0.0f;
    st.inv[1] = u[1] < count ? inv[u[1]] : 0.0f;
  }

  // The tile of columns [v0, v0 + 64); bounds and the diagonal are tested only in the
  // tiles that need them.
  __device__ void fold(const float (&acc)[8][4], std::int32_t v0, const float* inv, float theta) {
    const std::int32_t diag[2] = {u[0] - v0, u[1] - v0};
    if (v0 + gram_tile_columns <= count && (v0 >= m0 + 16 || m0 >= v0 + gram_tile_columns))
      fold_similarities<false>(st, acc, inv + v0, v0, gram_tile_columns, diag, theta);
    else
      fold_similarities<true>(st, acc, inv + v0, v0, count - v0, diag, theta);
  }

  // Row sums and newest neighbours (as positions pos0 + column, or -1) of the real rows.
  __device__ void store(std::int32_t pos0, float* rowsum, std::int32_t* newest, float* newest_c) {
    const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      reduce_column<4>(st.sum[h], st.near[h], st.near_c[h]);  // the quad holds one row
      if (lane % 4 == 0 && u[h] < count) {
        rowsum[u[h]] = st.sum[h];
        newest[u[h]] = st.near[h] < 0 ? -1 : pos0 + st.near[h];
        newest_c[u[h]] = st.near_c[h];
      }
    }
  }
};

// Four warpgroups: a 256-token block is four 64-row tiles, one per warpgroup.
inline constexpr int lightning_row_threads = 512;

// Rows of one key buffer: a whole number of tiles for either path.
KVP_HOST_DEVICE constexpr std::int32_t lightning_row_pitch(std::int32_t block) { return round64(block); }

// Shared memory, in bytes: two key buffers (each as lightning_mma_kernel's), per key
// its inverse norm, row sum, newest neighbour and that similarity, and the dropped
// similarities of each chunk of 32 keys ([ceil(b / 32)][pitch] floats).
KVP_HOST_DEVICE constexpr std::size_t lightning_row_smem_bytes(std::int32_t block, std::int32_t d) {
  const auto pitch = static_cast<std::size_t>(lightning_row_pitch(block));
  const std::size_t padded = pitch * (std::size_t(d) + 8) * 2, core = pitch * std::size_t(d) * 2;
  const std::size_t chunks = (static_cast<std::size_t>(block) + 31) / 32;
  return 2 * (padded > core ? padded : core) + (4 + chunks) * pitch * 4;
}

template <class P, dtype Elem>
__global__ void __launch_bounds__(lightning_row_threads, 1) lightning_row_kernel(P p, paged_kv_view cache,
                                                                               row_space rs, float* red_out) {
  extern __shared__ uint4 smem16[];
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const std::int32_t b = cache.block_size, d = cache.head_dim, pitch = lightning_row_pitch(b);
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const float theta = p.redundancy.theta;
#if KVP_CUDA_WGMMA
  const std::int32_t first_tile = warp / 4 * 64, tile_step = warps / 4 * 64, warp_row = warp % 4 * 16;
  const core_matrices at{d};
  const auto rows_of = [](std::int32_t count) { return round64(count); };
#else
  const std::int32_t first_tile = warp * 16, tile_step = warps * 16, warp_row = 0;
  const padded_rows at{d + 8};
  const auto rows_of = [](std::int32_t count) { return round16(count); };
#endif

  // Buffer i % 2 holds block i; its elements start at keys0 + (i % 2) * buffer.
  const std::size_t buffer = at(pitch, 0);
  auto* keys0 = reinterpret_cast<std::uint16_t*>(smem16);
  auto* inv = reinterpret_cast<float*>(keys0 + 2 * buffer);
  float* rowsum = inv + pitch;
  auto* newest = reinterpret_cast<std::int32_t*>(rowsum + pitch);
  float* newest_c = reinterpret_cast<float*>(newest + pitch);
  float* dropped = newest_c + pitch;

  const std::int32_t blocks = n > 0 ? (n + b - 1) / b : 0;
  const key_tile_loader loader(cache, rc.layer, it.seq, rc.head, at);
  // Rows past a block's count are zero, so the tiles past it add nothing.
  const auto fetch = [&](std::int32_t i) {
    const std::int32_t count = min(b, n - i * b);
    loader.copy(cache, keys0 + (i % 2) * buffer, rows_of(count), count, i * b);
    cp_async_commit();
  };
  if (blocks > 0) fetch(0);
  for (std::int32_t i = 0; i < blocks; ++i) {
    const std::int32_t pos0 = i * b, count = min(b, n - pos0), rows = rows_of(count);
    const std::uint16_t* keys = keys0 + (i % 2) * buffer;
    // The other buffer was last read by block i - 1, before that block's barriers.
    if (i + 1 < blocks) {
      fetch(i + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_async_shared();
    __syncthreads();
    inverse_norms_16<Elem>(keys, inv, count, d, at, p.redundancy.eps);
    __syncthreads();

    for (std::int32_t t0 = first_tile; t0 < rows; t0 += tile_step) {
      // This warp's 16 rows of the tile.
      const std::int32_t m0 = t0 + warp_row;
      similarity_strip strip(m0, count, inv);
#if KVP_CUDA_WGMMA
      // Two accumulator sets, named (a run-time index would put them in local memory):
      // the tile of columns v0 + 64 is on the tensor cores while tile v0 is folded.
      const std::uint16_t* a = keys + at(t0, 0);
      float acc0[8][4], acc1[8][4];  // the first wgmma of each tile overwrites them
      // The loop leaves only on paths that waited for every group (ptxas serialises
      // every wgmma of the kernel if a group could still be in flight past it).
      wgmma_gram_issue<Elem, gram_tile_columns>(acc0, a, keys, d);
      bool more = true;
      for (std::int32_t v0 = 0; more; v0 += 2 * gram_tile_columns) {
        const std::int32_t v1 = v0 + gram_tile_columns, v2 = v1 + gram_tile_columns;
        more = v1 < rows;
        if (more) {
          wgmma_gram_issue<Elem, gram_tile_columns>(acc1, a, keys + at(v1, 0), d);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        wgmma_fence_operands(acc0);
        strip.fold(acc0, v0, inv, theta);
        if (!more) break;
        more = v2 < rows;
        if (more) {
          wgmma_gram_issue<Elem, gram_tile_columns>(acc0, a, keys + at(v2, 0), d);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        wgmma_fence_operands(acc1);
        strip.fold(acc1, v1, inv, theta);
      }
#else
      for (std::int32_t v0 = 0; v0 < rows; v0 += gram_tile_columns) {
        float acc[8][4] = {};
        gram_tile<Elem>(acc, keys + at(m0, 0), keys + at(v0, 0), rows - v0, d, at.pitch);
        strip.fold(acc, v0, inv, theta);
      }
#endif
      strip.store(pos0, rowsum, newest, newest_c);
    }
    __syncthreads();
    subtract_dropped_by_chunks(rowsum, newest, newest_c, dropped, count, pos0, pitch);
    const float inv_n = 1.0f / static_cast<float>(b);
    for (std::int32_t t = threadIdx.x; t < count; t += blockDim.x)
      red_out[row * rs.max_tokens + pos0 + t] = rowsum[t] * inv_n / p.redundancy.tau;
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
