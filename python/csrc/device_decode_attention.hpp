// Decode attention's device path, a plain interface: compiled by nvcc in
// device_decode_attention.cu, called from the bindings (decode_attention.cpp, g++).
// No nanobind and no CUDA header here.
#pragma once

#include <cstddef>
#include <string>

#include <kvpolicy/attention/decode_attention_params.hpp>
#include <kvpolicy/core/per_head_kv_view.hpp>

#include "cache_description.hpp"

namespace kvpy {

// One call of kvp::cuda_decode_attention over exactly one of a per-head cache or a
// paged one (whose layer tables the call uploads into the front of the workspace).
// Every pointer in `batch`, `counts` and the views is device memory; batch.status
// (8 words) is required.
struct decode_attention_call {
  const kvp::per_head_kv_view* per_head = nullptr;
  const cache_description* paged = nullptr;
  kvp::decode_head_counts counts{};  // paged caches only
  kvp::decode_rows queries{}, out{};
  float scale = 0.0f;
  kvp::decode_batch batch{};
  kvp::decode_epilogue epilogue{};
  bool staged = false;  // the split step that stages K and V through shared memory
  int device_id = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Workspace bytes the call needs. Runs every host-side check (kvp::error naming the
// field) without touching device memory.
std::size_t device_decode_attention_workspace_bytes(const decode_attention_call& call);

// Launches on call.stream; no allocation and no host wait. Malformed device data
// (a length past the table, a block id out of range) lands in batch.status.
void device_decode_attention(const decode_attention_call& call, void* workspace, std::size_t workspace_bytes);

// The plan the call runs (grid, splits, shared memory), as the library prints it.
std::string describe_decode_attention(const decode_attention_call& call);

}  // namespace kvpy
