// KV-Compress on the GPU over a per-head block cache (per_head_kv_view.hpp): the
// schedule of select::head_adaptive_blocks for every batch item, then MoveCache on
// every head that evicts, with the same new lengths, freed blocks and moved bytes as
// host::compress_per_head.
//
// CUB's two-phase convention, as cuda_executor: compress() with temp == nullptr gives
// the workspace size. No allocation and no host synchronisation: a whole compression
// can be captured in a CUDA graph. Malformed shapes throw kvp::error before any
// launch; malformed device data (lengths, block ids, items, positions) is caught by
// the kernels before the moves, which then write nothing, and is reported in
// `device_per_head_result::status` (check()).
//
// The schedule without a sort (exec/cuda/per_head_schedule_kernel.cuh): a head's
// blocks cost the metric at fixed offsets of its sorted order, so the number of its
// blocks cheaper than a key v follows from how many of its tokens are below v; a
// radix select over the 32-bit metric keys, 8 bits a pass, finds each budget group's
// cut from per-head histograms. Each head then selects its evicted tokens by its own
// radix select and moves its survivors (exec/cuda/per_head_move_kernel.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/per_head_move_kernel.cuh"
#include "kvpolicy/exec/cuda/per_head_schedule_kernel.cuh"
#include "kvpolicy/exec/cuda/per_head_validate_kernel.cuh"
#include "kvpolicy/exec/device_status.hpp"
#include "kvpolicy/exec/host/per_head_compress.hpp"
#include "kvpolicy/exec/validate_per_head.hpp"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

KVP_NAMESPACE_BEGIN

// A per-head compression batch whose items live in device memory (per_head_item:
// seq, blocks_to_free, per_layer, logical_length; `per_layer` pointers, when the
// budget is per layer, point to device memory too).
struct device_per_head_batch {
  const per_head_item* items = nullptr;  // device, [num_items]
  std::int32_t num_items = 0;
};

// Where the executor writes its results, all device memory. Rows are (item, layer,
// KV head), row = (item x num_layers + layer) x num_kv_heads + head.
struct device_per_head_result {
  std::int32_t* status = nullptr;        // [status_words]; 0 in status[0] means success
  std::int32_t* new_lengths = nullptr;   // [rows]: tokens each head holds after
  std::int32_t* freed_counts = nullptr;  // [rows]: blocks each head gives up
  std::int32_t* freed_blocks = nullptr;  // [rows][cache.max_blocks]: their ids, in table order (first freed_counts)
  std::int32_t* evicted = nullptr;       // optional [rows]: tokens each head evicts
  std::int32_t* moved = nullptr;         // optional [rows]: tokens each head copied (MoveCache's moves)
  std::int64_t* freed = nullptr;         // optional [num_items]: blocks freed in all
  std::int64_t* nonfinite = nullptr;     // optional [num_items]: NaN or infinite metrics, protected ones included
};

struct cuda_per_head_executor {
  cudaStream_t stream = nullptr;
  // Optional: 3 events recorded before the first kernel, after the schedule (the
  // validation, the histograms and the group selects) and after the moves. Not while
  // capturing.
  cudaEvent_t* stage_marks = nullptr;

  cudaError_t compress(void* temp, std::size_t& temp_bytes, const select::head_adaptive_blocks& sel,
                       const per_head_kv_view& cache, const device_per_head_batch& batch,
                       const device_per_head_result& out) const {
    check_call(sel, cache, batch);
    const cuda::per_head_space s = space(sel, cache, batch, out.status);
    const cuda::per_head_workspace_layout layout(cache, s);
    if (temp == nullptr) {
      temp_bytes = layout.total;
      return cudaSuccess;
    }
    require(temp_bytes >= layout.total, "temp_bytes", "is {}; the batch needs {}", temp_bytes, layout.total);
    require(out.status && out.new_lengths && out.freed_counts && out.freed_blocks, "out",
            "needs status, new_lengths, freed_counts and freed_blocks (a null pointer was given)");
    const cuda::per_head_workspace w = layout.bind(temp);
    if (stage_marks) cudaEventRecord(stage_marks[0], stream);
    cuda::per_head_reset(w, layout, s, out.freed, out.nonfinite, cache.num_blocks, cache.num_seqs, stream);
    cuda::launch_per_head_validate(cache, s, w, stream);
    cuda::launch_per_head_schedule(cache, s, w, out.nonfinite, stream);
    if (stage_marks) cudaEventRecord(stage_marks[1], stream);
    cuda::launch_per_head_moves(cache, s, w, {out.new_lengths, out.freed_counts, out.freed_blocks, out.evicted, out.moved, out.freed},
                                stream);
    if (stage_marks) cudaEventRecord(stage_marks[2], stream);
    return cudaGetLastError();
  }

 private:
  static cuda::per_head_space space(const select::head_adaptive_blocks& sel, const per_head_kv_view& cache,
                                    const device_per_head_batch& batch, std::int32_t* status) {
    return {batch.items, batch.num_items, cache.num_layers, cache.num_kv_heads, status,
            sel.budget,  sel.protected_window, sel.sinks};
  }

  // The host-side checks: shapes, pointers, the selector's fields.
  static void check_call(const select::head_adaptive_blocks& sel, const per_head_kv_view& cache,
                         const device_per_head_batch& batch) {
    validate_per_head_shapes(cache, /*host_tables=*/false);
    require(!cache.metric.empty(), "cache.metric",
            "is a null pointer; KV-Compress evicts by the metric each slot holds");
    require(sel.protected_window >= 0, "pipeline.select.protected_window", "is {}; must not be negative",
            sel.protected_window);
    require(sel.sinks >= 0, "pipeline.select.sinks", "is {}; must not be negative", sel.sinks);
    require(batch.num_items >= 0, "batch.num_items", "is {}; must not be negative", batch.num_items);
    require(batch.num_items == 0 || batch.items != nullptr, "batch.items", "is a null pointer");
    require(std::int64_t{batch.num_items} * cache.num_layers * cache.num_kv_heads <= INT32_MAX, "batch.num_items",
            "is {}; items x layers x KV heads ({} x {} x {}) must fit 32 bits", batch.num_items, cache.num_layers,
            cache.num_kv_heads);
    require(std::int64_t{cache.num_seqs} * cache.num_layers * cache.num_kv_heads <= INT32_MAX, "cache.num_seqs",
            "is {}; sequences x layers x KV heads ({} x {}) must fit 32 bits", cache.num_seqs, cache.num_layers,
            cache.num_kv_heads);
    require(cache.num_layers < 32768 && cache.num_kv_heads < 65536, "cache.num_layers",
            "is {} with {} KV heads; the device status packs a (layer, head) pair in 32 bits", cache.num_layers,
            cache.num_kv_heads);
    require(std::int64_t{cache.num_blocks} * cache.block_size <= INT32_MAX, "cache.num_blocks",
            "is {}; blocks x block_size ({}) must fit 32 bits (physical slots are numbered in int32)",
            cache.num_blocks, cache.block_size);
  }
};

KVP_NAMESPACE_END
