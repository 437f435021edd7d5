// kvp::cuda_decode_attention over the caller's tensors: a per-head cache as read by
// read_per_head, or a kvpolicy.PagedCache with its layer tables uploaded first.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include <kvpolicy/attention/decode_attention.cuh>

#include "device_compress.hpp"
#include "device_decode_attention.hpp"
#include "device_upload.hpp"

namespace kvpy {
namespace {

constexpr std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

void launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("kvpolicy: ") + what + ": " + cudaGetErrorString(e));
}

kvp::cuda_decode_attention runner(const decode_attention_call& call) {
  return {.stream = static_cast<cudaStream_t>(call.stream), .staged = call.staged};
}

// [K layer table | V layer table] (paged caches only) | the attention's temp, each
// 256-byte aligned.
struct layout {
  std::size_t v_table = 0, temp = 0, total = 0;
  layout(const decode_attention_call& call, std::size_t temp_bytes) {
    const std::size_t table = call.paged ? align_up(sizeof(void*) * call.paged->shape.num_layers) : 0;
    v_table = table;
    temp = 2 * table;
    total = temp + align_up(temp_bytes);
  }
};

kvp::cuda::decode_attention_plan plan_of(const decode_attention_call& call) {
  kvp::require((call.per_head != nullptr) != (call.paged != nullptr), "cache",
               "give exactly one of a per-head cache and a paged one");
  const kvp::cuda_decode_attention run = runner(call);
  if (call.per_head)
    return run.plan(*call.per_head, call.queries, call.out, call.scale, call.batch, call.epilogue);
  // The plan only checks that the layer tables are non-null: the host-side copies do.
  const cache_description& c = *call.paged;
  return run.plan(c.view(c.k_layers.data(), c.v_layers.data()), call.counts, call.queries, call.out, call.scale,
                  call.batch, call.epilogue);
}

}  // namespace

std::size_t device_decode_attention_workspace_bytes(const decode_attention_call& call) {
  const device_scope on(call.device_id);
  return layout(call, plan_of(call).temp_bytes).total;
}

std::string describe_decode_attention(const decode_attention_call& call) {
  const device_scope on(call.device_id);
  return kvp::cuda::describe(plan_of(call));
}

void device_decode_attention(const decode_attention_call& call, void* workspace, std::size_t workspace_bytes) {
  const device_scope on(call.device_id);
  const auto stream = static_cast<cudaStream_t>(call.stream);
  const layout ws(call, plan_of(call).temp_bytes);  // every host-side check before a launch
  kvp::require(workspace_bytes >= ws.total, "workspace", "has {} bytes; the call needs {}", workspace_bytes, ws.total);
  kvp::require(reinterpret_cast<std::uintptr_t>(workspace) % 256 == 0, "workspace",
               "address {} is not 256-byte aligned", workspace);
  auto* base = static_cast<std::byte*>(workspace);
  std::size_t temp_bytes = ws.total - ws.temp;
  const kvp::cuda_decode_attention run = runner(call);
  if (call.per_head) {
    launched(run.attend(base + ws.temp, temp_bytes, *call.per_head, call.queries, call.out, call.scale, call.batch,
                        call.epilogue),
             "launching decode attention");
    return;
  }
  const cache_description& c = *call.paged;
  const std::size_t table_bytes = sizeof(void*) * c.shape.num_layers;
  auto* k_table = reinterpret_cast<void**>(base);
  auto* v_table = reinterpret_cast<void**>(base + ws.v_table);
  launched(upload_by_arguments(k_table, c.k_layers.data(), table_bytes, stream), "uploading the K layer table");
  launched(upload_by_arguments(v_table, c.v_layers.data(), table_bytes, stream), "uploading the V layer table");
  launched(run.attend(base + ws.temp, temp_bytes, c.view(k_table, v_table), call.counts, call.queries, call.out,
                      call.scale, call.batch, call.epilogue),
           "launching decode attention");
}

}  // namespace kvpy
