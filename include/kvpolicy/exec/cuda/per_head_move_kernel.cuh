// KV-Compress's eviction and MoveCache on the GPU, once the schedule gave each head
// its block count (per_head_schedule_kernel.cuh; host: exec/host/move_cache.hpp is
// the law).
//
// A head evicting `blocks` blocks evicts the first (blocks - 1) b + hanging tokens of
// its eviction order: its evictable tokens by rank_bits, lowest first. A block radix
// select finds that cut over the head's 64-bit keys (protected tokens above every
// key), held in shared memory where the head fits; the kept tokens become bits, and
// the holes (evicted below the new length) and movers (kept at or past it) are
// numbered into the workspace as physical slots (per_head_evict_kernel, a block per
// head). Then, as MoveCache, the newest mover fills the lowest hole, and so on: the
// copies are independent (sources at or past the new length, destinations below it)
// and run as a grid of their own (per_head_copy_kernel).
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/compact_kernel.cuh"
#include "kvpolicy/exec/cuda/per_head_validate_kernel.cuh"
#include "kvpolicy/exec/cuda/per_head_workspace.cuh"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The results a head writes (device_per_head_result's pointers).
struct per_head_outputs {
  std::int32_t* new_lengths = nullptr;
  std::int32_t* freed_counts = nullptr;
  std::int32_t* freed_blocks = nullptr;
  std::int32_t* evicted = nullptr;
  std::int32_t* moved = nullptr;
  std::int64_t* freed = nullptr;
};

// A physical slot, block x b + slot, split (a shift and a mask where b is a power of two).
struct block_slot {
  std::int32_t block, slot;
};
__device__ inline block_slot split_slot(std::int32_t p, std::int32_t b) {
  const auto u = static_cast<std::uint32_t>(p), v = static_cast<std::uint32_t>(b);
  return {static_cast<std::int32_t>(div_by(u, v)), static_cast<std::int32_t>(mod_by(u, v))};
}

// Copies the K and V rows of moves [first, first + n) (physical slots `from[i]` ->
// `to[i]`) in units of Unit bytes, every thread of the block taking some.
template <class Unit>
__device__ void copy_head_rows(const per_head_kv_view& c, std::int32_t layer, const std::int32_t* to,
                               const std::int32_t* from, std::int32_t n) {
  const std::int32_t b = c.block_size;
  const auto units = static_cast<std::int32_t>(c.row_bytes() / static_cast<std::int64_t>(sizeof(Unit)));
  for_each_slot(n, units, [&](std::int32_t, std::int32_t i, std::int32_t side, std::int32_t u) {
    const std::int32_t dst = to[i], src = from[i];
    const block_slot s = split_slot(src, b), d = split_slot(dst, b);
    const auto* from_row = reinterpret_cast<const Unit*>(side ? c.v_row_at(layer, s.block, s.slot) : c.k_row_at(layer, s.block, s.slot));
    auto* to_row = reinterpret_cast<Unit*>(side ? c.v_row_at(layer, d.block, d.slot) : c.k_row_at(layer, d.block, d.slot));
    to_row[u] = from_row[u];
  });
}

// Whether every K and V row of `layer` starts on a 16-byte boundary and spans whole
// 16-byte units.
__device__ inline bool rows_of_16_bytes(const per_head_kv_view& c, std::int32_t layer) {
  const std::int64_t elem = size_of(c.type);
  const auto bases = reinterpret_cast<std::uintptr_t>(c.k.layer(layer, c.type)) |
                     reinterpret_cast<std::uintptr_t>(c.v.layer(layer, c.type));
  const std::int64_t strides = (c.k_stride.block | c.k_stride.token | c.v_stride.block | c.v_stride.token) * elem;
  return bases % 16 == 0 && strides % 16 == 0 && c.row_bytes() % 16 == 0;
}

// Table entries a block of the evict kernel copies to shared memory (4 KiB).
inline constexpr std::int32_t per_head_table_copy = 1024;

// One block per row: the results, the cut, the kept bits and the numbered holes and
// movers. The copies are per_head_copy_kernel's, a grid of its own, so that they run
// at full occupancy rather than between this kernel's selects.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_evict_kernel(per_head_kv_view c, per_head_space s,
                                                                     per_head_workspace w, per_head_outputs out,
                                                                     std::int32_t smem_keys) {
  using scan = cub::BlockScan<std::uint64_t, row_threads>;
  extern __shared__ std::uint64_t row_keys[];  // [smem_keys], 8 or 4 bytes a key
  __shared__ std::int32_t table_copy[per_head_table_copy];
  __shared__ union {
    radix_select_storage select;
    typename scan::TempStorage scan;
  } tmp;
  if (failed(s)) return;
  const auto row = static_cast<std::int32_t>(blockIdx.x);
  const per_head_coord rc = decode_per_head_row(s, row);
  const per_head_item it = s.items[rc.item];
  const std::int32_t T = c.length(rc.layer, it.seq, rc.head), b = c.block_size;
  const std::int32_t* table_row = c.table.row(rc.layer, it.seq, rc.head);
  const std::int32_t blocks = w.rows[row].blocks;
  const std::int32_t evicted = select::head_adaptive_blocks::evicted_tokens(blocks, T, b);
  const std::int32_t k = T - evicted, kept_blocks = c.blocks_for(T) - blocks;

  if (threadIdx.x == 0) {
    out.new_lengths[row] = k;
    out.freed_counts[row] = blocks;
    if (out.evicted) out.evicted[row] = evicted;
    if (out.freed && blocks)
      atomicAdd(reinterpret_cast<unsigned long long*>(out.freed + rc.item), static_cast<unsigned long long>(blocks));
  }
  for (std::int32_t i = threadIdx.x; i < blocks; i += row_threads)
    out.freed_blocks[static_cast<std::int64_t>(row) * c.max_blocks + i] = table_row[kept_blocks + i];
  if (evicted == 0) {
    if (threadIdx.x == 0) {
      w.rows[row].moves = 0;
      if (out.moved) out.moved[row] = 0;
    }
    return;
  }

  // The head's keys in rank order, rank_bits(metric, position): the schedule's 32-bit
  // metric keys (w.keys, in this head's pairs, all read before the pairs are written)
  // above the positions; protected tokens above every key, so never cut. Read once
  // into shared memory where the head fits (the select reads them up to eight times):
  // whole where positions are given, else the 32-bit metric keys alone (the position
  // is the index), half the shared memory, twice the blocks an SM.
  const std::uint32_t* metric_keys = w.keys + static_cast<std::int64_t>(row) * w.key_pitch;
  // The head's table in shared memory where it fits: the holes and movers below look
  // up a block per token, one after another in each thread.
  const std::int32_t held_blocks = c.blocks_for(T);
  const bool table_fits = held_blocks <= per_head_table_copy;
  for (std::int32_t i = threadIdx.x; table_fits && i < held_blocks; i += row_threads) table_copy[i] = table_row[i];
  __syncthreads();
  const std::int32_t* table = table_fits ? table_copy : table_row;
  const auto widen = [](std::uint32_t m, std::int32_t p) -> std::uint64_t {
    return m == per_head_protected_key ? ~std::uint64_t{0} : (std::uint64_t{m} << 32) | static_cast<std::uint32_t>(p);
  };
  const bool narrow = c.positions.empty();
  auto cache_key = [&](std::int32_t t) -> std::uint64_t {
    if (narrow) return widen(metric_keys[t], t);
    const block_slot at = split_slot(t, b);
    return widen(metric_keys[t], c.positions.at(rc.layer, table[at.block], at.slot));
  };
  auto* narrow_keys = reinterpret_cast<std::uint32_t*>(row_keys);
  const bool resident = T <= smem_keys;
  if (resident) {
    constexpr std::int32_t batch = per_head_loads_in_flight;
    for (std::int32_t t0 = threadIdx.x; t0 < T; t0 += row_threads * batch) {
      std::uint64_t key[batch];
#pragma unroll
      for (int i = 0; i < batch; ++i) {
        const std::int32_t t = t0 + i * row_threads;
        key[i] = t >= T ? 0 : narrow ? metric_keys[t] : cache_key(t);
      }
#pragma unroll
      for (int i = 0; i < batch; ++i) {
        const std::int32_t t = t0 + i * row_threads;
        if (t < T && narrow) narrow_keys[t] = static_cast<std::uint32_t>(key[i]);
        if (t < T && !narrow) row_keys[t] = key[i];
      }
    }
    __syncthreads();
  }
  auto key_of = [&](std::int32_t t) {
    return !resident ? cache_key(t) : narrow ? widen(narrow_keys[t], t) : row_keys[t];
  };
  const std::uint64_t cut = block_kth_largest(key_of, T, k, tmp.select);

  // The kept bits, 32 tokens a word (a warp's ballot).
  std::uint32_t* kept = w.kept + static_cast<std::int64_t>(row) * w.words;
  const std::int32_t words = (T + 31) / 32, warp = static_cast<std::int32_t>(threadIdx.x) / 32;
  for (std::int32_t t0 = 0; t0 < T; t0 += row_threads) {
    const std::int32_t t = t0 + static_cast<std::int32_t>(threadIdx.x);
    const unsigned bits = __ballot_sync(0xffffffffu, t < T && key_of(t) >= cut);
    if (threadIdx.x % 32 == 0 && t0 / 32 + warp < words) kept[t0 / 32 + warp] = bits;
  }
  __syncthreads();
  // Holes (evicted below k) and movers (kept at or past k), both in position order, a
  // word per thread: one scan of both counts (holes high, movers low) per 256 words.
  // The copy pairs hole i with mover n - 1 - i: the newest survivor fills the lowest hole.
  std::int32_t* holes = w.pairs + static_cast<std::int64_t>(row) * 2 * w.pitch;
  std::int32_t* movers = holes + w.pitch;
  std::uint64_t carry = 0;
  for (std::int32_t w0 = 0; w0 < words; w0 += row_threads) {
    const std::int32_t wi = w0 + static_cast<std::int32_t>(threadIdx.x), base = wi * 32;
    const std::uint32_t bits = wi < words ? kept[wi] : 0u;
    const std::uint32_t below_k = base + 32 <= k ? ~0u : base >= k ? 0u : (1u << (k - base)) - 1u;
    std::uint32_t hole_bits = wi < words ? ~bits & below_k : 0u;
    std::uint32_t mover_bits = bits & ~below_k;
    const std::uint64_t counts = (std::uint64_t{static_cast<std::uint32_t>(__popc(hole_bits))} << 32) |
                                 static_cast<std::uint32_t>(__popc(mover_bits));
    std::uint64_t before = 0, total = 0;
    scan(tmp.scan).ExclusiveSum(counts, before, total);
    before += carry;
    auto hole_at = static_cast<std::int32_t>(before >> 32);
    auto mover_at = static_cast<std::int32_t>(before & 0xffffffffu);
    for (; hole_bits; hole_bits &= hole_bits - 1) {
      const std::int32_t t = base + __ffs(static_cast<int>(hole_bits)) - 1;
      const block_slot at = split_slot(t, b);
      holes[hole_at++] = table[at.block] * b + at.slot;
    }
    for (; mover_bits; mover_bits &= mover_bits - 1) {
      const std::int32_t t = base + __ffs(static_cast<int>(mover_bits)) - 1;
      const block_slot at = split_slot(t, b);
      movers[mover_at++] = table[at.block] * b + at.slot;
    }
    carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    w.rows[row].moves = static_cast<std::int32_t>(carry >> 32);
    if (out.moved) out.moved[row] = static_cast<std::int32_t>(carry >> 32);
  }
}

// Blocks per row of the copy kernel: a head moves up to half its tokens.
inline constexpr std::int32_t per_head_copy_slices = 4;

// Slice `slice` of each row's moves: K and V 16 bytes a thread where the rows allow,
// the metric and the position one thread a move. Sources lie at or past the new
// length and destinations below it, so no move reads what another writes.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_copy_kernel(per_head_kv_view c, per_head_space s,
                                                                    per_head_workspace w) {
  if (failed(s)) return;
  const auto row = static_cast<std::int32_t>(blockIdx.x) / per_head_copy_slices;
  const auto slice = static_cast<std::int32_t>(blockIdx.x) % per_head_copy_slices;
  const std::int32_t n = w.rows[row].moves;
  const std::int32_t first = static_cast<std::int32_t>(std::int64_t{n} * slice / per_head_copy_slices);
  const std::int32_t last = static_cast<std::int32_t>(std::int64_t{n} * (slice + 1) / per_head_copy_slices);
  if (first == last) return;
  const std::int32_t layer = decode_per_head_row(s, row).layer, b = c.block_size;
  const std::int32_t* holes = w.pairs + static_cast<std::int64_t>(row) * 2 * w.pitch;
  const std::int32_t* movers = holes + w.pitch;
  // Hole i takes mover n - 1 - i: the slice's movers, reversed, in shared memory.
  __shared__ std::int32_t from[row_threads];
  for (std::int32_t c0 = first; c0 < last; c0 += row_threads) {
    const std::int32_t m = last - c0 < row_threads ? last - c0 : row_threads;
    if (static_cast<std::int32_t>(threadIdx.x) < m) from[threadIdx.x] = movers[n - 1 - (c0 + static_cast<std::int32_t>(threadIdx.x))];
    __syncthreads();
    if (rows_of_16_bytes(c, layer))
      copy_head_rows<uint4>(c, layer, holes + c0, from, m);
    else
      copy_head_rows<std::uint16_t>(c, layer, holes + c0, from, m);  // every dtype is a whole number of 2 bytes
    if (static_cast<std::int32_t>(threadIdx.x) < m) {
      const std::int32_t to = holes[c0 + static_cast<std::int32_t>(threadIdx.x)], src = from[threadIdx.x];
      const block_slot d = split_slot(to, b), s = split_slot(src, b);
      c.metric.at(layer, d.block, d.slot) = c.metric.at(layer, s.block, s.slot);
      if (!c.positions.empty()) c.positions.at(layer, d.block, d.slot) = c.positions.at(layer, s.block, s.slot);
    }
    __syncthreads();
  }
}

// Keys a block keeps in shared memory: the longest head the cache can hold, up to
// 12288 (96 KiB of 8-byte keys, two blocks an SM; half with 4-byte keys); longer heads
// read their keys from the workspace and the cache.
inline constexpr std::int32_t per_head_resident_keys = 12288;

inline void launch_per_head_moves(const per_head_kv_view& c, const per_head_space& s, const per_head_workspace& w,
                                  const per_head_outputs& out, cudaStream_t stream) {
  if (s.rows() == 0) return;
  const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
  const auto keys = static_cast<std::int32_t>(capacity < per_head_resident_keys ? capacity : per_head_resident_keys);
  const std::size_t key_bytes = c.positions.empty() ? sizeof(std::uint32_t) : sizeof(std::uint64_t);
  const std::size_t smem = key_bytes * static_cast<std::size_t>(keys);
  cudaFuncSetAttribute(per_head_evict_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  per_head_evict_kernel<<<s.rows(), row_threads, smem, stream>>>(c, s, w, out, keys);
  per_head_copy_kernel<<<s.rows() * per_head_copy_slices, row_threads, 0, stream>>>(c, s, w);
}

}  // namespace cuda
KVP_NAMESPACE_END
