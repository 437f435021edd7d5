// A per-head block cache read off the caller's tensors (kvpolicy.compress_per_head,
// per_head_metric and decode_attention_per_head take the same ones).
#pragma once

#include <vector>

#include <kvpolicy/core/per_head_kv_view.hpp>
#include <nanobind/nanobind.h>

#include "tensor_args.hpp"

namespace kvpy {

// The view over the caller's tensors, with the arrays it points into kept alive.
struct per_head_tensors {
  kvp::per_head_kv_view view{};
  place at;
  std::vector<mut_array> written;
  std::vector<array> read;
};

// k, v: [num_blocks, b, d] (one pool for every layer: KV-Compress's unified cache) or
// [layers, num_blocks, b, d] (a pool per layer); metric float32 and positions int32
// their shape without d; tables int32 [layers, seqs, h_kv, max_blocks]; lengths int32
// [layers, seqs, h_kv]. Any strides where the view has one; rows (d) and table rows
// adjacent. `metric` may be None where the call writes no metric (the view's is empty).
per_head_tensors read_per_head(nanobind::handle k, nanobind::handle v, nanobind::handle metric,
                               nanobind::handle tables, nanobind::handle lengths, nanobind::handle positions,
                               bool metric_required = true);

}  // namespace kvpy
