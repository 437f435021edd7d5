// A decode-attention test case (host memory): random queries, keys and values of one
// sequence batch laid out three ways, over the same tokens per KV head:
//   per-head   each (layer, seq, KV head) its own shuffled blocks of a shared pool and
//              its own length (KV-Compress), K and V `[N, b, d]` apart
//   paged      one table per sequence, K and V `[L, N, b, h_kv, d]` (nano-vllm style),
//              each head attending its count (`counts`) and maybe the tail past a
//              compaction's new length (`tail`), or the sequence's length with a live
//              mask dropping some slots, or plainly the sequence's length
// The metric / F start as random values in [0, 1); positions are the token index plus
// a per-sequence offset. Used by tests/unit/test_decode_attention.cpp (host) and
// tests/gpu/decode_attention_test.cu (device against host).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/core/block_table.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"

namespace kvp_test {

struct decode_case {
  using i32 = std::int32_t;
  i32 layers = 2, layer = 1, seqs = 3, heads = 2, G = 4, d = 64, b = 16;
  i32 min_len = 0, max_len = 700;  // sequence lengths (and per-head lengths) drawn in [min_len, max_len]
  double dropped = 0.3;            // paged live mask: share of slots dropped
  kvp::dtype type = kvp::dtype::bf16;
  std::uint32_t seed = 1;
  float query_scale = 1.0f;  // spread of the logits

  // Per-head layout.
  i32 ph_blocks = 0, ph_max_blocks = 0;
  std::vector<std::byte> ph_k, ph_v;
  std::vector<float> ph_metric;
  std::vector<i32> ph_table, ph_lengths, ph_positions;
  // Paged layout.
  i32 pg_blocks = 0, pg_max_blocks = 0;
  std::vector<std::byte> pg_k, pg_v;
  std::vector<float> pg_scores;
  std::vector<i32> pg_table, pg_lengths, pg_counts, pg_tail, pg_positions;
  std::vector<std::uint8_t> pg_live;
  // Queries of every sequence `[seqs, h_q, d]`.
  std::vector<std::byte> q;

  std::size_t es() const { return static_cast<std::size_t>(kvp::size_of(type)); }
  i32 h_q() const { return heads * G; }

  void build() {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<i32> len(min_len, max_len);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    auto fill = [&](std::vector<std::byte>& v, std::size_t n, float sd) {
      v.resize(n * es());
      for (std::size_t i = 0; i < n; ++i)
        kvp::store_from_float(v.data(), type, static_cast<std::int64_t>(i), sd * normal(rng));
    };
    // Per-head: lengths [L, S, H]; tables [L, S, H, max_blocks], ids shuffled over one pool.
    for (i32 i = 0; i < layers * seqs * heads; ++i) ph_lengths.push_back(len(rng));
    ph_max_blocks = 1;
    for (i32 T : ph_lengths) ph_max_blocks = std::max(ph_max_blocks, (T + b - 1) / b);
    ph_blocks = layers * seqs * heads * ph_max_blocks;
    ph_table.resize(static_cast<std::size_t>(ph_blocks));
    std::iota(ph_table.begin(), ph_table.end(), 0);
    std::shuffle(ph_table.begin(), ph_table.end(), rng);
    fill(ph_k, static_cast<std::size_t>(ph_blocks) * b * d, 1.0f);
    fill(ph_v, static_cast<std::size_t>(ph_blocks) * b * d, 1.0f);
    ph_metric.resize(static_cast<std::size_t>(ph_blocks) * b);
    for (auto& x : ph_metric) x = unit(rng);
    ph_positions.assign(static_cast<std::size_t>(ph_blocks) * b, 0);
    for (i32 r = 0; r < layers * seqs * heads; ++r)
      for (i32 t = 0; t < ph_lengths[static_cast<std::size_t>(r)]; ++t)
        ph_positions[static_cast<std::size_t>(ph_table[static_cast<std::size_t>(r) * ph_max_blocks + t / b]) * b +
                     t % b] = 3 * t + r % 5;  // increasing, not the index

    // Paged: lengths [S]; tails (a compaction's new length) <= length; counts [L, S, H]
    // <= tail; table [S, max_blocks], ids shuffled.
    for (i32 s = 0; s < seqs; ++s) pg_lengths.push_back(len(rng));
    for (i32 L : pg_lengths) pg_tail.push_back(std::uniform_int_distribution<i32>(0, L)(rng));
    pg_max_blocks = 1;
    for (i32 T : pg_lengths) pg_max_blocks = std::max(pg_max_blocks, (T + b - 1) / b);
    pg_blocks = seqs * pg_max_blocks + 3;  // a few blocks no sequence holds
    std::vector<i32> ids(static_cast<std::size_t>(pg_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    pg_table.assign(ids.begin(), ids.begin() + seqs * pg_max_blocks);
    for (i32 l = 0; l < layers; ++l)
      for (i32 s = 0; s < seqs; ++s)
        for (i32 h = 0; h < heads; ++h)
          pg_counts.push_back(std::uniform_int_distribution<i32>(0, pg_tail[static_cast<std::size_t>(s)])(rng));
    const std::size_t slots = static_cast<std::size_t>(layers) * pg_blocks * b * heads;
    fill(pg_k, slots * d, 1.0f);
    fill(pg_v, slots * d, 1.0f);
    pg_scores.resize(slots);
    for (auto& x : pg_scores) x = unit(rng);
    pg_live.resize(slots);
    for (auto& x : pg_live) x = unit(rng) >= dropped ? 1 : 0;
    pg_positions.resize(slots);
    for (std::size_t i = 0; i < slots; ++i) pg_positions[i] = static_cast<i32>(i % 9973);

    fill(q, static_cast<std::size_t>(seqs) * h_q() * d, query_scale);
  }

  kvp::per_head_kv_view per_head(std::byte* k, std::byte* v, float* metric, const i32* table, const i32* lengths,
                                 i32* positions = nullptr) const {
    kvp::per_head_kv_view c;
    c.num_layers = layers, c.num_blocks = ph_blocks, c.block_size = b, c.num_kv_heads = heads, c.head_dim = d;
    c.num_seqs = seqs, c.max_blocks = ph_max_blocks, c.type = type, c.shared_pool = true;
    c.k = {k, 0, nullptr, 0};
    c.v = {v, 0, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(b, d);
    c.table = kvp::per_head_array::dense(table, seqs, heads, ph_max_blocks);
    c.lengths = kvp::per_head_array::dense(lengths, seqs, heads);
    c.metric = kvp::per_slot_metric::shared(metric, b);
    if (positions) c.positions = kvp::per_slot_positions::shared(positions, b);
    return c;
  }

  kvp::paged_kv_view paged(std::byte* k, std::byte* v, const i32* table, const i32* lengths,
                           std::uint8_t* live = nullptr, i32* positions = nullptr) const {
    kvp::paged_kv_view c;
    c.num_layers = layers, c.num_blocks = pg_blocks, c.block_size = b, c.num_kv_heads = heads, c.head_dim = d;
    c.num_seqs = seqs, c.type = type;
    const std::int64_t token = std::int64_t{heads} * d, block = token * b, layer = block * pg_blocks;
    c.k = {k, layer, nullptr, 0};
    c.v = {v, layer, nullptr, 0};
    c.k_stride = c.v_stride = {block, token, d, 1};
    c.table = kvp::block_table_view::dense(table, pg_max_blocks);
    c.lengths = lengths;
    if (live) c.live = kvp::live_view::contiguous(live, pg_blocks, b, heads);
    if (positions) c.positions = kvp::position_view::contiguous(positions, pg_blocks, b, heads);
    return c;
  }

  kvp::decode_head_counts counts(const i32* base, const i32* tail = nullptr) const {
    return {kvp::per_head_array::dense(base, seqs, heads), tail};
  }
  kvp::score_view scores(float* base) const { return kvp::score_view::contiguous(base, pg_blocks, b, heads); }
};

}  // namespace kvp_test
