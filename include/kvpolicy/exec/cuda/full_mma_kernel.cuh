// Full redundancy on tensor cores for f16/bf16 caches: one block per (row, tile of
// 128 columns u), a row's blocks adjacent on a flat grid so that they share its keys
// in L2 (decode_row_tile), streams every key tile v of the row through shared memory
// (cp.async, double-buffered), multiplies on wgmma (sm_90a; mma.sync elsewhere) and
// keeps, per u, its row sum and newest similar neighbour in registers. O(T) extra memory: the keys' inverse norms, computed once
// per row first (key_inverse_norms_kernel), and the per-u results that
// full_finish_kernel completes.
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

inline constexpr int full_mma_columns = 16 * (row_threads / 32);  // one 16-row tile per warp
inline constexpr int full_mma_keys = 64;                           // keys v per streamed tile

// Shared memory, in bytes, enough for either path: the column tile and two key tiles
// (16-bit; mma.sync: [.][d + 8]; wgmma: core matrices), and the inverse norms of
// the columns and of both key tiles.
KVP_HOST_DEVICE constexpr std::size_t full_mma_smem_bytes(std::int32_t d) {
  const std::size_t rows = full_mma_columns + 2 * full_mma_keys;
  return rows * (std::size_t(d) + 8) * 2 + rows * 4;
}

// Inverse norms of every candidate key of every row, a thread per key
// (inverse_norm_16, the host's summation order). The full kernel's blocks each
// computed those of every key tile they streamed, a row's norms T / 128 times over,
// with a quarter of their threads while the rest waited at a barrier. HeadDim: d as a
// constant, or 0 (as for the other kernels).
template <class P, dtype Elem, int HeadDim = 0>
__global__ void __launch_bounds__(row_threads) key_inverse_norms_kernel(P p, paged_kv_view cache, row_space rs,
                                                                        float* inv_out) {
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t n = candidate_end(p.scorer, cache.lengths[it.seq]);
  const std::int32_t t = static_cast<std::int32_t>(blockIdx.y * blockDim.x + threadIdx.x);
  if (t >= n) return;
  const auto* key = reinterpret_cast<const uint4*>(cache.k_row(rc.layer, it.seq, t, rc.head));
  inv_out[row * rs.max_tokens + t] =
      inverse_norm_16<Elem, HeadDim>([&](std::int32_t v) { return key[v]; }, cache.head_dim, p.redundancy.eps);
}

// HeadDim: d as a constant or 0. A constant unrolls gram_tile's loop: address
// arithmetic was some 30% of this kernel's 3.1 G warp instructions on gkv/A.
template <class P, dtype Elem, int HeadDim = 0>
__global__ void __launch_bounds__(row_threads, 3) full_columns_mma_kernel(P p, paged_kv_view cache, row_space rs,
                                                                       const float* inv, float* rowsum_out,
                                                                       std::int32_t* newest_out, float* newest_c_out) {
  extern __shared__ uint4 smem16[];
  if (failed(rs)) return;
  const row_tile rt = decode_row_tile(tiles_per_row(rs.max_tokens, full_mma_columns));
  const std::int64_t row = rt.row;
  const row_coord rc = decode_row(rs, rt.row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const auto u_pos0 = static_cast<std::int32_t>(rt.tile) * full_mma_columns;
  if (u_pos0 >= n) return;
  const std::int32_t u_count = min(full_mma_columns, n - u_pos0), d = HeadDim > 0 ? HeadDim : cache.head_dim;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float theta = p.redundancy.theta;
  const float* row_inv = inv + row * rs.max_tokens;
#if KVP_CUDA_WGMMA
  // A warpgroup takes 64 columns u (a warp 16 of them) against each key tile, on
  // wgmma with both operands in shared memory (core matrices): per 64 x 64 tile it
  // reads 32 KB of shared memory, where four warps' ldmatrix read 80 KB, and the
  // mma.sync kernel was bound by that traffic (L1 / shared 87% busy on gkv/A).
  const core_matrices at{d};
#else
  const padded_rows at{d + 8};
#endif

  auto* us = reinterpret_cast<std::uint16_t*>(smem16);
  std::uint16_t* vbase = us + at(full_mma_columns, 0);
  const std::size_t tile_elems = at(full_mma_keys, 0);
  auto* u_inv = reinterpret_cast<float*>(vbase + 2 * tile_elems);
  float* v_inv_base = u_inv + full_mma_columns;

  const key_tile_loader loader(cache, rc.layer, it.seq, rc.head, at);
  loader.copy(cache, us, full_mma_columns, u_count, u_pos0);
  loader.template copy_tile<full_mma_keys, HeadDim>(cache, vbase, n, 0);
  cp_async_commit();
  // Inverse norms of the columns and of the first key tile; those of a key tile are
  // read while the tile before it is folded, and stored after.
  for (std::int32_t i = threadIdx.x; i < full_mma_columns; i += blockDim.x)
    u_inv[i] = i < u_count ? row_inv[u_pos0 + i] : 0.0f;
  if (threadIdx.x < static_cast<unsigned>(full_mma_keys))
    v_inv_base[threadIdx.x] = static_cast<std::int32_t>(threadIdx.x) < n ? row_inv[threadIdx.x] : 0.0f;

  const std::int32_t m0 = warp * 16;
  const std::int32_t u[2] = {m0 + lane / 4, m0 + lane / 4 + 8};
  similarity_rows st;

  // One barrier per key tile: it publishes the tile (and its norms) and tells that
  // every warp is done with the other buffer, which the next tile's copy, issued
  // while this tile's MMAs run, then overwrites.
  int buf = 0;
  for (std::int32_t v_pos0 = 0; v_pos0 < n; v_pos0 += full_mma_keys, buf ^= 1) {
    const std::int32_t v_count = min(full_mma_keys, n - v_pos0), next = v_pos0 + full_mma_keys;
    cp_async_wait<0>();
    fence_async_shared();  // this thread's copies and zero rows, before wgmma reads them
    __syncthreads();
    const std::uint16_t* vs = vbase + buf * tile_elems;
    const float* v_inv = v_inv_base + buf * full_mma_keys;
    if (v_pos0 == 0) st.set_rows(u[0] < u_count ? u_inv[u[0]] : 0.0f, u[1] < u_count ? u_inv[u[1]] : 0.0f, theta);
    const std::int32_t j = static_cast<std::int32_t>(threadIdx.x);
    const float next_inv = j < full_mma_keys && next + j < n ? row_inv[next + j] : 0.0f;
    const auto copy_next = [&] {
      if (next >= n) return;
      loader.template copy_tile<full_mma_keys, HeadDim>(cache, vbase + (buf ^ 1) * tile_elems, n - next, next);
      cp_async_commit();
    };
    float acc[8][4];
#if KVP_CUDA_WGMMA
    // The warpgroup issues together (warps past the columns only skip the fold); the
    // next tile's copy is issued while the MMAs run, in the same branch (ptxas waits
    // for them where branches join).
    if (warp_uniform(warp / 4 * 64) < u_count) {
      wgmma_gram_issue<Elem, gram_tile_columns>(acc, us + at(warp / 4 * 64, 0), vs, d);
      copy_next();
      wgmma_gram_wait(acc);
      if (m0 < u_count) fold_tile(st, acc, v_inv, v_pos0, v_count, u_pos0 + m0 - v_pos0, theta);
    } else {
      copy_next();
    }
#else
    copy_next();
    if (m0 < u_count) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
      gram_tile<Elem, HeadDim>(acc, us + at(m0, 0), vs, full_mma_keys, d, at.pitch);
      fold_tile(st, acc, v_inv, v_pos0, v_count, u_pos0 + m0 - v_pos0, theta);
    }
#endif
    if (j < full_mma_keys) v_inv_base[(buf ^ 1) * full_mma_keys + j] = next_inv;  // the other buffer: free
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    reduce_column<4>(st.sum[h], st.near[h], st.near_c[h]);  // the quad holds one row
    st.finish(h);
    if (lane % 4 == 0 && u[h] < u_count) {
      const std::int64_t out = row * rs.max_tokens + u_pos0 + u[h];
      rowsum_out[out] = st.sum[h];
      newest_out[out] = st.near[h];
      newest_c_out[out] = st.near_c[h];
    }
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
