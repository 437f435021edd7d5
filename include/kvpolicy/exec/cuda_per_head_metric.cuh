// KV-Compress's metric on the GPU over a per-head cache (scorer::squared_attention_metric
// on the host is the law): `prefill` writes every slot's metric from the last w
// queries of a sequence's query window; `decode` adds the newest query's squared
// probabilities, as an engine does at every step. Both write cache.metric only.
//
// The items live in device memory and are checked there first (sequence, query slot,
// the heads' lengths); a malformed one stops the kernel after it, so nothing is
// written, and status[] says what (throw_if_error). Prefill takes a workspace (CUB's
// two-phase convention: temp == nullptr gives its size); decode none. No host
// synchronisation: both can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/per_head_metric_kernel.cuh"
#include "kvpolicy/exec/device_status.hpp"
#include "kvpolicy/exec/validate_per_head.hpp"
#include "kvpolicy/scorer/squared_attention_metric.hpp"

KVP_NAMESPACE_BEGIN

// The sequences whose metric is computed, in device memory: each item's sequence and
// its slot of the query view. `query_positions` (decode, optional): the newest query's
// position per item (for the excluded distance against cache.positions); without it,
// the head's last token's index.
struct device_metric_batch {
  const std::int32_t* seqs = nullptr;
  const std::int32_t* slots = nullptr;
  std::int32_t num_items = 0;
  const std::int32_t* query_positions = nullptr;
  std::int32_t* status = nullptr;  // [status_words], device
};

namespace cuda {

// One thread per item: its sequence and slot in range, every head's length within
// its table.
template <int = 0>
__global__ void per_head_metric_validate_kernel(per_head_kv_view c, query_window_view q, device_metric_batch batch) {
  const auto i = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= batch.num_items) return;
  const std::int32_t seq = batch.seqs[i], slot = batch.slots[i];
  if (seq < 0 || seq >= c.num_seqs) return report(batch.status, status_code::seq_out_of_range, i, seq);
  if (slot < 0 || slot >= q.num_slots)
    return report(batch.status, status_code::query_slot_out_of_range, i, slot, q.num_slots);
  const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
  for (std::int32_t l = 0; l < c.num_layers; ++l)
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      const std::int32_t T = c.length(l, seq, h);
      if (T < 0 || T > capacity)
        return report(batch.status, status_code::head_length_out_of_range, i, l, seq, h, T,
                      static_cast<std::int32_t>(capacity));
    }
}

}  // namespace cuda

struct cuda_per_head_metric {
  cudaStream_t stream = nullptr;

  cudaError_t prefill(void* temp, std::size_t& temp_bytes, const scorer::squared_attention_metric& m,
                      const per_head_kv_view& cache, const query_window_view& q, const device_metric_batch& batch) const {
    check(m, cache, q, batch, m.window);
    const std::int64_t capacity = std::int64_t{cache.max_blocks} * cache.block_size;
    const auto rows = static_cast<std::size_t>(batch.num_items) * cache.num_layers * cache.num_kv_heads;
    const std::size_t bytes = rows * static_cast<std::size_t>(capacity) * sizeof(float);
    if (temp == nullptr) {
      temp_bytes = bytes;
      return cudaSuccess;
    }
    require(temp_bytes >= bytes, "temp_bytes", "is {}; the batch needs {}", temp_bytes, bytes);
    if (!launch_validation(cache, q, batch)) return cudaGetLastError();
    const std::size_t smem = static_cast<std::size_t>(m.window) * (cache.head_dim * sizeof(float) + sizeof(cuda::softmax_stats));
    cudaFuncSetAttribute(cuda::per_head_prefill_metric_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
    cuda::per_head_prefill_metric_kernel<<<static_cast<unsigned>(rows), cuda::row_threads, smem, stream>>>(
        m, cache, q, space(cache, batch), static_cast<float*>(temp), capacity, batch.status);
    return cudaGetLastError();
  }

  cudaError_t decode(const scorer::squared_attention_metric& m, const per_head_kv_view& cache,
                     const query_window_view& q, const device_metric_batch& batch) const {
    check(m, cache, q, batch, 1);
    const auto rows = static_cast<std::size_t>(batch.num_items) * cache.num_layers * cache.num_kv_heads;
    if (!launch_validation(cache, q, batch)) return cudaGetLastError();
    const std::size_t smem = cache.head_dim * sizeof(float) + sizeof(cuda::softmax_stats);
    cuda::per_head_decode_metric_kernel<<<static_cast<unsigned>(rows), cuda::row_threads, smem, stream>>>(
        m, cache, q, space(cache, batch), batch.query_positions, batch.status);
    return cudaGetLastError();
  }

 private:
  static cuda::per_head_metric_space space(const per_head_kv_view& c, const device_metric_batch& b) {
    return {b.seqs, b.slots, b.num_items, c.num_layers, c.num_kv_heads};
  }

  // Clears the status and checks the items on the device; false when there is nothing to do.
  bool launch_validation(const per_head_kv_view& c, const query_window_view& q, const device_metric_batch& b) const {
    cudaMemsetAsync(b.status, 0, status_words * sizeof(std::int32_t), stream);
    if (b.num_items == 0) return false;
    cuda::per_head_metric_validate_kernel<<<(b.num_items + 127) / 128, 128, 0, stream>>>(c, q, b);
    return true;
  }

  static void check(const scorer::squared_attention_metric& m, const per_head_kv_view& c, const query_window_view& q,
                    const device_metric_batch& b, std::int32_t queries) {
    validate_per_head_shapes(c, /*host_tables=*/false);
    require(!c.metric.empty(), "cache.metric", "is a null pointer; the metric is written there");
    require(m.window >= 1, "pipeline.scorer.window", "is {}; must be at least 1", m.window);
    require(m.window <= 256, "pipeline.scorer.window", "is {}; the GPU metric holds at most 256 queries", m.window);
    require(m.pool_kernel >= 1 && m.pool_kernel % 2 == 1, "pipeline.scorer.pool_kernel",
            "is {}; must be odd and >= 1", m.pool_kernel);
    require(m.excluded_distance >= 0, "pipeline.scorer.excluded_distance", "is {}; must not be negative",
            m.excluded_distance);
    require(q.base != nullptr, "queries.base", "is a null pointer");
    require(q.head_dim == c.head_dim, "queries.head_dim", "is {}; the cache's head_dim is {}", q.head_dim, c.head_dim);
    require(q.num_q_heads >= c.num_kv_heads && q.num_q_heads % c.num_kv_heads == 0, "queries.num_q_heads",
            "is {}; must be a multiple of the cache's {} KV heads", q.num_q_heads, c.num_kv_heads);
    require(q.num_layers >= c.num_layers, "queries.num_layers", "is {}; the cache has {} layers", q.num_layers,
            c.num_layers);
    require(q.window >= queries, "queries.window",
            "is {}; the metric reads the last {} queries of a slot (presets::kv_compress::metric.window)", q.window,
            queries);
    // Rows are read four elements at a time (8 bytes of f16/bf16, 16 of f32).
    require(c.head_dim % 4 == 0, "cache.head_dim", "is {}; the GPU metric reads rows in fours", c.head_dim);
    const std::int64_t align = size_of(c.type) * 4, qalign = size_of(q.type) * 4;
    require((c.k_stride.token * size_of(c.type)) % align == 0 && (c.k_stride.block * size_of(c.type)) % align == 0,
            "cache.k_stride", "has rows not on {}-byte boundaries (token {}, block {} elements)", align,
            c.k_stride.token, c.k_stride.block);
    require(c.k.table != nullptr || reinterpret_cast<std::uintptr_t>(c.k.layer(0, c.type)) % align == 0, "cache.k",
            "is not {}-byte aligned", align);
    require((q.pos_stride * size_of(q.type)) % qalign == 0 && (q.head_stride * size_of(q.type)) % qalign == 0 &&
                (q.slot_stride * size_of(q.type)) % qalign == 0 && (q.layer_stride * size_of(q.type)) % qalign == 0 &&
                reinterpret_cast<std::uintptr_t>(q.base) % static_cast<std::uintptr_t>(qalign) == 0,
            "queries", "has rows not on {}-byte boundaries", qalign);
    require(b.num_items >= 0, "batch.num_items", "is {}; must not be negative", b.num_items);
    require(b.num_items == 0 || (b.seqs && b.slots), "batch", "needs seqs and slots (a null pointer was given)");
    require(b.status != nullptr, "batch.status", "is a null pointer");
  }
};

KVP_NAMESPACE_END
