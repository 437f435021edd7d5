// The score epilogue, fused: temporal aggregate through F, pooling, redundancy
// softmax and combine, protect, the row's keep count by its selector's kind
// (select_count.cuh) and the keep mask by a block radix select.
// One block per (item, layer, KV head) row, the row's scores in shared memory.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/destination_table.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/select_count.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Arrays of max_tokens floats the epilogue holds per row: the row and a copy for
// pooling, and for a selector that sees protected scores the scores before protect.
template <class Sel>
inline constexpr std::int32_t epilogue_row_arrays = sees_protected_scores<Sel> ? 3 : 2;

// Shared memory of the epilogue, in floats.
template <class Sel>
KVP_HOST_DEVICE constexpr std::size_t epilogue_smem_floats(std::int32_t max_tokens) {
  return epilogue_row_arrays<Sel> * std::size_t(max_tokens);
}

struct epilogue_shared {
  typename block_reduce::TempStorage reduce;
  float broadcast;
  radix_select_storage select;
};

// for t in [threadIdx.x, end) step blockDim.x: store(t, load(t)), with the loads of
// epilogue_tuning::load_batch tokens issued before any of their stores. The loads are
// independent, but the compiler may not move a load above a store through a pointer
// it cannot tell apart, so in a plain loop each token waits out its own round trip
// to L2. A thread handles the same tokens as in the plain loop.
template <class Load, class Store>
__device__ void for_each_token_batched(std::int32_t end, Load load, Store store) {
  using V = decltype(load(0));
  const auto step = static_cast<std::int32_t>(blockDim.x);
  constexpr int batch = epilogue_tuning::load_batch;
  for (std::int32_t t0 = threadIdx.x; t0 < end; t0 += batch * step) {
    V v[batch];
#pragma unroll
    for (int u = 0; u < batch; ++u)
      if (t0 + u * step < end) v[u] = load(t0 + u * step);
#pragma unroll
    for (int u = 0; u < batch; ++u)
      if (t0 + u * step < end) store(t0 + u * step, v[u]);
  }
}

// Applies an aggregator (or a `then` of two) to s[0, n), as host::apply_aggregate.
// F of the row's first `prefix_tokens` tokens (a shared prefix, compression_batch::
// targets) is read from the shared blocks and written to `f_stash` ([tokens] of this
// row), whence the compaction takes it to the targets.
template <class A>
__device__ void apply_aggregate(const A& a, float* s, float* tmp, std::int32_t n, std::int32_t history,
                                epilogue_shared& sh, const paged_kv_view& cache, const score_view& f,
                                const row_coord& rc, std::int32_t seq, std::int32_t T, float* f_stash,
                                std::int32_t prefix_tokens) {
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
          return f_slot{t < prefix_tokens ? f_stash + t : at, t < n && t < history ? *at : 0.0f};
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
    apply_aggregate(a.first, s, tmp, n, history, sh, cache, f, rc, seq, T, f_stash, prefix_tokens);
    apply_aggregate(a.second, s, tmp, n, history, sh, cache, f, rc, seq, T, f_stash, prefix_tokens);
  }
}

// Outputs of the epilogue.
struct epilogue_out {
  std::uint8_t* keep = nullptr;         // [rows][max_tokens]
  float* scores = nullptr;              // optional [rows][max_tokens]: final scores
  std::int32_t* kept_counts = nullptr;  // optional [rows]
  std::int32_t* nonfinite = nullptr;    // optional [items]: non-finite candidate scores, zeroed by validation
  std::int32_t* new_lengths = nullptr;  // [items]
  std::int32_t* released_counts = nullptr;
  std::int32_t* released_blocks = nullptr;  // [items][max_blocks]
  std::int32_t max_blocks = 0;
  // Where rows of one item keep different counts (per head, or from their scores):
  // [items] each, zeroed by validation. The largest count so far, and rows done.
  std::int32_t* item_max = nullptr;
  std::int32_t* item_rows_done = nullptr;
  // Shared prefixes: the launch group's targets, where their F goes ([rows][max_tokens])
  // and, optionally, the items' new tables ([items][max_blocks]).
  prefix_targets targets{};
  float* f_stash = nullptr;
  std::int32_t* new_tables = nullptr;
};

// The item's new length, the blocks it releases (the targets it did not use too) and,
// when asked for, its new table; written by one thread.
// A window-only layout's view is shifted to the item's window (`window_begin`
// tokens on): the length counts from the sequence's start again, and the table keeps
// the blocks before the window.
__device__ inline void write_item_result(const epilogue_out& out, const paged_kv_view& cache, std::int32_t item,
                                         std::int32_t seq, std::int32_t T, std::int32_t new_length,
                                         std::int32_t window_begin) {
  const std::int32_t b = cache.block_size, used = (T + b - 1) / b, kept = (new_length + b - 1) / b;
  const std::int32_t before = window_begin / b;
  const destination_table to = destination_table::of(cache.table, seq, out.targets, item);
  out.new_lengths[item] = window_begin + new_length;
  out.released_counts[item] = used - kept;
  for (std::int32_t k = kept; k < used; ++k)
    out.released_blocks[std::int64_t{item} * out.max_blocks + (k - kept)] = to.block(k);
  if (out.new_tables) {
    std::int32_t* table = out.new_tables + std::int64_t{item} * out.max_blocks;
    for (std::int32_t k = 0; k < before; ++k) table[k] = cache.table.unshifted(seq, k);
    for (std::int32_t k = 0; k < kept; ++k) table[before + k] = to.block(k);
  }
}

// `rows_global`: null when the row and its pooling copy (and the scores before protect)
// fit in shared memory; otherwise [epilogue_row_arrays][rows][max_tokens] floats of
// global memory that stand in for them
// (rows too long for shared memory: slower, same results). `ready_in`: null to wait
// for the whole grid before (scores and redundancy), or the score stage's row
// hand-off flags; `ready_out`: null, or the flags this kernel hands each row on with.
template <class P>
__global__ void __launch_bounds__(row_threads, epilogue_tuning::blocks_per_sm)
    epilogue_kernel(P p, paged_kv_view cache, score_view f, row_space rs, const float* scores_in, const float* red_in,
                    float* rows_global, epilogue_out out, const std::int32_t* ready_in, std::int32_t* ready_out) {
  using Sel = typename P::select_type;
  using L = typename P::layout_type;
  using count_kind = select_kind_t<Sel>;
  constexpr bool scored = !std::same_as<typename P::scorer_type, none>;
  extern __shared__ float4 smem4[];
  __shared__ epilogue_shared sh;
  __shared__ typename count_kind::storage count_storage;
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
  float* before = nullptr;  // the final scores before protect (row_token::before_protect)
  if constexpr (sees_protected_scores<Sel>) before = rows_global ? rows_global + 2 * cells + base : s + 2 * rs.max_tokens;
  const float inf = __builtin_huge_valf();
  // Cautious update: a token the head dropped enters aggregation with no score, is
  // never kept and is not counted as protected (host_executor.hpp, the same steps).
  const bool cautious = !cache.live.empty();
  const auto held = [&](std::int32_t t) { return cache.alive(rc.layer, it.seq, t, rc.head); };

  for_each_token_batched(
      n, [&](std::int32_t t) { return scored && (!cautious || held(t)) ? scores_in[base + t] : 0.0f; },
      [&](std::int32_t t, float v) { s[t] = v; });
  __syncthreads();
  const std::int32_t prefix_tokens = min(T, out.targets.count(rc.item) * cache.block_size);
  apply_aggregate(p.aggregate, s, tmp, n, it.history_tokens, sh, cache, f, rc, it.seq, T,
                  out.f_stash ? out.f_stash + base : nullptr, prefix_tokens);

  if constexpr (!std::same_as<typename P::redundancy_type, none>) {
    // R = softmax(red / tau) over the candidates; red_in already holds red / n / tau.
    // Read once, into the pooling copy (free again): each thread keeps its own tokens.
    // Under cautious update the softmax runs over the held candidates; a dropped one
    // gets R 0 (-inf here), as on the host.
    float m = -inf;
    for_each_token_batched(
        n, [&](std::int32_t t) { return !cautious || held(t) ? red_in[base + t] : -inf; },
        [&](std::int32_t t, float r) {
          tmp[t] = r;
          m = fmaxf(m, r);
        });
    m = block_max(m, sh.reduce, sh.broadcast);
    float sum = 0.0f;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
      const float e = cautious && tmp[t] == -inf ? 0.0f : expf(tmp[t] - m);
      tmp[t] = e;
      sum += e;
    }
    sum = block_sum(sum, sh.reduce, sh.broadcast);
    const float inv = sum > 0.0f || !cautious ? 1.0f / sum : 0.0f;  // a head that holds no candidate
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) s[t] = p.redundancy.combine(s[t], tmp[t] * inv);
  }
  if (out.nonfinite) {
    // Counted before protect, whose +inf is no input's (the host counts the same).
    __syncthreads();
    float odd = 0.0f;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) odd += isfinite(s[t]) ? 0.0f : 1.0f;
    odd = block_sum(odd, sh.reduce, sh.broadcast);
    if (threadIdx.x == 0 && odd > 0.0f) atomicAdd(out.nonfinite + rc.item, static_cast<std::int32_t>(odd));
  }
  // Under cautious update the pooling copy, free again, marks the held tokens (1).
  float* held_mark = tmp;
  float held_tokens = 0.0f, held_protected = 0.0f;
  for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
    const bool covered = p.protect.covers(t, T) || t >= n;
    const bool h = !cautious || held(t);
    // As host::scores_before_protect: no score past the candidates, none where dropped.
    if (before) before[t] = t < n && h ? s[t] : -inf;
    if (covered) s[t] = inf;
    if (cautious) {
      if (!h) s[t] = -inf;
      held_mark[t] = h ? 1.0f : 0.0f;
      held_tokens += h ? 1.0f : 0.0f;
      held_protected += h && covered ? 1.0f : 0.0f;
    }
  }
  __syncthreads();
  std::int32_t must = protected_count(T, n, p.protect.sinks, p.protect.window), live = T;
  if (cautious) {
    live = static_cast<std::int32_t>(block_sum(held_tokens, sh.reduce, sh.broadcast));
    must = static_cast<std::int32_t>(block_sum(held_protected, sh.reduce, sh.broadcast));
  }

  // How many the row keeps, then which: the keep_count largest rank keys, or the
  // selector's pattern (a pattern kind, select_count.cuh). A dropped token's key is 0,
  // below every held one's (rank_bits of -inf at position 0 is 0x007fffff << 32).
  const count_inputs in{s,    scored ? scores_in + base : nullptr, before, T, n, must, it.budget,
                         head_index{rc.layer, rc.head}, it.query_slot, live};
  const std::int32_t keep_count = count_kind::keep_count(p.select, in, count_storage);
  if constexpr (is_pattern_kind<count_kind>) {
    // The pooling copy is free again: the pattern's working positions.
    count_kind::keep(p.select, in, out.keep + base, reinterpret_cast<std::int32_t*>(tmp), sh.select);
    if (out.scores)
      for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) out.scores[base + t] = s[t];
  } else if constexpr (std::same_as<Sel, none>) {
    for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
      out.keep[base + t] = !cautious || held_mark[t] != 0.0f;
      if (out.scores) out.scores[base + t] = s[t];
    }
  } else {
    const auto rank_of = [&](std::int32_t t) -> std::uint64_t {
      return cautious && held_mark[t] == 0.0f ? 0 : rank_bits(p.select.rank_key(s[t], t, T), t);
    };
    const std::uint64_t threshold = block_kth_largest(rank_of, T, keep_count, sh.select);
    for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
      out.keep[base + t] = rank_of(t) >= threshold;
      if (out.scores) out.scores[base + t] = s[t];
    }
  }
  if (threadIdx.x == 0 && out.kept_counts) out.kept_counts[row] = it.window_begin + keep_count;

  // The item's new length and released blocks: with one count for every row, the
  // item's first row writes them; else the item's last row to finish, from the
  // largest count of all its rows (layers share the item's block table).
  if (uniform_counts<Sel> && !cautious) {
    if (threadIdx.x == 0 && rc.layer == rs.layer_begin && rc.head == 0)
      write_item_result(out, cache, rc.item, it.seq, T, moves_tokens<L>() ? keep_count : T, it.window_begin);
  } else {
    if (threadIdx.x == 0) {
      atomicMax(out.item_max + rc.item, keep_count);
      __threadfence();
      const std::int32_t rows_per_item = rs.num_layers * rs.num_heads;
      if (atomicAdd(out.item_rows_done + rc.item, 1) == rows_per_item - 1) {
        __threadfence();
        const std::int32_t longest = atomicAdd(out.item_max + rc.item, 0);
        write_item_result(out, cache, rc.item, it.seq, T, moves_tokens<L>() ? longest : T, it.window_begin);
      }
    }
  }
  if (ready_out) publish_row(ready_out, blockIdx.x);
}

}  // namespace cuda
KVP_NAMESPACE_END
