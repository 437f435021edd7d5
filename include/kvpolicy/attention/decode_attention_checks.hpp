// The checks of a decode-attention call that need no table or length (shapes,
// dtypes, strides, pointers, the epilogue's target), shared by the host reference and
// the CUDA call, which runs them on the host before any launch. Each names its field.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/validate.hpp"
#include "kvpolicy/exec/validate_per_head.hpp"

KVP_NAMESPACE_BEGIN
namespace detail {

// Queries and output against the cache's KV heads, head dim and dtype.
inline void check_decode_rows(const decode_rows& r, const char* name, std::int32_t kv_heads, std::int32_t d, dtype t) {
  require(r.base != nullptr, path("{}.base", name), "is a null pointer");
  require(r.head_dim == d, path("{}.head_dim", name), "is {}; the cache's head_dim is {}", r.head_dim, d);
  require(r.num_heads >= kv_heads && r.num_heads % kv_heads == 0, path("{}.num_heads", name),
          "is {}; must be a positive multiple of the cache's {} KV heads", r.num_heads, kv_heads);
  require(r.type == t, path("{}.type", name), "is {}; the cache holds {}", name_of(r.type), name_of(t));
  require(r.head_stride >= d, path("{}.head_stride", name), "is {}; must be at least head_dim {}", r.head_stride, d);
  require(r.item_stride >= std::int64_t{r.num_heads - 1} * r.head_stride + d, path("{}.item_stride", name),
          "is {}; an item's {} rows span {} elements", r.item_stride, r.num_heads,
          std::int64_t{r.num_heads - 1} * r.head_stride + d);
}

inline void check_decode_call(const decode_rows& q, const decode_rows& out, float scale, const decode_batch& batch,
                              const decode_epilogue& epi, std::int32_t num_layers, std::int32_t kv_heads,
                              std::int32_t d, dtype t) {
  check_decode_rows(q, "queries", kv_heads, d, t);
  check_decode_rows(out, "out", kv_heads, d, t);
  require(out.num_heads == q.num_heads, "out.num_heads", "is {}; the queries have {} heads", out.num_heads,
          q.num_heads);
  require(std::isfinite(scale) && scale > 0.0f, "scale", "is {}; the softmax scale must be positive and finite", scale);
  require(batch.num_items >= 0, "batch.num_items", "is {}; must not be negative", batch.num_items);
  require(batch.layer >= 0 && batch.layer < num_layers, "batch.layer", "is {}; the cache has {} layers", batch.layer,
          num_layers);
  require(batch.max_tokens >= 0, "batch.max_tokens", "is {}; must not be negative (0: the table's capacity)",
          batch.max_tokens);
  require(epi.excluded_distance >= 0, "epilogue.excluded_distance", "is {}; must not be negative",
          epi.excluded_distance);
}

}  // namespace detail

// A per-head block cache (KV-Compress): shapes and strides; the epilogue writes
// cache.metric.
inline void check_decode_attention(const per_head_kv_view& c, const decode_rows& q, const decode_rows& out, float scale,
                                   const decode_batch& batch, const decode_epilogue& epi, bool host_tables) {
  validate_per_head_shapes(c, host_tables);
  detail::check_decode_call(q, out, scale, batch, epi, c.num_layers, c.num_kv_heads, c.head_dim, c.type);
  require(!epi.writes() || !c.metric.empty(), "cache.metric",
          "is a null pointer; the epilogue adds the probabilities to it");
}

// A paged cache with a shared block table: shapes and strides, the counts' and the
// live view's pointers; the epilogue writes epi.scores.
inline void check_decode_attention(const paged_kv_view& c, const decode_head_counts& counts, const decode_rows& q,
                                   const decode_rows& out, float scale, const decode_batch& batch,
                                   const decode_epilogue& epi, bool host_tables) {
  detail::validate_paged_view(c);
  detail::check_decode_call(q, out, scale, batch, epi, c.num_layers, c.num_kv_heads, c.head_dim, c.type);
  detail::validate_bases(c.k, c, batch.layer, batch.layer + 1, "k", host_tables);
  detail::validate_bases(c.v, c, batch.layer, batch.layer + 1, "v", host_tables);
  if (counts.given() && counts.counts.layers && host_tables)
    require(counts.counts.layers[batch.layer] != nullptr, detail::path("counts.layers[{}]", batch.layer),
            "is a null pointer");
  require(!epi.writes() || !epi.scores.empty(), "epilogue.scores",
          "is a null pointer; the epilogue adds the probabilities to F there");
}

KVP_NAMESPACE_END
