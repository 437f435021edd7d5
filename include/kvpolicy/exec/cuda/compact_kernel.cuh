// Compact layout on the GPU (Zipage alg. 4): an order-preserving, in-place
// compaction of each (item, layer, KV head) row, moving K, V and F with 16-byte copies.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Tokens per chunk such that the chunk's K and V rows fit in `smem_bytes`.
KVP_HOST_DEVICE constexpr std::int32_t compact_chunk(std::int64_t row_bytes, std::size_t smem_bytes) {
  const auto fit = static_cast<std::int64_t>(smem_bytes) / (2 * row_bytes);
  return static_cast<std::int32_t>(fit < row_threads ? fit : row_threads);
}

// Destinations never pass their sources (the i-th kept token goes to position
// i <= t), so a chunk's sources are read whole into shared memory before any of
// its rows is written, and chunks run front to back: a chunk only overwrites
// positions whose tokens were already read. Rows whose position does not change
// are neither read nor written. Reads are cp.async (every row of the chunk in
// flight at once); each warp moves one token's K and V rows at a time. `ready_in`:
// null to wait for the whole epilogue grid first, or its row hand-off flags.
template <class P>
__global__ void __launch_bounds__(row_threads) compact_kernel(P p, paged_kv_view cache, score_view f, row_space rs,
                                                              const std::uint8_t* keep, std::int32_t chunk,
                                                              const std::int32_t* ready_in) {
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  extern __shared__ uint4 smem16[];
  __shared__ typename scan::TempStorage scan_tmp;
  // Per moving token of the chunk (by its kept index): its rows and F, or null.
  __shared__ const uint4* src_k[row_threads];
  __shared__ const uint4* src_v[row_threads];
  __shared__ uint4* dst_k[row_threads];
  __shared__ uint4* dst_v[row_threads];
  __shared__ float* src_f[row_threads];
  __shared__ float* dst_f[row_threads];
  __shared__ std::int32_t chunk_kept;
  const last_block_waits_at_exit in_order;
  if (!ready_in) wait_for_prerequisites();  // the keep mask and F
  if (failed(rs)) return;
  if (ready_in) await_row(ready_in, blockIdx.x);
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  const std::int32_t vecs = static_cast<std::int32_t>(cache.row_bytes() / 16);
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const bool with_f = !f.empty();

  std::int32_t written = 0;  // kept tokens before this chunk
  for (std::int32_t c0 = 0; c0 < T; c0 += chunk) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    const std::int32_t flag = (threadIdx.x < static_cast<unsigned>(chunk) && t < T) ? keep[row * rs.max_tokens + t] : 0;
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(flag, before, total);
    if (flag) {
      const std::int32_t dst = p.layout.destination(written + before);
      const bool moves = dst != t;
      src_k[before] = moves ? reinterpret_cast<const uint4*>(cache.k_row(rc.layer, it.seq, t, rc.head)) : nullptr;
      src_v[before] = moves ? reinterpret_cast<const uint4*>(cache.v_row(rc.layer, it.seq, t, rc.head)) : nullptr;
      dst_k[before] = moves ? reinterpret_cast<uint4*>(cache.k_row(rc.layer, it.seq, dst, rc.head)) : nullptr;
      dst_v[before] = moves ? reinterpret_cast<uint4*>(cache.v_row(rc.layer, it.seq, dst, rc.head)) : nullptr;
      src_f[before] = moves && with_f ? &f.at(rc.layer, cache.physical_block(it.seq, t), t % b, rc.head) : nullptr;
      dst_f[before] = moves && with_f ? &f.at(rc.layer, cache.physical_block(it.seq, dst), dst % b, rc.head) : nullptr;
    }
    if (threadIdx.x == 0) chunk_kept = total;
    __syncthreads();
    const std::int32_t kept = chunk_kept;

    // Read every moving row of the chunk (K then V of kept index k at 2k, 2k + 1).
    for (std::int32_t k = warp; k < kept; k += warps) {
      if (!src_k[k]) continue;
      uint4* stage = smem16 + 2 * std::size_t(k) * vecs;
      for (std::int32_t v = lane; v < 2 * vecs; v += 32)
        cp_async_16(stage + v, v < vecs ? src_k[k] + v : src_v[k] + (v - vecs), 16);
    }
    cp_async_commit();
    float moved_f = 0.0f;
    if (threadIdx.x < static_cast<unsigned>(kept) && src_f[threadIdx.x]) moved_f = *src_f[threadIdx.x];
    cp_async_wait<0>();
    __syncthreads();
    // Then write them to their destinations.
    for (std::int32_t k = warp; k < kept; k += warps) {
      if (!dst_k[k]) continue;
      const uint4* stage = smem16 + 2 * std::size_t(k) * vecs;
      for (std::int32_t v = lane; v < 2 * vecs; v += 32) (v < vecs ? dst_k[k][v] : dst_v[k][v - vecs]) = stage[v];
    }
    if (threadIdx.x < static_cast<unsigned>(kept) && dst_f[threadIdx.x]) *dst_f[threadIdx.x] = moved_f;
    written += kept;
    __syncthreads();
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
