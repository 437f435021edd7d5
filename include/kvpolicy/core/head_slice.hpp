// A rank's slice of the KV heads, as views over the whole cache: what an engine that
// keeps every head in one tensor (or a test of tensor parallelism) hands one rank. An
// engine whose ranks hold their own tensors describes them directly instead: the same
// views with num_kv_heads = the rank's heads. Nothing is copied; KV head h of the slice
// is head first + h of the whole, and its query heads h * G + g those of the whole from
// first * G (G = h_q / h_kv, the GQA group, the same on every rank).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/slot_view.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
inline void check_head_slice(std::int32_t first, std::int32_t count, std::int32_t heads) {
  require(count > 0 && first >= 0 && first <= heads - count, "heads",
          "[{}, {}) is not a non-empty slice of the cache's {} KV heads", first, first + count, heads);
}
}  // namespace detail

// KV heads [first, first + count) of every layer; block table, lengths and sharing shared.
inline paged_kv_view slice_heads(paged_kv_view c, std::int32_t first, std::int32_t count) {
  detail::check_head_slice(first, count, c.num_kv_heads);
  c.k.offset += first * c.k_stride.head;
  c.v.offset += first * c.v_stride.head;
  if (!c.positions.empty()) c.positions.base += first * c.positions.head_stride;
  if (!c.live.empty()) c.live.base += first * c.live.head_stride;
  c.num_kv_heads = count;
  return c;
}

// A per-head block cache's KV heads [first, first + count): their table rows and
// lengths (the block pool, metric and positions are the pool's, shared). Tables and
// lengths given as one tensor each; per-layer lists are refused (point each layer's
// entry at its first head instead).
inline per_head_kv_view slice_heads(per_head_kv_view c, std::int32_t first, std::int32_t count) {
  detail::check_head_slice(first, count, c.num_kv_heads);
  require(c.table.layers == nullptr && c.lengths.layers == nullptr, "cache.table",
          "is a list of per-layer tensors; slice_heads moves one base: point each layer's entry at head {} instead",
          first);
  c.table.base += first * c.table.head_stride;
  c.lengths.base += first * c.lengths.head_stride;
  c.num_kv_heads = count;
  return c;
}

// F, positions or live bytes of KV heads [first, first + count).
template <class T>
slot_view<T> slice_heads(slot_view<T> v, std::int32_t first, std::int32_t count, std::int32_t heads) {
  detail::check_head_slice(first, count, heads);
  if (!v.empty()) v.base += first * v.head_stride;
  return v;
}

// The query heads of KV heads [first, first + count): G = num_q_heads / kv_heads each.
inline query_window_view slice_heads(query_window_view q, std::int32_t first, std::int32_t count,
                                     std::int32_t kv_heads) {
  detail::check_head_slice(first, count, kv_heads);
  require(q.base == nullptr || q.num_q_heads % kv_heads == 0, "queries.num_q_heads",
          "is {}; not a multiple of the cache's {} KV heads", q.num_q_heads, kv_heads);
  if (q.base == nullptr) return q;
  const std::int32_t G = q.num_q_heads / kv_heads;
  q.base = static_cast<const std::byte*>(q.base) + first * G * q.head_stride * size_of(q.type);
  q.num_q_heads = count * G;
  return q;
}

KVP_NAMESPACE_END
