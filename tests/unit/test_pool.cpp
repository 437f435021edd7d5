// Pooling (SnapKV eq. 8): max / avg, odd kernels, windows clipped at the ends,
// first_only; and pooling after the global score (Zipage's then<global, pool>).
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

template <class A>
std::vector<float> pooled(const A& a, const std::vector<float>& s, int history = 0, test_cache* cache = nullptr) {
  const int T = static_cast<int>(s.size());
  test_cache local({.block_size = 3, .head_dim = 1, .lengths = {T}});
  test_cache& tc = cache ? *cache : local;
  kvp::pipeline<table_scorer, A, none, none, none> p;
  p.scorer = {s.data()};
  p.aggregate = a;
  p.protect = {.window = 0, .sinks = 0};
  return kvp_test::run(p, tc, {{.seq = 0, .budget = T, .history_tokens = history}}).scores[0];
}

void check_vec(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
  }
}

const std::vector<float> s7{1, 5, 2, 0, 3, 4, 0};

}  // namespace

TEST_CASE("pool: max, kernel 3 and 5, clipped at the ends") {
  using agg::pool_mode;
  check_vec(pooled(agg::pool{.mode = pool_mode::max, .kernel = 3}, s7), {5, 5, 5, 3, 4, 4, 4});
  check_vec(pooled(agg::pool{.mode = pool_mode::max, .kernel = 5}, s7), {5, 5, 5, 5, 4, 4, 4});
  check_vec(pooled(agg::pool{.mode = pool_mode::max, .kernel = 7}, s7), {5, 5, 5, 5, 5, 4, 4});
  check_vec(pooled(agg::pool{.mode = pool_mode::max, .kernel = 1}, s7), {1, 5, 2, 0, 3, 4, 0});
  // A kernel wider than the row: every window is the whole row.
  check_vec(pooled(agg::pool{.mode = pool_mode::max, .kernel = 9}, {1, 3, 2}), {3, 3, 3});
}

TEST_CASE("pool: avg divides by the clipped count") {
  using agg::pool_mode;
  check_vec(pooled(agg::pool{.mode = pool_mode::avg, .kernel = 3}, s7),
            {6.0 / 2, 8.0 / 3, 7.0 / 3, 5.0 / 3, 7.0 / 3, 7.0 / 3, 4.0 / 2});
  check_vec(pooled(agg::pool{.mode = pool_mode::avg, .kernel = 5}, s7),
            {8.0 / 3, 8.0 / 4, 11.0 / 5, 14.0 / 5, 9.0 / 5, 7.0 / 4, 7.0 / 3});
  check_vec(pooled(agg::pool{.mode = pool_mode::avg, .kernel = 1}, s7), {1, 5, 2, 0, 3, 4, 0});
  check_vec(pooled(agg::pool{.mode = pool_mode::avg, .kernel = 5}, {6}), {6});
}

TEST_CASE("pool: defaults (max, kernel 5, every compression)") {
  const agg::pool p;
  CHECK(p.mode == agg::pool_mode::max);
  CHECK(p.kernel == 5);
  CHECK_FALSE(p.first_only);
  check_vec(pooled(agg::pool{}, s7, 3), {5, 5, 5, 5, 4, 4, 4});
}

TEST_CASE("pool: first_only pools only on a sequence's first compression") {
  const agg::pool p{.mode = agg::pool_mode::max, .kernel = 3, .first_only = true};
  check_vec(pooled(p, s7, 0), {5, 5, 5, 3, 4, 4, 4});
  check_vec(pooled(p, s7, 1), {1, 5, 2, 0, 3, 4, 0});
  check_vec(pooled(p, s7, 7), {1, 5, 2, 0, 3, 4, 0});
}

TEST_CASE("then<global_score, pool>: F stores the unpooled score; pooling follows the combine") {
  using Z = agg::then<agg::global_score, agg::pool>;
  const Z z{{.mode = agg::global_mode::max, .alpha = 0.8f}, {.mode = agg::pool_mode::max, .kernel = 3, .first_only = true}};
  test_cache tc({.block_size = 3, .head_dim = 1, .lengths = {7}});
  // First compression: F <- S, scores pooled.
  check_vec(pooled(z, s7, 0, &tc), {5, 5, 5, 3, 4, 4, 4});
  for (int t = 0; t < 7; ++t) CHECK(tc.f(0, 0, t, 0) == s7[t]);
  // Second: S' = max(0.8 F, S) on the first 4 tokens, no pooling (first_only).
  const std::vector<float> s2{0, 0, 3, 1, 1, 1, 1};
  check_vec(pooled(z, s2, 4, &tc), {0.8, 4.0, 3.0, 1.0, 1, 1, 1});
  const std::vector<double> f_after{0.8, 4.0, 3.0, 1.0, 1, 1, 1};
  for (int t = 0; t < 7; ++t) CHECK(tc.f(0, 0, t, 0) == doctest::Approx(f_after[t]));
  // Without first_only the second round is pooled too (after the combine).
  Z z2 = z;
  z2.second.first_only = false;
  for (int t = 0; t < 7; ++t) tc.f(0, 0, t, 0) = s7[t];
  check_vec(pooled(z2, s2, 4, &tc), {4.0, 4.0, 4.0, 3.0, 1, 1, 1});
}

TEST_CASE("pool: clipped at the end of the candidates (R-KV scorer), not of the sequence") {
  std::mt19937 rng(3);
  for (int iter = 0; iter < 100; ++iter) {
    const int w = 1 + iter % 3, T = w + 1 + iter % 9;
    test_cache tc({.block_size = 4, .head_dim = 3, .lengths = {T}, .q_heads = 2, .window = w,
                   .seed = static_cast<std::uint32_t>(iter)});
    kvp::pipeline<kvp::scorer::window_attention, agg::pool, none, none, none> p;
    p.scorer = {.window = w, .group = kvp::group_reduce::max_logits, .keys_before_window = true};
    p.aggregate = {.mode = iter % 2 ? agg::pool_mode::avg : agg::pool_mode::max, .kernel = 1 + 2 * (iter % 4)};
    p.protect = {.window = 0, .sinks = 0};
    const auto got = kvp_test::run(p, tc, {{.seq = 0, .budget = T}}).scores[0];
    std::vector<float> q;
    for (int j = 0; j < w; ++j)
      for (int g = 0; g < 2; ++g) {
        const auto r = tc.query(0, 0, j, g);
        q.insert(q.end(), r.begin(), r.end());
      }
    kvp_test::ref::attention_params rp;
    rp.window = w;
    rp.group = kvp_test::ref::group_op::max_logits;
    rp.keys_before_window = true;
    const auto want = kvp_test::ref::pool(kvp_test::ref::window_scores(tc.keys(0, 0, 0), q, T, 3, 2, rp),
                                          p.aggregate.kernel, p.aggregate.mode == agg::pool_mode::max);
    REQUIRE(static_cast<int>(want.size()) == T - w);
    for (int t = 0; t < T - w; ++t) CHECK(got[t] == doctest::Approx(want[t]).epsilon(1e-5));
  }
}
