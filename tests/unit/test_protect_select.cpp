// Protect (window, sinks = +inf) and the selectors: uniform top-k with the
// deterministic tie rule, and StreamingLLM's sinks + recent. SPEC.md "Protect",
// "Selectors".
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "support/reference.hpp"
#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::table_scorer;
using kvp_test::test_cache;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float nan_ = std::numeric_limits<float>::quiet_NaN();

using kvp_test::mask;
using kvp_test::mask_of;

// Keep mask of top-k over the table scores, with the given protect.
kvp::host_result top_k_of(const std::vector<float>& s, int k, kvp::protect pr = {.window = 0, .sinks = 0}) {
  const int T = static_cast<int>(s.size());
  test_cache tc({.block_size = 2, .head_dim = 1, .lengths = {T}});
  kvp::pipeline<table_scorer, none, none, kvp::select::top_k, none> p;
  p.scorer = {s.data()};
  p.protect = pr;
  return kvp_test::run(p, tc, {{.seq = 0, .budget = k}});
}

}  // namespace

TEST_CASE("protect: window and sinks get +inf, others keep their score") {
  const std::vector<float> s{0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  const auto res = top_k_of(s, 4, {.window = 2, .sinks = 1});
  CHECK(res.scores[0] == std::vector<float>{inf, 0.2f, 0.3f, 0.4f, inf, inf});
  CHECK(res.keep_masks[0] == mask_of(6, {0, 3, 4, 5}));
  // The protect hook.
  const kvp::protect pr{.window = 2, .sinks = 1};
  CHECK(pr.covers(0, 6));
  CHECK_FALSE(pr.covers(1, 6));
  CHECK_FALSE(pr.covers(3, 6));
  CHECK(pr.covers(4, 6));
  CHECK(pr.covers(5, 6));
  const kvp::protect def;
  CHECK(def.window == 16);
  CHECK(def.sinks == 0);
}

TEST_CASE("protect: a protected token is kept even when its score is the lowest") {
  const std::vector<float> s{-5.0f, 3.0f, 2.0f, 1.0f, -9.0f};
  CHECK(top_k_of(s, 3, {.window = 1, .sinks = 1}).keep_masks[0] == mask_of(5, {0, 1, 4}));
  CHECK(top_k_of(s, 2, {.window = 1, .sinks = 1}).keep_masks[0] == mask_of(5, {0, 4}));
  CHECK(top_k_of(s, 3, {.window = 0, .sinks = 0}).keep_masks[0] == mask_of(5, {1, 2, 3}));
}

TEST_CASE("protect: non-candidates of the R-KV scorer are +inf and kept") {
  test_cache tc({.block_size = 2, .head_dim = 2, .lengths = {7}, .window = 3});
  kvp::pipeline<kvp::scorer::window_attention, none, none, kvp::select::top_k, none> p;
  p.scorer = {.window = 3, .keys_before_window = true};
  p.protect = {.window = 0, .sinks = 0};  // the candidates alone exclude the window
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 4}});
  for (int t = 4; t < 7; ++t) {
    CHECK(res.scores[0][t] == inf);
    CHECK(res.keep_masks[0][t] == 1);
  }
  for (int t = 0; t < 4; ++t) CHECK(std::isfinite(res.scores[0][t]));
}

TEST_CASE("top-k: keeps the k highest") {
  const std::vector<float> s{0.3f, 0.9f, 0.1f, 0.5f, 0.7f};
  CHECK(top_k_of(s, 1).keep_masks[0] == mask_of(5, {1}));
  CHECK(top_k_of(s, 2).keep_masks[0] == mask_of(5, {1, 4}));
  CHECK(top_k_of(s, 3).keep_masks[0] == mask_of(5, {1, 3, 4}));
  CHECK(top_k_of(s, 5).keep_masks[0] == mask_of(5, {0, 1, 2, 3, 4}));
  CHECK(top_k_of(s, 2).new_lengths[0] == 5);  // layout none: nothing moves
}

TEST_CASE("top-k: equal scores go to the more recent token") {
  const std::vector<float> s{1, 2, 2, 1, 2};
  CHECK(top_k_of(s, 1).keep_masks[0] == mask_of(5, {4}));
  CHECK(top_k_of(s, 2).keep_masks[0] == mask_of(5, {2, 4}));
  CHECK(top_k_of(s, 3).keep_masks[0] == mask_of(5, {1, 2, 4}));
  CHECK(top_k_of(s, 4).keep_masks[0] == mask_of(5, {1, 2, 3, 4}));
  const std::vector<float> zeros(9, 0.0f);
  CHECK(top_k_of(zeros, 3).keep_masks[0] == mask_of(9, {6, 7, 8}));
  // -0 and +0 are equal scores.
  CHECK(top_k_of({0.0f, -0.0f, 0.0f}, 1).keep_masks[0] == mask_of(3, {2}));
  CHECK(top_k_of({0.0f, 0.0f, -0.0f}, 1).keep_masks[0] == mask_of(3, {2}));
  // Protected +inf ties: the protected tokens are all kept, whatever their order.
  CHECK(top_k_of({5, 5, 5, 5, 5, 5}, 3, {.window = 2, .sinks = 1}).keep_masks[0] == mask_of(6, {0, 4, 5}));
}

TEST_CASE("top-k: NaN ranks as -inf; -inf ties go to the more recent") {
  const std::vector<float> s{nan_, 0.5f, -inf, 0.1f};
  CHECK(top_k_of(s, 2).keep_masks[0] == mask_of(4, {1, 3}));
  CHECK(top_k_of(s, 3).keep_masks[0] == mask_of(4, {1, 2, 3}));
  CHECK(kvp::ranks_before(1.0f, 0, 0.5f, 5));
  CHECK(kvp::ranks_before(1.0f, 3, 1.0f, 2));
  CHECK_FALSE(kvp::ranks_before(1.0f, 2, 1.0f, 3));
  CHECK_FALSE(kvp::ranks_before(1.0f, 2, 1.0f, 2));  // irreflexive
  CHECK(kvp::ranks_before(-inf, 1, nan_, 0));
  CHECK(kvp::ranks_before(nan_, 1, -inf, 0));
  CHECK_FALSE(kvp::ranks_before(nan_, 0, -1e30f, 1));
}

TEST_CASE("top-k: random rows agree with an independent stable sort") {
  std::mt19937 rng(5);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int iter = 0; iter < 300; ++iter) {
    const int T = pick(1, 20), k = pick(1, T);
    std::vector<float> s(static_cast<std::size_t>(T));
    for (float& x : s) x = static_cast<float>(pick(0, 4)) * 0.25f;  // many ties
    if (T > 2 && pick(0, 3) == 0) s[pick(0, T - 1)] = nan_;
    const auto want = kvp_test::ref::top_k(s, k);
    mask m(static_cast<std::size_t>(T), 0);
    for (int t : want) m[t] = 1;
    CHECK(top_k_of(s, k).keep_masks[0] == m);
  }
}

TEST_CASE("sinks_recent: keeps the sinks and the most recent tokens") {
  test_cache tc({.block_size = 3, .head_dim = 1, .lengths = {10}});
  kvp::pipeline<none, none, none, kvp::select::sinks_recent, none> p;
  p.select = {.sinks = 2};
  p.protect = {.window = 2, .sinks = 2};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 5}});
  CHECK(res.keep_masks[0] == mask_of(10, {0, 1, 7, 8, 9}));
  const kvp::select::sinks_recent def;
  CHECK(def.sinks == 4);
  CHECK(def.keep_count(10, 6) == 6);
  CHECK(def.rank_key(-3.0f, 2, 10) == std::numeric_limits<float>::max());  // a sink
  CHECK(def.rank_key(100.0f, 7, 10) == 7.0f);                              // recency
  CHECK(def.rank_key(inf, 7, 10) == inf);                                  // protected: first
  CHECK(kvp::ranks_before(def.rank_key(inf, 7, 10), 7, def.rank_key(0.0f, 2, 10), 2));
}

TEST_CASE("sinks_recent equals no scorer + top-k with the sinks protected") {
  std::mt19937 rng(8);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int iter = 0; iter < 200; ++iter) {
    const auto layout = kvp_test::all_layouts[pick(0, kvp_test::layout_count - 1)];
    const auto type = kvp_test::all_dtypes[pick(0, 2)];
    const int T = pick(1, 20), b = pick(1, 5), H = pick(1, 2);
    const int sinks = pick(0, 3), window = pick(0, std::min(T, 4));
    const int must = std::min(T, std::min(sinks, T - window) + window);
    const int budget = pick(std::max(1, must), T);
    const bool csr = pick(0, 1) == 1;
    auto make = [&] {
      return test_cache({.layers = 2, .block_size = b, .kv_heads = H, .head_dim = 2, .type = type, .lengths = {T, 3},
                         .csr = csr, .layout = layout, .seed = static_cast<std::uint32_t>(iter)});
    };
    test_cache a = make(), c = make();
    CAPTURE(a.describe());
    kvp::pipeline<none, none, none, kvp::select::sinks_recent, kvp::layout::compact> p1;
    p1.select = {.sinks = sinks};
    p1.protect = {.window = window, .sinks = sinks};
    kvp::pipeline<none, none, none, kvp::select::top_k, kvp::layout::compact> p2;
    p2.protect = {.window = window, .sinks = sinks};
    const auto r1 = kvp_test::run(p1, a, {{.seq = 0, .budget = budget}});
    const auto r2 = kvp_test::run(p2, c, {{.seq = 0, .budget = budget}});
    CHECK(r1.keep_masks == r2.keep_masks);
    CHECK(r1.new_lengths == r2.new_lengths);
    CHECK(r1.released_blocks == r2.released_blocks);
    CHECK(a.take_snapshot().buffers == c.take_snapshot().buffers);
    // Which tokens: the first min(sinks, budget) and the most recent rest.
    mask m(static_cast<std::size_t>(T), 0);
    const int head = std::min(sinks, budget);
    for (int t = 0; t < head; ++t) m[t] = 1;
    for (int t = T - (budget - head); t < T; ++t) m[t] = 1;
    for (int row = 0; row < 2 * H; ++row)
      CHECK(mask(r1.keep_masks[0].begin() + row * T, r1.keep_masks[0].begin() + (row + 1) * T) == m);
  }
}

TEST_CASE("sinks_recent keeps every protected token, whatever its own sinks") {
  // protect.sinks = 3 but the selector's sinks = 1: tokens 1 and 2 are protected
  // (SPEC: window and sink tokens are always kept) and must survive.
  test_cache tc({.block_size = 3, .head_dim = 1, .lengths = {10}});
  kvp::pipeline<none, none, none, kvp::select::sinks_recent, none> p;
  p.select = {.sinks = 1};
  p.protect = {.window = 2, .sinks = 3};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 6}});
  const auto& m = res.keep_masks[0];
  for (int t : {0, 1, 2, 8, 9}) {
    CAPTURE(t);
    CHECK(m[t] == 1);
  }
  int kept = 0;
  for (auto x : m) kept += x;
  CHECK(kept == 6);
  // The selector's sinks exceed protect's and the budget is tight: protect {sinks 1,
  // window 3}, selector sinks 4, budget 4: the protected 0, 7, 8, 9 are kept, the
  // selector's unprotected sinks 1..3 give way.
  p.select = {.sinks = 4};
  p.protect = {.window = 3, .sinks = 1};
  CHECK(kvp_test::run(p, tc, {{.seq = 0, .budget = 4}}).keep_masks[0] == mask_of(10, {0, 7, 8, 9}));
  // Two more slots go to the selector's sinks before recency (equal keys: the more
  // recent sinks 3 and 2 first).
  CHECK(kvp_test::run(p, tc, {{.seq = 0, .budget = 6}}).keep_masks[0] == mask_of(10, {0, 2, 3, 7, 8, 9}));
}
