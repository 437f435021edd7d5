// KV-Compress's head-adaptive, block-granular schedule (SPEC.md "Head-adaptive top-k";
// kv-compress.txt 4.2.2; select/head_adaptive_blocks.hpp) and its squared-attention
// metric (4.3; scorer/squared_attention_metric.hpp): the cost rule, the budget
// conversions and the metric worked by hand, then random properties against an
// independent reference. Host only: no pipeline runs through kvp_test::run.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvpolicy/core/error.hpp"
#include "kvpolicy/scorer/squared_attention_metric.hpp"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

using kvp::select::head_adaptive_blocks;
using hab_row = kvp::select::head_adaptive_blocks::row;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

std::vector<hab_row> rows_of(const std::vector<std::vector<float>>& m,
                             const std::vector<std::vector<std::int32_t>>& pos = {}) {
  std::vector<hab_row> r;
  for (std::size_t i = 0; i < m.size(); ++i) r.push_back({m[i], pos.empty() ? std::span<const std::int32_t>{} : pos[i]});
  return r;
}

head_adaptive_blocks::schedule plan(const head_adaptive_blocks& p, const std::vector<std::vector<float>>& m,
                                    int kv_heads, int b, std::vector<std::int64_t> asked,
                                    const std::vector<std::vector<std::int32_t>>& pos = {}, int logical_length = -1) {
  const auto rows = rows_of(m, pos);
  return p.plan(rows, kv_heads, b, asked, logical_length);
}

template <class F>
void expect_error(F&& f, const std::string& field) {
  try {
    f();
    FAIL("no error for ", field);
  } catch (const kvp::error& e) {
    CHECK(e.field() == field);
  }
}

}  // namespace

TEST_CASE("head_adaptive_blocks: the partial last block is evicted first, with only its hanging tokens") {
  // b 4, T 10: blocks of 4, 4, 2; hanging 2. Metrics by slot; ascending order of the
  // slots: 7 (0.1), 2 (0.2), 9 (0.3), 0 (0.4), 5 (0.5), 3 (0.6), 8 (0.7), 1 (0.8), 6 (0.9), 4 (1.0).
  const std::vector<std::vector<float>> m{{0.4f, 0.8f, 0.2f, 0.6f, 1.0f, 0.5f, 0.9f, 0.1f, 0.7f, 0.3f}};
  const head_adaptive_blocks p{.protected_window = 0};
  CHECK(head_adaptive_blocks::hanging(10, 4) == 2);
  CHECK(head_adaptive_blocks::hanging(8, 4) == 4);
  auto s = plan(p, m, 1, 4, {1});
  CHECK(s.rows[0].blocks == 1);
  CHECK(s.rows[0].evicted == 2);  // (1 - 1) * 4 + 2
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{7, 2});
  s = plan(p, m, 1, 4, {2});
  CHECK(s.rows[0].evicted == 6);  // (2 - 1) * 4 + 2
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{7, 2, 9, 0, 5, 3});
  s = plan(p, m, 1, 4, {5});  // only 3 blocks held
  CHECK(s.rows[0].blocks == 3);
  CHECK(s.rows[0].evicted == 10);
  CHECK(s.freed == std::vector<std::int64_t>{3});
  s = plan(p, m, 1, 4, {0});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.rows[0].evicted == 0);
  CHECK(s.rows[0].slots.empty());
}

TEST_CASE("head_adaptive_blocks: blocks go to the cheapest cost across heads (cost = metric at (e - 1) b + hanging - 1)") {
  // b 2, one layer, two heads.
  // Head 0, T 5 (hanging 1): ascending 1 (t1), 2 (t3), 3 (t4), 4 (t2), 5 (t0);
  //   costs e1 = sorted[0] = 1, e2 = sorted[2] = 3, e3 = sorted[4] = 5.
  // Head 1, T 4 (hanging 2): ascending 0.2 (t3), 0.5 (t0), 2.5 (t1), 6 (t2);
  //   costs e1 = sorted[1] = 0.5, e2 = sorted[3] = 6.
  // Ranked: (0.5, h1 e1), (1, h0 e1), (3, h0 e2), (5, h0 e3), (6, h1 e2).
  const std::vector<std::vector<float>> m{{5, 1, 4, 2, 3}, {0.5f, 2.5f, 6, 0.2f}};
  const head_adaptive_blocks p{.protected_window = 0};
  auto s = plan(p, m, 2, 2, {1});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.rows[1].blocks == 1);
  CHECK(s.rows[1].slots == std::vector<std::int32_t>{3, 0});
  s = plan(p, m, 2, 2, {3});
  CHECK(s.rows[0].blocks == 2);
  CHECK(s.rows[0].evicted == 3);  // (2 - 1) * 2 + 1
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{1, 3, 4});
  CHECK(s.rows[1].blocks == 1);
  CHECK(s.rows[1].evicted == 2);
  CHECK(s.freed == std::vector<std::int64_t>{3});
  s = plan(p, m, 2, 2, {4});
  CHECK(s.rows[0].blocks == 3);
  CHECK(s.rows[1].blocks == 1);
  s = plan(p, m, 2, 2, {5});
  CHECK(s.rows[0].evicted == 5);
  CHECK(s.rows[1].evicted == 4);
}

TEST_CASE("head_adaptive_blocks: ties go to the older token within a head and to the lower (layer, head) across heads") {
  const head_adaptive_blocks p{.protected_window = 0};
  // Equal metrics: the older tokens first.
  auto s = plan(p, {{1, 1, 1, 1, 1, 1}}, 1, 2, {2});
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{0, 1, 2, 3});
  // With positions: slot 3 holds position 0, slot 2 position 1, ...: the older positions first.
  s = plan(p, {{1, 1, 1, 1}}, 1, 2, {1}, {{3, 2, 1, 0}}, 4);
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{3, 2});
  // Equal costs in two layers x two heads: the lower row first, then its next block
  // only when it ranks before the others' first blocks (it does not: same cost, higher e).
  const std::vector<std::vector<float>> same{{2, 2, 2, 2}, {2, 2, 2, 2}, {2, 2, 2, 2}, {2, 2, 2, 2}};
  s = plan(p, same, 2, 2, {3});
  CHECK(s.rows[0].blocks == 2);  // (2, row 0, e1), (2, row 0, e2), (2, row 1, e1): row before e
  CHECK(s.rows[1].blocks == 1);
  CHECK(s.rows[2].blocks == 0);
  CHECK(s.rows[3].blocks == 0);
  // The ranking reads the cost, not the other metrics of the block: row 1 costs 1 < 2.
  s = plan(p, {{0, 2, 2, 2}, {1, 1, 5, 5}}, 2, 2, {1});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.rows[1].blocks == 1);
  // -0 and +0 are one cost: the lower row wins.
  s = plan(p, {{0.0f, 0.0f}, {-0.0f, -0.0f}}, 2, 2, {1});
  CHECK(s.rows[0].blocks == 1);
}

TEST_CASE("head_adaptive_blocks: NaN ranks as -inf, +inf stays evictable but last") {
  const head_adaptive_blocks p{.protected_window = 0};
  const float nan = std::nanf("");
  // Row 1's NaN makes its first block (hanging 1) cost -inf: it goes first.
  auto s = plan(p, {{0.1f, 0.2f, 0.3f}, {5, nan, 7}}, 2, 2, {1});
  CHECK(s.rows[1].blocks == 1);
  CHECK(s.nonfinite == 1);
  // One block of hanging 1 in a row of 3 (b 2): the NaN slot is evicted first.
  s = plan(p, {{3, nan, 1}}, 1, 2, {1});
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{1});
  // An unprotected +inf is evictable, after every finite metric.
  s = plan(p, {{inf, 1, 2, inf}}, 1, 2, {1});
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{1, 2});
  s = plan(p, {{inf, 1, 2, inf}}, 1, 2, {2});
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{1, 2, 0, 3});
  CHECK(s.nonfinite == 2);
}

TEST_CASE("head_adaptive_blocks: sinks and the protected window are never evicted") {
  // b 4, T 12, window 4, sinks 2: evictable positions 2..7 (6 tokens), hanging 4, so one
  // block; the protected tokens have the lowest metrics and are still never reached.
  const head_adaptive_blocks p{.protected_window = 4, .sinks = 2};
  std::vector<float> m{-9, -9, 0.6f, 0.2f, 0.5f, 0.1f, 0.4f, 0.3f, -9, -9, -9, -9};
  CHECK(head_adaptive_blocks::max_blocks(6, 12, 4) == 1);
  auto s = plan(p, {m}, 1, 4, {3});
  CHECK(s.freed == std::vector<std::int64_t>{1});
  CHECK(s.rows[0].evicted == 4);
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{5, 3, 7, 6});
  // Protection reads positions, not slots: a compressed row whose slots hold positions
  // 0, 30, 5, 28, 12, 31, 9, 2 of a 32-token sequence. Window 4 protects 28..31, sinks 2
  // protect 0: evictable slots 2 (5), 4 (12), 6 (9), 7 (2).
  const std::vector<std::vector<std::int32_t>> pos{{0, 30, 5, 28, 12, 31, 9, 2}};
  s = plan(p, {{0, 0, 3, 0, 1, 0, 4, 2}}, 1, 2, {9}, pos, 32);
  CHECK(s.rows[0].blocks == 2);  // hanging 2: 2 + 2 tokens
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{4, 7, 2, 6});
}

TEST_CASE("head_adaptive_blocks: a head with fewer evictable tokens than its next block frees nothing more") {
  const head_adaptive_blocks p{.protected_window = 5};
  // T 6, b 4: hanging 2, evictable 1 < 2: nothing.
  CHECK(head_adaptive_blocks::max_blocks(1, 6, 4) == 0);
  auto s = plan(p, {{0, 0, 0, 0, 0, 0}}, 1, 4, {1});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.freed == std::vector<std::int64_t>{0});
  // T 8, b 4: hanging 4, evictable 3 < 4: nothing, while the cheap head beside it frees
  // all its possible blocks (T 9, hanging 1, evictable 4: blocks 1 (1 token) and 2 (5 > 4: no)).
  s = plan(p, {{1, 1, 1, 1, 1, 1, 1, 1}, {9, 9, 9, 9, 9, 9, 9, 9, 9}}, 2, 4, {4});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.rows[1].blocks == 1);
  CHECK(s.rows[1].evicted == 1);
  CHECK(s.freed == std::vector<std::int64_t>{1});
  // T 6, window 3, b 4: hanging 2 <= evictable 3: one block; the next needs 6.
  const head_adaptive_blocks q{.protected_window = 3};
  s = plan(q, {{5, 4, 3, 2, 1, 0}}, 1, 4, {2});
  CHECK(s.rows[0].blocks == 1);
  CHECK(s.rows[0].slots == std::vector<std::int32_t>{2, 1});
  // Empty rows hold no blocks.
  s = plan(q, {{}, {1, 2, 3, 4, 5, 6, 7, 8}}, 2, 4, {1});
  CHECK(s.rows[0].blocks == 0);
  CHECK(s.rows[1].blocks == 1);
}

TEST_CASE("head_adaptive_blocks: a per-layer budget spends each layer's count on its own heads") {
  const head_adaptive_blocks p{.protected_window = 0, .budget = kvp::select::block_budget::layer};
  // Layer 0 is expensive, layer 1 cheap; each frees its own count.
  const std::vector<std::vector<float>> m{{9, 8}, {7, 6}, {1, 2}, {0, 3}};
  auto s = plan(p, m, 2, 2, {1, 2});
  CHECK(s.rows[0].blocks + s.rows[1].blocks == 1);
  CHECK(s.rows[1].blocks == 1);  // cost 7 < 9
  CHECK(s.rows[2].blocks + s.rows[3].blocks == 2);
  CHECK(s.freed == std::vector<std::int64_t>{1, 2});
  // The same rows with one count for the sequence: the cheap layer first.
  const head_adaptive_blocks seq{.protected_window = 0};
  s = plan(seq, m, 2, 2, {2});
  CHECK(s.rows[2].blocks == 1);
  CHECK(s.rows[3].blocks == 1);
  CHECK(s.rows[0].blocks + s.rows[1].blocks == 0);
}

TEST_CASE("head_adaptive_blocks: its errors name the field") {
  const head_adaptive_blocks p;
  const std::vector<std::vector<float>> m{{1, 2}, {3, 4}};
  expect_error([&] { plan(p, m, 2, 0, {1}); }, "block_size");
  expect_error([&] { plan(p, m, 3, 2, {1}); }, "rows");
  expect_error([&] { plan(p, m, 2, 2, {1, 1}); }, "blocks_to_free");
  expect_error([&] { plan(p, m, 2, 2, {-1}); }, "blocks_to_free[0]");
  expect_error([&] { plan(p, m, 2, 2, {1}, {{0, 1}, {0, 1}}); }, "logical_length");
  expect_error([&] { plan(p, m, 2, 2, {1}, {{0, 1}, {0}}, 4); }, "rows[1].positions");
  expect_error([&] { plan(p, m, 2, 2, {1}, {{0, 1}, {0, 4}}, 4); }, "rows[1].positions[1]");
  expect_error([&] { plan(head_adaptive_blocks{.protected_window = -1}, m, 2, 2, {1}); },
               "pipeline.select.protected_window");
  expect_error([&] { plan(head_adaptive_blocks{.sinks = -2}, m, 2, 2, {1}); }, "pipeline.select.sinks");
}

TEST_CASE("head_adaptive_blocks: blocks to free from a token budget or a compression rate, rounded as the authors do") {
  using kvp::select::blocks_to_free_for_rate;
  using kvp::select::blocks_to_free_for_tokens;
  // 4 rows, b 4, 40 blocks held. 10 tokens per row round up to 3 blocks: 12 kept, 28 freed.
  CHECK(blocks_to_free_for_tokens(40, 10, 4, 4) == 28);
  CHECK(blocks_to_free_for_tokens(40, 12, 4, 4) == 28);
  CHECK(blocks_to_free_for_tokens(40, 13, 4, 4) == 24);  // 4 blocks per row
  CHECK(blocks_to_free_for_tokens(10, 13, 4, 4) == 0);   // under budget
  CHECK(blocks_to_free_for_tokens(40, -1, 4, 4) == 0);   // no budget
  CHECK(blocks_to_free_for_tokens(40, 0, 4, 4) == 40);
  // Rate 0.5, 100 positions, 4 rows, b 16, window 20: P = 32, C = 68,
  // target = ceil(68 * 4 * 0.5) + 32 * 4 = 136 + 128 = 264; 400 held: 136 over -> 9 blocks (8.5 up).
  CHECK(blocks_to_free_for_rate(400, 100, 0.5, 4, 16, 20) == 9);
  CHECK(blocks_to_free_for_rate(264, 100, 0.5, 4, 16, 20) == 0);
  CHECK(blocks_to_free_for_rate(265, 100, 0.5, 4, 16, 20) == 1);
  CHECK(blocks_to_free_for_rate(400, 32, 0.5, 4, 16, 20) == 0);  // nothing outside the window
  CHECK(blocks_to_free_for_rate(400, 100, 1.0, 4, 16, 20) == 0);
  // ceil of the fractional target: C 3 x 1 row x 0.5 = 1.5 -> 2; P 0.
  CHECK(blocks_to_free_for_rate(3, 3, 0.5, 1, 1, 0) == 1);
  // The token budget feeds the schedule: 2 rows of 8 tokens (b 2: 8 blocks), 2 tokens per row -> free 6.
  const std::int64_t n = blocks_to_free_for_tokens(8, 2, 2, 2);
  CHECK(n == 6);
  const auto s = plan(head_adaptive_blocks{.protected_window = 0}, {{1, 2, 3, 4, 5, 6, 7, 8}, {8, 7, 6, 5, 4, 3, 2, 1}},
                      2, 2, {n});
  CHECK(s.freed == std::vector<std::int64_t>{6});
  CHECK(s.rows[0].evicted + s.rows[1].evicted == 12);
}

// ---------------------------------------------------------------------------
// The metric
// ---------------------------------------------------------------------------

namespace {

// Independent reference in double: per query head, the squared causal softmax summed
// over the queries, then max-pooled (kernel k, clipped), then summed over the group;
// pool_after = true pools the group sum instead (scorer::squared_attention + pool).
std::vector<double> reference_metric(const std::vector<float>& q, const std::vector<float>& k, int n, int G, int d,
                                     int T, int kernel, int v, bool pool_after = false) {
  std::vector<std::vector<double>> head(G, std::vector<double>(T, 0.0));
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < n; ++j) {
      const int pj = T - n + j;
      std::vector<double> z(pj + 1);
      double mx = -1e300, sum = 0;
      for (int t = 0; t <= pj; ++t) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += double(q[(j * G + g) * d + i]) * k[t * d + i];
        z[t] = dot / std::sqrt(double(d));
        mx = std::max(mx, z[t]);
      }
      for (double& x : z) sum += (x = std::exp(x - mx));
      for (int t = 0; t <= pj; ++t)
        if (pj - t >= v) head[g][t] += (z[t] / sum) * (z[t] / sum);
    }
  const auto pool = [&](const std::vector<double>& r) {
    std::vector<double> o(T);
    for (int t = 0; t < T; ++t) {
      o[t] = -1e300;
      for (int u = std::max(0, t - kernel / 2); u <= std::min(T - 1, t + kernel / 2); ++u) o[t] = std::max(o[t], r[u]);
    }
    return o;
  };
  std::vector<double> out(T, 0.0);
  if (pool_after) {
    std::vector<double> sum(T, 0.0);
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < T; ++t) sum[t] += head[g][t];
    return pool(sum);
  }
  for (int g = 0; g < G; ++g) {
    const auto p = pool(head[g]);
    for (int t = 0; t < T; ++t) out[t] += p[t];
  }
  return out;
}

}  // namespace

TEST_CASE("squared_attention_metric: prefill by hand (G 2, w 2, d 2, T 5)") {
  const int G = 2, d = 2, T = 5, n = 2;
  std::vector<float> out(T);
  // Zero queries: uniform softmax. Query 0 sits at position 3 (p = 1/4 on keys 0..3),
  // query 1 at 4 (p = 1/5 on 0..4): per head 1/16 + 1/25 = 0.1025 on keys 0..3, 0.04 on
  // key 4; kernel 7 covers some key <= 3 from every key: 0.1025 everywhere, x G 2.
  const std::vector<float> zero_q(n * G * d, 0.0f);
  std::vector<float> keys(T * d);
  for (int i = 0; i < T * d; ++i) keys[i] = 0.25f * float(i % 7) - 0.5f;
  kvp::scorer::squared_attention_metric m{.window = n};
  m.prefill(zero_q, keys, G, d, out);
  for (int t = 0; t < T; ++t) CHECK(out[t] == doctest::Approx(2 * 0.1025).epsilon(1e-6));
  // No pooling and excluded distance 1: query at 3 adds to keys 0..2, query at 4 to 0..3.
  m.pool_kernel = 1;
  m.excluded_distance = 1;
  m.prefill(zero_q, keys, G, d, out);
  const double want[] = {0.205, 0.205, 0.205, 2 * 0.04, 0.0};
  for (int t = 0; t < T; ++t) CHECK(out[t] == doctest::Approx(want[t]).epsilon(1e-6));

  // Head 0 looks at key 0, head 1 at key 2: pooling each head before the group sum
  // (kernel 3) differs from pooling the sum.
  const std::vector<float> q{4, 0, 0, 4,   // query 0 (position 3): head 0, head 1
                             4, 0, 0, 4};  // query 1 (position 4)
  const std::vector<float> k{2, 0, 0, 0, 0, 2, 0, 0, 0, 0};
  m = {.window = 2, .pool_kernel = 3};
  m.prefill(q, k, G, d, out);
  const auto before = reference_metric(q, k, n, G, d, T, 3, 0);
  const auto after = reference_metric(q, k, n, G, d, T, 3, 0, true);
  bool differs = false;
  for (int t = 0; t < T; ++t) {
    CHECK(out[t] == doctest::Approx(before[t]).epsilon(1e-5));
    differs |= std::abs(before[t] - after[t]) > 1e-3;
  }
  CHECK(differs);
  // By hand, a = e^(8 / sqrt 2): head 0's logit is 8 / sqrt 2 on key 0 and 0 elsewhere,
  // head 1's the same on key 2. Query 0 sees keys 0..3, query 1 keys 0..4, so a head's
  // peak key gets big = (a / (a + 3))^2 + (a / (a + 4))^2 and its other keys 0..3
  // small = (1 / (a + 3))^2 + (1 / (a + 4))^2. The pool of key 1 (keys 0..2) takes each
  // head's peak: 2 big; pooling the group sum would give big + small.
  const double a = std::exp(8 / std::sqrt(2.0));
  const double big = std::pow(a / (a + 3), 2) + std::pow(a / (a + 4), 2);
  const double small = std::pow(1 / (a + 3), 2) + std::pow(1 / (a + 4), 2);
  CHECK(out[1] == doctest::Approx(2 * big).epsilon(1e-5));
  CHECK(after[1] == doctest::Approx(big + small).epsilon(1e-5));
  CHECK(out[4] == doctest::Approx(2 * small).epsilon(1e-5));  // keys 3..4: neither peak
  // Default kernel 7 against the reference, and the error when w does not match.
  m = {.window = 2};
  m.prefill(q, k, G, d, out);
  const auto k7 = reference_metric(q, k, n, G, d, T, 7, 0);
  for (int t = 0; t < T; ++t) CHECK(out[t] == doctest::Approx(k7[t]).epsilon(1e-5));
  m.window = 3;
  expect_error([&] { m.prefill(q, k, G, d, out); }, "queries");
  m.window = 2;
  m.pool_kernel = 4;
  expect_error([&] { m.prefill(q, k, G, d, out); }, "pipeline.scorer.pool_kernel");
}

TEST_CASE("squared_attention_metric: decode adds each new query's squared probabilities, summed over the group") {
  const int G = 2, d = 2, T = 4;
  std::vector<float> keys{1, 0, 0, 1, -1, 0, 0.5f, 0.5f};
  // Zero queries: 1/4 per key per head: += 2 / 16.
  std::vector<float> metric{1, 2, 3, 4};
  kvp::scorer::squared_attention_metric m;
  m.decode(std::vector<float>(G * d, 0.0f), keys, G, d, metric);
  for (int t = 0; t < T; ++t) CHECK(metric[t] == doctest::Approx(t + 1 + 0.125).epsilon(1e-6));
  // Excluded distance 2 at the query's position 3: keys 0 and 1 only.
  m.excluded_distance = 2;
  metric = {0, 0, 0, 0};
  m.decode(std::vector<float>(G * d, 0.0f), keys, G, d, metric);
  CHECK(metric == std::vector<float>{0.125f, 0.125f, 0, 0});
  // With positions (a compressed row) and an explicit query position 10: only key
  // position 9 is closer than 2 to it.
  metric = {0, 0, 0, 0};
  m.decode(std::vector<float>(G * d, 0.0f), keys, G, d, metric, 10, std::vector<std::int32_t>{2, 9, 5, 8});
  CHECK(metric == std::vector<float>{0.125f, 0, 0.125f, 0.125f});
  // A real query against an independent computation.
  m.excluded_distance = 0;
  const std::vector<float> q{1.5f, -0.5f, 0.25f, 2};
  metric = {0, 0, 0, 0};
  m.decode(q, keys, G, d, metric);
  for (int t = 0; t < T; ++t) {
    double want = 0;
    for (int g = 0; g < G; ++g) {
      double z[T], mx = -1e300, sum = 0;
      for (int u = 0; u < T; ++u) {
        z[u] = (double(q[g * d]) * keys[u * d] + double(q[g * d + 1]) * keys[u * d + 1]) / std::sqrt(2.0);
        mx = std::max(mx, z[u]);
      }
      for (double& x : z) sum += (x = std::exp(x - mx));
      want += (z[t] / sum) * (z[t] / sum);
    }
    CHECK(metric[t] == doctest::Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("squared_attention_metric: random prefills against the reference") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int round = 0; round < 40; ++round) {
    const int G = 1 + int(rng() % 4), d = 1 + int(rng() % 8), T = 1 + int(rng() % 40);
    const int w = 1 + int(rng() % 12), kernel = 1 + 2 * int(rng() % 4), v = int(rng() % 3);
    const int n = std::min(w, T);
    std::vector<float> q(n * G * d), k(T * d), out(T);
    for (float& x : q) x = nd(rng);
    for (float& x : k) x = nd(rng);
    const kvp::scorer::squared_attention_metric m{.window = w, .pool_kernel = kernel, .excluded_distance = v};
    m.prefill(q, k, G, d, out);
    const auto want = reference_metric(q, k, n, G, d, T, kernel, v);
    for (int t = 0; t < T; ++t) CHECK(out[t] == doctest::Approx(want[t]).epsilon(1e-4).scale(1e-6));
  }
}

// ---------------------------------------------------------------------------
// Random properties of the schedule
// ---------------------------------------------------------------------------

TEST_CASE("head_adaptive_blocks: random sequences against an independent reference") {
  std::mt19937 rng(31);
  const float nan = std::nanf("");
  // NaN as -inf for the reference's comparisons.
  const auto key = [](float x) { return std::isnan(x) ? -double(inf) : double(x); };
  for (int round = 0; round < 400; ++round) {
    const int layers = 1 + int(rng() % 3), kv_heads = 1 + int(rng() % 4), n_rows = layers * kv_heads;
    const int bs[] = {1, 2, 4, 16};
    const int b = bs[rng() % 4];
    const bool per_layer = rng() % 3 == 0;
    const bool with_positions = rng() % 3 == 0;
    const head_adaptive_blocks p{.protected_window = int(rng() % 21),
                                 .sinks = int(rng() % 4),
                                 .budget = per_layer ? kvp::select::block_budget::layer
                                                     : kvp::select::block_budget::sequence};
    const int logical = 1 + int(rng() % 80);
    std::vector<std::vector<float>> m(n_rows);
    std::vector<std::vector<std::int32_t>> pos;
    for (int r = 0; r < n_rows; ++r) {
      const int T = with_positions ? int(rng() % (logical + 1)) : logical;
      m[r].resize(T);
      for (float& x : m[r]) {
        const unsigned c = rng() % 50;
        x = c == 0 ? nan : c == 1 ? inf : c == 2 ? -inf : float(rng() % 8) * 0.25f;  // many ties
      }
      if (with_positions) {
        std::vector<std::int32_t> all(logical);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        all.resize(T);
        pos.push_back(all);
      }
    }
    const int groups = per_layer ? layers : 1;
    std::vector<std::int64_t> asked(groups);
    for (auto& a : asked) a = int(rng() % (n_rows * (logical / b + 2) / groups + 2));
    const auto s = plan(p, m, kv_heads, b, asked, pos, with_positions ? logical : -1);
    INFO("round ", round, " b ", b, " layers ", layers, " heads ", kv_heads, " window ", p.protected_window,
         " sinks ", p.sinks, " per_layer ", per_layer, " positions ", with_positions);

    // The reference: each row's evictable tokens sorted by (metric, NaN as -inf; position),
    // its possible blocks' costs, then per group the first `asked` of (cost, row, e).
    std::vector<std::vector<std::int32_t>> order(n_rows);
    std::vector<std::tuple<double, int, int>> blocks;
    std::vector<int> want_blocks(n_rows, 0);
    std::vector<std::int64_t> want_freed(groups, 0);
    std::int64_t nonfinite = 0;
    for (int r = 0; r < n_rows; ++r) {
      const int T = int(m[r].size());
      const auto position = [&](int t) { return with_positions ? pos[r][t] : t; };
      for (int t = 0; t < T; ++t) {
        nonfinite += !std::isfinite(m[r][t]);
        const int ps = position(t);
        if (ps >= p.sinks && ps < logical - p.protected_window) order[r].push_back(t);
      }
      std::sort(order[r].begin(), order[r].end(), [&](int a, int c) {
        return key(m[r][a]) != key(m[r][c]) ? key(m[r][a]) < key(m[r][c]) : position(a) < position(c);
      });
      const int hanging = T % b == 0 ? b : T % b, held = (T + b - 1) / b;
      for (int e = 1; e <= held && (e - 1) * b + hanging <= int(order[r].size()); ++e)
        blocks.emplace_back(key(m[r][order[r][(e - 1) * b + hanging - 1]]), r, e);
    }
    CHECK(s.nonfinite == nonfinite);
    for (int g = 0; g < groups; ++g) {
      std::vector<std::tuple<double, int, int>> mine;
      for (const auto& blk : blocks)
        if (std::get<1>(blk) / (n_rows / groups) == g) mine.push_back(blk);
      std::sort(mine.begin(), mine.end());
      want_freed[g] = std::min<std::int64_t>(asked[g], std::int64_t(mine.size()));
      for (std::int64_t i = 0; i < want_freed[g]; ++i) ++want_blocks[std::get<1>(mine[i])];
    }
    CHECK(s.freed == want_freed);  // as asked whenever the group has that many possible blocks

    for (int r = 0; r < n_rows; ++r) {
      const int T = int(m[r].size()), hanging = T % b == 0 ? b : T % b;
      const auto& e = s.rows[r];
      CHECK(e.blocks == want_blocks[r]);
      CHECK(e.evicted == (e.blocks == 0 ? 0 : (e.blocks - 1) * b + hanging));
      CHECK(int(e.slots.size()) == e.evicted);
      if (e.blocks > 0) CHECK((T - e.evicted) % b == 0);
      // A prefix of the row's ascending order: nothing protected, no slot twice.
      CHECK(std::vector<std::int32_t>(order[r].begin(), order[r].begin() + e.evicted) == e.slots);
      CHECK(std::set<std::int32_t>(e.slots.begin(), e.slots.end()).size() == e.slots.size());
      for (std::int32_t t : e.slots) {
        const int ps = with_positions ? pos[r][t] : t;
        CHECK(ps >= p.sinks);
        CHECK(ps < logical - p.protected_window);
      }
    }
  }
}
