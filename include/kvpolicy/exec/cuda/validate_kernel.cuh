// Device-side validation of what lives in device memory: the batch items, the
// engine's lengths and block table, and whether a batch sequence holds a block
// another sequence (or the engine's sharing marker) says is shared. Runs first;
// every later kernel checks its verdict, so a malformed batch writes nothing.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Per-call state of the validation, in the workspace, and the per-item accumulators
// the validation clears for the kernels after it.
struct validation_state {
  std::int32_t* ready = nullptr;        // [flag_sets][rows]: row hand-off flags
  std::int32_t flag_sets = 0;
  std::int32_t* first_item = nullptr;   // [num_seqs]: the first batch item naming the seq; no_item if none
  std::int32_t* owner = nullptr;        // [num_blocks]: the sequence that claimed the block, -1 before
  std::int32_t* item_max = nullptr;     // [items], or null
  std::int32_t* item_rows_done = nullptr;
  std::int32_t* nonfinite = nullptr;    // [items], or null (device_result::nonfinite_counts)
  // What first_item and owner hold before the call: the bytes 0x7f and 0xff.
  static constexpr std::int32_t no_item = 0x7f7f7f7f;
};

// One block per batch item. Mirrors validate_batch (exec/validate.hpp) for the item:
// its sequence, length, block ids, budget, windows, history and slot. First it clears
// the item's row hand-off flags and accumulators, which the workspace holds from any
// earlier call or none, and records itself as its sequence's item (the lowest index
// wins, so a later item naming the same sequence is the one reported).
template <class P>
__global__ void __launch_bounds__(row_threads) validate_kernel(P p, paged_kv_view cache, query_window_view queries,
                                                               row_space rs, validation_state v) {
  const std::int32_t i = blockIdx.x;
  const std::int64_t per_item = std::int64_t{rs.num_layers} * rs.num_heads;
  for (std::int32_t k = 0; k < v.flag_sets; ++k)
    for (std::int64_t r = threadIdx.x; r < per_item; r += blockDim.x) v.ready[k * rs.rows() + i * per_item + r] = 0;
  if (threadIdx.x == 0) {
    if (v.item_max) v.item_max[i] = 0, v.item_rows_done[i] = 0;
    if (v.nonfinite) v.nonfinite[i] = 0;
  }
  const batch_item it = rs.items[i];
  __shared__ std::int32_t ok;
  if (threadIdx.x == 0) {
    ok = 0;
    if (it.seq < 0 || it.seq >= cache.num_seqs) {
      report(rs.status, status_code::seq_out_of_range, i, it.seq);
    } else {
      atomicMin(v.first_item + it.seq, i);
      const std::int32_t T = cache.lengths[it.seq];
      const std::int64_t capacity = cache.table.capacity(it.seq) * cache.block_size;
      if (T < 0 || T > capacity) {
        report(rs.status, status_code::length_out_of_range, i, it.seq, T, static_cast<std::int32_t>(capacity));
      } else if (T > rs.max_tokens) {
        report(rs.status, status_code::length_over_max_tokens, i, it.seq, T, rs.max_tokens);
      } else {
        ok = 1;
      }
    }
  }
  __syncthreads();
  if (!ok) return;

  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  for (std::int32_t k = threadIdx.x; k < (T + b - 1) / b; k += blockDim.x) {
    const std::int32_t id = cache.table.block(it.seq, k);
    if (id < 0 || id >= cache.num_blocks) report(rs.status, status_code::block_out_of_range, i, it.seq, k, id);
  }

  if (threadIdx.x != 0) return;
  if (it.budget <= 0) return report(rs.status, status_code::budget_not_positive, i, it.budget);
  if (it.budget > T) return report(rs.status, status_code::budget_over_length, i, it.budget, it.seq, T);
  const std::int32_t w = scorer_window(p.scorer);
  if (w > T) return report(rs.status, status_code::window_over_length, i, w, it.seq, T, 0);
  if (p.protect.window > T) return report(rs.status, status_code::window_over_length, i, p.protect.window, it.seq, T, 1);
  if (it.history_tokens < 0 || it.history_tokens > T)
    return report(rs.status, status_code::history_out_of_range, i, it.history_tokens, T);
  if constexpr (AttentionScorer<typename P::scorer_type>) {
    if (it.query_slot < 0 || it.query_slot >= queries.num_slots)
      return report(rs.status, status_code::query_slot_out_of_range, i, it.query_slot, queries.num_slots);
  }
  using Sel = typename P::select_type;
  if constexpr (BudgetSelector<Sel> && !ScoreDependentSelector<Sel>) {
    const std::int32_t must = protected_count(T, candidate_end(p.scorer, T), p.protect.sinks, p.protect.window);
    const std::int32_t layers = uniform_counts<Sel> ? 1 : rs.num_layers, heads = uniform_counts<Sel> ? 1 : rs.num_heads;
    for (std::int32_t l = rs.layer_begin; l < rs.layer_begin + layers; ++l)
      for (std::int32_t h = 0; h < heads; ++h) {
        const std::int32_t keep = budget_keep_count(p.select, T, it.budget, head_index{l, h});
        if (keep < must || keep > T)
          return report(rs.status, status_code::budget_under_protected, i, it.budget, keep, must, T, l, h);
      }
  }
}

// One block per sequence of the view, after validate_kernel: the lengths and block
// ids of the sequences outside the batch (read below), and every block each sequence
// holds claimed in `owner`. A block two sequences claim, one of them in the batch, is
// shared: its batch sequence may not be compressed. So is one the engine's marker
// (cache.sharing) names. Also reports a batch item naming a sequence an earlier item
// names. (A template only so that every translation unit may define it, as an inline
// function.)
template <int = 0>
__global__ void __launch_bounds__(row_threads) claim_blocks_kernel(paged_kv_view cache, row_space rs,
                                                                   validation_state v) {
  if (failed(rs)) return;  // a batch item is malformed: its table may not be read
  const std::int32_t seq = blockIdx.x, b = cache.block_size;
  const std::int32_t item = v.first_item[seq];
  const bool in_batch = item != validation_state::no_item;
  const std::int32_t T = cache.lengths[seq];
  if (!in_batch) {
    const std::int64_t capacity = cache.table.capacity(seq) * b;
    if (T < 0 || T > capacity) {
      if (threadIdx.x == 0) report(rs.status, status_code::length_out_of_range, -1, seq, T, static_cast<std::int32_t>(capacity));
      return;
    }
  } else if (threadIdx.x == 0) {
    // Items after the first that name this sequence.
    for (std::int32_t j = item + 1; j < rs.num_items; ++j)
      if (rs.items[j].seq == seq) report(rs.status, status_code::seq_repeated, j, seq);
  }
  const std::int32_t blocks = (T + b - 1) / b;
  for (std::int32_t k = threadIdx.x; k < blocks; k += blockDim.x) {
    const std::int32_t id = cache.table.block(seq, k);
    if (id < 0 || id >= cache.num_blocks) {
      if (!in_batch) report(rs.status, status_code::block_out_of_range, -1, seq, k, id);
      continue;  // a batch sequence's ids were checked by validate_kernel
    }
    if (in_batch && cache.sharing.marked() && cache.sharing.shared(id))
      report(rs.status, status_code::block_marked_shared, item, seq, k, id);
    const std::int32_t other = atomicCAS(v.owner + id, -1, seq);
    if (other == -1 || (other == seq && !in_batch)) continue;
    if (other == seq) {
      report(rs.status, status_code::block_repeated, item, seq, k, id, seq);
    } else if (in_batch) {
      const bool both = v.first_item[other] != validation_state::no_item;
      report(rs.status, both ? status_code::block_repeated : status_code::block_held_outside_batch, item, seq, k, id,
             other);
    } else if (v.first_item[other] != validation_state::no_item) {
      // The batch sequence claimed it first: name its entry of the block.
      const std::int32_t other_blocks = (cache.lengths[other] + b - 1) / b;
      std::int32_t at = 0;
      while (at < other_blocks && cache.table.block(other, at) != id) ++at;
      report(rs.status, status_code::block_held_outside_batch, v.first_item[other], other, at, id, seq);
    }
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
