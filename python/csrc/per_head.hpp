// KV-Compress over a per-head block cache (kvpolicy.compress_per_head): the caller's
// K, V, metric, block tables and lengths read as a kvp::per_head_kv_view; host arrays
// run kvp::host::compress_per_head, CUDA arrays kvp::cuda_per_head_executor.
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

// Binds host_compress_per_head, kv_compress_blocks_to_free and, in a build with CUDA,
// device_per_head_workspace_bytes and device_compress_per_head.
void register_per_head(nanobind::module_& m);

}  // namespace kvpy
