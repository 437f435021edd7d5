// The score epilogue, fused: temporal aggregate through F, pooling, redundancy
// softmax and combine, protect, and top-k selection by a block radix select.
// One block per (item, layer, KV head) row, the row's scores in shared memory.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Shared memory of the epilogue, in floats: the row and a copy for pooling.
KVP_HOST_DEVICE constexpr std::size_t epilogue_smem_floats(std::int32_t max_tokens) {
  return 2 * std::size_t(max_tokens);
}

// The radix select's digit search: one thread per 8-bit digit.
static_assert(row_threads == 256, "the radix select gives each of the 256 digits a thread");
using digit_scan = cub::BlockScan<std::int32_t, row_threads>;

struct epilogue_shared {
  typename block_reduce::TempStorage reduce;
  typename digit_scan::TempStorage scan;
  float broadcast;
  std::uint32_t hist[256];
  std::uint64_t prefix;
  std::int32_t remaining;
  bool settled;  // every key under the prefix is kept: lower digits change nothing
};

// Tokens per thread whose loads are issued together (for_each_token_batched).
inline constexpr int epilogue_batch = 4;

// for t in [threadIdx.x, end) step blockDim.x: store(t, load(t)), with the loads of
// epilogue_batch tokens issued before any of their stores. The loads are
// independent, but the compiler may not move a load above a store through a pointer
// it cannot tell apart, so in a plain loop each token waits out its own round trip
// to L2 (configuration A, with the redundancy read once and 8 blocks per SM: epilogue
// 0.062 -> 0.057 ms). A thread handles the same tokens as in the plain loop.
template <class Load, class Store>
__device__ void for_each_token_batched(std::int32_t end, Load load, Store store) {
  using V = decltype(load(0));
  const auto step = static_cast<std::int32_t>(blockDim.x);
  for (std::int32_t t0 = threadIdx.x; t0 < end; t0 += epilogue_batch * step) {
    V v[epilogue_batch];
#pragma unroll
    for (int u = 0; u < epilogue_batch; ++u)
      if (t0 + u * step < end) v[u] = load(t0 + u * step);
#pragma unroll
    for (int u = 0; u < epilogue_batch; ++u)
      if (t0 + u * step < end) store(t0 + u * step, v[u]);
  }
}

// Applies an aggregator (or a `then` of two) to s[0, n), as host::apply_aggregate.
template <class A>
__device__ void apply_aggregate(const A& a, float* s, float* tmp, std::int32_t n, std::int32_t history,
                                epilogue_shared& sh, const paged_kv_view& cache, const score_view& f,
                                const row_coord& rc, std::int32_t seq, std::int32_t T) {
  if constexpr (TemporalAggregator<A>) {
    if (a.max_norm) {
      float m = 0.0f;
      for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) m = fmaxf(m, s[t]);
      m = block_max(m, sh.reduce, sh.broadcast);
      if (m > 0.0f)
        for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) s[t] /= m;
    }
    const std::int32_t b = cache.block_size;
    struct f_slot {
      float* at;
      float history;
    };
    for_each_token_batched(
        T,
        [&](std::int32_t t) {
          float* at = &f.at(rc.layer, cache.physical_block(seq, t), t % b, rc.head);
          return f_slot{at, t < n && t < history ? *at : 0.0f};
        },
        [&](std::int32_t t, const f_slot& slot) {
          if (t < n) {
            if (t < history) s[t] = a.combine(slot.history, s[t]);
            *slot.at = s[t];
          } else {
            *slot.at = 0.0f;  // no score: no history
          }
        });
    __syncthreads();
  } else if constexpr (SpatialAggregator<A>) {
    if (a.first_only && history != 0) return;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) tmp[t] = s[t];
    __syncthreads();
    const std::int32_t r = a.kernel / 2;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
      const std::int32_t lo = max(0, t - r), hi = min(n - 1, t + r);
      float acc = a.identity();
      for (std::int32_t u = lo; u <= hi; ++u) acc = a.reduce(acc, tmp[u]);
      s[t] = a.finish(acc, hi - lo + 1);
    }
    __syncthreads();
  } else if constexpr (detail::is_then<A>::value) {
    apply_aggregate(a.first, s, tmp, n, history, sh, cache, f, rc, seq, T);
    apply_aggregate(a.second, s, tmp, n, history, sh, cache, f, rc, seq, T);
  }
}

// Outputs of the epilogue.
struct epilogue_out {
  std::uint8_t* keep = nullptr;         // [rows][max_tokens]
  float* scores = nullptr;              // optional [rows][max_tokens]: final scores
  std::int32_t* new_lengths = nullptr;  // [items]
  std::int32_t* released_counts = nullptr;
  std::int32_t* released_blocks = nullptr;  // [items][max_blocks]
  std::int32_t max_blocks = 0;
};

// Blocks per SM the registers are capped for (32, without spills): configuration A's
// 1024 rows fit in one wave, and a block fits beside the score kernel's last blocks
// when rows are handed on one by one (row hand-off in cuda_executor).
inline constexpr int epilogue_blocks_per_sm = 8;

// `rows_global`: null when the row and its pooling copy fit in shared memory;
// otherwise [2][rows][max_tokens] floats of global memory that stand in for them
// (rows too long for shared memory: slower, same results). `ready_in`: null to wait
// for the whole grid before (scores and redundancy), or the score stage's row
// hand-off flags; `ready_out`: null, or the flags this kernel hands each row on with.
template <class P>
__global__ void __launch_bounds__(row_threads, epilogue_blocks_per_sm)
    epilogue_kernel(P p, paged_kv_view cache, score_view f, row_space rs, const float* scores_in, const float* red_in,
                    float* rows_global, epilogue_out out, const std::int32_t* ready_in, std::int32_t* ready_out) {
  using Sel = typename P::select_type;
  using L = typename P::layout_type;
  extern __shared__ float4 smem4[];
  __shared__ epilogue_shared sh;
  const last_block_waits_at_exit in_order;
  if (!ready_in) wait_for_prerequisites();  // scores and redundancy
  allow_dependents();
  if (failed(rs)) return;
  if (ready_in) await_row(ready_in, blockIdx.x);
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const std::int64_t base = row * rs.max_tokens;
  const std::int64_t cells = rs.rows() * rs.max_tokens;
  float* s = rows_global ? rows_global + base : reinterpret_cast<float*>(smem4);
  float* tmp = rows_global ? rows_global + cells + base : s + rs.max_tokens;
  const float inf = __builtin_huge_valf();

  for_each_token_batched(
      n, [&](std::int32_t t) { return std::same_as<typename P::scorer_type, none> ? 0.0f : scores_in[base + t]; },
      [&](std::int32_t t, float v) { s[t] = v; });
  __syncthreads();
  apply_aggregate(p.aggregate, s, tmp, n, it.history_tokens, sh, cache, f, rc, it.seq, T);

  if constexpr (!std::same_as<typename P::redundancy_type, none>) {
    // R = softmax(red / tau) over the candidates; red_in already holds red / n / tau.
    // Read once, into the pooling copy (free again): each thread keeps its own tokens.
    float m = -inf;
    for_each_token_batched(
        n, [&](std::int32_t t) { return red_in[base + t]; },
        [&](std::int32_t t, float r) {
          tmp[t] = r;
          m = fmaxf(m, r);
        });
    m = block_max(m, sh.reduce, sh.broadcast);
    float sum = 0.0f;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
      const float e = expf(tmp[t] - m);
      tmp[t] = e;
      sum += e;
    }
    sum = block_sum(sum, sh.reduce, sh.broadcast);
    const float inv = 1.0f / sum;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) s[t] = p.redundancy.combine(s[t], tmp[t] * inv);
  }
  for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x)
    if (p.protect.covers(t, T) || t >= n) s[t] = inf;
  __syncthreads();

  // Radix select of the keep_count-th largest composite key, 8 bits at a time; the
  // threshold keeps exactly the keep_count largest keys (they are all distinct).
  std::int32_t keep_count = T;
  std::uint64_t threshold = 0;
  if constexpr (!std::same_as<Sel, none>) {
    keep_count = p.select.keep_count(T, it.budget);
    if (threadIdx.x == 0) {
      sh.prefix = 0;
      sh.remaining = keep_count;
      sh.settled = false;
    }
    std::uint64_t mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
      sh.hist[threadIdx.x] = 0;
      __syncthreads();
      const std::uint64_t prefix = sh.prefix;
      const std::int32_t remaining = sh.remaining;
      for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
        const std::uint64_t key = rank_bits(p.select.rank_key(s[t], t, T), t);
        if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      // Thread i holds digit 255 - i; counts from the top digit down, the selected
      // digit is the first whose running count reaches `remaining` (the last digit
      // when none does, 255 when nothing remains: as a serial walk would choose).
      const std::int32_t i = static_cast<std::int32_t>(threadIdx.x), digit = 255 - i;
      const auto count = static_cast<std::int32_t>(sh.hist[digit]);
      std::int32_t through = 0;
      digit_scan(sh.scan).InclusiveSum(count, through);
      const std::int32_t above = through - count;
      if ((through >= remaining || i == 255) && (i == 0 || above < remaining)) {
        sh.remaining = remaining - above;
        sh.prefix = prefix | (static_cast<std::uint64_t>(digit) << shift);
        sh.settled = count == remaining - above;
      }
      mask |= 0xffull << shift;
      __syncthreads();
      if (sh.settled) break;  // keys >= the prefix with zero low bits are exactly the kept ones
    }
    threshold = sh.prefix;
  }
  for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
    bool keep = true;
    if constexpr (!std::same_as<Sel, none>) keep = rank_bits(p.select.rank_key(s[t], t, T), t) >= threshold;
    out.keep[base + t] = keep;
    if (out.scores) out.scores[base + t] = s[t];
  }

  // One block per item reports its new length and the blocks it releases.
  if (threadIdx.x == 0 && rc.layer == rs.layer_begin && rc.head == 0) {
    const std::int32_t new_length = moves_tokens<L>() ? keep_count : T;
    const std::int32_t b = cache.block_size, used = (T + b - 1) / b, kept = (new_length + b - 1) / b;
    out.new_lengths[rc.item] = new_length;
    out.released_counts[rc.item] = used - kept;
    for (std::int32_t k = kept; k < used; ++k)
      out.released_blocks[std::int64_t{rc.item} * out.max_blocks + (k - kept)] = cache.table.block(it.seq, k);
  }
  if (ready_out) publish_row(ready_out, blockIdx.x);
}

}  // namespace cuda
KVP_NAMESPACE_END
