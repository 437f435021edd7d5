// The device path's plain interface: compiled by nvcc in device_compress_*.cu (one
// per preset), called from the bindings (g++). No nanobind and no CUDA header here.
#pragma once

#include <cstddef>
#include <cstdint>

#include <kvpolicy/core/batch.hpp>
#include <kvpolicy/core/query_window_view.hpp>
#include <kvpolicy/core/score_view.hpp>

#include "cache_description.hpp"

namespace kvpy {

// Where the caller's device buffers are: results, workspace (all device memory,
// allocated by the caller's framework; null where optional and not wanted).
struct device_outputs {
  std::int32_t* status = nullptr;           // [8]
  std::int32_t* new_lengths = nullptr;      // [n]
  std::int32_t* released_counts = nullptr;  // [n]
  std::int32_t* released_blocks = nullptr;  // [n, ceil(max_tokens / b)], -1 past each count
  std::int32_t* kept_counts = nullptr;      // [n, layers, h_kv]
  std::int32_t* nonfinite = nullptr;        // [n]
  std::uint8_t* keep_masks = nullptr;       // optional [n, layers, h_kv, max_tokens], 0 past each length
  float* scores = nullptr;                  // optional, the same shape: final scores after protect
};

struct device_call {
  const cache_description* cache = nullptr;
  kvp::query_window_view queries{};
  kvp::score_view scores{};
  // Items: rows (seq, query_slot, budget, history_tokens, window_begin) either in device memory
  // (device_items) or in host memory (host_items), which the call uploads through
  // kernel arguments into its workspace, so that a captured graph holds them.
  const kvp::batch_item* device_items = nullptr;
  const kvp::batch_item* host_items = nullptr;
  std::int32_t num_items = 0;
  std::int32_t max_tokens = 0;
  std::int32_t layer_begin = 0;
  std::int32_t layer_count = 0;
  bool masks = false;  // whether outputs.keep_masks is given (sizes the workspace)
  void* stream = nullptr;  // cudaStream_t
};

// Workspace bytes a call needs (the layer tables, host items and the executor's own).
template <class P>
std::size_t device_workspace_bytes(const P& policy, const device_call& call);

// Compresses on call.stream: sets the unused results (released blocks -1, masks 0),
// then runs kvp::cuda_executor. Throws kvp::error for a malformed shape; malformed
// device data lands in outputs.status. Launches only: no allocation, no host wait.
template <class P>
void device_compress(const P& policy, const device_call& call, const device_outputs& out, void* workspace,
                     std::size_t workspace_bytes);

// cuda_runtime helpers (device_runtime.cu).
bool stream_is_capturing(void* stream);
// Copies the status to the host, waits for the stream and throws the kvp::error the
// status stands for (kvp::check).
void check_status(const std::int32_t* status, void* stream);
// A device allocation for callers whose framework the package cannot allocate with
// (stream-ordered, so a capture records it).
void* device_alloc(std::size_t bytes, void* stream);
void device_free(void* p, void* stream) noexcept;
// Makes `device` current for a scope, restoring the caller's after.
class device_scope {
 public:
  explicit device_scope(int device);
  ~device_scope();
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace kvpy
