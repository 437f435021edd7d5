// The device path for one preset: kvp::cuda_executor over a cache_description, its
// layer tables and host items uploaded into the front of the caller's workspace.
// Included once per preset by the generated device_compress_<preset>.cu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include <kvpolicy/kvpolicy.cuh>

#include "device_compress.hpp"
#include "device_upload.hpp"

namespace kvpy {
namespace detail {

constexpr std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

// [K layer table | V layer table | host items | the executor's workspace], each
// 256-byte aligned as cudaMalloc's own allocations are.
struct workspace_layout {
  std::size_t k_table = 0, v_table = 0, items = 0, temp = 0, temp_bytes = 0, total = 0;
  workspace_layout(const device_call& call, std::size_t executor_bytes) {
    const std::size_t table = align_up(sizeof(void*) * call.cache->shape.num_layers);
    v_table = table;
    items = 2 * table;
    temp = items + (call.host_items ? align_up(sizeof(kvp::batch_item) * call.num_items) : 0);
    temp_bytes = executor_bytes;
    total = temp + align_up(executor_bytes);
  }
};

inline kvp::device_batch batch_of(const device_call& call, const kvp::batch_item* items) {
  return {.items = items, .num_items = call.num_items, .max_tokens = call.max_tokens,
          .layer_begin = call.layer_begin, .layer_count = call.layer_count};
}

inline void launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("kvpolicy: ") + what + ": " + cudaGetErrorString(e));
}

// The executor's own workspace bytes. Its size query reads no device memory: the
// layer tables and items only need to be non-null.
template <class P>
std::size_t executor_bytes(const P& policy, const device_call& call, bool masks) {
  const cache_description& c = *call.cache;
  const kvp::paged_kv_view view = c.view(c.k_layers.data(), c.v_layers.data());
  kvp::device_result sizing{};
  static std::uint8_t some_mask;  // only whether keep_masks is null counts
  sizing.keep_masks = masks ? &some_mask : nullptr;
  const kvp::cuda_executor ex{.stream = static_cast<cudaStream_t>(call.stream)};
  std::size_t bytes = 0;
  launched(ex.compress(nullptr, bytes, policy, view, call.queries, call.scores,
                       batch_of(call, reinterpret_cast<const kvp::batch_item*>(&some_mask)), sizing),
           "sizing the workspace");
  return bytes;
}

}  // namespace detail

template <class P>
std::size_t device_workspace_bytes(const P& policy, const device_call& call) {
  const device_scope on(call.cache->device_id);
  return detail::workspace_layout(call, detail::executor_bytes(policy, call, call.masks)).total;
}

template <class P>
void device_compress(const P& policy, const device_call& call, const device_outputs& out, void* workspace,
                     std::size_t workspace_bytes) {
  const device_scope on(call.cache->device_id);
  const cache_description& c = *call.cache;
  const auto stream = static_cast<cudaStream_t>(call.stream);
  // Every shape check (the executor's size query) before the first byte is written.
  const detail::workspace_layout ws(call, detail::executor_bytes(policy, call, out.keep_masks != nullptr));
  kvp::require(workspace_bytes >= ws.total, "workspace", "has {} bytes; the call needs {}", workspace_bytes, ws.total);
  auto* base = static_cast<std::byte*>(workspace);
  auto* k_table = reinterpret_cast<void**>(base + ws.k_table);
  auto* v_table = reinterpret_cast<void**>(base + ws.v_table);
  const std::size_t table_bytes = sizeof(void*) * c.shape.num_layers;
  detail::launched(upload_by_arguments(k_table, c.k_layers.data(), table_bytes, stream), "uploading the K layer table");
  detail::launched(upload_by_arguments(v_table, c.v_layers.data(), table_bytes, stream), "uploading the V layer table");
  const kvp::batch_item* items = call.device_items;
  if (call.host_items) {
    auto* at = reinterpret_cast<kvp::batch_item*>(base + ws.items);
    detail::launched(upload_by_arguments(at, call.host_items, sizeof(kvp::batch_item) * call.num_items, stream),
                     "uploading the batch items");
    items = at;
  }

  // What the executor leaves unwritten reads as "none": no released block, not kept.
  const std::size_t n = static_cast<std::size_t>(call.num_items);
  const std::size_t max_blocks = (call.max_tokens + c.shape.block_size - 1) / c.shape.block_size;
  detail::launched(cudaMemsetAsync(out.released_blocks, 0xff, n * max_blocks * sizeof(std::int32_t), stream),
                   "clearing released_blocks");
  const kvp::compression_batch layers_only{{}, call.layer_begin, call.layer_count};
  const kvp::layer_range layers = kvp::resolve_layers(layers_only, c.view(k_table, v_table));
  const std::size_t row_tokens =
      n * static_cast<std::size_t>(layers.end - layers.begin) * c.shape.num_kv_heads * call.max_tokens;
  if (out.keep_masks) detail::launched(cudaMemsetAsync(out.keep_masks, 0, row_tokens, stream), "clearing keep_masks");
  if (out.scores)
    detail::launched(cudaMemsetAsync(out.scores, 0, row_tokens * sizeof(float), stream), "clearing scores");

  const kvp::device_result result{.status = out.status,
                                  .new_lengths = out.new_lengths,
                                  .released_counts = out.released_counts,
                                  .released_blocks = out.released_blocks,
                                  .keep_masks = out.keep_masks,
                                  .scores = out.scores,
                                  .kept_counts = out.kept_counts,
                                  .nonfinite_counts = out.nonfinite};
  const kvp::cuda_executor ex{.stream = stream};
  std::size_t temp_bytes = ws.temp_bytes;
  detail::launched(ex.compress(base + ws.temp, temp_bytes, policy, c.view(k_table, v_table), call.queries, call.scores,
                               detail::batch_of(call, items), result),
                   "launching the compression");
}

}  // namespace kvpy
