// Fill layout on the GPU: the kept tokens past each row's kept count move into the
// evicted slots below it. Sources (at or past the count) and destinations (below it)
// never meet, so every move is independent: no staging, no order between chunks.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/compact_kernel.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Moves of a row of at most max_tokens tokens: never more than half of them.
KVP_HOST_DEVICE constexpr std::int32_t fill_pairs_per_row(std::int32_t max_tokens) { return max_tokens / 2 + 1; }

// One block per row. Pass 1 numbers the holes (evicted slots below k) in position
// order and the movers (kept tokens at k or after) newest first, by block scans,
// into the row's scratch (`pairs`: [rows][2][pitch]) as physical slots (block * b +
// slot: the block table is read once per token, not once per 16 bytes); pass 2 copies K and V 16 bytes
// per thread (for_each_slot, as the compaction), F and the position one thread per
// move. `ready_in`: null to wait for the whole epilogue grid, or its row flags.
template <bool Positions>
__global__ void __launch_bounds__(row_threads) fill_kernel(paged_kv_view cache, score_view f, row_space rs,
                                                           const std::uint8_t* keep, std::int32_t* pairs,
                                                           std::int32_t pitch, const std::int32_t* ready_in) {
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  __shared__ typename scan::TempStorage scan_tmp;
  const last_block_waits_at_exit in_order;
  if (!ready_in) wait_for_prerequisites();  // the keep mask and F
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  if (ready_in) await_row(ready_in, static_cast<std::uint32_t>(row));
  const row_coord rc = decode_row(rs, static_cast<std::uint32_t>(row));
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  const std::uint8_t* kept = keep + row * rs.max_tokens;
  std::int32_t* holes = pairs + row * 2 * pitch;
  std::int32_t* movers = holes + pitch;

  // k: the kept count.
  std::int32_t k = 0;
  for (std::int32_t c0 = 0; c0 < T; c0 += blockDim.x) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(t < T && kept[t] ? 1 : 0, before, total);
    k += total;
    __syncthreads();
  }
  // Holes below k in position order; movers at k or after, counted from the front,
  // then numbered from the end (newest first).
  std::int32_t n_holes = 0;
  for (std::int32_t c0 = 0; c0 < k; c0 += blockDim.x) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    const std::int32_t hole = t < k && !kept[t] ? 1 : 0;
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(hole, before, total);
    if (hole) holes[n_holes + before] = cache.physical_block(it.seq, t) * b + t % b;
    n_holes += total;
    __syncthreads();
  }
  std::int32_t seen = 0;
  for (std::int32_t c0 = k; c0 < T; c0 += blockDim.x) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    const std::int32_t mover = t < T && kept[t] ? 1 : 0;
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(mover, before, total);
    if (mover) movers[n_holes - 1 - (seen + before)] = cache.physical_block(it.seq, t) * b + t % b;
    seen += total;
    __syncthreads();
  }
  // Cautious update: the row is dense in [0, k) after the moves.
  if (!cache.live.empty())
    for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x)
      cache.live.at(rc.layer, cache.physical_block(it.seq, t), t % b, rc.head) = t < k;
  if (n_holes == 0) return;
  // Every K and V row: the copies of one move are independent of every other's.
  const std::int32_t vecs = static_cast<std::int32_t>(cache.row_bytes() / 16);
  for_each_slot(n_holes, vecs, [&](std::int32_t, std::int32_t i, std::int32_t side, std::int32_t v) {
    const std::int32_t to = holes[i], from = movers[i];
    const uint4* src = reinterpret_cast<const uint4*>(side ? cache.v_row_at(rc.layer, from / b, from % b, rc.head)
                                                           : cache.k_row_at(rc.layer, from / b, from % b, rc.head));
    uint4* dst = reinterpret_cast<uint4*>(side ? cache.v_row_at(rc.layer, to / b, to % b, rc.head)
                                               : cache.k_row_at(rc.layer, to / b, to % b, rc.head));
    dst[v] = src[v];
  });
  if (f.empty() && !Positions) return;
  for (std::int32_t i = threadIdx.x; i < n_holes; i += blockDim.x) {
    const std::int32_t to = holes[i], from = movers[i];
    if (!f.empty()) f.at(rc.layer, to / b, to % b, rc.head) = f.at(rc.layer, from / b, from % b, rc.head);
    if constexpr (Positions)
      cache.positions.at(rc.layer, to / b, to % b, rc.head) = cache.positions.at(rc.layer, from / b, from % b, rc.head);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
