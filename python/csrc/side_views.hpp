// The two views beside the cache: the observation queries and the global score F,
// read off the caller's arrays (shape checked against the cache, strides as given).
#pragma once

#include <nanobind/nanobind.h>

#include <kvpolicy/core/query_window_view.hpp>
#include <kvpolicy/core/score_view.hpp>

#include "cache_description.hpp"
#include "tensor_args.hpp"

namespace kvpy {

// `queries`: [num_layers, slots, window, num_q_heads, head_dim], float16, bfloat16 or
// float32; None gives the empty view (pipelines that read no queries). `keep` holds
// the array while the view is used.
kvp::query_window_view queries_view(nanobind::handle queries, const cache_description& cache, array& keep);

// `scores` (F): float32 [num_layers, num_blocks, block_size, num_kv_heads], written in
// place; None gives the empty view (pipelines without a temporal aggregator). The
// executors index F by the cache's shape, so its shape must be exactly that.
kvp::score_view scores_view(nanobind::handle scores, const cache_description& cache, mut_array& keep);

}  // namespace kvpy
