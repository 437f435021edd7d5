// The per-head device path: kvp::cuda_per_head_executor over the caller's tensors,
// items converted to kvp::per_head_item in the front of the caller's workspace.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include <kvpolicy/exec/cuda_per_head_executor.cuh>
#include <kvpolicy/exec/cuda_per_head_metric.cuh>

#include "device_compress.hpp"
#include "device_per_head.hpp"
#include "device_upload.hpp"

namespace kvpy {
namespace {

constexpr std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

void launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("kvpolicy: ") + what + ": " + cudaGetErrorString(e));
}

// int64 rows as kvp::per_head_item; per_layer points into the row (columns 3 ..) with
// a per-layer budget. A seq or logical_length outside int32 makes the seq -1, which
// the executor's validation refuses (batch[i].seq).
__global__ void per_head_items_kernel(const std::int64_t* in, kvp::per_head_item* out, std::int32_t n,
                                      std::int32_t cols, bool per_layer) {
  for (std::int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const std::int64_t* r = in + std::int64_t{i} * cols;
    const std::int64_t seq = r[0], logical = r[2];
    const bool fits = seq >= INT32_MIN && seq <= INT32_MAX && logical >= INT32_MIN && logical <= INT32_MAX;
    kvp::per_head_item it;
    it.seq = fits ? static_cast<std::int32_t>(seq) : -1;
    it.blocks_to_free = r[1];
    it.per_layer = per_layer ? r + 3 : nullptr;
    it.logical_length = fits ? static_cast<std::int32_t>(logical) : -1;
    out[i] = it;
  }
}

// [host rows (when the items are on the host) | per_head_item[n] | the executor's], 256-byte aligned.
struct layout {
  std::size_t rows = 0, items = 0, temp = 0, temp_bytes = 0, total = 0;
  layout(const per_head_call& call, std::size_t executor_bytes) {
    const auto n = static_cast<std::size_t>(call.num_items);
    items = call.host_items ? align_up(n * static_cast<std::size_t>(call.columns) * sizeof(std::int64_t)) : 0;
    temp = items + align_up(n * sizeof(kvp::per_head_item));
    temp_bytes = executor_bytes;
    total = temp + align_up(executor_bytes);
  }
};

kvp::device_per_head_batch batch_of(const per_head_call& call, const kvp::per_head_item* items) {
  return {items, call.num_items};
}

std::size_t executor_bytes(const per_head_call& call) {
  static kvp::per_head_item some;  // the size query only needs a non-null pointer
  const kvp::cuda_per_head_executor ex{.stream = static_cast<cudaStream_t>(call.stream)};
  std::size_t bytes = 0;
  launched(ex.compress(nullptr, bytes, call.select, call.view, batch_of(call, &some), kvp::device_per_head_result{}),
           "sizing the workspace");
  return bytes;
}

}  // namespace

std::size_t device_per_head_workspace_bytes(const per_head_call& call) {
  const device_scope on(call.device_id);
  return layout(call, executor_bytes(call)).total;
}

void device_compress_per_head(const per_head_call& call, const per_head_outputs& out, void* workspace,
                              std::size_t workspace_bytes) {
  const device_scope on(call.device_id);
  const auto stream = static_cast<cudaStream_t>(call.stream);
  // Every host-side check (the executor's size query) before the first launch.
  const layout ws(call, executor_bytes(call));
  kvp::require(workspace_bytes >= ws.total, "workspace", "has {} bytes; the call needs {}", workspace_bytes, ws.total);
  kvp::require(out.status && out.new_lengths && out.freed_counts && out.freed_blocks, "out",
               "needs status, new_lengths, freed_counts and freed_blocks");
  if (call.num_items == 0) {  // nothing to launch: a clean status (outputs are empty)
    launched(cudaMemsetAsync(out.status, 0, kvp::status_words * sizeof(std::int32_t), stream), "clearing the status");
    return;
  }
  auto* base = static_cast<std::byte*>(workspace);
  const bool per_layer = call.select.budget == kvp::select::block_budget::layer;
  const std::int64_t* rows = call.device_items;
  if (call.host_items && call.num_items > 0) {
    auto* at = reinterpret_cast<std::int64_t*>(base + ws.rows);
    launched(upload_by_arguments(at, call.host_items,
                                 static_cast<std::size_t>(call.num_items) * call.columns * sizeof(std::int64_t), stream),
             "uploading the batch items");
    rows = at;
  }
  auto* items = reinterpret_cast<kvp::per_head_item*>(base + ws.items);
  if (call.num_items > 0) {
    const int grid = (call.num_items + 255) / 256;
    per_head_items_kernel<<<grid < 1024 ? grid : 1024, 256, 0, stream>>>(rows, items, call.num_items, call.columns,
                                                                         per_layer);
    launched(cudaGetLastError(), "converting the batch items");
  }
  const kvp::per_head_kv_view& c = call.view;
  const std::size_t n_rows =
      static_cast<std::size_t>(call.num_items) * static_cast<std::size_t>(c.num_layers) * c.num_kv_heads;
  launched(cudaMemsetAsync(out.freed_blocks, 0xff, n_rows * c.max_blocks * sizeof(std::int32_t), stream),
           "clearing freed_blocks");
  kvp::device_per_head_result r;
  r.status = out.status;
  r.new_lengths = out.new_lengths;
  r.freed_counts = out.freed_counts;
  r.freed_blocks = out.freed_blocks;
  r.evicted = out.evicted;
  r.moved = out.moved;
  r.freed = out.freed;
  r.nonfinite = out.nonfinite;
  const kvp::cuda_per_head_executor ex{.stream = stream};
  std::size_t temp_bytes = ws.temp_bytes;
  launched(ex.compress(base + ws.temp, temp_bytes, call.select, c, batch_of(call, items), r),
           "launching the per-head compression");
}

namespace {

// [seqs | slots | query positions (decode, when given) | prefill's temp], 256-byte aligned.
struct metric_layout {
  std::size_t slots = 0, positions = 0, temp = 0, temp_bytes = 0, total = 0;
  metric_layout(const per_head_metric_call& call, std::size_t executor_bytes) {
    const std::size_t column = align_up(static_cast<std::size_t>(call.num_items) * sizeof(std::int32_t));
    slots = column;
    positions = 2 * column;
    temp = 3 * column;
    temp_bytes = executor_bytes;
    total = temp + align_up(executor_bytes);
  }
};

bool has_query_positions(const per_head_metric_call& call) {
  if (call.prefill || call.query_positions == nullptr) return false;
  for (std::int32_t i = 0; i < call.num_items; ++i)
    if (call.query_positions[i] >= 0) return true;
  return false;  // every one -1: the head's last token, as without them
}

std::size_t metric_bytes(const per_head_metric_call& call) {
  const kvp::cuda_per_head_metric run{.stream = static_cast<cudaStream_t>(call.stream)};
  static std::int32_t some[1];  // the checks only need non-null pointers
  const kvp::device_metric_batch batch{some, some, call.num_items, nullptr, some};
  std::size_t bytes = 0;
  if (call.prefill)
    launched(run.prefill(nullptr, bytes, call.metric, call.view, call.queries, batch), "sizing the workspace");
  return bytes;
}

}  // namespace

std::size_t device_per_head_metric_workspace_bytes(const per_head_metric_call& call) {
  const device_scope on(call.device_id);
  return metric_layout(call, metric_bytes(call)).total;
}

void device_per_head_metric(const per_head_metric_call& call, std::int32_t* status, void* workspace,
                            std::size_t workspace_bytes) {
  const device_scope on(call.device_id);
  const auto stream = static_cast<cudaStream_t>(call.stream);
  const metric_layout ws(call, metric_bytes(call));  // every host-side check before a launch
  kvp::require(workspace_bytes >= ws.total, "workspace", "has {} bytes; the call needs {}", workspace_bytes, ws.total);
  kvp::require(status != nullptr, "status", "is a null pointer");
  auto* base = static_cast<std::byte*>(workspace);
  auto* seqs = reinterpret_cast<std::int32_t*>(base);
  auto* slots = reinterpret_cast<std::int32_t*>(base + ws.slots);
  auto* positions = reinterpret_cast<std::int32_t*>(base + ws.positions);
  const std::size_t bytes = static_cast<std::size_t>(call.num_items) * sizeof(std::int32_t);
  const bool with_positions = has_query_positions(call);
  if (call.num_items > 0) {
    launched(upload_by_arguments(seqs, call.seqs, bytes, stream), "uploading the items' sequences");
    launched(upload_by_arguments(slots, call.slots, bytes, stream), "uploading the items' query slots");
    if (with_positions)
      launched(upload_by_arguments(positions, call.query_positions, bytes, stream), "uploading the query positions");
  }
  const kvp::device_metric_batch batch{seqs, slots, call.num_items, with_positions ? positions : nullptr, status};
  const kvp::cuda_per_head_metric run{.stream = stream};
  if (call.prefill) {
    std::size_t temp_bytes = ws.temp_bytes;
    launched(run.prefill(base + ws.temp, temp_bytes, call.metric, call.view, call.queries, batch),
             "launching the prefill metric");
  } else {
    launched(run.decode(call.metric, call.view, call.queries, batch), "launching the decode metric");
  }
}

}  // namespace kvpy
