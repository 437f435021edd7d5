// libkvp_capi.so: the C API of kvp_capi.h over kvp::cuda_executor (and its per-head
// entry points over kvp::cuda_per_head_executor).
//
// Raw device pointers in, nothing allocated, nothing synchronised: kvp_capi_compress
// enqueues one compression on the given stream (after the items' widening for the
// four-column policies, kvp_capi.h) and returns, so torch.cuda.Event around the call
// times the GPU work. Malformed shapes are rejected before any
// launch (KVP_CAPI_EINVAL); malformed device data (lengths, block ids, items) is
// caught by the executor's first kernel and read back by kvp_capi_status.
#include "capi_common.hpp"  // first: kvpolicy's error.hpp sets FMT_USE_CONSTEXPR before fmt is seen

#include <cuda_runtime.h>

#include "kvpolicy/exec/cuda_executor.cuh"
#include "kvpolicy/exec/cuda_per_head_executor.cuh"

namespace {

using namespace kvp_capi;

kvp::device_batch batch_of(const kvp_capi_shape& s, const kvp::batch_item* items) {
  return {items, s.num_items, s.max_tokens, s.layer_begin, s.layer_count};
}

kvp::device_result result_in(void* ws, const ws_layout& w, std::uint8_t* keep_masks, float* final_scores) {
  return {at<std::int32_t>(ws, w.status), at<std::int32_t>(ws, w.new_lengths), at<std::int32_t>(ws, w.released_counts),
          at<std::int32_t>(ws, w.released_blocks), keep_masks, final_scores};
}

int cuda_code(cudaError_t e) {
  if (e == cudaSuccess) return KVP_CAPI_OK;
  last_error = std::string("CUDA: ") + cudaGetErrorString(e);
  return KVP_CAPI_ECUDA;
}

// Four-column items (seq, slot, budget, history) as kvp::batch_item, window_begin 0.
__global__ void widen_items_kernel(const std::int32_t* in, kvp::batch_item* out, std::int32_t n) {
  for (std::int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = {in[4 * i], in[4 * i + 1], in[4 * i + 2], in[4 * i + 3], 0};
}

// The items as the executor reads them: the caller's own where they have
// kvp::batch_item's five columns (KARA), else widened into the workspace (one launch).
const kvp::batch_item* device_items(const kvp_capi_shape& s, const std::int32_t* items, void* ws, const ws_layout& w,
                                    cudaStream_t stream) {
  if (item_columns(s) == 5 || s.num_items == 0) return reinterpret_cast<const kvp::batch_item*>(items);
  kvp::require(items != nullptr, "items", "is a null pointer");
  auto* out = at<kvp::batch_item>(ws, w.items);
  const int grid = (s.num_items + 255) / 256;
  widen_items_kernel<<<grid < 1024 ? grid : 1024, 256, 0, stream>>>(items, out, s.num_items);
  return out;
}

// One compression on `stream`; stage_marks (5 events) optional.
int compress_on(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                const std::int32_t* block_table, const std::int32_t* lengths, const std::int32_t* items,
                void* workspace, std::size_t workspace_bytes, std::uint8_t* keep_masks, float* final_scores,
                cudaStream_t stream, cudaEvent_t* stage_marks, const kvp_capi_calibration* calibration = nullptr) {
  kvp::require(s != nullptr, "shape", "is a null pointer");
  kvp::require(workspace != nullptr, "workspace", "is a null pointer");
  const views v = make_views(*s, kv_cache, queries, f, block_table, lengths);
  const ws_layout w = layout_of(*s);
  kvp::require(workspace_bytes > w.executor, "workspace_bytes", "is {}; kvp_capi_workspace_size says more",
               workspace_bytes);
  return with_policy(*s, calibration, [&](const auto& p) -> int {
    kvp::cuda_executor ex;
    ex.stream = stream;
    ex.stage_marks = stage_marks;
    // Before the executor's own checks: a refused call has then written only the
    // workspace's copy of the items.
    const kvp::batch_item* dev_items = device_items(*s, items, workspace, w, stream);
    if (const int rc = cuda_code(cudaGetLastError()); rc != KVP_CAPI_OK) return rc;
    std::size_t exec_bytes = workspace_bytes - w.executor;
    return cuda_code(ex.compress(at<std::byte>(workspace, w.executor), exec_bytes, p, v.cache, v.queries, v.scores,
                                 batch_of(*s, dev_items), result_in(workspace, w, keep_masks, final_scores)));
  });
}

// ---- KV-Compress over a per-head cache (kvp::cuda_per_head_executor) ----

// The caller's int64 items (device memory) as kvp::per_head_item: per_layer points
// into the caller's array (columns 3 ..) with a per-layer budget. A seq or
// logical_length outside int32 makes the item's seq -1, which validation refuses.
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

kvp::device_per_head_result per_head_result_of(const kvp_capi_per_head_out& o) {
  kvp::device_per_head_result r;
  r.status = o.status;
  r.new_lengths = o.new_lengths;
  r.freed_counts = o.freed_counts;
  r.freed_blocks = o.freed_blocks;
  r.evicted = o.evicted;
  r.moved = o.moved;
  r.freed = o.freed;
  r.nonfinite = o.nonfinite;
  return r;
}

// One per-head compression on `stream`; stage_marks (3 events, the executor's) optional.
int compress_per_head_on(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                         std::int32_t* positions, const std::int32_t* tables, const std::int32_t* lengths,
                         const std::int64_t* items, void* workspace, std::size_t workspace_bytes,
                         const kvp_capi_per_head_out* out, cudaStream_t stream, cudaEvent_t* stage_marks) {
  kvp::require(s != nullptr, "shape", "is a null pointer");
  require_per_head_out(out);
  const kvp::select::head_adaptive_blocks sel = per_head_selector(*s);
  const kvp::per_head_kv_view view = make_per_head_view(*s, k_cache, v_cache, metric, positions, tables, lengths);
  const per_head_ws_layout w = per_head_layout_of(*s);
  kvp::require(s->num_items == 0 || items != nullptr, "items", "is a null pointer");
  kvp::require(workspace != nullptr, "workspace", "is a null pointer");
  kvp::require(workspace_bytes >= w.executor, "workspace_bytes", "is {}; kvp_capi_per_head_workspace_size says more",
               workspace_bytes);
  auto* dev_items = s->num_items > 0 ? at<kvp::per_head_item>(workspace, w.items) : nullptr;
  if (s->num_items > 0) {
    const int grid = (s->num_items + 255) / 256;
    per_head_items_kernel<<<grid < 1024 ? grid : 1024, 256, 0, stream>>>(items, dev_items, s->num_items,
                                                                         per_head_item_columns(*s),
                                                                         s->per_layer_budget != 0);
    if (const int rc = cuda_code(cudaGetLastError()); rc != KVP_CAPI_OK) return rc;
  }
  kvp::cuda_per_head_executor ex;
  ex.stream = stream;
  ex.stage_marks = stage_marks;
  std::size_t exec_bytes = workspace_bytes - w.executor;
  return cuda_code(ex.compress(at<std::byte>(workspace, w.executor), exec_bytes, sel, view,
                               kvp::device_per_head_batch{dev_items, s->num_items}, per_head_result_of(*out)));
}

}  // namespace

extern "C" {

int kvp_capi_shape_size(void) { return static_cast<int>(sizeof(kvp_capi_shape)); }

int kvp_capi_status_words(void) { return KVP_CAPI_STATUS_WORDS; }

int kvp_capi_workspace_size(const kvp_capi_shape* s, std::size_t* bytes) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && bytes != nullptr, "kvp_capi_workspace_size", "null argument");
    auto* d = dummy();
    const auto* di = static_cast<const std::int32_t*>(d);
    const views v = make_views(*s, d, d, static_cast<float*>(d), di, di);
    const ws_layout w = layout_of(*s);
    return with_policy(*s, [&](const auto& p) -> int {
      std::size_t exec_bytes = 0;
      // Without keep-mask output the executor keeps the masks in its workspace: the larger size.
      const cudaError_t e = kvp::cuda_executor{}.compress(nullptr, exec_bytes, p, v.cache, v.queries, v.scores,
                                                          batch_of(*s, static_cast<const kvp::batch_item*>(d)),
                                                          result_in(d, w, nullptr, nullptr));
      *bytes = w.executor + round_up(exec_bytes);
      return cuda_code(e);
    });
  });
}

int kvp_capi_compress(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                      const std::int32_t* block_table, const std::int32_t* lengths, const std::int32_t* items,
                      void* workspace, std::size_t workspace_bytes, std::uint8_t* keep_masks, float* final_scores,
                      std::uintptr_t stream) {
  return guarded([&]() -> int {
    return compress_on(s, kv_cache, queries, f, block_table, lengths, items, workspace, workspace_bytes, keep_masks,
                       final_scores, reinterpret_cast<cudaStream_t>(stream), nullptr);
  });
}

int kvp_capi_calibration_size(void) { return static_cast<int>(sizeof(kvp_capi_calibration)); }

int kvp_capi_calibration_defaults(kvp_capi_calibration* out) {
  return guarded([&]() -> int {
    kvp::require(out != nullptr, "out", "is a null pointer");
    *out = calibration_defaults();
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress_calibrated(const kvp_capi_shape* s, const kvp_capi_calibration* calibration, void* kv_cache,
                                 const void* queries, float* f, const std::int32_t* block_table,
                                 const std::int32_t* lengths, const std::int32_t* items, void* workspace,
                                 std::size_t workspace_bytes, std::uint8_t* keep_masks, float* final_scores,
                                 std::uintptr_t stream) {
  return guarded([&]() -> int {
    return compress_on(s, kv_cache, queries, f, block_table, lengths, items, workspace, workspace_bytes, keep_masks,
                       final_scores, reinterpret_cast<cudaStream_t>(stream), nullptr, calibration);
  });
}

int kvp_capi_compress_staged(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                             const std::int32_t* block_table, const std::int32_t* lengths, const std::int32_t* items,
                             void* workspace, std::size_t workspace_bytes, float* stage_ms, std::uintptr_t stream) {
  return guarded([&]() -> int {
    kvp::require(stage_ms != nullptr, "stage_ms", "is a null pointer");
    cudaEvent_t marks[5] = {};
    int rc = KVP_CAPI_OK;
    for (auto& e : marks)
      if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventCreate(&e));
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    if (rc == KVP_CAPI_OK) {
      try {
        rc = compress_on(s, kv_cache, queries, f, block_table, lengths, items, workspace, workspace_bytes, nullptr,
                         nullptr, st, marks);
      } catch (...) {
        for (auto e : marks)
          if (e) cudaEventDestroy(e);
        throw;
      }
    }
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventSynchronize(marks[4]));
    for (int i = 0; rc == KVP_CAPI_OK && i < 4; ++i) rc = cuda_code(cudaEventElapsedTime(&stage_ms[i], marks[i], marks[i + 1]));
    for (auto e : marks)
      if (e) cudaEventDestroy(e);
    return rc;
  });
}

int kvp_capi_status(const kvp_capi_shape* s, const void* workspace, std::int32_t* host_words, std::uintptr_t stream) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && workspace != nullptr, "kvp_capi_status", "null argument");
    std::int32_t words[kvp::status_words] = {};
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    if (auto e = cudaMemcpyAsync(words, at<std::int32_t>(workspace, layout_of(*s).status), sizeof words,
                                 cudaMemcpyDeviceToHost, st);
        e != cudaSuccess)
      return cuda_code(e);
    if (auto e = cudaStreamSynchronize(st); e != cudaSuccess) return cuda_code(e);
    if (host_words)
      for (int i = 0; i < kvp::status_words; ++i) host_words[i] = words[i];
    kvp::check(words);  // throws the kvp::error a failed device validation stands for
    return KVP_CAPI_OK;
  });
}

int kvp_capi_new_lengths(const kvp_capi_shape* s, const void* workspace, std::int32_t* host_out,
                         std::uintptr_t stream) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && workspace != nullptr && host_out != nullptr, "kvp_capi_new_lengths",
                 "null argument");
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    if (auto e = cudaMemcpyAsync(host_out, at<std::int32_t>(workspace, layout_of(*s).new_lengths),
                                 std::size_t(s->num_items) * sizeof(std::int32_t), cudaMemcpyDeviceToHost, st);
        e != cudaSuccess)
      return cuda_code(e);
    return cuda_code(cudaStreamSynchronize(st));
  });
}

int kvp_capi_per_head_shape_size(void) { return static_cast<int>(sizeof(kvp_capi_per_head_shape)); }

int kvp_capi_per_head_workspace_size(const kvp_capi_per_head_shape* s, std::size_t* bytes) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && bytes != nullptr, "kvp_capi_per_head_workspace_size", "null argument");
    auto* d = dummy();
    auto* di = static_cast<std::int32_t*>(d);
    const kvp::select::head_adaptive_blocks sel = per_head_selector(*s);
    const kvp::per_head_kv_view view = make_per_head_view(*s, d, d, static_cast<float*>(d), di, di, di);
    const per_head_ws_layout w = per_head_layout_of(*s);
    const kvp_capi_per_head_out o{di, di, di, di, nullptr, nullptr, nullptr, nullptr};
    std::size_t exec_bytes = 0;
    const cudaError_t e = kvp::cuda_per_head_executor{}.compress(
        nullptr, exec_bytes, sel, view,
        kvp::device_per_head_batch{static_cast<const kvp::per_head_item*>(d), s->num_items}, per_head_result_of(o));
    *bytes = w.executor + round_up(exec_bytes);
    return cuda_code(e);
  });
}

int kvp_capi_compress_per_head(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                               std::int32_t* positions, const std::int32_t* tables, const std::int32_t* lengths,
                               const std::int64_t* items, void* workspace, std::size_t workspace_bytes,
                               const kvp_capi_per_head_out* out, std::uintptr_t stream) {
  return guarded([&]() -> int {
    return compress_per_head_on(s, k_cache, v_cache, metric, positions, tables, lengths, items, workspace,
                                workspace_bytes, out, reinterpret_cast<cudaStream_t>(stream), nullptr);
  });
}

int kvp_capi_compress_per_head_staged(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                                      std::int32_t* positions, const std::int32_t* tables,
                                      const std::int32_t* lengths, const std::int64_t* items, void* workspace,
                                      std::size_t workspace_bytes, const kvp_capi_per_head_out* out,
                                      float* stage_ms, std::uintptr_t stream) {
  return guarded([&]() -> int {
    kvp::require(stage_ms != nullptr, "stage_ms", "is a null pointer");
    // events[0]: before the items' conversion; events[1..3]: the executor's three marks.
    cudaEvent_t events[4] = {};
    int rc = KVP_CAPI_OK;
    for (auto& e : events)
      if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventCreate(&e));
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventRecord(events[0], st));
    if (rc == KVP_CAPI_OK) {
      try {
        rc = compress_per_head_on(s, k_cache, v_cache, metric, positions, tables, lengths, items, workspace,
                                  workspace_bytes, out, st, events + 1);
      } catch (...) {
        for (auto e : events)
          if (e) cudaEventDestroy(e);
        throw;
      }
    }
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventSynchronize(events[3]));
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventElapsedTime(&stage_ms[0], events[1], events[2]));
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventElapsedTime(&stage_ms[1], events[2], events[3]));
    if (rc == KVP_CAPI_OK) rc = cuda_code(cudaEventElapsedTime(&stage_ms[2], events[0], events[3]));
    for (auto e : events)
      if (e) cudaEventDestroy(e);
    return rc;
  });
}

int kvp_capi_per_head_status(const std::int32_t* status, std::int32_t* host_words, std::uintptr_t stream) {
  return guarded([&]() -> int {
    kvp::require(status != nullptr, "status", "is a null pointer");
    std::int32_t words[kvp::status_words] = {};
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    if (auto e = cudaMemcpyAsync(words, status, sizeof words, cudaMemcpyDeviceToHost, st); e != cudaSuccess)
      return cuda_code(e);
    if (auto e = cudaStreamSynchronize(st); e != cudaSuccess) return cuda_code(e);
    if (host_words)
      for (int i = 0; i < kvp::status_words; ++i) host_words[i] = words[i];
    kvp::throw_if_error(words);  // the kvp::error a failed device validation stands for
    return KVP_CAPI_OK;
  });
}

const char* kvp_capi_last_error(void) { return last_error.c_str(); }

}  // extern "C"
