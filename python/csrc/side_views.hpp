// The two views beside the cache: the observation queries and the global score F,
// read off the caller's arrays (shape checked against the cache, strides as given).
#pragma once

#include <cstdint>
#include <initializer_list>

#include <nanobind/nanobind.h>

#include <kvpolicy/core/error.hpp>
#include <kvpolicy/core/slot_view.hpp>

#include <kvpolicy/core/query_window_view.hpp>
#include <kvpolicy/core/score_view.hpp>

#include "cache_description.hpp"
#include "tensor_args.hpp"

namespace kvpy {

// A side array of one value per cached (layer, block, slot, KV head): `name` of shape
// [num_layers, num_blocks, block_size, num_kv_heads] exactly (the executors index it by
// the cache's shape), any strides, written in place, in the cache's memory, of element
// type T or one of `also` (same size; `expected` names them). `keep` holds the array.
template <class T>
kvp::slot_view<T> slot_array(nanobind::handle arg, const char* name, const kvp::cache_shape& shape, const place& where,
                             const char* expected, mut_array& keep,
                             std::initializer_list<nanobind::dlpack::dtype> also = {}) {
  keep = writable(arg, name);
  require_ndim(keep, 4, name, "[num_layers, num_blocks, block_size, num_kv_heads]");
  bool typed = keep.dtype() == nanobind::dtype<T>();
  for (const auto t : also) typed = typed || keep.dtype() == t;
  kvp::require(typed, name, "has element type {}; expected {}", dtype_name(keep), expected);
  require_place(place_of(keep, name), where, name);
  const std::int64_t want[] = {shape.num_layers, shape.num_blocks, shape.block_size, shape.num_kv_heads};
  for (int i = 0; i < 4; ++i)
    kvp::require(static_cast<std::int64_t>(keep.shape(i)) == want[i], name,
                 "has shape {}; the cache needs ({}, {}, {}, {})", shape_of(keep), want[0], want[1], want[2], want[3]);
  return {static_cast<T*>(keep.data()), keep.stride(0), keep.stride(1), keep.stride(2), keep.stride(3)};
}

// `queries`: [num_layers, slots, window, num_q_heads, head_dim], float16, bfloat16 or
// float32; None gives the empty view (pipelines that read no queries). `keep` holds
// the array while the view is used.
kvp::query_window_view queries_view(nanobind::handle queries, const cache_description& cache, array& keep);

// `scores` (F): float32 [num_layers, num_blocks, block_size, num_kv_heads], written in
// place; None gives the empty view (pipelines without a temporal aggregator). The
// executors index F by the cache's shape, so its shape must be exactly that.
kvp::score_view scores_view(nanobind::handle scores, const cache_description& cache, mut_array& keep);

}  // namespace kvpy
