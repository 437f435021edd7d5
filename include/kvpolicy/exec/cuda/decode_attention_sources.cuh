// Where decode attention's kernels find a KV head's tokens: one small struct per
// kind of cache, read the same way by the validate, split and combine kernels.
//   per_head_decode_source   a per-head block cache (each (layer, seq, KV head) its own
//                            table and length; the metric per physical slot)
//   paged_decode_source<Live>  a shared block table: every head the sequence's length
//                            or its own count and the tail after it, tokens the live
//                            view drops skipped where Live; F per (block, slot, KV head)
// A head's tokens are a span of logical indices j (decode_row_span): token j below the
// count, token j + gap past it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Where one KV head's rows of one layer start, and the byte strides from a token's
// (physical block, slot) to its row.
struct decode_head_rows {
  const std::byte* k;
  const std::byte* v;
  std::int64_t k_block, k_token, v_block, v_token;

  __device__ const std::byte* key(std::int32_t blk, std::int32_t slot) const {
    return k + blk * k_block + slot * k_token;
  }
  __device__ const std::byte* value(std::int32_t blk, std::int32_t slot) const {
    return v + blk * v_block + slot * v_token;
  }
};

struct per_head_decode_source {
  per_head_kv_view c;
  static constexpr bool live = false;

  __device__ std::int32_t block_size() const { return c.block_size; }
  __device__ std::int32_t length(std::int32_t l, std::int32_t seq, std::int32_t h) const { return c.length(l, seq, h); }
  __device__ decode_row_span span(std::int32_t l, std::int32_t seq, std::int32_t h) const {
    const std::int32_t T = c.length(l, seq, h);
    return {T, T, 0};
  }
  __device__ std::int32_t block(std::int32_t l, std::int32_t seq, std::int32_t h, std::int32_t i) const {
    return c.block(l, seq, h, i);
  }
  __device__ decode_head_rows rows(std::int32_t l, std::int32_t) const {
    const std::int64_t es = size_of(c.type);
    return {c.k.layer(l, c.type),  c.v.layer(l, c.type),  c.k_stride.block * es,
            c.k_stride.token * es, c.v_stride.block * es, c.v_stride.token * es};
  }
  __device__ bool alive(std::int32_t, std::int32_t, std::int32_t, std::int32_t) const { return true; }
  __device__ float* metric(const decode_epilogue&, std::int32_t l, std::int32_t blk, std::int32_t slot,
                           std::int32_t) const {
    return &c.metric.at(l, blk, slot);
  }
  __device__ std::int32_t position(std::int32_t l, std::int32_t blk, std::int32_t slot, std::int32_t,
                                   std::int32_t t) const {
    return c.positions.empty() ? t : c.positions.at(l, blk, slot);
  }
};

template <bool Live>
struct paged_decode_source {
  paged_kv_view c;
  decode_head_counts counts;
  static constexpr bool live = Live;

  __device__ std::int32_t block_size() const { return c.block_size; }
  __device__ std::int32_t count(std::int32_t l, std::int32_t seq, std::int32_t h) const {
    return counts.given() ? *counts.counts.row(l, seq, h) : c.lengths[seq];
  }
  __device__ std::int32_t tail(std::int32_t seq) const {
    return counts.given() && counts.tail_from ? counts.tail_from[seq] : c.lengths[seq];
  }
  // Head h attends tokens [0, count) and [tail, length) of the sequence.
  __device__ decode_row_span span(std::int32_t l, std::int32_t seq, std::int32_t h) const {
    const std::int32_t L = c.lengths[seq], n = count(l, seq, h), t = tail(seq);
    return {n + (L - t), n, t - n};
  }
  __device__ std::int32_t block(std::int32_t, std::int32_t seq, std::int32_t, std::int32_t i) const {
    return c.table.block(seq, i);
  }
  __device__ decode_head_rows rows(std::int32_t l, std::int32_t h) const {
    const std::int64_t es = size_of(c.type);
    return {c.k.layer(l, c.type) + h * c.k_stride.head * es,
            c.v.layer(l, c.type) + h * c.v_stride.head * es,
            c.k_stride.block * es,
            c.k_stride.token * es,
            c.v_stride.block * es,
            c.v_stride.token * es};
  }
  __device__ bool alive(std::int32_t l, std::int32_t blk, std::int32_t slot, std::int32_t h) const {
    if constexpr (Live) return c.live.at(l, blk, slot, h) != 0;
    return true;
  }
  __device__ float* metric(const decode_epilogue& e, std::int32_t l, std::int32_t blk, std::int32_t slot,
                           std::int32_t h) const {
    return &e.scores.at(l, blk, slot, h);
  }
  __device__ std::int32_t position(std::int32_t l, std::int32_t blk, std::int32_t slot, std::int32_t h,
                                   std::int32_t t) const {
    return c.positions.empty() ? t : c.positions.at(l, blk, slot, h);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
