// Device-side validation of what lives in device memory: the batch items, the
// engine's lengths and block table. Runs first; every later kernel checks its verdict.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// One block per batch item. Mirrors validate_batch (exec/validate.hpp) check for check.
// First it clears the item's row hand-off flags (`ready`: [flag_sets][rows]), which
// the workspace holds from any earlier call or none.
template <class P>
__global__ void __launch_bounds__(row_threads) validate_kernel(P p, paged_kv_view cache, query_window_view queries,
                                                               row_space rs, std::int32_t* ready,
                                                               std::int32_t flag_sets) {
  const std::int32_t i = blockIdx.x;
  const std::int64_t per_item = std::int64_t{rs.num_layers} * rs.num_heads;
  for (std::int32_t k = 0; k < flag_sets; ++k)
    for (std::int64_t r = threadIdx.x; r < per_item; r += blockDim.x) ready[k * rs.rows() + i * per_item + r] = 0;
  const batch_item it = rs.items[i];
  __shared__ std::int32_t ok;
  if (threadIdx.x == 0) {
    ok = 0;
    if (it.seq < 0 || it.seq >= cache.num_seqs) {
      report(rs.status, status_code::seq_out_of_range, i, it.seq);
    } else {
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

  // Repeated sequences, and block ids: in range, unique within the batch.
  for (std::int32_t j = threadIdx.x; j < i; j += blockDim.x)
    if (rs.items[j].seq == it.seq) report(rs.status, status_code::seq_repeated, i, it.seq);
  const std::int32_t T = cache.lengths[it.seq], b = cache.block_size;
  const std::int32_t nb = (T + b - 1) / b;
  for (std::int32_t k = threadIdx.x; k < nb; k += blockDim.x) {
    const std::int32_t id = cache.table.block(it.seq, k);
    if (id < 0 || id >= cache.num_blocks) {
      report(rs.status, status_code::block_out_of_range, i, it.seq, k, id);
      continue;
    }
    for (std::int32_t k2 = 0; k2 < k; ++k2)
      if (cache.table.block(it.seq, k2) == id) report(rs.status, status_code::block_repeated, i, it.seq, k, id, it.seq);
    for (std::int32_t j = 0; j < i; ++j) {
      const std::int32_t s2 = rs.items[j].seq;
      if (s2 < 0 || s2 >= cache.num_seqs || s2 == it.seq) continue;
      const std::int32_t T2 = cache.lengths[s2];
      if (T2 < 0 || T2 > cache.table.capacity(s2) * b) continue;
      for (std::int32_t k2 = 0; k2 < (T2 + b - 1) / b; ++k2)
        if (cache.table.block(s2, k2) == id) report(rs.status, status_code::block_repeated, i, it.seq, k, id, s2);
    }
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
  if constexpr (!std::same_as<typename P::select_type, none>) {
    const std::int32_t keep = p.select.keep_count(T, it.budget);
    const std::int32_t must = protected_count(T, candidate_end(p.scorer, T), p.protect.sinks, p.protect.window);
    if (keep < must || keep > T) return report(rs.status, status_code::budget_under_protected, i, it.budget, keep, must, T);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
