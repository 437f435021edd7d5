// The host path: kvp::host_executor on host arrays, results as NumPy arrays.
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

// Binds _core.host_compress(policy, cache, items, queries, scores, layer_begin,
// layer_count, max_tokens, return_masks, return_scores, communicator) -> dict of NumPy
// arrays; communicator None, or an object with all_reduce(array, "max" | "sum")
// (tensor parallelism: the cache is this rank's KV heads).
void register_host_compress(nanobind::module_& m);

}  // namespace kvpy
