// Global score (G-KV, Zipage alg. 2) and accumulate (KV-Compress eq. 20, H2O):
// SPEC.md "Aggregators". Scores are set by hand through a table scorer.
#include <doctest/doctest.h>

#include <vector>

#include "support/reference.hpp"
#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::table_scorer;
using kvp_test::test_cache;
namespace agg = kvp::aggregate;

namespace {

test_cache one_row(int T, int b = 2) {
  return test_cache({.block_size = b, .head_dim = 1, .lengths = {T}, .seed = 5});
}

struct outcome {
  std::vector<float> scores;  // final, after protect {0, 0}
  std::vector<float> f;       // F of tokens [0, T) after the call
};

// Runs score(table) -> A, no selection, no layout, on seq 0.
template <class A>
outcome run_aggregate(const A& a, test_cache& tc, const std::vector<float>& s, int history) {
  kvp::pipeline<table_scorer, A, none, none, none> p;
  p.scorer = {s.data()};
  p.aggregate = a;
  p.protect = {.window = 0, .sinks = 0};
  const int T = tc.length(0);
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = T, .history_tokens = history}});
  outcome o{res.scores[0], {}};
  for (int t = 0; t < T; ++t) o.f.push_back(tc.f(0, 0, t, 0));
  return o;
}

void check_vec(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
  }
}

}  // namespace

TEST_CASE("global score: first compression stores F <- S and leaves S") {
  test_cache tc = one_row(4);
  const std::vector<float> s{0.3f, 0.9f, 0.1f, 0.5f};
  const auto o = run_aggregate(agg::global_score{}, tc, s, 0);
  check_vec(o.scores, {0.3, 0.9, 0.1, 0.5});
  check_vec(o.f, {0.3, 0.9, 0.1, 0.5});
}

TEST_CASE("global score: max / sum / mean modes, alpha, only the first history_tokens") {
  const std::vector<float> s{0.3f, 0.9f, 0.1f, 0.5f};
  const std::vector<float> f{1.0f, 0.5f, 7.0f, 7.0f};  // tokens 2, 3 have no history
  auto run = [&](agg::global_score a) {
    test_cache tc = one_row(4);
    for (int t = 0; t < 4; ++t) tc.f(0, 0, t, 0) = f[t];
    const auto o = run_aggregate(a, tc, s, 2);
    CHECK(o.f == o.scores);  // F <- S
    return o.scores;
  };
  using agg::global_mode;
  // max, alpha 0.8 (default): max(0.8 F, S).
  check_vec(run({}), {0.8, 0.9, 0.1, 0.5});
  check_vec(run({.mode = global_mode::max, .alpha = 0.8f}), {0.8, 0.9, 0.1, 0.5});
  // sum: alpha F + S.
  check_vec(run({.mode = global_mode::sum, .alpha = 0.8f}), {1.1, 1.3, 0.1, 0.5});
  // mean: alpha F + (1 - alpha) S.
  check_vec(run({.mode = global_mode::mean, .alpha = 0.8f}), {0.8 + 0.2 * 0.3, 0.4 + 0.2 * 0.9, 0.1, 0.5});
  // alpha 0.5, max: max(0.5, 0.3), max(0.25, 0.9).
  check_vec(run({.mode = global_mode::max, .alpha = 0.5f}), {0.5, 0.9, 0.1, 0.5});
  // alpha 0.25, sum.
  check_vec(run({.mode = global_mode::sum, .alpha = 0.25f}), {0.55, 1.025, 0.1, 0.5});
}

TEST_CASE("global score: max_norm divides S by its per-head max before combining") {
  const std::vector<float> s{0.3f, 0.9f, 0.1f, 0.5f};
  test_cache tc = one_row(4);
  tc.f(0, 0, 0, 0) = 1.0f;
  tc.f(0, 0, 1, 0) = 0.5f;
  // S / 0.9 = (1/3, 1, 1/9, 5/9); then max(0.8 F, S) on tokens 0, 1.
  const auto o = run_aggregate(agg::global_score{.max_norm = true}, tc, s, 2);
  check_vec(o.scores, {0.8, 1.0, 1.0 / 9, 5.0 / 9});
  check_vec(o.f, {0.8, 1.0, 1.0 / 9, 5.0 / 9});
  // First compression: only the normalisation.
  test_cache tc2 = one_row(4);
  check_vec(run_aggregate(agg::global_score{.max_norm = true}, tc2, s, 0).scores, {1.0 / 3, 1.0, 1.0 / 9, 5.0 / 9});
  // Per head: two KV heads normalise separately.
  test_cache tc3({.block_size = 2, .kv_heads = 2, .head_dim = 1, .lengths = {2}});
  kvp::pipeline<kvp_test::first_element_scorer, agg::global_score, none, none, none> p;
  p.aggregate.max_norm = true;
  p.protect = {.window = 0, .sinks = 0};
  tc3.set_key(0, 0, 0, 0, {2.0f});
  tc3.set_key(0, 0, 1, 0, {4.0f});
  tc3.set_key(0, 0, 0, 1, {1.0f});
  tc3.set_key(0, 0, 1, 1, {0.25f});
  const auto res = kvp_test::run(p, tc3, {{.seq = 0, .budget = 2}});
  check_vec(res.scores[0], {0.5, 1.0, 1.0, 0.25});
}

TEST_CASE("accumulate: S <- F + S on tokens with history, F <- S") {
  const std::vector<float> s{0.3f, 0.9f, 0.1f, 0.5f};
  test_cache tc = one_row(4);
  for (int t = 0; t < 4; ++t) tc.f(0, 0, t, 0) = static_cast<float>(t + 1);
  const auto o = run_aggregate(agg::accumulate{}, tc, s, 3);
  check_vec(o.scores, {1.3, 2.9, 3.1, 0.5});
  check_vec(o.f, {1.3, 2.9, 3.1, 0.5});
  // History 0: F <- S.
  test_cache tc2 = one_row(4);
  check_vec(run_aggregate(agg::accumulate{}, tc2, s, 0).f, {0.3, 0.9, 0.1, 0.5});
  // History T: every token.
  test_cache tc3 = one_row(4);
  tc3.fill_f(1.0f);
  check_vec(run_aggregate(agg::accumulate{}, tc3, s, 4).scores, {1.3, 1.9, 1.1, 1.5});
}

TEST_CASE("global score: F moves with its token through compaction, then serves the next round") {
  // T = 6 in blocks of 2 (shuffled); keep 3 of S = (.5 .1 .9 .2 .7 .3): tokens 0, 2, 4.
  test_cache tc = one_row(6, 2);
  const std::vector<float> s1{0.5f, 0.1f, 0.9f, 0.2f, 0.7f, 0.3f};
  kvp::pipeline<table_scorer, agg::global_score, none, kvp::select::top_k, kvp::layout::compact> p;
  p.protect = {.window = 0, .sinks = 0};
  p.scorer = {s1.data()};
  const auto before = tc.take_snapshot();
  auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 3}});
  CHECK(res.new_lengths[0] == 3);
  CHECK(res.keep_masks[0] == std::vector<std::uint8_t>{1, 0, 1, 0, 1, 0});
  CHECK(res.released_blocks[0] == std::vector<int>{tc.block(0, 2)});
  check_vec({tc.f(0, 0, 0, 0), tc.f(0, 0, 1, 0), tc.f(0, 0, 2, 0)}, {0.5, 0.9, 0.7});
  const int kept[3] = {0, 2, 4};
  for (int i = 0; i < 3; ++i) {
    CHECK(tc.token_bytes(kvp_test::kv_kind::k, 0, 0, i, 0) == tc.token_bytes(before, kvp_test::kv_kind::k, 0, 0, kept[i], 0));
    CHECK(tc.token_bytes(kvp_test::kv_kind::v, 0, 0, i, 0) == tc.token_bytes(before, kvp_test::kv_kind::v, 0, 0, kept[i], 0));
  }

  // The engine appends two tokens (reusing the released block) and compresses again
  // with history_tokens = 3: S = (.1 .2 .3 .4 .6) -> max(0.8 F, S) on 0..2
  // = (.4 .72 .56 .4 .6): keep tokens 1, 2, 4 (ties: none).
  tc.set_length(0, 5);
  tc.randomize_tokens(0, 3, 5);
  const std::vector<float> s2{0.1f, 0.2f, 0.3f, 0.4f, 0.6f};
  p.scorer = {s2.data()};
  res = kvp_test::run(p, tc, {{.seq = 0, .budget = 3, .history_tokens = 3}});
  CHECK(res.keep_masks[0] == std::vector<std::uint8_t>{0, 1, 1, 0, 1});
  check_vec({res.scores[0][0], res.scores[0][1], res.scores[0][2], res.scores[0][3], res.scores[0][4]},
            {0.4, 0.72, 0.56, 0.4, 0.6});
  check_vec({tc.f(0, 0, 0, 0), tc.f(0, 0, 1, 0), tc.f(0, 0, 2, 0)}, {0.72, 0.56, 0.6});
  CHECK(res.released_blocks[0] == std::vector<int>{tc.block(0, 2)});
}

TEST_CASE("global score with the R-KV scorer: non-candidates get no history") {
  test_cache tc({.block_size = 2, .head_dim = 2, .lengths = {6}, .window = 2, .seed = 9});
  kvp::pipeline<kvp::scorer::window_attention, agg::global_score, none, none, none> p;
  p.scorer = {.window = 2, .keys_before_window = true};
  p.protect = {.window = 2, .sinks = 0};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 6}});
  for (int t = 0; t < 4; ++t) CHECK(tc.f(0, 0, t, 0) == res.scores[0][t]);
  CHECK(tc.f(0, 0, 4, 0) == 0.0f);
  CHECK(tc.f(0, 0, 5, 0) == 0.0f);
}

TEST_CASE("global score: random rows against the reference") {
  std::mt19937 rng(77);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::uniform_real_distribution<float> u(0.0f, 2.0f);
  for (int iter = 0; iter < 200; ++iter) {
    const int T = pick(1, 12), history = pick(0, T);
    test_cache tc({.block_size = pick(1, 4), .head_dim = 1, .lengths = {T}, .seed = static_cast<std::uint32_t>(iter),
                   .f_lo = 0.0f, .f_hi = 2.0f});
    std::vector<float> s(static_cast<std::size_t>(T));
    for (float& x : s) x = u(rng);
    std::vector<double> f0;
    for (int t = 0; t < T; ++t) f0.push_back(tc.f(0, 0, t, 0));
    const agg::global_score a{.mode = static_cast<agg::global_mode>(pick(0, 2)), .alpha = u(rng) / 2,
                              .max_norm = pick(0, 1) == 1};
    const auto o = run_aggregate(a, tc, s, history);
    const auto [want_s, want_f] =
        kvp_test::ref::global_score(std::vector<double>(s.begin(), s.end()), f0, history,
                                    static_cast<kvp_test::ref::global_op>(a.mode), a.alpha, a.max_norm);
    for (int t = 0; t < T; ++t) {
      CHECK(o.scores[t] == doctest::Approx(want_s[t]).epsilon(1e-5));
      CHECK(o.f[t] == doctest::Approx(want_f[t]).epsilon(1e-5));
    }
  }
}
