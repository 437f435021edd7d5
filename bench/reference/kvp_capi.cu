// libkvp_capi.so: the C API of kvp_capi.h over kvp::cuda_executor.
//
// Raw device pointers in, nothing allocated, nothing synchronised: kvp_capi_compress
// enqueues one compression on the given stream and returns, so torch.cuda.Event
// around the call times the GPU work. Malformed shapes are rejected before any
// launch (KVP_CAPI_EINVAL); malformed device data (lengths, block ids, items) is
// caught by the executor's first kernel and read back by kvp_capi_status.
#include "capi_common.hpp"  // first: kvpolicy's error.hpp sets FMT_USE_CONSTEXPR before fmt is seen

#include <cuda_runtime.h>

#include "kvpolicy/exec/cuda_executor.cuh"

namespace {

using namespace kvp_capi;

kvp::device_batch batch_of(const kvp_capi_shape& s, const std::int32_t* items) {
  return {reinterpret_cast<const kvp::batch_item*>(items), s.num_items, s.max_tokens, s.layer_begin, s.layer_count};
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

}  // namespace

extern "C" {

int kvp_capi_shape_size(void) { return static_cast<int>(sizeof(kvp_capi_shape)); }

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
                                                          batch_of(*s, di), result_in(d, w, nullptr, nullptr));
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
    kvp::require(s != nullptr, "shape", "is a null pointer");
    kvp::require(workspace != nullptr, "workspace", "is a null pointer");
    const views v = make_views(*s, kv_cache, queries, f, block_table, lengths);
    const ws_layout w = layout_of(*s);
    kvp::require(workspace_bytes > w.executor, "workspace_bytes", "is {}; kvp_capi_workspace_size says more",
                 workspace_bytes);
    return with_policy(*s, [&](const auto& p) -> int {
      kvp::cuda_executor ex;
      ex.stream = reinterpret_cast<cudaStream_t>(stream);
      std::size_t exec_bytes = workspace_bytes - w.executor;
      return cuda_code(ex.compress(at<std::byte>(workspace, w.executor), exec_bytes, p, v.cache, v.queries, v.scores,
                                   batch_of(*s, items), result_in(workspace, w, keep_masks, final_scores)));
    });
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

const char* kvp_capi_last_error(void) { return last_error.c_str(); }

}  // extern "C"
