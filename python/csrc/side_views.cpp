#include "side_views.hpp"

#include <kvpolicy/core/error.hpp>

namespace nb = nanobind;
using kvp::require;

namespace kvpy {

kvp::query_window_view queries_view(nb::handle queries, const cache_description& cache, array& keep) {
  if (queries.is_none()) return {};
  keep = readable(queries, "queries");
  require_ndim(keep, 5, "queries", "[num_layers, slots, window, num_q_heads, head_dim]");
  require_place(place_of(keep, "queries"), place{cache.on_device, cache.device_id}, "queries");
  kvp::query_window_view q;
  q.type = cache_dtype(keep, "queries");
  require(keep.stride(4) == 1 || keep.shape(4) == 1, "queries", "has strides {}; each query row must be contiguous",
          strides_of(keep));
  q.base = keep.data();
  q.num_layers = static_cast<std::int32_t>(keep.shape(0));
  q.num_slots = static_cast<std::int32_t>(keep.shape(1));
  q.window = static_cast<std::int32_t>(keep.shape(2));
  q.num_q_heads = static_cast<std::int32_t>(keep.shape(3));
  q.head_dim = static_cast<std::int32_t>(keep.shape(4));
  q.layer_stride = keep.stride(0);
  q.slot_stride = keep.stride(1);
  q.pos_stride = keep.stride(2);
  q.head_stride = keep.stride(3);
  return q;  // the executors check its sizes against the cache and the pipeline
}

kvp::score_view scores_view(nb::handle scores, const cache_description& cache, mut_array& keep) {
  if (scores.is_none()) return {};
  keep = writable(scores, "scores");
  require_ndim(keep, 4, "scores", "[num_layers, num_blocks, block_size, num_kv_heads]");
  require_dtype(keep, float32_type, "scores", "float32");
  require_place(place_of(keep, "scores"), place{cache.on_device, cache.device_id}, "scores");
  const auto& s = cache.shape;
  const std::int64_t want[] = {s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads};
  for (int i = 0; i < 4; ++i)
    require(static_cast<std::int64_t>(keep.shape(i)) == want[i], "scores",
            "has shape {}; the cache needs ({}, {}, {}, {})", shape_of(keep), want[0], want[1], want[2], want[3]);
  return {static_cast<float*>(keep.data()), keep.stride(0), keep.stride(1), keep.stride(2), keep.stride(3)};
}

}  // namespace kvpy
