// Compact layout on the GPU (Zipage alg. 4): an order-preserving, in-place
// compaction of each (item, layer, KV head) row, moving K, V and F with 16-byte copies.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/destination_table.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Chunks staged at once: one chunk's rows are written while the next one's are read.
inline constexpr int compact_stages = 2;

// Column slices per row: a row's K and V bytes split into `slices` equal, 16-byte
// aligned column ranges, each moved by a block of its own. Slices never share a byte
// (byte o of a row moves from token t to the same byte of its destination), so they
// need no ordering between them; they let a launch of few rows (one sequence: 64
// rows) fill the GPU (splits_to_fill, which never adds a wave), with slices of at
// least compact_tuning::min_slice_bytes on 16-byte bounds (so at most the largest
// power of two dividing the row's 16-byte vectors).
KVP_HOST_DEVICE constexpr std::int32_t compact_slices(std::int64_t rows, std::int64_t row_bytes, std::int64_t slots) {
  const std::int64_t vecs = row_bytes / 16, divides = vecs & -vecs, wide = row_bytes / compact_tuning::min_slice_bytes;
  return splits_to_fill(rows, slots, divides < wide ? divides : wide);
}

// Tokens per chunk such that compact_stages chunks' K and V rows (or slices of them,
// `row_bytes` each) fit in `smem_bytes`.
KVP_HOST_DEVICE constexpr std::int32_t compact_chunk(std::int64_t row_bytes, std::size_t smem_bytes) {
  const auto fit = static_cast<std::int64_t>(smem_bytes) / (compact_stages * 2 * row_bytes);
  return static_cast<std::int32_t>(fit < row_threads ? fit : row_threads);
}
// Dynamic shared memory of compact_kernel for chunks of `chunk` tokens.
KVP_HOST_DEVICE constexpr std::size_t compact_staging_bytes(std::int32_t chunk, std::int64_t row_bytes) {
  return static_cast<std::size_t>(compact_stages) * static_cast<std::size_t>(chunk) * 2 *
         static_cast<std::size_t>(row_bytes);
}

// Calls fn(i, k, side, v) for this thread's share of the 16-byte slots of `kept`
// tokens' rows: 2 * vecs per token, K (side 0) then V (side 1), slot i = (2 k + side)
// * vecs + v, which is also its place in a stage. Consecutive threads take
// consecutive slots, so a warp moves whole rows (one token's K and V for 256-byte
// rows) with one 16-byte access per lane; a warp per token with a loop over its
// slots spent many times the instructions per token.
template <class Fn>
__device__ inline void for_each_slot(std::int32_t kept, std::int32_t vecs, Fn fn) {
  const std::int32_t per_token = 2 * vecs, slots = kept * per_token, shift = __ffs(per_token) - 1;
  const auto threads = static_cast<std::int32_t>(blockDim.x);
  const auto each = [&]<bool Pow2>() {
#pragma unroll 4
    for (auto i = static_cast<std::int32_t>(threadIdx.x); i < slots; i += threads) {
      const std::int32_t k = Pow2 ? i >> shift : i / per_token, r = i - k * per_token, side = r >= vecs;
      fn(i, k, side, r - side * vecs);
    }
  };
  // A run-time division is some 20 instructions; rows of 2^n bytes take a shift.
  if ((per_token & (per_token - 1)) == 0)
    each.template operator()<true>();
  else
    each.template operator()<false>();
}

// Destinations never pass their sources (the i-th kept token goes to position
// i <= t), so chunk c writes only positions below chunk c + 1, and a chunk may
// overwrite positions of chunks before it, whose rows were already read. Chunks are
// therefore read one ahead: chunk c + 1's rows are in flight (cp.async, every row
// of the chunk at once) while chunk c's are written, from the other stage of
// shared memory; chunk c + 1 is written only after chunk c's reads completed.
// Rows whose position does not change are neither read nor written. K and V move
// by 16-byte slots (for_each_slot), F and the positions through the registers of the
// thread that found the token. A block moves one column slice of its row (compact_slices; blocks
// of a row adjacent, F moved by the first). `ready_in`: null to wait for the whole
// epilogue grid first, or its row hand-off flags. `EngineState`: the view has
// positions or the batch targets for shared prefixes; without them the kernel is the
// plain compaction, whose per-token work (most of a row's time when the row is split
// over slices) carries no branch or register for either.
template <class P, bool EngineState>
__global__ void __launch_bounds__(row_threads) compact_kernel(P p, paged_kv_view cache, score_view f, row_space rs,
                                                              const std::uint8_t* keep, std::int32_t chunk,
                                                              std::int32_t slices, const std::int32_t* ready_in,
                                                              prefix_targets targets, const float* f_stash) {
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  extern __shared__ uint4 smem16[];
  __shared__ typename scan::TempStorage scan_tmp;
  // Per token of a chunk (by its kept index): its source K and V rows (needed only
  // to start the reads) and, per stage, its destination rows; null when it stays.
  __shared__ const uint4* src[2][row_threads];
  __shared__ uint4* dst[compact_stages][2][row_threads];
  const last_block_waits_at_exit in_order;
  if (!ready_in) wait_for_prerequisites();  // the keep mask and F
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x / slices;
  if (ready_in) await_row(ready_in, static_cast<std::uint32_t>(row));
  const row_coord rc = decode_row(rs, static_cast<std::uint32_t>(row));
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  // Where kept tokens go: the own blocks, or the targets of a shared prefix, whose F
  // the epilogue left in f_stash.
  const destination_table to_table = EngineState ? destination_table::of(cache.table, it.seq, targets, rc.item)
                                                 : destination_table{cache.table, it.seq};
  const std::int32_t prefix_tokens = EngineState ? to_table.shared * b : 0;
  // This block's slice: 16-byte vectors [v0, v0 + vecs) of each K and V row.
  const std::int32_t vecs = static_cast<std::int32_t>(cache.row_bytes() / 16) / slices,
                     v0 = static_cast<std::int32_t>(blockIdx.x % slices) * vecs;
  // F and the positions move with their tokens through the first slice's block, which
  // also writes the live bytes (cautious update: 1 where a kept token lands, else 0).
  const bool with_f = !f.empty() && v0 == 0, with_positions = EngineState && !cache.positions.empty() && v0 == 0;
  const bool with_live = !cache.live.empty() && v0 == 0;
  const std::size_t stage_vecs = 2 * std::size_t(chunk) * vecs;
  // A moving token's F and position, and where they go (null: nothing to move).
  struct sidecar_move {
    float f_val = 0.0f;
    float* f_dst = nullptr;
    std::int32_t position = 0;
    std::int32_t* position_dst = nullptr;
  };

  // The calling thread's keep flag in chunk c0 (0 past the row or the chunk).
  const auto flag_of = [&](std::int32_t c0) -> std::int32_t {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    return (threadIdx.x < static_cast<unsigned>(chunk) && t < T) ? keep[row * rs.max_tokens + t] : 0;
  };
  // Finds chunk c0's kept tokens (the first of them kept index `written`; `flag`:
  // the thread's flag_of(c0), loaded a chunk ahead so that its latency passes under
  // the chunk before), records their rows for `stage` and starts reading the moving
  // ones into it (one cp.async group). Returns the chunk's kept count; the calling
  // thread's token, if it moves, leaves its F and position (where they move with it)
  // and their destinations in `side`.
  const auto gather = [&](std::int32_t c0, std::int32_t flag, int stage, std::int32_t written, sidecar_move& side) {
    const std::int32_t t = c0 + static_cast<std::int32_t>(threadIdx.x);
    std::int32_t before = 0, total = 0;
    scan(scan_tmp).ExclusiveSum(flag, before, total);
    side = {};
    if (flag) {
      const std::int32_t to = p.layout.destination(written + before);
      if (with_live) cache.live.at(rc.layer, to_table.block(to / b), to % b, rc.head) = 1;
      // A token of a shared prefix moves even to its own position: to a target block.
      const bool moves = to != t || to < prefix_tokens;
      const std::int32_t from_block = moves ? cache.physical_block(it.seq, t) : 0;
      const std::int32_t to_block = moves ? to_table.block(to / b) : 0;
      src[0][before] = moves ? reinterpret_cast<const uint4*>(cache.k_row_at(rc.layer, from_block, t % b, rc.head)) + v0
                             : nullptr;
      src[1][before] = moves ? reinterpret_cast<const uint4*>(cache.v_row_at(rc.layer, from_block, t % b, rc.head)) + v0
                             : nullptr;
      dst[stage][0][before] =
          moves ? reinterpret_cast<uint4*>(cache.k_row_at(rc.layer, to_block, to % b, rc.head)) + v0 : nullptr;
      dst[stage][1][before] =
          moves ? reinterpret_cast<uint4*>(cache.v_row_at(rc.layer, to_block, to % b, rc.head)) + v0 : nullptr;
      if (moves && (with_f || with_positions)) {
        if (with_f) {
          side.f_val = t < prefix_tokens ? f_stash[row * rs.max_tokens + t] : f.at(rc.layer, from_block, t % b, rc.head);
          side.f_dst = &f.at(rc.layer, to_block, to % b, rc.head);
        }
        if (with_positions) {
          side.position = cache.positions.at(rc.layer, from_block, t % b, rc.head);
          side.position_dst = &cache.positions.at(rc.layer, to_block, to % b, rc.head);
        }
      }
    }
    __syncthreads();
    uint4* staged = smem16 + stage * stage_vecs;
    for_each_slot(total, vecs, [&](std::int32_t i, std::int32_t k, std::int32_t side, std::int32_t v) {
      if (const uint4* from = src[side][k]) cp_async_16(staged + i, from + v);
    });
    cp_async_commit();
    return total;
  };

  if (T <= 0) return;
  if (with_live) {
    // Cleared before gather marks the destinations: nothing in this kernel reads them.
    for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x)
      cache.live.at(rc.layer, to_table.block(t / b), t % b, rc.head) = 0;
    __syncthreads();
  }
  sidecar_move side, side_next;
  std::int32_t written = 0;  // kept tokens before chunk c0
  std::int32_t flag_next = flag_of(chunk);
  std::int32_t kept_next = gather(0, flag_of(0), 0, 0, side_next);
  int stage = 0;
  for (std::int32_t c0 = 0; c0 < T; c0 += chunk, stage ^= 1) {
    const std::int32_t kept = kept_next;
    side = side_next;
    if (c0 + chunk < T) {
      kept_next = gather(c0 + chunk, flag_next, stage ^ 1, written + kept, side_next);
      flag_next = flag_of(c0 + 2 * chunk);
      cp_async_wait<1>();  // this chunk's group; the next one's stays in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint4* staged = smem16 + stage * stage_vecs;
    for_each_slot(kept, vecs, [&](std::int32_t i, std::int32_t k, std::int32_t side, std::int32_t v) {
      if (uint4* to = dst[stage][side][k]) to[v] = staged[i];
    });
    if (side.f_dst) *side.f_dst = side.f_val;
    if (side.position_dst) *side.position_dst = side.position;
    written += kept;
    __syncthreads();  // the stage and its destinations are free for chunk c0 + 2 chunk
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
