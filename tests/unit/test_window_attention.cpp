// Window attention (SnapKV / Zipage C.2 / G-KV / R-KV) and squared attention
// (KV-Compress L2): SPEC.md "Scorers", checked on hand-computed cases with d = 1
// and against an independent double-precision reference on random inputs.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "support/reference.hpp"
#include "support/test_cache.hpp"

using kvp::none;
using kvp_test::test_cache;
namespace ref = kvp_test::ref;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

// Final scores (after protect {0, 0}) of every (layer, KV head) row of seq 0, with
// nothing after the scorer: `[layer][head][T]`.
template <class S>
std::vector<float> scores_of(const S& scorer, test_cache& tc, int seq = 0, int slot = 0) {
  kvp::pipeline<S, none, none, none, none> p;
  p.scorer = scorer;
  p.protect = {.window = 0, .sinks = 0};
  const auto res = kvp_test::run(p, tc, {{.seq = seq, .query_slot = slot, .budget = tc.length(seq)}});
  REQUIRE(res.scores.size() == 1);
  CHECK(res.new_lengths[0] == tc.length(seq));
  return res.scores[0];
}

void check_close(const std::vector<float>& got, const std::vector<double>& want, std::size_t offset = 0) {
  for (std::size_t t = 0; t < want.size(); ++t) {
    CAPTURE(t);
    CHECK(got[offset + t] == doctest::Approx(want[t]).epsilon(1e-5));
  }
}

// A one-sequence, d = 1 cache: keys k_t, queries set by the caller.
test_cache tiny(int T, int G, int w, int d = 1) {
  return test_cache({.block_size = 2, .head_dim = d, .lengths = {T}, .q_heads = G, .window = w, .randomize = false});
}

}  // namespace

TEST_CASE("window attention: group reduce max / mean / sum / max_logits by hand") {
  // T = 2 keys k = (1, -1); w = 1 query per head; G = 2 query heads of one KV head.
  // Head 0: q = ln3 / 2 -> logits (ln3/2, -ln3/2) -> probabilities (3/4, 1/4).
  // Head 1: q = 0       -> logits (0, 0)         -> probabilities (1/2, 1/2).
  test_cache tc = tiny(2, 2, 1);
  tc.set_key(0, 0, 0, 0, {1.0f});
  tc.set_key(0, 0, 1, 0, {-1.0f});
  tc.set_query(0, 0, 0, 0, {std::log(3.0f) / 2});
  tc.set_query(0, 0, 0, 1, {0.0f});
  using kvp::group_reduce;
  kvp::scorer::window_attention s{.window = 1};

  s.group = group_reduce::max;
  check_close(scores_of(s, tc), {0.75, 0.5});
  s.group = group_reduce::mean;
  check_close(scores_of(s, tc), {0.625, 0.375});
  s.group = group_reduce::sum;
  check_close(scores_of(s, tc), {1.25, 0.75});
  // max_logits: max over the group of the raw logits (ln3/2, 0), then one softmax:
  // (sqrt3 / (1 + sqrt3), 1 / (1 + sqrt3)), which is not the max of the probabilities.
  s.group = group_reduce::max_logits;
  const auto ml = scores_of(s, tc);
  const double r3 = std::sqrt(3.0);
  check_close(ml, {r3 / (1 + r3), 1 / (1 + r3)});
  CHECK(ml[0] < 0.74f);  // max of probabilities would give 0.75
  CHECK(ml[1] > 0.36f);  // ... and 0.5 here: the two differ
}

TEST_CASE("window attention: logits are scaled by 1/sqrt(d)") {
  // d = 4: q = (ln3, 0, 0, 0), k = (+-1, 0, 0, 0): logits +-ln3/2 -> (3/4, 1/4).
  test_cache tc = tiny(2, 1, 1, 4);
  tc.set_key(0, 0, 0, 0, {1.0f, 0.0f, 0.0f, 0.0f});
  tc.set_key(0, 0, 1, 0, {-1.0f, 0.0f, 0.0f, 0.0f});
  tc.set_query(0, 0, 0, 0, {std::log(3.0f), 0.0f, 0.0f, 0.0f});
  check_close(scores_of(kvp::scorer::window_attention{.window = 1}, tc), {0.75, 0.25});
}

TEST_CASE("window attention: causal mask inside the window, window reduce mean / sum") {
  // T = 3 equal keys, w = 2: the query at position 1 sees keys {0, 1} (1/2 each), the
  // query at position 2 sees all three (1/3 each).
  test_cache tc = tiny(3, 1, 2);
  using kvp::window_reduce;
  kvp::scorer::window_attention s{.window = 2, .reduce = window_reduce::mean};
  check_close(scores_of(s, tc), {5.0 / 12, 5.0 / 12, 1.0 / 6});
  s.reduce = window_reduce::sum;
  check_close(scores_of(s, tc), {5.0 / 6, 5.0 / 6, 1.0 / 3});
  s.causal = false;
  check_close(scores_of(s, tc), {2.0 / 3, 2.0 / 3, 2.0 / 3});
  s.reduce = window_reduce::mean;
  check_close(scores_of(s, tc), {1.0 / 3, 1.0 / 3, 1.0 / 3});
}

TEST_CASE("window attention: the slot's newest queries are the window") {
  // The buffer holds 4 queries; a scorer window of 2 uses entries 2 and 3.
  test_cache tc = tiny(3, 1, 4);
  tc.set_key(0, 0, 0, 0, {1.0f});
  tc.set_key(0, 0, 1, 0, {-1.0f});
  tc.set_key(0, 0, 2, 0, {0.0f});
  tc.set_query(0, 0, 0, 0, {50.0f});
  tc.set_query(0, 0, 1, 0, {-50.0f});
  tc.set_query(0, 0, 2, 0, {0.0f});  // position 1: sees keys 0, 1 -> 1/2, 1/2
  tc.set_query(0, 0, 3, 0, {0.0f});  // position 2: 1/3 each
  check_close(scores_of(kvp::scorer::window_attention{.window = 2}, tc), {5.0 / 12, 5.0 / 12, 1.0 / 6});
}

TEST_CASE("window attention: the right slot, layer and GQA group") {
  // Two layers, two KV heads, G = 2, two slots; only (layer 1, slot 1, heads 2 and 3)
  // are set to something other than zero, for KV head 1.
  test_cache tc({.layers = 2, .block_size = 2, .kv_heads = 2, .head_dim = 1, .lengths = {2, 2}, .q_heads = 4,
                 .window = 1, .randomize = false});
  for (int h = 0; h < 2; ++h) {
    tc.set_key(1, 1, 0, h, {1.0f});
    tc.set_key(1, 1, 1, h, {-1.0f});
  }
  tc.set_query(1, 1, 0, 2, {std::log(3.0f) / 2});   // KV head 1, g = 0: (3/4, 1/4)
  tc.set_query(1, 1, 0, 3, {-std::log(3.0f) / 2});  // KV head 1, g = 1: (1/4, 3/4)
  const auto s = scores_of(kvp::scorer::window_attention{.window = 1, .group = kvp::group_reduce::max}, tc, 1, 1);
  // [layer][head][T]
  check_close(s, {0.5, 0.5}, kvp_test::result_index(0, 0, 0, 2, 2));
  check_close(s, {0.5, 0.5}, kvp_test::result_index(0, 1, 0, 2, 2));
  check_close(s, {0.5, 0.5}, kvp_test::result_index(1, 0, 0, 2, 2));
  check_close(s, {0.75, 0.75}, kvp_test::result_index(1, 1, 0, 2, 2));
}

TEST_CASE("window attention, R-KV variant: keys before the window only") {
  // T = 5, w = 2: candidates are keys 0..2, softmax over them only.
  // q = 1, k = (0, ln2, ln3, *, *): probabilities (1, 2, 3) / 6 for both queries.
  test_cache tc = tiny(5, 1, 2);
  const float k[5] = {0.0f, std::log(2.0f), std::log(3.0f), 4.0f, -3.0f};
  for (int t = 0; t < 5; ++t) tc.set_key(0, 0, t, 0, {k[t]});
  tc.set_query(0, 0, 0, 0, {1.0f});
  tc.set_query(0, 0, 1, 0, {1.0f});
  const kvp::scorer::window_attention s{.window = 2, .keys_before_window = true};
  CHECK(s.key_end(5) == 3);
  const auto a = scores_of(s, tc);
  check_close(a, {1.0 / 6, 2.0 / 6, 3.0 / 6});
  CHECK(a[3] == inf);  // not candidates: kept as they are
  CHECK(a[4] == inf);
  // Changing a window key changes no score.
  tc.set_key(0, 0, 3, 0, {-40.0f});
  tc.set_key(0, 0, 4, 0, {25.0f});
  CHECK(scores_of(s, tc) == a);
  // Without the variant the window keys take part in the softmax.
  const auto full = scores_of(kvp::scorer::window_attention{.window = 2}, tc);
  CHECK(full[0] != a[0]);
}

TEST_CASE("squared attention: probabilities squared, summed; excluded distance") {
  // T = 4 equal keys, w = 2: the query at position 2 sees keys 0..2 (1/3 each), the
  // query at 3 sees all four (1/4 each).
  test_cache tc = tiny(4, 1, 2);
  kvp::scorer::squared_attention s{.window = 2, .group = kvp::group_reduce::sum, .reduce = kvp::window_reduce::sum};
  const double a = 1.0 / 9, b = 1.0 / 16;
  check_close(scores_of(s, tc), {a + b, a + b, a + b, b});
  // v = 2: the query at 2 adds only to key 0 (distance 2); the query at 3 to keys 0, 1.
  s.excluded_distance = 2;
  check_close(scores_of(s, tc), {a + b, b, 0, 0});
  // v = 1: each query skips itself.
  s.excluded_distance = 1;
  check_close(scores_of(s, tc), {a + b, a + b, b, 0});
}

TEST_CASE("squared attention: group sum over G query heads") {
  // G = 2, w = 1, T = 2, k = (1, -1); heads give (3/4, 1/4) and (1/2, 1/2):
  // squared and summed: (9/16 + 1/4, 1/16 + 1/4).
  test_cache tc = tiny(2, 2, 1);
  tc.set_key(0, 0, 0, 0, {1.0f});
  tc.set_key(0, 0, 1, 0, {-1.0f});
  tc.set_query(0, 0, 0, 0, {std::log(3.0f) / 2});
  tc.set_query(0, 0, 0, 1, {0.0f});
  check_close(scores_of(kvp::scorer::squared_attention{.window = 1}, tc), {9.0 / 16 + 0.25, 1.0 / 16 + 0.25});
}

TEST_CASE("h2o scorer: window attention summed over the window") {
  const kvp::scorer::h2o h;
  CHECK(h.window == 16);
  CHECK(h.reduce == kvp::window_reduce::sum);
  CHECK(h.causal);
  CHECK_FALSE(h.keys_before_window);
  kvp::scorer::h2o small;
  small.window = 2;
  test_cache tc = tiny(3, 1, 2);
  check_close(scores_of(small, tc), {5.0 / 6, 5.0 / 6, 1.0 / 3});
}

TEST_CASE("window / squared attention match the reference on random inputs") {
  std::mt19937 rng(1234);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int cases = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const int H = pick(1, 2), G = pick(1, 3), d = pick(1, 5), w = pick(1, 4), T = pick(w, 14);
    const auto type = kvp_test::all_dtypes[pick(0, 2)];
    const auto qtype = kvp_test::all_dtypes[pick(0, 2)];
    test_cache tc({.layers = 2, .block_size = pick(1, 5), .kv_heads = H, .head_dim = d, .type = type,
                   .lengths = {pick(1, 9), T}, .csr = pick(0, 1) == 1, .layout = kvp_test::all_layouts[pick(0, kvp_test::layout_count - 1)],
                   .q_heads = H * G, .window = w + pick(0, 2), .slots = 3, .q_type = qtype,
                   .seed = static_cast<std::uint32_t>(iter)});
    CAPTURE(tc.describe());
    const int slot = pick(0, 2), layer = pick(0, 1);
    ref::attention_params rp;
    rp.window = w;
    rp.group = static_cast<ref::group_op>(pick(0, 3));
    rp.reduce = static_cast<ref::window_op>(pick(0, 1));
    rp.causal = pick(0, 1) == 1;
    std::vector<float> got;
    const bool squared = pick(0, 3) == 0;
    if (squared) {
      rp.squared = true;
      rp.excluded_distance = pick(0, 3);
      const kvp::scorer::squared_attention s{.window = w,
                                             .group = static_cast<kvp::group_reduce>(rp.group),
                                             .reduce = static_cast<kvp::window_reduce>(rp.reduce),
                                             .causal = rp.causal,
                                             .excluded_distance = rp.excluded_distance};
      kvp::pipeline<kvp::scorer::squared_attention, none, none, none, none> p;
      p.scorer = s;
      p.protect = {.window = 0, .sinks = 0};
      got = kvp_test::run(p, tc, {{.seq = 1, .query_slot = slot, .budget = 1}}, layer, 1).scores[0];
    } else {
      rp.keys_before_window = pick(0, 2) == 0;
      const kvp::scorer::window_attention s{.window = w,
                                            .group = static_cast<kvp::group_reduce>(rp.group),
                                            .reduce = static_cast<kvp::window_reduce>(rp.reduce),
                                            .causal = rp.causal,
                                            .keys_before_window = rp.keys_before_window};
      kvp::pipeline<kvp::scorer::window_attention, none, none, none, none> p;
      p.scorer = s;
      p.protect = {.window = 0, .sinks = 0};
      got = kvp_test::run(p, tc, {{.seq = 1, .query_slot = slot, .budget = 1}}, layer, 1).scores[0];
    }
    REQUIRE(got.size() == static_cast<std::size_t>(H) * T);
    for (int h = 0; h < H; ++h) {
      std::vector<float> q;
      for (int j = 0; j < w; ++j)
        for (int g = 0; g < G; ++g) {
          const auto row = tc.query(layer, slot, tc.window() - w + j, h * G + g);
          q.insert(q.end(), row.begin(), row.end());
        }
      const auto want = ref::window_scores(tc.keys(layer, 1, h), q, T, d, G, rp);
      for (int t = 0; t < T; ++t) {
        CAPTURE(h);
        CAPTURE(t);
        const float x = got[kvp_test::result_index(0, h, t, H, T)];
        if (t < static_cast<int>(want.size()))
          CHECK(x == doctest::Approx(want[t]).epsilon(1e-4).scale(1.0));
        else
          CHECK(x == inf);
      }
    }
    ++cases;
  }
  CHECK(cases == 400);
}

// The optional visible_end hint lets kernels skip the mask below it: every key under
// it must be visible. For the built-in scorers it is exact: visible(pj, t) holds for
// t < visible_end(pj) and for no other t.
TEST_CASE("window / squared attention: visible_end agrees with visible") {
  const auto check_hint = [](const auto& s, bool causal) {
    for (std::int32_t pj = 0; pj < 40; ++pj) {
      const std::int32_t end = s.visible_end(pj);
      for (std::int32_t t = 0; t < 48; ++t) CHECK_MESSAGE(s.visible(pj, t) == (t < end), "pj ", pj, " t ", t);
      if (causal) CHECK(end == pj + 1);
    }
  };
  for (bool causal : {true, false}) {
    kvp::scorer::window_attention wa;
    wa.causal = causal;
    check_hint(wa, causal);
    kvp::scorer::squared_attention sq;
    sq.causal = causal;
    check_hint(sq, causal);
  }
  check_hint(kvp::scorer::h2o{}, true);
}
