// Compact layout on the GPU (Zipage alg. 4): an order-preserving, in-place
// compaction of each (item, layer, KV head) row, moving K, V and F with 16-byte copies.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"

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
// are neither read nor written.
template <class P>
__global__ void __launch_bounds__(row_threads) compact_kernel(P p, paged_kv_view cache, score_view f, row_space rs,
                                                              const std::uint8_t* keep, std::int32_t chunk) {
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  extern __shared__ uint4 smem16[];
  __shared__ typename scan::TempStorage scan_tmp;
  __shared__ std::int32_t src_of[row_threads];  // kept index in chunk -> source position, -1 if in place
  __shared__ float f_buf[row_threads];
  __shared__ std::int32_t chunk_kept;
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  const std::int32_t vecs = static_cast<std::int32_t>(cache.row_bytes() / 16);
  const bool with_f = !f.empty();

  std::int32_t written = 0;  // kept tokens before this chunk
  for (std::int32_t c0 = 0; c0 < T; c0 += chunk) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    const std::int32_t flag = (threadIdx.x < static_cast<unsigned>(chunk) && t < T) ? keep[row * rs.max_tokens + t] : 0;
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(flag, before, total);
    if (flag) src_of[before] = p.layout.destination(written + before) == t ? -1 : t;
    if (threadIdx.x == 0) chunk_kept = total;
    __syncthreads();
    const std::int32_t kept = chunk_kept;
    const std::int32_t work = kept * vecs;

    // Read every moving row of the chunk (K and V), and its F.
    for (std::int32_t e = threadIdx.x; e < work; e += blockDim.x) {
      const std::int32_t k = e / vecs, v = e % vecs, src = src_of[k];
      if (src < 0) continue;
      smem16[2 * std::size_t(k) * vecs + v] = reinterpret_cast<const uint4*>(cache.k_row(rc.layer, it.seq, src, rc.head))[v];
      smem16[(2 * std::size_t(k) + 1) * vecs + v] =
          reinterpret_cast<const uint4*>(cache.v_row(rc.layer, it.seq, src, rc.head))[v];
    }
    if (with_f && threadIdx.x < static_cast<unsigned>(kept) && src_of[threadIdx.x] >= 0) {
      const std::int32_t src = src_of[threadIdx.x];
      f_buf[threadIdx.x] = f.at(rc.layer, cache.physical_block(it.seq, src), src % b, rc.head);
    }
    __syncthreads();
    // Then write them to their destinations.
    for (std::int32_t e = threadIdx.x; e < work; e += blockDim.x) {
      const std::int32_t k = e / vecs, v = e % vecs;
      if (src_of[k] < 0) continue;
      const std::int32_t dst = p.layout.destination(written + k);
      reinterpret_cast<uint4*>(cache.k_row(rc.layer, it.seq, dst, rc.head))[v] = smem16[2 * std::size_t(k) * vecs + v];
      reinterpret_cast<uint4*>(cache.v_row(rc.layer, it.seq, dst, rc.head))[v] =
          smem16[(2 * std::size_t(k) + 1) * vecs + v];
    }
    if (with_f && threadIdx.x < static_cast<unsigned>(kept) && src_of[threadIdx.x] >= 0) {
      const std::int32_t dst = p.layout.destination(written + static_cast<std::int32_t>(threadIdx.x));
      f.at(rc.layer, cache.physical_block(it.seq, dst), dst % b, rc.head) = f_buf[threadIdx.x];
    }
    written += kept;
    __syncthreads();
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
