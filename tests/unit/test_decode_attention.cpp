// host::decode_attention (the law of the CUDA decode attention): a hand-computed case,
// then random caches of every kind against a naive formula over the same tokens read
// straight from the test's arrays, then the refusals (nothing written).
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "support/decode_case.hpp"

namespace {

using i32 = std::int32_t;

// One layer, one sequence, one KV head of G 2, d 2, blocks of 2: tokens t0 t1 in
// block 1, t2 in block 0. K = [1 0], [0 1], [1 1]; V = [1 2], [3 4], [5 6].
struct hand_case {
  std::vector<float> k = {1, 1, 0, 0, 1, 0, 0, 1};  // block 0: t2, (free); block 1: t0, t1
  std::vector<float> v = {5, 6, 0, 0, 1, 2, 3, 4};
  std::vector<float> metric = std::vector<float>(4, 0.0f);
  std::vector<i32> table = {1, 0}, lengths = {3};
  // q0 = [ln 2, 0]: logits ln2, 0, ln2, p = .4 .2 .4; q1 = [0, ln 3]: p = 1/7, 3/7, 3/7.
  std::vector<float> q = {std::log(2.0f), 0.0f, 0.0f, std::log(3.0f)};
  std::vector<float> out = std::vector<float>(4, -1.0f);

  kvp::per_head_kv_view view() {
    kvp::per_head_kv_view c;
    c.num_layers = 1, c.num_blocks = 2, c.block_size = 2, c.num_kv_heads = 1, c.head_dim = 2, c.num_seqs = 1;
    c.max_blocks = 2, c.type = kvp::dtype::f32;
    c.k = {k.data(), 0, nullptr, 0};
    c.v = {v.data(), 0, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(2, 2);
    c.table = kvp::per_head_array::dense(table.data(), 1, 1, 2);
    c.lengths = kvp::per_head_array::dense(lengths.data(), 1, 1);
    c.metric = kvp::per_slot_metric::shared(metric.data(), 2);
    return c;
  }
  kvp::decode_rows queries() { return kvp::decode_rows::contiguous(q.data(), 2, 2, kvp::dtype::f32); }
  kvp::decode_rows output() { return kvp::decode_rows::contiguous(out.data(), 2, 2, kvp::dtype::f32); }
};

}  // namespace

TEST_CASE("decode attention (host): a hand-computed case, its squared and plain metric, the excluded distance") {
  hand_case hc;
  kvp::decode_batch batch{.num_items = 1};
  kvp::host::decode_attention(hc.view(), hc.queries(), hc.output(), 1.0f, batch, {.kind = kvp::decode_metric::squared});
  CHECK(hc.out[0] == doctest::Approx(0.4 * 1 + 0.2 * 3 + 0.4 * 5));
  CHECK(hc.out[1] == doctest::Approx(0.4 * 2 + 0.2 * 4 + 0.4 * 6));
  CHECK(hc.out[2] == doctest::Approx(25.0 / 7));
  CHECK(hc.out[3] == doctest::Approx(32.0 / 7));
  // Slots: t0 = block 1 slot 0 (index 2), t1 = index 3, t2 = block 0 slot 0 (index 0).
  CHECK(hc.metric[2] == doctest::Approx(0.16 + 1.0 / 49));
  CHECK(hc.metric[3] == doctest::Approx(0.04 + 9.0 / 49));
  CHECK(hc.metric[0] == doctest::Approx(0.16 + 9.0 / 49));
  CHECK(hc.metric[1] == 0.0f);  // a free slot

  hand_case plain;
  kvp::host::decode_attention(plain.view(), plain.queries(), plain.output(), 1.0f, batch,
                              {.kind = kvp::decode_metric::probability, .excluded_distance = 1});
  CHECK(plain.metric[2] == doctest::Approx(0.4 + 1.0 / 7));
  CHECK(plain.metric[3] == doctest::Approx(0.2 + 3.0 / 7));
  CHECK(plain.metric[0] == 0.0f);  // t2 is the query's own position: 2 - 2 < 1

  // The scale multiplies the logits: scale 2 on q / 2 is the same attention.
  hand_case halved;
  for (auto& x : halved.q) x /= 2;
  kvp::host::decode_attention(halved.view(), halved.queries(), halved.output(), 2.0f, batch);
  for (std::size_t i = 0; i < 4; ++i) CHECK(halved.out[i] == doctest::Approx(hc.out[i]));
  CHECK(halved.metric == std::vector<float>(4, 0.0f));  // no epilogue: nothing written
}

namespace {

// The naive formula: softmax over the head's attended tokens of scale * q . k, in
// double, tokens read from the case's arrays by index (not through the views).
struct naive_head {
  std::vector<double> out;        // [G][d]
  std::vector<double> sums;       // per attended token: sum over g of p (or p^2)
  std::vector<std::size_t> slot;  // its metric slot
};

naive_head naive(const kvp_test::decode_case& dc, const std::vector<std::size_t>& k_rows,
                 const std::vector<std::size_t>& slots, const std::vector<std::byte>& K,
                 const std::vector<std::byte>& V, i32 seq, i32 h, float scale, bool squared) {
  naive_head r;
  r.out.assign(static_cast<std::size_t>(dc.G) * dc.d, 0.0);
  r.sums.assign(k_rows.size(), 0.0);
  r.slot = slots;
  for (i32 g = 0; g < dc.G; ++g) {
    std::vector<double> z(k_rows.size());
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t j = 0; j < k_rows.size(); ++j) {
      double dot = 0;
      for (i32 i = 0; i < dc.d; ++i)
        dot +=
            double(kvp::load_as_float(dc.q.data(), dc.type, (std::int64_t{seq} * dc.h_q() + h * dc.G + g) * dc.d + i)) *
            kvp::load_as_float(K.data(), dc.type, static_cast<std::int64_t>(k_rows[j]) * dc.d + i);
      z[j] = dot * scale;
      m = std::max(m, z[j]);
    }
    double s = 0;
    for (auto& x : z) s += (x = std::exp(x - m));
    for (std::size_t j = 0; j < k_rows.size(); ++j) {
      const double p = z[j] / s;
      r.sums[j] += squared ? p * p : p;
      for (i32 i = 0; i < dc.d; ++i)
        r.out[static_cast<std::size_t>(g) * dc.d + i] +=
            p * kvp::load_as_float(V.data(), dc.type, static_cast<std::int64_t>(k_rows[j]) * dc.d + i);
    }
  }
  return r;
}

void check_head(const kvp_test::decode_case& dc, const naive_head& want, const std::vector<double>& exact, i32 item,
                i32 h, const std::vector<float>& metric, const std::vector<float>& metric0) {
  for (i32 g = 0; g < dc.G; ++g)
    for (i32 i = 0; i < dc.d; ++i)
      CHECK(exact[(static_cast<std::size_t>(item) * dc.h_q() + h * dc.G + g) * dc.d + i] ==
            doctest::Approx(want.out[static_cast<std::size_t>(g) * dc.d + i]).epsilon(1e-9));
  for (std::size_t j = 0; j < want.slot.size(); ++j)
    CHECK(metric[want.slot[j]] == doctest::Approx(metric0[want.slot[j]] + want.sums[j]).epsilon(1e-6));
}

}  // namespace

TEST_CASE("decode attention (host): per-head, counts, live and plain paged caches against the naive formula") {
  for (kvp::dtype t : {kvp::dtype::f32, kvp::dtype::bf16}) {
    kvp_test::decode_case dc;
    dc.type = t, dc.d = 8, dc.G = 3, dc.max_len = 60, dc.b = 4, dc.seed = 7;
    dc.build();
    CAPTURE(kvp::name_of(t));
    const std::vector<i32> items = {2, 0};
    const kvp::decode_batch batch{.seqs = items.data(), .num_items = 2, .layer = dc.layer};
    const float scale = 0.3f;
    std::vector<std::byte> out(items.size() * static_cast<std::size_t>(dc.h_q()) * dc.d * dc.es());
    // The queries are [seqs, h_q, d]; item i reads sequence items[i]'s: pass them in item order.
    std::vector<std::byte> qi;
    for (i32 s : items)
      qi.insert(qi.end(), dc.q.begin() + static_cast<std::ptrdiff_t>(s) * dc.h_q() * dc.d * dc.es(),
                dc.q.begin() + static_cast<std::ptrdiff_t>(s + 1) * dc.h_q() * dc.d * dc.es());
    const auto qv = kvp::decode_rows::contiguous(qi.data(), dc.h_q(), dc.d, t);
    const auto ov = kvp::decode_rows::contiguous(out.data(), dc.h_q(), dc.d, t);
    std::vector<double> exact(out.size() / dc.es());

    SUBCASE("per-head cache, squared metric") {
      std::vector<float> metric = dc.ph_metric;
      const auto c =
          dc.per_head(dc.ph_k.data(), dc.ph_v.data(), metric.data(), dc.ph_table.data(), dc.ph_lengths.data());
      kvp::host::decode_attention(c, qv, ov, scale, batch, {.kind = kvp::decode_metric::squared}, exact);
      for (std::size_t it = 0; it < items.size(); ++it)
        for (i32 h = 0; h < dc.heads; ++h) {
          const std::size_t r = (static_cast<std::size_t>(dc.layer) * dc.seqs + items[it]) * dc.heads + h;
          std::vector<std::size_t> rows;
          for (i32 tok = 0; tok < dc.ph_lengths[r]; ++tok)
            rows.push_back(static_cast<std::size_t>(dc.ph_table[r * dc.ph_max_blocks + tok / dc.b]) * dc.b +
                           tok % dc.b);
          check_head(dc, naive(dc, rows, rows, dc.ph_k, dc.ph_v, items[it], h, scale, true), exact,
                     static_cast<i32>(it), h, metric, dc.ph_metric);
        }
    }
    SUBCASE("paged cache: counts, live mask, both, plain, counts and tail; F gets the plain probabilities") {
      for (int mode = 0; mode < 5; ++mode) {
        CAPTURE(mode);
        const bool counts = mode == 0 || mode == 2 || mode == 4, live = mode == 1 || mode == 2, tail = mode == 4;
        std::vector<float> scores = dc.pg_scores;
        std::vector<std::uint8_t> live_bytes = dc.pg_live;
        const auto c = dc.paged(dc.pg_k.data(), dc.pg_v.data(), dc.pg_table.data(), dc.pg_lengths.data(),
                                live ? live_bytes.data() : nullptr);
        const kvp::decode_head_counts hc =
            counts ? dc.counts(dc.pg_counts.data(), tail ? dc.pg_tail.data() : nullptr) : kvp::decode_head_counts{};
        kvp::host::decode_attention(c, hc, qv, ov, scale, batch,
                                    {.kind = kvp::decode_metric::probability, .scores = dc.scores(scores.data())},
                                    exact);
        for (std::size_t it = 0; it < items.size(); ++it)
          for (i32 h = 0; h < dc.heads; ++h) {
            const i32 s = items[it];
            const i32 L = dc.pg_lengths[static_cast<std::size_t>(s)];
            const i32 n = counts ? dc.pg_counts[(static_cast<std::size_t>(dc.layer) * dc.seqs + s) * dc.heads + h] : L;
            const i32 from = tail ? dc.pg_tail[static_cast<std::size_t>(s)] : L;
            std::vector<std::size_t> rows, slots;
            for (i32 tok = 0; tok < L; ++tok) {
              if (tok >= n && tok < from) continue;  // dropped by the compaction, before the tail
              const std::size_t blk =
                  static_cast<std::size_t>(dc.pg_table[static_cast<std::size_t>(s) * dc.pg_max_blocks + tok / dc.b]);
              const std::size_t slot =
                  ((static_cast<std::size_t>(dc.layer) * dc.pg_blocks + blk) * dc.b + tok % dc.b) * dc.heads + h;
              if (live && dc.pg_live[slot] == 0) continue;
              rows.push_back(slot), slots.push_back(slot);
            }
            check_head(dc, naive(dc, rows, slots, dc.pg_k, dc.pg_v, s, h, scale, false), exact, static_cast<i32>(it), h,
                       scores, dc.pg_scores);
          }
      }
    }
  }
}

TEST_CASE("decode attention (host): a head that attends nothing writes zeros and adds nothing") {
  kvp_test::decode_case dc;
  dc.type = kvp::dtype::f32, dc.d = 4, dc.G = 2, dc.min_len = 5, dc.max_len = 9, dc.b = 4, dc.dropped = 1.0;
  dc.build();
  std::vector<float> scores = dc.pg_scores;
  std::vector<float> out(static_cast<std::size_t>(dc.h_q()) * dc.d, -7.0f);
  const auto c = dc.paged(dc.pg_k.data(), dc.pg_v.data(), dc.pg_table.data(), dc.pg_lengths.data(), dc.pg_live.data());
  const std::vector<i32> items = {1};
  kvp::host::decode_attention(c, {},
                              kvp::decode_rows::contiguous(dc.q.data() + dc.h_q() * dc.d * 4, dc.h_q(), dc.d, dc.type),
                              kvp::decode_rows::contiguous(out.data(), dc.h_q(), dc.d, dc.type), 1.0f,
                              {.seqs = items.data(), .num_items = 1, .layer = 1},
                              {.kind = kvp::decode_metric::squared, .scores = dc.scores(scores.data())});
  CHECK(out == std::vector<float>(out.size(), 0.0f));
  CHECK(scores == dc.pg_scores);
}

TEST_CASE("decode attention (host): refusals name the field and write nothing") {
  kvp_test::decode_case dc;
  dc.type = kvp::dtype::f32, dc.d = 4, dc.G = 2, dc.min_len = 1, dc.max_len = 20, dc.b = 4;
  dc.build();
  std::vector<float> metric = dc.ph_metric;
  std::vector<i32> lengths = dc.ph_lengths, table = dc.ph_table, counts = dc.pg_counts;
  std::vector<float> out(static_cast<std::size_t>(dc.seqs) * dc.h_q() * dc.d, -7.0f);
  const std::vector<float> out0 = out;
  const auto q = kvp::decode_rows::contiguous(dc.q.data(), dc.h_q(), dc.d, dc.type);
  const auto o = kvp::decode_rows::contiguous(out.data(), dc.h_q(), dc.d, dc.type);
  const auto c = dc.per_head(dc.ph_k.data(), dc.ph_v.data(), metric.data(), table.data(), lengths.data());
  const kvp::decode_epilogue sq{.kind = kvp::decode_metric::squared};
  auto refused = [&](auto&& call, const char* field) {
    CHECK_THROWS_WITH_AS(call(), doctest::Contains(field), kvp::error);
    CHECK(out == out0);
    CHECK(metric == dc.ph_metric);
  };
  const std::vector<i32> bad_seq = {0, 3};
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.seqs = bad_seq.data(), .num_items = 2}, sq); },
          "batch[1].seq");
  refused([&] { kvp::host::decode_attention(c, q, o, 0.0f, {.num_items = 1}, sq); }, "scale");
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.num_items = 1, .layer = 2}, sq); }, "batch.layer");
  auto q_bad = q;
  q_bad.num_heads = 3;
  refused([&] { kvp::host::decode_attention(c, q_bad, o, 1.0f, {.num_items = 1}, sq); }, "queries.num_heads");
  auto o_bad = o;
  o_bad.type = kvp::dtype::bf16;
  refused([&] { kvp::host::decode_attention(c, q, o_bad, 1.0f, {.num_items = 1}, sq); }, "out.type");
  auto no_metric = c;
  no_metric.metric = {};
  refused([&] { kvp::host::decode_attention(no_metric, q, o, 1.0f, {.num_items = 1}, sq); }, "cache.metric");
  lengths[static_cast<std::size_t>(dc.seqs * dc.heads + 1)] = dc.ph_max_blocks * dc.b + 1;  // layer 1, seq 0, head 1
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.num_items = 1, .layer = 1}, sq); },
          "cache.lengths[layer 1][seq 0][head 1]");
  lengths = dc.ph_lengths;
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.num_items = 1, .max_tokens = 1}, sq); },
          "batch.max_tokens");
  table[0] = dc.ph_blocks;  // layer 0, seq 0, head 0, entry 0
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.num_items = 1}, sq); },
          "cache.table[layer 0][seq 0][head 0][0]");
  std::vector<double> exact(3);
  table = dc.ph_table;
  refused([&] { kvp::host::decode_attention(c, q, o, 1.0f, {.num_items = 1}, sq, exact); }, "exact");
  // Paged: a count over the sequence's length; F missing for the epilogue.
  std::vector<float> scores = dc.pg_scores;
  const auto p = dc.paged(dc.pg_k.data(), dc.pg_v.data(), dc.pg_table.data(), dc.pg_lengths.data());
  counts[1] = dc.pg_lengths[0] + 1;  // layer 0, seq 0, head 1
  refused([&] { kvp::host::decode_attention(p, dc.counts(counts.data()), q, o, 1.0f, {.num_items = 1}); },
          "counts[layer 0][seq 0][head 1]");
  counts = dc.pg_counts;
  std::vector<i32> tail = dc.pg_tail;
  tail[0] = dc.pg_lengths[0] + 1;
  refused([&] { kvp::host::decode_attention(p, dc.counts(counts.data(), tail.data()), q, o, 1.0f, {.num_items = 1}); },
          "counts.tail_from[0]");
  tail[0] = -1;
  refused([&] { kvp::host::decode_attention(p, dc.counts(counts.data(), tail.data()), q, o, 1.0f, {.num_items = 1}); },
          "counts.tail_from[0]");
  refused([&] { kvp::host::decode_attention(p, {}, q, o, 1.0f, {.num_items = 1}, sq); }, "epilogue.scores");
  CHECK(scores == dc.pg_scores);
}
