// Decode attention on the host: the law the CUDA kernels are tested against. Plain
// loops over host memory, fp64 logits, softmax and sums; one new query token per
// item, GQA (query head g of KV head h is h * G + g), over one layer of
//   (a) a per-head block cache (each (layer, seq, KV head) its own table and length),
//   (b) a paged cache whose heads attend their own counts (decode_head_counts) or
//       skip the tokens its live view marks dropped (cautious update),
//   (c) a plain paged cache (every head the sequence's length).
// A head that attends no token (length 0, every token dropped) writes zeros and adds
// nothing to the metric. The epilogue (decode_epilogue) adds each token's squared or
// plain probabilities, summed over the group in fp64, to its fp32 metric slot.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvpolicy/attention/decode_attention_checks.hpp"
#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"

KVP_NAMESPACE_BEGIN
namespace host {
namespace decode_detail {

// One (item, KV head): `row` gives the head's length and, per token, its K and V rows,
// whether it is attended, its metric slot and its position.
template <class Row>
void decode_head(const Row& row, const decode_rows& q, const decode_rows& out, float scale, std::int32_t item,
                 std::int32_t h, std::int32_t G, dtype t, const decode_epilogue& epi, std::int32_t query_position,
                 std::span<double> exact) {
  const std::int32_t T = row.length(), d = q.head_dim;
  std::vector<double> z(static_cast<std::size_t>(T)), sums(static_cast<std::size_t>(T), 0.0),
      o(static_cast<std::size_t>(d));
  std::vector<double> qv(static_cast<std::size_t>(d));
  for (std::int32_t g = 0; g < G; ++g) {
    const std::int32_t head = h * G + g;
    for (std::int32_t i = 0; i < d; ++i) qv[static_cast<std::size_t>(i)] = load_as_float(q.row(item, head), t, i);
    double m = -std::numeric_limits<double>::infinity();
    for (std::int32_t k = 0; k < T; ++k) {
      double dot = 0.0;
      if (row.attended(k)) {
        const std::byte* key = row.key(k);
        for (std::int32_t i = 0; i < d; ++i) dot += qv[static_cast<std::size_t>(i)] * load_as_float(key, t, i);
        dot *= scale;
        m = std::max(m, dot);
      } else {
        dot = -std::numeric_limits<double>::infinity();
      }
      z[static_cast<std::size_t>(k)] = dot;
    }
    std::fill(o.begin(), o.end(), 0.0);
    if (m != -std::numeric_limits<double>::infinity()) {
      double s = 0.0;
      for (std::int32_t k = 0; k < T; ++k)
        if (row.attended(k)) s += (z[static_cast<std::size_t>(k)] = std::exp(z[static_cast<std::size_t>(k)] - m));
      for (std::int32_t k = 0; k < T; ++k) {
        if (!row.attended(k)) continue;
        const double p = z[static_cast<std::size_t>(k)] / s;
        const std::byte* v = row.value(k);
        for (std::int32_t i = 0; i < d; ++i) o[static_cast<std::size_t>(i)] += p * load_as_float(v, t, i);
        sums[static_cast<std::size_t>(k)] += epi.kind == decode_metric::squared ? p * p : p;
      }
    }
    for (std::int32_t i = 0; i < d; ++i) {
      store_from_float(out.row(item, head), t, i, static_cast<float>(o[static_cast<std::size_t>(i)]));
      if (!exact.empty())
        exact[(static_cast<std::size_t>(item) * q.num_heads + head) * d + i] = o[static_cast<std::size_t>(i)];
    }
  }
  if (!epi.writes()) return;
  const std::int32_t pq = query_position >= 0 ? query_position : row.last_index();
  for (std::int32_t k = 0; k < T; ++k)
    if (row.attended(k) && pq - row.position(k) >= epi.excluded_distance)
      row.metric(k) += static_cast<float>(sums[static_cast<std::size_t>(k)]);
}

inline void check_exact(std::span<double> exact, const decode_rows& q, const decode_batch& batch) {
  require(exact.empty() || exact.size() == static_cast<std::size_t>(batch.num_items) * q.num_heads * q.head_dim,
          "exact", "has {} doubles; must be empty or items {} x heads {} x d {}", exact.size(), batch.num_items,
          q.num_heads, q.head_dim);
}

inline std::int32_t item_seq(const decode_batch& batch, std::int32_t i, std::int32_t num_seqs) {
  const std::int32_t seq = batch.seqs ? batch.seqs[i] : i;
  // Named as the device check names it (status_code::seq_out_of_range): item i's sequence.
  require(seq >= 0 && seq < num_seqs, kvp::detail::path("batch[{}].seq", i), "is {}; the cache has {} sequences", seq,
          num_seqs);
  return seq;
}

inline void check_max_tokens(const decode_batch& batch, std::int32_t T, std::int32_t seq) {
  require(batch.max_tokens == 0 || T <= batch.max_tokens, "batch.max_tokens", "is {}; seq {} holds {} tokens",
          batch.max_tokens, seq, T);
}

}  // namespace decode_detail

// (a) A per-head block cache. Every pointer is host memory. `exact` (optional,
// [items][h_q][d]): the output before rounding to the cache's dtype.
inline void decode_attention(const per_head_kv_view& c, const decode_rows& q, const decode_rows& out, float scale,
                             const decode_batch& batch, const decode_epilogue& epi = {}, std::span<double> exact = {}) {
  check_decode_attention(c, q, out, scale, batch, epi, /*host_tables=*/true);
  decode_detail::check_exact(exact, q, batch);
  const std::int32_t l = batch.layer, b = c.block_size, G = q.num_heads / c.num_kv_heads;
  const std::int64_t capacity = std::int64_t{c.max_blocks} * b;
  // Every item's rows first, so that a malformed one writes nothing.
  for (std::int32_t i = 0; i < batch.num_items; ++i) {
    const std::int32_t seq = decode_detail::item_seq(batch, i, c.num_seqs);
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      const std::int32_t T = c.length(l, seq, h);
      require(T >= 0 && T <= capacity, kvp::detail::path("cache.lengths[layer {}][seq {}][head {}]", l, seq, h),
              "is {}; the block table holds room for {} tokens", T, capacity);
      decode_detail::check_max_tokens(batch, T, seq);
      for (std::int32_t k = 0; k < c.blocks_for(T); ++k)
        require(c.block(l, seq, h, k) >= 0 && c.block(l, seq, h, k) < c.num_blocks,
                kvp::detail::path("cache.table[layer {}][seq {}][head {}][{}]", l, seq, h, k),
                "is block id {}; valid ids are [0, {})", c.block(l, seq, h, k), c.num_blocks);
    }
  }
  for (std::int32_t i = 0; i < batch.num_items; ++i) {
    const std::int32_t seq = batch.seqs ? batch.seqs[i] : i;
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      struct row_t {
        const per_head_kv_view& c;
        std::int32_t l, seq, h;
        std::int32_t length() const { return c.length(l, seq, h); }
        std::int32_t last_index() const { return length() - 1; }
        bool attended(std::int32_t) const { return true; }
        const std::byte* key(std::int32_t t) const { return c.k_row(l, seq, h, t); }
        const std::byte* value(std::int32_t t) const { return c.v_row(l, seq, h, t); }
        float& metric(std::int32_t t) const { return c.metric.at(l, c.physical_block(l, seq, h, t), t % c.block_size); }
        std::int32_t position(std::int32_t t) const {
          return c.positions.empty() ? t : c.positions.at(l, c.physical_block(l, seq, h, t), t % c.block_size);
        }
      } row{c, l, seq, h};
      decode_detail::decode_head(row, q, out, scale, i, h, G, c.type, epi,
                                 batch.query_positions ? batch.query_positions[i] : -1, exact);
    }
  }
}

// (b), (c) A paged cache with a shared block table: each head attends its count's
// tokens and the tail where `counts` is given (decode_head_counts), else the
// sequence's length, skipping the tokens cache.live marks dropped. The epilogue adds
// to epi.scores.
inline void decode_attention(const paged_kv_view& c, const decode_head_counts& counts, const decode_rows& q,
                             const decode_rows& out, float scale, const decode_batch& batch,
                             const decode_epilogue& epi = {}, std::span<double> exact = {}) {
  check_decode_attention(c, counts, q, out, scale, batch, epi, /*host_tables=*/true);
  decode_detail::check_exact(exact, q, batch);
  const std::int32_t l = batch.layer, b = c.block_size, G = q.num_heads / c.num_kv_heads;
  auto span = [&](std::int32_t seq, std::int32_t h) {
    const std::int32_t L = c.lengths[seq];
    const std::int32_t count = counts.given() ? *counts.counts.row(l, seq, h) : L;
    const std::int32_t tail = counts.given() && counts.tail_from ? counts.tail_from[seq] : L;
    return decode_row_span{count + (L - tail), count, tail - count};
  };
  for (std::int32_t i = 0; i < batch.num_items; ++i) {
    const std::int32_t seq = decode_detail::item_seq(batch, i, c.num_seqs);
    const std::int32_t L = c.lengths[seq];
    const std::int64_t capacity = c.table.capacity(seq) * b;
    require(L >= 0 && L <= capacity, kvp::detail::path("cache.lengths[{}]", seq),
            "is {}; the block table holds room for {} tokens", L, capacity);
    for (std::int32_t k = 0; k < (L + b - 1) / b; ++k)
      require(c.physical_block(seq, k * b) >= 0 && c.physical_block(seq, k * b) < c.num_blocks,
              kvp::detail::path("cache.table[seq {}][{}]", seq, k), "is block id {}; valid ids are [0, {})",
              c.physical_block(seq, k * b), c.num_blocks);
    const std::int32_t tail = counts.given() && counts.tail_from ? counts.tail_from[seq] : L;
    require(tail >= 0 && tail <= L, kvp::detail::path("counts.tail_from[{}]", seq),
            "is {}; the sequence holds {} tokens", tail, L);
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      const std::int32_t count = counts.given() ? *counts.counts.row(l, seq, h) : L;
      require(count >= 0 && count <= tail, kvp::detail::path("counts[layer {}][seq {}][head {}]", l, seq, h),
              "is {}; at most {} (the sequence's length, or its tail_from where given)", count, tail);
      decode_detail::check_max_tokens(batch, span(seq, h).length, seq);
    }
  }
  for (std::int32_t i = 0; i < batch.num_items; ++i) {
    const std::int32_t seq = batch.seqs ? batch.seqs[i] : i;
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      // Logical index j of the head's span is token s.token(j) of the sequence.
      struct row_t {
        const paged_kv_view& c;
        const decode_epilogue& epi;
        std::int32_t l, seq, h;
        decode_row_span s;
        std::int32_t length() const { return s.length; }
        std::int32_t last_index() const { return s.token(s.length - 1); }
        bool attended(std::int32_t j) const { return c.alive(l, seq, s.token(j), h); }
        const std::byte* key(std::int32_t j) const { return c.k_row(l, seq, s.token(j), h); }
        const std::byte* value(std::int32_t j) const { return c.v_row(l, seq, s.token(j), h); }
        float& metric(std::int32_t j) const {
          const std::int32_t t = s.token(j);
          return epi.scores.at(l, c.physical_block(seq, t), t % c.block_size, h);
        }
        std::int32_t position(std::int32_t j) const {
          const std::int32_t t = s.token(j);
          return c.positions.empty() ? t : c.positions.at(l, c.physical_block(seq, t), t % c.block_size, h);
        }
      } row{c, epi, l, seq, h, span(seq, h)};
      decode_detail::decode_head(row, q, out, scale, i, h, G, c.type, epi,
                                 batch.query_positions ? batch.query_positions[i] : -1, exact);
    }
  }
}

}  // namespace host
KVP_NAMESPACE_END
