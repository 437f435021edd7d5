// KV-Compress end to end on the host over a per-head cache (host::compress_per_head):
// the block schedule across a sequence's heads from the metric in the cache, then
// MoveCache per head; worked by hand on two heads of different lengths.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"

namespace {

// One layer, one sequence, two KV heads of 10 and 7 tokens, blocks of 4, d 4, f32,
// one shared pool of 8 blocks; K[0] = 100 h + t identifies each token. The sequence
// has 10 positions; head 1 holds 0 to 4, 8 and 9 (an earlier compression took 5 to 7).
struct two_heads {
  static constexpr int b = 4, d = 4, blocks = 8, max_blocks = 3;
  std::vector<float> k = std::vector<float>(blocks * b * d, -1.0f), v = k;
  std::vector<float> metric = std::vector<float>(blocks * b, -7.0f);
  std::vector<std::int32_t> positions = std::vector<std::int32_t>(blocks * b, -1);
  std::vector<std::int32_t> table{5, 2, 7, 0, 3, -1};
  std::vector<std::int32_t> lengths{10, 7};

  two_heads(const std::vector<float>& m0, const std::vector<float>& m1) {
    const std::vector<float>* m[2] = {&m0, &m1};
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < lengths[h]; ++t) {
        const int slot = table[h * max_blocks + t / b] * b + t % b;
        k[slot * d] = static_cast<float>(100 * h + t);
        v[slot * d] = static_cast<float>(1000 + 100 * h + t);
        metric[slot] = (*m[h])[t];
        positions[slot] = h == 1 && t >= 5 ? t + 3 : t;  // head 1 lost positions 5 to 7 before
      }
  }
  kvp::per_head_kv_view view() {
    kvp::per_head_kv_view c;
    c.num_layers = 1, c.num_blocks = blocks, c.block_size = b, c.num_kv_heads = 2, c.head_dim = d, c.num_seqs = 1;
    c.max_blocks = max_blocks, c.type = kvp::dtype::f32;
    c.k = {k.data(), 0, nullptr, 0};
    c.v = {v.data(), 0, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(b, d);
    c.table = kvp::per_head_array::dense(table.data(), 1, 2, max_blocks);
    c.lengths = kvp::per_head_array::dense(lengths.data(), 1, 2);
    c.metric = kvp::per_slot_metric::shared(metric.data(), b);
    c.positions = kvp::per_slot_positions::shared(positions.data(), b);
    return c;
  }
  float token(int h, int t) const { return k[(table[h * max_blocks + t / b] * b + t % b) * d]; }
  float metric_at(int h, int t) const { return metric[table[h * max_blocks + t / b] * b + t % b]; }
};

}  // namespace

TEST_CASE("compress_per_head: two blocks freed across two heads, by hand") {
  // Protected: positions 8 and 9 (the sequence's last 2) in both heads. Head 0 (10 tokens, hanging 2): ascending
  // evictable metrics 1 2 3 4 5 6 7 8 (tokens 1 3 5 7 0 2 4 6); its first block costs the
  // 2nd (2), its second the 6th (6). Head 1 (7 tokens, hanging 3): ascending 0.1 0.5 3 4 5
  // (tokens 2 0 1 4 3); its first block costs the 3rd (3), a second would need 7 tokens.
  // The two cheapest blocks: head 0's first (2), head 1's first (3): head 0 evicts 1 and 3,
  // head 1 evicts 2, 0 and 1. MoveCache: head 0's 9 and 8 fill slots 1 and 3; head 1's 6,
  // 5, 4 fill slots 0, 1, 2.
  two_heads c({5, 1, 6, 2, 7, 3, 8, 4, 9, 9}, {0.5f, 3, 0.1f, 5, 4, 9, 9});
  const std::vector<float> untouched_k = c.k;
  const kvp::select::head_adaptive_blocks sel{.protected_window = 2, .sinks = 0};
  const std::vector<kvp::per_head_item> items{{.seq = 0, .blocks_to_free = 2, .logical_length = 10}};
  const auto r = kvp::host::compress_per_head(sel, c.view(), items);
  CHECK(r.new_lengths[0] == std::vector<std::int32_t>{8, 4});
  CHECK(r.evicted[0] == std::vector<std::int32_t>{2, 3});
  CHECK(r.freed[0] == 2);
  CHECK(r.freed_blocks[0] == std::vector<std::vector<std::int32_t>>{{7}, {3}});
  const std::vector<float> head0{0, 9, 2, 8, 4, 5, 6, 7}, head1{106, 105, 104, 103};
  for (int t = 0; t < 8; ++t) CHECK(c.token(0, t) == head0[t]);
  for (int t = 0; t < 4; ++t) CHECK(c.token(1, t) == head1[t]);
  const std::vector<float> metric1{9, 9, 4, 5};
  for (int t = 0; t < 4; ++t) CHECK(c.metric_at(1, t) == metric1[t]);
  // Blocks no head holds are never written.
  for (int blk : {1, 4, 6})
    for (int i = 0; i < two_heads::b * two_heads::d; ++i)
      CHECK(c.k[blk * two_heads::b * two_heads::d + i] == untouched_k[blk * two_heads::b * two_heads::d + i]);
}

TEST_CASE("compress_per_head: refusals name the field and write nothing") {
  two_heads c({5, 1, 6, 2, 7, 3, 8, 4, 9, 9}, {0.5f, 3, 0.1f, 5, 4, 9, 9});
  const std::vector<float> before = c.k;
  const kvp::select::head_adaptive_blocks sel{.protected_window = 2, .sinks = 0};
  auto refuses = [&](kvp::per_head_kv_view view, std::vector<kvp::per_head_item> items, const char* field) {
    try {
      kvp::host::compress_per_head(sel, view, items);
      FAIL("accepted, expected an error on ", field);
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
    }
    CHECK(c.k == before);
  };
  auto no_metric = c.view();
  no_metric.metric = {};
  refuses(no_metric, {{.seq = 0, .blocks_to_free = 1, .logical_length = 10}}, "cache.metric");
  refuses(c.view(), {{.seq = 1, .blocks_to_free = 1, .logical_length = 10}}, "batch[0].seq");
  refuses(c.view(), {{.seq = 0, .blocks_to_free = 1, .logical_length = 10}, {.seq = 0, .blocks_to_free = 1}},
          "batch[1].seq");
  refuses(c.view(), {{.seq = 0, .blocks_to_free = 1}}, "batch[0].logical_length");
}
