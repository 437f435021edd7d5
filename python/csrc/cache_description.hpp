// The cache as the bindings read it off the caller's tensors: what a paged_kv_view
// needs, with the layers' bases as plain host-side arrays. Plain C++ (no nanobind):
// the host path points the view at these arrays, the device path copies them into
// its workspace first (the executor reads layer tables where it runs).
#pragma once

#include <cstdint>
#include <vector>

#include <kvpolicy/core/cache_layouts.hpp>
#include <kvpolicy/core/paged_kv_view.hpp>

namespace kvpy {

struct cache_description {
  kvp::cache_shape shape;
  kvp::sequence_table seqs;
  std::vector<void*> k_layers, v_layers;  // [num_layers] each: where layer l's K and V start
  kvp::kv_strides k_stride, v_stride;     // the tensors' own strides, in elements
  kvp::position_view positions{};
  kvp::live_view live{};  // cautious update: the tokens each (layer, KV head) holds
  bool on_device = false;  // CUDA memory (else host memory)
  int device_id = 0;
  std::int32_t max_tokens = 0;  // what the block table has room for per sequence, at most

  // The view with its layer tables at `k_table` / `v_table` (num_layers pointers each,
  // readable where the executor runs).
  kvp::paged_kv_view view(void* const* k_table, void* const* v_table) const {
    kvp::paged_kv_view v;
    v.num_layers = shape.num_layers;
    v.num_blocks = shape.num_blocks;
    v.block_size = shape.block_size;
    v.num_kv_heads = shape.num_kv_heads;
    v.head_dim = shape.head_dim;
    v.type = shape.type;
    v.num_seqs = seqs.num_seqs;
    v.table = seqs.table;
    v.lengths = seqs.lengths;
    v.sharing = seqs.sharing;
    v.k = {nullptr, 0, k_table, 0};
    v.v = {nullptr, 0, v_table, 0};
    v.k_stride = k_stride;
    v.v_stride = v_stride;
    v.positions = positions;
    v.live = live;
    return v;
  }
};

}  // namespace kvpy
