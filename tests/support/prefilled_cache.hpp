// A per-head block cache (KV-Compress's unified pool) after a prefill, owned in host
// memory for tests: rows given by their positions, blocks handed out shuffled, K and V
// random, the metric and positions per slot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"

namespace kvp_test {

// A per-head cache after a prefill, f32, one shared pool (KV-Compress's unified
// cache), blocks handed out shuffled. Each (layer, seq, head) row holds `lengths` tokens
// whose positions are given (ascending: no compression has moved them yet); K and V
// random. Every head of a fresh prefill holds every position; a head an earlier
// compression thinned holds a subset.
struct prefilled_cache {
  using i32 = std::int32_t;
  i32 L, S, H, b, d;
  i32 max_blocks = 0, num_blocks = 0;
  std::vector<i32> lengths;                   // [L, S, H]
  std::vector<std::vector<i32>> row_positions;  // [L, S, H][t]
  std::vector<i32> table;                     // [L, S, H, max_blocks]
  std::vector<float> k, v, metric;            // [N, b, d], [N, b, d], [N, b]
  std::vector<i32> positions;                 // [N, b]

  prefilled_cache(i32 L_, i32 S_, i32 H_, i32 b_, i32 d_, std::vector<std::vector<i32>> rows, std::uint32_t seed)
      : L(L_), S(S_), H(H_), b(b_), d(d_), row_positions(std::move(rows)) {
    std::mt19937 rng(seed);
    i32 held = 0;
    for (const auto& r : row_positions) {
      lengths.push_back(static_cast<i32>(r.size()));
      max_blocks = std::max(max_blocks, blocks_for(lengths.back()));
      held += blocks_for(lengths.back());
    }
    num_blocks = held + 3;  // three blocks no head holds
    std::vector<i32> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(row_positions.size() * max_blocks, -1);
    std::size_t next = 0;
    for (std::size_t r = 0; r < row_positions.size(); ++r)
      for (i32 i = 0; i < blocks_for(lengths[r]); ++i) table[r * max_blocks + i] = ids[next++];
    std::normal_distribution<float> nd(0.0f, 1.0f);
    k.resize(static_cast<std::size_t>(num_blocks) * b * d);
    v.resize(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    metric.assign(static_cast<std::size_t>(num_blocks) * b, -1.0f);
    positions.assign(metric.size(), -1);
    for (std::size_t r = 0; r < row_positions.size(); ++r)
      for (i32 t = 0; t < lengths[r]; ++t) positions[slot(r, t)] = row_positions[r][t];
  }

  i32 blocks_for(i32 T) const { return (T + b - 1) / b; }
  std::size_t row(i32 l, i32 s, i32 h) const { return (static_cast<std::size_t>(l) * S + s) * H + h; }
  std::size_t slot(std::size_t r, i32 t) const {
    return static_cast<std::size_t>(table[r * max_blocks + t / b]) * b + t % b;
  }

  kvp::per_head_kv_view view() {
    kvp::per_head_kv_view c;
    c.num_layers = L, c.num_blocks = num_blocks, c.block_size = b, c.num_kv_heads = H, c.head_dim = d, c.num_seqs = S;
    c.max_blocks = max_blocks, c.type = kvp::dtype::f32, c.shared_pool = true;
    c.k = {k.data(), 0, nullptr, 0};
    c.v = {v.data(), 0, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(b, d);
    c.table = kvp::per_head_array::dense(table.data(), S, H, max_blocks);
    c.lengths = kvp::per_head_array::dense(lengths.data(), S, H);
    c.metric = kvp::per_slot_metric::shared(metric.data(), b);
    c.positions = kvp::per_slot_positions::shared(positions.data(), b);
    return c;
  }

  // The preset's prefill metric of every row, from random queries (G per KV head) of
  // the row's newest positions, written into the cache's per-slot metric. A row's
  // slots are in position order, so the causal mask by slot is the mask by position.
  // Query scales differ by KV head, so heads attend more or less sharply and their
  // metrics differ in level and spread: the schedule evicts differently per head.
  void write_prefill_metric(const kvp::scorer::squared_attention_metric& m, i32 G, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t r = 0; r < row_positions.size(); ++r) {
      const i32 T = lengths[r], n = std::min(m.window, T);
      const float sharpness = 0.5f + 1.5f * static_cast<float>(r % static_cast<std::size_t>(H));
      std::vector<float> keys(static_cast<std::size_t>(T) * d), queries(static_cast<std::size_t>(n) * G * d), out(T);
      for (i32 t = 0; t < T; ++t) std::copy_n(&k[slot(r, t) * d], d, &keys[static_cast<std::size_t>(t) * d]);
      for (float& x : queries) x = sharpness * nd(rng);
      m.prefill(queries, keys, G, d, out);
      for (i32 t = 0; t < T; ++t) metric[slot(r, t)] = out[t];
    }
  }
};

}  // namespace kvp_test
