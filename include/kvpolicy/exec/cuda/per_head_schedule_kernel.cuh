// KV-Compress's block schedule on the GPU without sorting (select::head_adaptive_blocks
// is the law; cuda_per_head_executor.cuh the facade).
//
// A head of T tokens frees blocks in order; its e-th block costs the metric at offset
// o_e = (e - 1) b + hanging - 1 of its evictable tokens sorted by metric (then
// position). So the blocks of the head costing less than a key v number
//     f(c) = 0 if c < hanging, else min(held, 1 + (c - hanging) / b),
// c = the head's evictable tokens with a metric key below v: no sort needed, only
// counts. A group (the sequence, or one layer of it) frees its `need` cheapest blocks,
// ranked by (cost, row, e); the cut is the need-th smallest cost, found by a radix
// select over the 32-bit metric keys, 8 bits a pass: each pass, per head, a histogram
// of the next digit among the keys under the prefix (per_head_histogram_kernel; the
// first pass reads the metric through the table and keeps each head's keys in order,
// which the later passes and the evict kernel read instead), then
// each head adds f(its keys below digit j) to its group's F(j) at every digit boundary
// (per_head_row_blocks_kernel, a warp per head), and the group takes the digit where F
// reaches `need` (per_head_group_digit_kernel). After the last pass the cut is a full
// key: each head frees its blocks cheaper than the cut (per_head_row_cut_kernel), and
// the blocks costing exactly the cut go to the lower rows first, as the host ranks
// them (per_head_group_ties_kernel).
#pragma once

#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/per_head_validate_kernel.cuh"
#include "kvpolicy/exec/cuda/per_head_workspace.cuh"
#include "kvpolicy/select/head_adaptive_blocks.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The 32-bit metric key of the host's cost ranking: rank_bits' upper word (NaN as
// -inf, -0 as +0, order-preserving).
__device__ inline std::uint32_t metric_key(float m) { return static_cast<std::uint32_t>(rank_bits(m, 0) >> 32); }

// f above: blocks of a head of T tokens (held blocks) whose cost offset lies below c.
__device__ inline std::int32_t blocks_below(std::int32_t c, std::int32_t T, std::int32_t b) {
  if (T <= 0) return 0;
  const std::int32_t hanging = select::head_adaptive_blocks::hanging(T, b), held = (T + b - 1) / b;
  if (c < hanging) return 0;
  const std::int32_t e = 1 + (c - hanging) / b;
  return e < held ? e : held;
}

__device__ inline std::int32_t per_head_length(const per_head_kv_view& c, const per_head_space& s, std::int32_t row,
                                               per_head_coord& rc, per_head_item& it) {
  rc = decode_per_head_row(s, row);
  it = s.items[rc.item];
  return c.length(rc.layer, it.seq, rc.head);
}

// Passes 1 and 2 keep the keys under their prefix as candidates for the later ones
// (pass 2 where pass 1's did not fit: a float key's first 8 bits are its sign and 7
// exponent bits, which all of a row may share).
inline constexpr std::int32_t per_head_candidate_passes = 2;

// The last passes' histogram of a row whose candidates fit (block 0 of the row's
// tiles): its candidates under the prefix, a thread per candidate, whole warps.
__device__ inline void count_candidates(std::uint32_t* hist, const std::uint32_t* candidates, std::int32_t n,
                                        std::uint32_t mask, std::uint32_t prefix, int shift) {
  for (std::int32_t i0 = 0; i0 < n; i0 += row_threads) {
    const std::int32_t i = i0 + static_cast<std::int32_t>(threadIdx.x);
    const std::uint32_t key = i < n ? candidates[i] : 0u;
    count_digit(hist, i < n && (key & mask) == prefix ? (key >> shift) & 0xffu : no_digit);
  }
}

// One block per (row, tile of per_head_tile_tokens tokens), a thread per token of
// each of its per_head_loads_in_flight runs of row_threads. Pass 0 reads the metric
// through the table (every load of the tile in flight at once), writes the row's keys
// (w.keys), counts the row's evictable tokens and the item's non-finite metrics, and
// checks positions; the later passes read the first candidates that fit (one block a
// row) or else the keys, in order, and then (passes 1 and 2) keep those under their
// prefix as candidates (w.candidates, counted past the room).
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_histogram_kernel(per_head_kv_view c, per_head_space s,
                                                                         per_head_workspace w, std::int32_t pass,
                                                                         std::int64_t* nonfinite) {
  static_assert(per_head_tile_tokens == per_head_loads_in_flight * row_threads);
  constexpr std::int32_t runs = per_head_loads_in_flight;
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  __shared__ typename scan::TempStorage scan_storage;
  __shared__ std::int32_t candidate_base;
  if (failed(s)) return;
  const row_tile rt = decode_row_tile(w.tiles);
  const auto row = static_cast<std::int32_t>(rt.row);
  // The source first: a row that reads its candidates needs its first tile only, and
  // the others leave after this one load.
  const per_head_row_state& st = w.rows[row];
  std::int32_t list = 0;  // the pass whose candidates this one reads (0: the keys)
  for (std::int32_t q = 1; q < pass && q <= per_head_candidate_passes; ++q)
    if (list == 0 && st.candidates[q - 1] <= w.words) list = q;
  const bool from_candidates = list != 0;
  const bool keeps = !from_candidates && pass >= 1 && pass <= per_head_candidate_passes;
  if (from_candidates && rt.tile > 0) return;
  const std::int32_t group = row / s.rows_per_group();
  if (pass > 0 && w.groups[group].settled) return;
  per_head_coord rc;
  per_head_item it;
  const std::int32_t T = per_head_length(c, s, row, rc, it);
  const std::int32_t begin = static_cast<std::int32_t>(rt.tile) * per_head_tile_tokens;
  if (begin >= T) return;
  const std::int32_t tid = static_cast<std::int32_t>(threadIdx.x);
  const int shift = 24 - 8 * pass;
  const std::uint32_t mask = pass == 0 ? 0u : ~0u << (32 - 8 * pass);
  const std::uint32_t prefix = pass == 0 ? 0u : w.groups[group].prefix;
  std::uint32_t* keys = w.keys + static_cast<std::int64_t>(row) * w.key_pitch;
  std::uint32_t* candidates = w.candidates + static_cast<std::int64_t>(row) * w.words;

  __shared__ std::uint32_t hist[256];
  __shared__ std::int32_t counts[2];  // evictable, non-finite
  hist[tid] = 0;
  if (tid < 2) counts[tid] = 0;
  __syncthreads();
  if (from_candidates) {
    count_candidates(hist, candidates, st.candidates[list - 1], mask, prefix, shift);
    __syncthreads();
    const std::uint32_t n = hist[tid];
    if (n) atomicAdd(w.hist + (static_cast<std::int64_t>(pass) * s.rows() + row) * 256 + tid, n);
    return;
  }
  std::uint32_t key[runs];
  if (pass == 0) {
    const std::int32_t length = it.logical_length >= 0 ? it.logical_length : T;
    const std::int32_t* table = c.table.row(rc.layer, it.seq, rc.head);
    const std::int32_t b = c.block_size;
    float m[runs];
    std::int32_t p[runs];
#pragma unroll
    for (int k = 0; k < runs; ++k) {
      const std::int32_t t = begin + k * row_threads + tid;
      m[k] = 0.0f;
      p[k] = 0;
      if (t < T) {
        const std::int32_t blk = table[div_by(t, b)], slot = static_cast<std::int32_t>(mod_by(t, b));
        m[k] = c.metric.at(rc.layer, blk, slot);
        p[k] = c.positions.empty() ? t : c.positions.at(rc.layer, blk, slot);
      }
    }
    std::int32_t evictable = 0, nan_or_inf = 0;
#pragma unroll
    for (int k = 0; k < runs; ++k) {
      const std::int32_t t = begin + k * row_threads + tid;
      key[k] = per_head_protected_key;
      if (t < T) {
        if (p[k] < 0 || p[k] >= length)
          report(s.status, status_code::position_out_of_range, rc.item, rc.layer, rc.head, t, p[k], length);
        nan_or_inf += !isfinite(m[k]);
        if (!per_head_protects(s, p[k], length)) {
          evictable += 1;
          key[k] = metric_key(m[k]);
        }
        keys[t] = key[k];
      }
    }
    atomicAdd(&counts[0], evictable);
    atomicAdd(&counts[1], nan_or_inf);
  } else {
#pragma unroll
    for (int k = 0; k < runs; ++k) {
      const std::int32_t t = begin + k * row_threads + tid;
      key[k] = t < T ? keys[t] : per_head_protected_key;
    }
  }
  // Whole warps count every run (count_digit).
  std::int32_t kept = 0;
#pragma unroll
  for (int k = 0; k < runs; ++k) {
    const bool counted = key[k] != per_head_protected_key && (key[k] & mask) == prefix;
    kept += counted;
    count_digit(hist, counted ? (key[k] >> shift) & 0xffu : no_digit);
  }
  if (keeps) {
    // The tile's counted keys, after those of the tiles that reserved before it; past
    // the room, only counted (the row then reads its keys in the last passes).
    std::int32_t before = 0, total = 0;
    scan(scan_storage).ExclusiveSum(kept, before, total);
    if (tid == 0) candidate_base = total ? atomicAdd(&w.rows[row].candidates[pass - 1], total) : 0;
    __syncthreads();
    std::int32_t at = candidate_base + before;
#pragma unroll
    for (int k = 0; k < runs; ++k)
      if (key[k] != per_head_protected_key && (key[k] & mask) == prefix) {
        if (at < w.words) candidates[at] = key[k];
        ++at;
      }
  }
  __syncthreads();
  const std::uint32_t n = hist[tid];
  if (n) atomicAdd(w.hist + (static_cast<std::int64_t>(pass) * s.rows() + row) * 256 + tid, n);
  if (pass == 0 && tid == 0) {
    if (counts[0]) atomicAdd(&w.rows[row].evictable, counts[0]);
    if (counts[1] && nonfinite)
      atomicAdd(reinterpret_cast<unsigned long long*>(nonfinite + rc.item), static_cast<unsigned long long>(counts[1]));
  }
}

// Rows per block of the warp-per-row kernels (one warp a row).
inline constexpr std::int32_t per_head_rows_per_block = row_threads / 32;

// A warp's lane holds 8 adjacent digits (8 lane .. 8 lane + 7) of a row's histogram.
struct lane_digits {
  std::uint32_t h[8];
  __device__ lane_digits(const std::uint32_t* row_hist, int lane) {
    const uint4* p = reinterpret_cast<const uint4*>(row_hist + lane * 8);
    const uint4 a = p[0], q = p[1];
    h[0] = a.x, h[1] = a.y, h[2] = a.z, h[3] = a.w, h[4] = q.x, h[5] = q.y, h[6] = q.z, h[7] = q.w;
  }
  // The row's keys in digits below d (every lane gets the warp's total).
  __device__ std::int32_t below(std::int32_t d, int lane) const {
    std::int32_t n = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) n += lane * 8 + k < d ? static_cast<std::int32_t>(h[k]) : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    return n;
  }
};

__device__ inline const std::uint32_t* pass_hist(const per_head_workspace& w, const per_head_space& s,
                                                 std::int32_t pass, std::int32_t row) {
  return w.hist + (static_cast<std::int64_t>(pass) * s.rows() + row) * 256;
}

// Rows per block of the F kernel (a warp each): the block adds its rows' F
// contributions in shared memory, then once to the group's F, so that a group's 256
// addresses take 32 times fewer global atomics.
inline constexpr std::int32_t per_head_f_rows = 32;

// One warp per row, after pass `pass`'s histograms. First the row folds the previous
// pass's digit into `less` (its keys below the group's prefix); then it adds, for
// every digit boundary j of this pass, its blocks cheaper than j to the group's
// F(j). Pass 0 also adds the row's possible blocks to the group's total.
template <int = 0>
__global__ void __launch_bounds__(per_head_f_rows * 32) per_head_row_blocks_kernel(per_head_kv_view c, per_head_space s,
                                                                                  per_head_workspace w, std::int32_t pass) {
  __shared__ unsigned long long block_f[256];  // F contributions of the rows in the block's first group
  if (failed(s)) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int32_t first = static_cast<std::int32_t>(blockIdx.x) * per_head_f_rows;
  const std::int32_t row = first + static_cast<std::int32_t>(threadIdx.x) / 32;
  const std::int32_t first_group = first / s.rows_per_group();
  for (auto j = static_cast<std::int32_t>(threadIdx.x); j < 256; j += static_cast<std::int32_t>(blockDim.x)) block_f[j] = 0;
  __syncthreads();
  const std::int32_t group = row / s.rows_per_group();
  // A warp past the rows or in a settled group adds nothing, but meets the barrier.
  if (row < s.rows() && !(pass > 0 && w.groups[group].settled)) {
    per_head_group_state& gs = w.groups[group];
    per_head_coord rc;
    per_head_item it;
    const std::int32_t T = per_head_length(c, s, row, rc, it), b = c.block_size;
    per_head_row_state& st = w.rows[row];
    std::int32_t less = 0;
    if (pass > 0) {
      less = st.less + lane_digits(pass_hist(w, s, pass - 1, row), lane).below(gs.digit[pass - 1], lane);
      if (lane == 0) st.less = less;
    } else if (lane == 0) {
      const std::int32_t possible = blocks_below(st.evictable, T, b);
      if (possible) atomicAdd(reinterpret_cast<unsigned long long*>(&gs.total), static_cast<unsigned long long>(possible));
    }
    const lane_digits d(pass_hist(w, s, pass, row), lane);
    std::int32_t sum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += static_cast<std::int32_t>(d.h[k]);
    std::int32_t incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const std::int32_t v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    std::int32_t count = less + incl - sum;
    unsigned long long* F = group == first_group
                                ? block_f + lane * 8
                                : reinterpret_cast<unsigned long long*>(w.cheaper) +
                                      (static_cast<std::int64_t>(pass) * s.groups() + group) * 256 + lane * 8;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const std::int32_t n = blocks_below(count, T, b);
      if (n) atomicAdd(F + k, static_cast<unsigned long long>(n));
      count += static_cast<std::int32_t>(d.h[k]);
    }
  }
  __syncthreads();
  unsigned long long* F = reinterpret_cast<unsigned long long*>(w.cheaper) +
                          (static_cast<std::int64_t>(pass) * s.groups() + first_group) * 256;
  for (auto j = static_cast<std::int32_t>(threadIdx.x); j < 256; j += static_cast<std::int32_t>(blockDim.x))
    if (block_f[j]) atomicAdd(F + j, block_f[j]);
}

// One block per budget group, after the rows' pass: the digit where F(j) reaches the
// group's need. Pass 0 first sets the need, min(asked, total), and settles the groups
// that free nothing or everything they can.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_group_digit_kernel(per_head_space s, per_head_workspace w,
                                                                           std::int32_t pass) {
  __shared__ long long shared_need;
  if (failed(s)) return;
  const auto g = static_cast<std::int32_t>(blockIdx.x);
  per_head_group_state& gs = w.groups[g];
  if (gs.settled) return;
  if (pass == 0) {
    if (threadIdx.x == 0) {
      const per_head_coord rc = decode_per_head_row(s, g * s.rows_per_group());
      const per_head_item it = s.items[rc.item];
      const std::int64_t asked = s.budget == select::block_budget::sequence ? it.blocks_to_free : it.per_layer[rc.layer];
      const std::int64_t need = asked < gs.total ? asked : gs.total;
      gs.need = need;
      if (need == 0 || need == gs.total) gs.settled = 1;
      shared_need = gs.settled ? -1 : need;
    }
    __syncthreads();
    if (shared_need < 0) return;
  }
  // F(j): the group's blocks cheaper than digit j's range; non-decreasing, F(0) < need,
  // and the blocks of the last digit reach it: exactly one digit holds the need-th block.
  const auto* F = reinterpret_cast<const long long*>(w.cheaper) + (static_cast<std::int64_t>(pass) * s.groups() + g) * 256;
  const long long need = gs.need, at = F[threadIdx.x];
  const long long next = threadIdx.x == 255 ? LLONG_MAX : F[threadIdx.x + 1];
  if (at < need && next >= need) {
    gs.digit[pass] = static_cast<std::int32_t>(threadIdx.x);
    gs.prefix |= static_cast<std::uint32_t>(threadIdx.x) << (24 - 8 * pass);
  }
}

// One warp per row after the last pass: the cut is a full key. The row's blocks
// cheaper than it (`blocks`) and those costing exactly it (`ties`), or, in a settled
// group, nothing or every block it can free.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_row_cut_kernel(per_head_kv_view c, per_head_space s,
                                                                       per_head_workspace w) {
  if (failed(s)) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int32_t row =
      static_cast<std::int32_t>(blockIdx.x) * per_head_rows_per_block + static_cast<std::int32_t>(threadIdx.x) / 32;
  if (row >= s.rows()) return;
  const per_head_group_state& gs = w.groups[row / s.rows_per_group()];
  per_head_coord rc;
  per_head_item it;
  const std::int32_t T = per_head_length(c, s, row, rc, it), b = c.block_size;
  per_head_row_state& st = w.rows[row];
  if (gs.settled) {
    if (lane == 0) st.blocks = gs.need == 0 ? 0 : blocks_below(st.evictable, T, b);
    return;
  }
  constexpr std::int32_t last = per_head_passes - 1;
  const std::int32_t digit = gs.digit[last];
  const lane_digits d(pass_hist(w, s, last, row), lane);
  const std::int32_t less = st.less + d.below(digit, lane);
  if (lane == 0) {
    const std::int32_t equal = static_cast<std::int32_t>(pass_hist(w, s, last, row)[digit]);
    st.blocks = blocks_below(less, T, b);
    st.ties = blocks_below(less + equal, T, b) - st.blocks;
  }
}

// One block per group that is not settled: of the blocks costing exactly the cut, the
// lower rows' go first (within a row its earlier blocks), until the need is reached.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_group_ties_kernel(per_head_space s, per_head_workspace w) {
  using reduce = cub::BlockReduce<long long, row_threads>;
  using scan = cub::BlockScan<std::int32_t, row_threads>;
  __shared__ union {
    typename reduce::TempStorage reduce;
    typename scan::TempStorage scan;
  } tmp;
  __shared__ long long shared_left;
  if (failed(s)) return;
  const auto g = static_cast<std::int32_t>(blockIdx.x);
  const per_head_group_state& gs = w.groups[g];
  if (gs.settled) return;
  const std::int32_t first = g * s.rows_per_group(), last_row = first + s.rows_per_group();
  long long cheaper = 0;
  for (std::int32_t r = first + static_cast<std::int32_t>(threadIdx.x); r < last_row; r += row_threads)
    cheaper += w.rows[r].blocks;
  const long long total = reduce(tmp.reduce).Sum(cheaper);
  if (threadIdx.x == 0) shared_left = gs.need - total;
  __syncthreads();
  long long left = shared_left;
  for (std::int32_t chunk = first; chunk < last_row; chunk += row_threads) {
    const std::int32_t r = chunk + static_cast<std::int32_t>(threadIdx.x);
    const std::int32_t ties = r < last_row ? w.rows[r].ties : 0;
    std::int32_t before = 0, all = 0;
    scan(tmp.scan).ExclusiveSum(ties, before, all);
    if (r < last_row && ties > 0) {
      const long long room = left - before;
      w.rows[r].blocks += room <= 0 ? 0 : (room < ties ? static_cast<std::int32_t>(room) : ties);
    }
    left -= all;
    __syncthreads();
  }
}

// The schedule: per pass the histograms, the rows' F contributions and the groups'
// digit; then each row's blocks at the cut and the groups' ties.
inline void launch_per_head_schedule(const per_head_kv_view& c, const per_head_space& s, const per_head_workspace& w,
                                     std::int64_t* nonfinite, cudaStream_t stream) {
  if (s.rows() == 0) return;
  const std::int64_t hist_blocks = std::int64_t{s.rows()} * w.tiles;
  const std::int32_t warp_blocks = (s.rows() + per_head_rows_per_block - 1) / per_head_rows_per_block;
  const std::int32_t f_blocks = (s.rows() + per_head_f_rows - 1) / per_head_f_rows;
  for (std::int32_t pass = 0; pass < per_head_passes; ++pass) {
    per_head_histogram_kernel<<<static_cast<unsigned>(hist_blocks), row_threads, 0, stream>>>(c, s, w, pass,
                                                                                             nonfinite);
    per_head_row_blocks_kernel<<<f_blocks, per_head_f_rows * 32, 0, stream>>>(c, s, w, pass);
    per_head_group_digit_kernel<<<s.groups(), row_threads, 0, stream>>>(s, w, pass);
  }
  per_head_row_cut_kernel<<<warp_blocks, row_threads, 0, stream>>>(c, s, w);
  per_head_group_ties_kernel<<<s.groups(), row_threads, 0, stream>>>(s, w);
}

}  // namespace cuda
KVP_NAMESPACE_END
