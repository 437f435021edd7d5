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
  return slot_array<float>(scores, "scores", cache.shape, place{cache.on_device, cache.device_id}, "float32", keep);
}

}  // namespace kvpy
