// The per-head device path's plain interface: compiled by nvcc in device_per_head.cu,
// called from the bindings (per_head.cpp, g++). No nanobind and no CUDA header here.
#pragma once

#include <cstddef>
#include <cstdint>

#include <kvpolicy/core/per_head_kv_view.hpp>
#include <kvpolicy/core/query_window_view.hpp>
#include <kvpolicy/scorer/squared_attention_metric.hpp>
#include <kvpolicy/select/head_adaptive_blocks.hpp>

namespace kvpy {

// The caller's device buffers (allocated by its framework). Rows are (item, layer,
// KV head): row = (item x layers + layer) x h_kv + head.
struct per_head_outputs {
  std::int32_t* status = nullptr;        // [8]
  std::int32_t* new_lengths = nullptr;   // [rows]
  std::int32_t* freed_counts = nullptr;  // [rows]
  std::int32_t* freed_blocks = nullptr;  // [rows, max_blocks], -1 past each count
  std::int32_t* evicted = nullptr;       // [rows]
  std::int32_t* moved = nullptr;         // [rows]
  std::int64_t* freed = nullptr;         // [n]
  std::int64_t* nonfinite = nullptr;     // [n]
};

// Items: int64 rows (seq, blocks_to_free, logical_length[, one count per layer]) in
// device memory (device_items) or host memory (host_items, uploaded through kernel
// arguments into the workspace, so that a captured graph holds them); a kernel turns
// them into kvp::per_head_item in the workspace.
struct per_head_call {
  kvp::per_head_kv_view view{};
  kvp::select::head_adaptive_blocks select{};
  const std::int64_t* device_items = nullptr;
  const std::int64_t* host_items = nullptr;
  std::int32_t num_items = 0;
  std::int32_t columns = 3;  // 3, or 3 + layers with a per-layer budget
  int device_id = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Workspace bytes a call needs (its items and the executor's own). Runs every
// host-side check of the executor (kvp::error naming the field).
std::size_t device_per_head_workspace_bytes(const per_head_call& call);

// Launches on call.stream: the items' conversion, freed_blocks set to -1, then
// kvp::cuda_per_head_executor. No allocation and no host wait.
void device_compress_per_head(const per_head_call& call, const per_head_outputs& out, void* workspace,
                              std::size_t workspace_bytes);

// KV-Compress's metric (kvp::cuda_per_head_metric): items are host values (seqs,
// query slots, decode's query positions), uploaded through kernel arguments.
struct per_head_metric_call {
  kvp::per_head_kv_view view{};
  kvp::scorer::squared_attention_metric metric{};
  kvp::query_window_view queries{};
  const std::int32_t* seqs = nullptr;             // host [num_items]
  const std::int32_t* slots = nullptr;            // host [num_items]
  const std::int32_t* query_positions = nullptr;  // host [num_items], decode: -1 = the head's last token
  std::int32_t num_items = 0;
  bool prefill = true;
  int device_id = 0;
  void* stream = nullptr;
};

std::size_t device_per_head_metric_workspace_bytes(const per_head_metric_call& call);
// Writes the 8 status words at `status` (device); launches only.
void device_per_head_metric(const per_head_metric_call& call, std::int32_t* status, void* workspace,
                            std::size_t workspace_bytes);

}  // namespace kvpy
