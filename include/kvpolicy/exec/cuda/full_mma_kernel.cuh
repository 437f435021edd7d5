// Full redundancy on tensor cores for f16/bf16 caches, each pair of keys once: one
// block per (row, tile of 128 keys u), a row's blocks adjacent on a flat grid so that
// they share its keys in L2 (decode_row_tile), streams the row's key tiles v from its
// own tile on (the upper triangle of the Gram matrix) through shared memory
// (cp.async, double-buffered) and multiplies on wgmma (sm_90a; mma.sync elsewhere).
// A pair over theta names the newer key a neighbour of the older and the older one of
// the newer: the rows u keep their newest column in registers; the columns v past
// the block's tile take their newest row through a 64-bit atomic max of (position,
// similarity), which gives the same result in any order. The row sums of
// similarities come from the sum of the row's normalised keys, in O(d) per key.
// O(T d / 256 + T) extra memory: inverse norms, partial key sums and the packed
// newest neighbours (key_norms_and_sums_kernel), which full_finish_kernel completes.
// Under cautious update a dropped key's inverse norm is NaN: its pairs are never over
// theta, and its own row sum (NaN) full_finish_kernel replaces.
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

// Keys u per block: each warp takes `row_groups` 16-row tiles, full_mma_group_rows
// apart. Two groups halve the key tiles streamed from L2 (each serves 256 rows, not
// 128), where two such blocks fit on an SM.
inline constexpr int full_mma_group_rows = 16 * (row_threads / 32);
KVP_HOST_DEVICE constexpr std::int32_t full_mma_columns(int row_groups) { return full_mma_group_rows * row_groups; }
inline constexpr int full_mma_keys = 64;                           // keys v per streamed tile
// Keys per partial key sum: those of one block of key_norms_and_sums_kernel.
inline constexpr int key_sum_span = row_threads;

// Shared memory, in bytes, enough for either path: the column tile and two key tiles
// (16-bit; mma.sync: [.][d + 8]; wgmma: core matrices), the inverse norms of the
// columns and of both key tiles, and the row's key sum.
KVP_HOST_DEVICE constexpr std::size_t full_mma_smem_bytes(std::int32_t d, int row_groups) {
  const std::size_t rows = std::size_t(full_mma_columns(row_groups)) + 2 * full_mma_keys;
  return rows * (std::size_t(d) + 8) * 2 + rows * 4 + std::size_t(d) * 4;
}

// A newest neighbour as one 64-bit word, (position + 1) above the similarity's bits,
// so that an atomic max keeps the newest; 0 is "none". Each (key, neighbour) pair is
// found by one block only, so the low half never decides.
__device__ inline unsigned long long pack_newest(std::int32_t pos, float c) {
  return (static_cast<unsigned long long>(pos + 1) << 32) | __float_as_uint(c);
}

// Shared memory of key_norms_and_sums_kernel, in bytes: its span of keys, padded
// rows of d + 8 (conflict-free reads of a 16-byte chunk by 8 adjacent rows).
KVP_HOST_DEVICE constexpr std::size_t key_norms_smem_bytes(std::int32_t d) {
  return std::size_t(key_sum_span) * (std::size_t(d) + 8) * 2;
}

// Per row, before full_pairs_mma_kernel: the inverse norm of every candidate key, a
// thread per key (inverse_norm_16, the host's summation order); the sum of each 256
// keys' normalised vectors inv_t k_t in fp32, in a fixed order, into
// key_sums[row][blockIdx.y][d]; and the packed newest neighbours cleared. The span's
// keys are first copied to shared memory whole rows at a time: a thread reading its
// own key from global memory touched one 16-byte chunk of each 32-byte sector per
// load, and both passes read the keys. HeadDim: d as a constant, or 0 (as for the
// other kernels).
template <class P, dtype Elem, int HeadDim = 0>
__global__ void __launch_bounds__(row_threads) key_norms_and_sums_kernel(P p, paged_kv_view cache, row_space rs,
                                                                         float* inv_out, float* key_sums,
                                                                         unsigned long long* newest_out) {
  extern __shared__ uint4 smem16[];
  __shared__ float inv[key_sum_span];
  __shared__ float part[row_threads * 8];  // [groups][d]: one 8-element chunk per thread
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t n = candidate_end(p.scorer, cache.lengths[it.seq]), d = HeadDim > 0 ? HeadDim : cache.head_dim;
  const std::int32_t t0 = static_cast<std::int32_t>(blockIdx.y) * key_sum_span;
  if (t0 >= n) return;  // the pairs kernel sums the spans below n only
  const std::int32_t count = min(key_sum_span, n - t0), tid = static_cast<std::int32_t>(threadIdx.x);
  auto* keys = reinterpret_cast<std::uint16_t*>(smem16);
  const padded_rows at{d + 8};
  key_tile_loader(cache, rc.layer, it.seq, rc.head, at).copy(cache, keys, count, count, t0);
  cp_async_commit();
  if (tid < count) newest_out[row * rs.max_tokens + t0 + tid] = 0;
  cp_async_wait<0>();
  __syncthreads();
  const auto key = [&](std::int32_t t) { return reinterpret_cast<const uint4*>(keys + at(t, 0)); };
  if (tid < count) {
    const uint4* k = key(tid);
    const float x = inverse_norm_16<Elem, HeadDim>([&](std::int32_t v) { return k[v]; }, d, p.redundancy.eps);
    // Under cautious update a key the head dropped is not in the row: out of the key
    // sums (0 here) and NaN to the pairs kernel, where no comparison with it passes
    // theta (NaN compares false, whatever theta's sign).
    const bool held = cache.live.empty() || cache.alive(rc.layer, it.seq, t0 + tid, rc.head);
    inv[tid] = held ? x : 0.0f;
    inv_out[row * rs.max_tokens + t0 + tid] = held ? x : __builtin_nanf("");
  }
  __syncthreads();
  // Thread (group, chunk) sums chunk `chunk` of keys group, group + groups, ...; the
  // groups' sums are then added in group order.
  const std::int32_t chunks = d / 8, groups = row_threads / chunks, group = tid / chunks, chunk = tid % chunks;
  if (group < groups) {
    float acc[8] = {};
    for (std::int32_t t = group; t < count; t += groups) {
      float x[8];
      widen8<Elem>(key(t)[chunk], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(inv[t], x[i], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) part[group * d + chunk * 8 + i] = acc[i];
  }
  __syncthreads();
  for (std::int32_t i = tid; i < d; i += row_threads) {
    float sum = 0.0f;
    for (std::int32_t g = 0; g < groups; ++g) sum += part[g * d + i];
    key_sums[(row * gridDim.y + blockIdx.y) * d + i] = sum;
  }
}

// For each column of a 16 x 64 Gram tile, the newest of the warp's 16 rows whose
// element is over theta (mask: over_theta), into `newest` (packed) by an atomic max.
// A column lives in the 8 lanes of one lane % 4: a ballot per mask bit and row half
// gives them its rows over theta, the highest set bit the newest, a shuffle its
// similarity; lanes 0 to 3 write.
template <int Tiles>
__device__ inline void newest_rows_of_columns(const std::uint32_t (&mask)[2], const float (&acc)[Tiles][4],
                                              const float* col_inv, const float* row_inv, std::int32_t row_pos0,
                                              std::int32_t col_pos0, unsigned long long* newest) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
  const std::uint32_t mine = 0x11111111u << (lane % 4);
#pragma unroll
  for (int bit = 0; bit < 2 * Tiles; ++bit) {
    const std::uint32_t high = __ballot_sync(0xffffffffu, (mask[1] >> bit) & 1u) & mine;  // rows 8 to 15
    const std::uint32_t low = __ballot_sync(0xffffffffu, (mask[0] >> bit) & 1u) & mine;   // rows 0 to 7
    if ((high | low) == 0u) continue;  // uniform over the 8 lanes of the column, not the warp
    const std::uint32_t rows = high != 0u ? high : low;
    const std::int32_t src = 31 - __clz(static_cast<int>(rows));
    const float x_low = __shfl_sync(mine, acc[bit / 2][bit % 2], src, 32);
    const float x_high = __shfl_sync(mine, acc[bit / 2][2 + bit % 2], src, 32);
    const std::int32_t r = src / 4 + (high != 0u ? 8 : 0), col = mask_column(bit);
    const float c = (high != 0u ? x_high : x_low) * col_inv[col] * row_inv[r];
    if (lane < 4) atomicMax(newest + col_pos0 + col, pack_newest(row_pos0 + r, c));
  }
}

// HeadDim: d as a constant or 0. A constant unrolls gram_tile's loop (mma.sync) and
// copies whole key tiles without bound tests. RowGroups: 1 or 2 (full_mma_columns);
// with 2 the accumulators of both tiles take 124 registers, so two blocks per SM.
template <class P, dtype Elem, int HeadDim = 0, int RowGroups = 1>
__global__ void __launch_bounds__(row_threads, RowGroups == 1 ? 3 : 2)
    full_pairs_mma_kernel(P p, paged_kv_view cache, row_space rs, const float* inv, const float* key_sums,
                          float* rowsum_out, unsigned long long* newest_out) {
  static_assert(RowGroups == 1 || RowGroups == 2);
  constexpr int G = RowGroups;
  constexpr std::int32_t full_mma_columns = cuda::full_mma_columns(G);
  extern __shared__ uint4 smem16[];
  if (failed(rs)) return;
  const key_tile_block kb = decode_key_tile_block(p, cache, rs, full_mma_columns);
  if (kb.u_count <= 0) return;
  const std::int64_t row = kb.row;
  const std::int32_t n = kb.n, u_pos0 = kb.u_pos0, u_count = kb.u_count, d = HeadDim > 0 ? HeadDim : cache.head_dim;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float theta = p.redundancy.theta;
  const float* row_inv = inv + row * rs.max_tokens;
  unsigned long long* row_newest = newest_out + row * rs.max_tokens;
#if KVP_CUDA_WGMMA
  // A warpgroup takes 64 keys u (a warp 16 of them) against each key tile, on wgmma
  // with both operands in shared memory (core matrices): per 64 x 64 tile it reads
  // 32 KB of shared memory, where four warps' ldmatrix read 80 KB, and the mma.sync
  // kernel was bound by that traffic.
  const core_matrices at{d};
#else
  const padded_rows at{d + 8};
#endif

  auto* us = reinterpret_cast<std::uint16_t*>(smem16);
  std::uint16_t* vbase = us + at(full_mma_columns, 0);
  const std::size_t tile_elems = at(full_mma_keys, 0);
  auto* u_inv = reinterpret_cast<float*>(vbase + 2 * tile_elems);
  float* v_inv_base = u_inv + full_mma_columns;
  float* key_sum = v_inv_base + 2 * full_mma_keys;  // [d]: the row's sum of inv_t k_t

  const key_tile_loader loader(cache, kb.rc.layer, kb.it.seq, kb.rc.head, at);
  loader.copy(cache, us, full_mma_columns, u_count, u_pos0);
  loader.template copy_tile<full_mma_keys, HeadDim>(cache, vbase, n - u_pos0, u_pos0);
  cp_async_commit();
  // Inverse norms of the rows and of the first key tile; those of a key tile are
  // read while the tile before it is folded, and stored after.
  for (std::int32_t i = threadIdx.x; i < full_mma_columns; i += blockDim.x)
    u_inv[i] = i < u_count ? row_inv[u_pos0 + i] : 0.0f;
  if (threadIdx.x < static_cast<unsigned>(full_mma_keys)) {
    const std::int32_t t = u_pos0 + static_cast<std::int32_t>(threadIdx.x);
    v_inv_base[threadIdx.x] = t < n ? row_inv[t] : 0.0f;
  }
  {
    // The partial key sums of key_norms_and_sums_kernel, in span order.
    const float* sums = key_sums + row * tiles_per_row(rs.max_tokens, key_sum_span) * d;
    for (std::int32_t i = threadIdx.x; i < d; i += blockDim.x) {
      float total = 0.0f;
      for (std::int32_t s = 0; s * key_sum_span < n; ++s) total += sums[s * d + i];
      key_sum[i] = total;
    }
  }

  // The warp's 16-row tiles (group g: rows m0[g] on), and the lane's two rows of each.
  std::int32_t m0[G], u[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m0[g] = g * full_mma_group_rows + warp * 16;
    u[g][0] = m0[g] + lane / 4;
    u[g][1] = m0[g] + lane / 4 + 8;
  }
  // Per row: theta / inv_u (an element is over theta when acc * inv_v exceeds it), the
  // newest column over theta and its acc * inv_v.
  float over[G][2] = {}, near_x[G][2] = {};
  std::int32_t near[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) near[g][0] = near[g][1] = -1;

  // One barrier per key tile: it publishes the tile (and its norms) and tells that
  // every warp is done with the other buffer, which the next tile's copy, issued
  // while this tile's MMAs run, then overwrites.
  int buf = 0;
  for (std::int32_t v_pos0 = u_pos0; v_pos0 < n; v_pos0 += full_mma_keys, buf ^= 1) {
    const std::int32_t v_count = min(full_mma_keys, n - v_pos0), next = v_pos0 + full_mma_keys;
    cp_async_wait<0>();
    fence_async_shared();  // this thread's copies and zero rows, before wgmma reads them
    __syncthreads();
    const std::uint16_t* vs = vbase + buf * tile_elems;
    const float* v_inv = v_inv_base + buf * full_mma_keys;
    if (v_pos0 == u_pos0)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int h = 0; h < 2; ++h) over[g][h] = u[g][h] < u_count ? theta / u_inv[u[g][h]] : __builtin_huge_valf();
    const std::int32_t j = static_cast<std::int32_t>(threadIdx.x);
    const float next_inv = j < full_mma_keys && next + j < n ? row_inv[next + j] : 0.0f;
    const auto copy_next = [&] {
      if (next >= n) return;
      loader.template copy_tile<full_mma_keys, HeadDim>(cache, vbase + (buf ^ 1) * tile_elems, n - next, next);
      cp_async_commit();
    };
    // The rows' newest columns in this tile (later tiles are newer), and, past the
    // block's own tile, the columns' newest rows.
    const auto fold = [&](int g, const float (&acc)[8][4]) {
      std::uint32_t mask[2] = {0u, 0u};
      over_theta_tile(mask, acc, v_inv, over[g], v_count, u_pos0 + m0[g] - v_pos0, theta);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (mask[h] != 0u) {
          const std::int32_t bit = 31 - __clz(static_cast<int>(mask[h]));
          near[g][h] = v_pos0 + mask_column(bit);
          near_x[g][h] = masked_similarity(acc, v_inv, h, bit);
        }
      if (v_pos0 >= u_pos0 + full_mma_columns && __any_sync(0xffffffffu, (mask[0] | mask[1]) != 0u))
        newest_rows_of_columns(mask, acc, v_inv, u_inv + m0[g], u_pos0 + m0[g], v_pos0, row_newest);
    };
    float acc[G][8][4];
#if KVP_CUDA_WGMMA
    // The warpgroup issues together (warps past the rows only skip the fold), every
    // group's MMAs before it waits (rows past u_count are zero); the next tile's copy
    // is issued while the MMAs run, in the same branch (ptxas waits for them where
    // branches join).
    const std::int32_t wg_row = warp_uniform(warp / 4 * 64);
    if (wg_row < u_count) {
#pragma unroll
      for (int g = 0; g < G; ++g)
        wgmma_gram_issue<Elem, gram_tile_columns>(acc[g], us + at(g * full_mma_group_rows + wg_row, 0), vs, d);
      copy_next();
#pragma unroll
      for (int g = 0; g < G; ++g) wgmma_gram_wait(acc[g]);
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (m0[g] < u_count) fold(g, acc[g]);
    } else {
      copy_next();
    }
#else
    copy_next();
#pragma unroll
    for (int g = 0; g < G; ++g)
      if (m0[g] < u_count) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i][0] = acc[g][i][1] = acc[g][i][2] = acc[g][i][3] = 0.0f;
        gram_tile<Elem, HeadDim>(acc[g], us + at(m0[g], 0), vs, full_mma_keys, d, at.pitch);
        fold(g, acc[g]);
      }
#endif
    if (j < full_mma_keys) v_inv_base[(buf ^ 1) * full_mma_keys + j] = next_inv;  // the other buffer: free
  }

  // Per row u (a quad of lanes, each a quarter of its chunks): the row sum of
  // similarities without the diagonal, inv_u (k_u . (S - inv_u k_u)) with S the row's
  // key sum; and the newest of the quad's columns, into the packed newest neighbour.
  const std::int32_t q = lane % 4, chunks = d / 8;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int32_t r = u[g][h];
      const bool real = r < u_count;
      const float inv_u = real ? u_inv[r] : 0.0f;
      float sum = 0.0f;
      for (std::int32_t c = q; real && c < chunks; c += 4) {
        float k[8];
        widen8<Elem>(*reinterpret_cast<const uint4*>(us + at(r, c)), k);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum = fmaf(k[i], fmaf(-inv_u, k[i], key_sum[c * 8 + i]), sum);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      std::int32_t nr = near[g][h];
      float nx = near_x[g][h];
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        const std::int32_t n2 = __shfl_xor_sync(0xffffffffu, nr, o);
        const float x2 = __shfl_xor_sync(0xffffffffu, nx, o);
        if (n2 > nr) nr = n2, nx = x2;
      }
      if (q == 0 && real) {
        rowsum_out[row * rs.max_tokens + u_pos0 + r] = inv_u * sum;
        if (nr >= 0) atomicMax(row_newest + u_pos0 + r, pack_newest(nr, nx * inv_u));
      }
    }
}

}  // namespace cuda
KVP_NAMESPACE_END
