// Device-side validation of what lives in device memory: the batch items, the
// engine's lengths and block table, and whether a batch sequence holds a block
// another sequence (or the engine's sharing marker) says is shared. Runs first;
// every later kernel checks its verdict, so a malformed batch writes nothing.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Per-call state of the validation, in the workspace, and the per-item accumulators
// the validation clears for the kernels after it. Nothing here needs a value from
// before the call (the workspace may hold anything): validate_kernel resets `owner`,
// and `item_of_seq` is believed only where the item it names names the sequence.
struct validation_state {
  std::int32_t* ready = nullptr;        // [flag_sets][rows]: row hand-off flags
  std::int32_t flag_sets = 0;
  std::int32_t* item_of_seq = nullptr;  // [num_seqs]: a batch item naming the sequence, if any
  std::int32_t* owner = nullptr;        // [num_blocks]: the sequence that claimed the block, -1 before;
                                        // -2 - item for a target of that item
  std::int32_t* readers = nullptr;      // [num_blocks]: non-zero where a batch item reads it as its shared prefix
  prefix_targets targets{};             // the batch's targets (device_batch::targets)
  std::int32_t* item_max = nullptr;     // [items], or null
  std::int32_t* item_rows_done = nullptr;
  std::int32_t* nonfinite = nullptr;    // [items], or null (device_result::nonfinite_counts)
};

// Blocks of validate_kernel past the items that reset `owner` and `readers`, each some
// 16 entries per thread.
KVP_HOST_DEVICE constexpr std::int32_t owner_reset_blocks(std::int32_t num_blocks) {
  const std::int32_t per_block = 16 * row_threads;
  return (num_blocks + per_block - 1) / per_block;
}

// The first batch item naming `seq`, or -1 (item_of_seq checked against the items).
__device__ inline std::int32_t batch_item_of(const validation_state& v, const row_space& rs, std::int32_t seq) {
  const std::int32_t i = v.item_of_seq[seq];
  if (i < 0 || i >= rs.num_items || rs.items[i].seq != seq) return -1;
  std::int32_t first = i;
  for (std::int32_t j = 0; j < i; ++j)
    if (rs.items[j].seq == seq) {
      first = j;
      break;
    }
  return first;
}

// Where block `id` is in `seq`'s table (its first entry), for an error's message.
__device__ inline std::int32_t logical_block_of(const paged_kv_view& cache, std::int32_t seq, std::int32_t id) {
  const std::int32_t blocks = (cache.lengths[seq] + cache.block_size - 1) / cache.block_size;
  std::int32_t at = 0;
  while (at < blocks && cache.table.block(seq, at) != id) ++at;
  return at;
}

// The indptr entry at fault when the CSR row of `seq` starts before its indices or ends
// before it starts (its entries would be read out of bounds), or -1.
__device__ inline std::int32_t bad_indptr(const block_table_view& t, std::int32_t seq) {
  if (!t.is_csr()) return -1;
  if (t.indptr[seq] < 0) return seq;
  return t.indptr[seq + 1] < t.indptr[seq] ? seq + 1 : -1;
}
__device__ inline void report_indptr(std::int32_t* status, const block_table_view& t, std::int32_t item,
                                     std::int32_t at) {
  report(status, status_code::indptr_invalid, item, at, t.indptr[at], at > 0 ? t.indptr[at - 1] : 0);
}

// One block per batch item, then owner_reset_blocks blocks that reset `owner`.
// Mirrors validate_batch (exec/validate.hpp) for the item: its sequence, length, block
// ids, budget, windows, history and slot. First it clears the item's row hand-off
// flags and accumulators, which the workspace holds from any earlier call or none,
// and records itself as an item of its sequence.
template <class P>
__global__ void __launch_bounds__(row_threads) validate_kernel(P p, paged_kv_view cache, query_window_view queries,
                                                               row_space rs, validation_state v) {
  if (static_cast<std::int32_t>(blockIdx.x) >= rs.num_items) {
    const auto first = (static_cast<std::int32_t>(blockIdx.x) - rs.num_items) * static_cast<std::int32_t>(blockDim.x);
    const auto step = static_cast<std::int32_t>((gridDim.x - rs.num_items) * blockDim.x);
    for (std::int32_t k = first + static_cast<std::int32_t>(threadIdx.x); k < cache.num_blocks; k += step) {
      v.owner[k] = -1;
      v.readers[k] = 0;
    }
    return;
  }
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
      v.item_of_seq[it.seq] = i;  // any of the items naming it: claim_blocks_kernel finds the first
      const std::int32_t T = cache.lengths[it.seq];
      const std::int64_t capacity = cache.table.capacity(it.seq) * cache.block_size;
      if (const std::int32_t at = bad_indptr(cache.table, it.seq); at >= 0) {
        report_indptr(rs.status, cache.table, i, at);
      } else if (T < 0 || T > capacity) {
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
  const std::int32_t shared = v.targets.count(i);
  if (shared < 0 || shared > (T + b - 1) / b)
    return (void)(threadIdx.x == 0 ? report(rs.status, status_code::targets_over_blocks, i, shared, it.seq, (T + b - 1) / b)
                                   : void());
  for (std::int32_t j = threadIdx.x; j < shared; j += blockDim.x) {
    const std::int32_t id = v.targets.block(i, j);
    if (id < 0 || id >= cache.num_blocks)
      report(rs.status, status_code::target_out_of_range, i, v.targets.indptr[i] + j, id);
    else if (cache.sharing.marked() && cache.sharing.shared(id))  // the engine counts another holder
      report(rs.status, status_code::target_marked_shared, i, v.targets.indptr[i] + j, id);
  }

  if (threadIdx.x != 0) return;
  if constexpr (!window_only<typename P::layout_type>()) {
    if (it.window_begin != 0) return report(rs.status, status_code::window_without_layout, i, it.window_begin);
  }
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
// (cache.sharing) names. The blocks of a batch item's shared prefix (targets) are only
// read: they are marked in `readers` instead, and a batch item that writes one of them
// stops the compression (each side sets its mark, then looks for the other's, so one of
// the two sees it). The targets are claimed too: no sequence may hold one. Also reports
// a batch item naming a sequence an earlier item names. (A template only so that every
// translation unit may define it, as an inline function.)
template <int = 0>
__global__ void __launch_bounds__(row_threads) claim_blocks_kernel(paged_kv_view cache, row_space rs,
                                                                   validation_state v) {
  if (failed(rs)) return;  // a batch item is malformed: its table may not be read
  const std::int32_t seq = blockIdx.x, b = cache.block_size;
  const std::int32_t item = batch_item_of(v, rs, seq);
  const bool in_batch = item >= 0;
  const std::int32_t T = cache.lengths[seq];
  if (!in_batch) {
    const std::int64_t capacity = cache.table.capacity(seq) * b;
    if (const std::int32_t at = bad_indptr(cache.table, seq); at >= 0) {
      if (threadIdx.x == 0) report_indptr(rs.status, cache.table, -1, at);
      return;
    }
    if (T < 0 || T > capacity) {
      if (threadIdx.x == 0) report(rs.status, status_code::length_out_of_range, -1, seq, T, static_cast<std::int32_t>(capacity));
      return;
    }
  } else if (threadIdx.x == 0) {
    // Items after the first that name this sequence.
    for (std::int32_t j = item + 1; j < rs.num_items; ++j)
      if (rs.items[j].seq == seq) report(rs.status, status_code::seq_repeated, j, seq);
  }
  const auto target_holder = [&](std::int32_t owner) { return -2 - owner; };  // the item of a target claim
  const std::int32_t shared = in_batch ? v.targets.count(item) : 0;
  // The targets of this sequence's item: free, and nobody's prefix.
  for (std::int32_t j = threadIdx.x; j < shared; j += blockDim.x) {
    const std::int32_t id = v.targets.block(item, j);
    const std::int32_t other = atomicCAS(v.owner + id, -1, -2 - item);
    __threadfence();
    if (other != -1)
      report(rs.status, status_code::target_held, item, id, other >= 0 ? other : rs.items[target_holder(other)].seq, item);
    else if (atomicAdd(v.readers + id, 0) != 0)
      report(rs.status, status_code::target_held, item, id, -1, item);
  }
  // A window-only layout's item: the blocks before its window (entries [0, first) of
  // the row, which the shifted view no longer shows) are only read, as a shared
  // prefix is: no batch item may write one. Their ids are checked too.
  const std::int32_t before_window = in_batch && cache.table.first ? cache.table.first[seq] : 0;
  for (std::int32_t k = threadIdx.x; k < before_window; k += blockDim.x) {
    const std::int32_t id = cache.table.unshifted(seq, k);
    if (id < 0 || id >= cache.num_blocks) {
      report(rs.status, status_code::block_out_of_range, item, seq, k, id);
      continue;
    }
    atomicOr(v.readers + id, 1);
    __threadfence();
    const std::int32_t owner = atomicAdd(v.owner + id, 0);
    if (owner >= 0 && batch_item_of(v, rs, owner) >= 0)
      report(rs.status, status_code::prefix_block_written, batch_item_of(v, rs, owner), owner,
             logical_block_of(cache, owner, id), id);
  }
  const std::int32_t blocks = (T + b - 1) / b;
  for (std::int32_t k = threadIdx.x; k < blocks; k += blockDim.x) {
    const std::int32_t id = cache.table.block(seq, k);
    if (id < 0 || id >= cache.num_blocks) {
      if (!in_batch) report(rs.status, status_code::block_out_of_range, -1, seq, k, id);
      continue;  // a batch sequence's ids were checked by validate_kernel
    }
    if (in_batch && k < shared) {
      // A block of the item's shared prefix: read only. No batch item may write it,
      // and it may not be anybody's target.
      atomicOr(v.readers + id, 1);
      __threadfence();
      const std::int32_t owner = atomicAdd(v.owner + id, 0);
      if (owner <= -2)
        report(rs.status, status_code::target_held, target_holder(owner), id, seq, target_holder(owner));
      else if (owner >= 0 && batch_item_of(v, rs, owner) >= 0)
        report(rs.status, status_code::prefix_block_written, batch_item_of(v, rs, owner), owner,
               logical_block_of(cache, owner, id), id);
      continue;
    }
    if (in_batch && cache.sharing.marked() && cache.sharing.shared(id))
      report(rs.status, status_code::block_marked_shared, item, seq, k, id);
    const std::int32_t other = atomicCAS(v.owner + id, -1, seq);
    if (other <= -2) {
      report(rs.status, status_code::target_held, target_holder(other), id, seq, target_holder(other));
      continue;
    }
    if (in_batch && other == -1) {
      __threadfence();
      if (atomicAdd(v.readers + id, 0) != 0) report(rs.status, status_code::prefix_block_written, item, seq, k, id);
    }
    if (other == -1 || (other == seq && !in_batch)) continue;
    if (other == seq) {
      report(rs.status, status_code::block_repeated, item, seq, k, id, seq);
      continue;
    }
    const std::int32_t other_item = batch_item_of(v, rs, other);
    if (in_batch) {
      report(rs.status, other_item >= 0 ? status_code::block_repeated : status_code::block_held_outside_batch, item,
             seq, k, id, other);
    } else if (other_item >= 0) {
      // The batch sequence claimed it first: name its entry of the block.
      report(rs.status, status_code::block_held_outside_batch, other_item, other, logical_block_of(cache, other, id),
             id, seq);
    }
  }
}

// Window-only layouts: the view every later kernel reads has each batch row shifted
// to its window (block_table_view::first) and the window's length in place of the
// sequence's. Two launches on the stream: every sequence as it is, then each batch
// item's window, checked here (the validation after it sees only the window).
// `first` and `lengths` are the workspace arrays the shifted view points at.
// Templates, as claim_blocks_kernel: a header's kernels are defined in every TU.
template <int = 0>
__global__ void __launch_bounds__(row_threads) window_rows_reset_kernel(const std::int32_t* lengths_in,
                                                                        std::int32_t num_seqs, std::int32_t* first,
                                                                        std::int32_t* lengths) {
  const auto seq = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (seq >= num_seqs) return;
  first[seq] = 0;
  lengths[seq] = lengths_in[seq];
}

template <int = 0>
__global__ void __launch_bounds__(row_threads) window_rows_kernel(const std::int32_t* lengths_in, std::int32_t num_seqs,
                                                                  std::int32_t block_size, row_space rs,
                                                                  std::int32_t* first, std::int32_t* lengths) {
  const auto i = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= rs.num_items) return;
  const batch_item it = rs.items[i];
  if (it.seq < 0 || it.seq >= num_seqs) return;  // the validation reports it
  const std::int32_t T = lengths_in[it.seq];
  if (it.window_begin < 0 || it.window_begin % block_size != 0 || it.window_begin >= T)
    return report(rs.status, status_code::window_begin_invalid, i, it.window_begin, it.seq, T, block_size);
  first[it.seq] = it.window_begin / block_size;
  lengths[it.seq] = T - it.window_begin;
}

}  // namespace cuda
KVP_NAMESPACE_END
