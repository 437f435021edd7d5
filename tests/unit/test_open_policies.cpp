// Policies written here, in the test file, not in the library: a per-head budget
// selector, score-dependent selectors, a key scorer that reads its head, an
// attention scorer and a layout of the user's own. Each runs through the executors'
// existing stage kinds with no edit under exec/ (the CUDA build of this file runs
// every case on both executors, which must agree). Also: per-head results, the merge
// of layer groups, the rule for non-finite scores. SPEC.md "Selectors",
// "Non-finite values"; docs/extending.md.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>
#include <vector>

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

// Top-k whose count depends on the head: odd KV heads keep the budget, even ones the
// budget plus the layer index (a count known before any score).
struct per_head_top_k : kvp::select::top_k {
  KVP_HOST_DEVICE constexpr std::int32_t keep_count(std::int32_t, std::int32_t k, kvp::head_index h) const noexcept {
    return h.kv_head % 2 == 1 ? k : k + h.layer;
  }
};
static_assert(kvp::BudgetSelector<per_head_top_k> && !kvp::uniform_counts<per_head_top_k>);

// Functions of a row's tokens, as a score-dependent selector hands them to its row.
struct final_score {
  KVP_HOST_DEVICE float operator()(const kvp::row_token& x) const { return x.score; }
};
struct raw_score {
  KVP_HOST_DEVICE float operator()(const kvp::row_token& x) const { return x.raw; }
};
// A finite positive final score, else 0 (protected tokens are +inf).
struct positive_part {
  KVP_HOST_DEVICE float operator()(const kvp::row_token& x) const {
    return x.score > 0.0f && x.score < __builtin_huge_valf() ? x.score : 0.0f;
  }
};

// Top-p over the final scores: the fewest tokens whose positive scores reach `p` of
// all the positive mass. Protected tokens (+inf, weight 0) rank first, so they are
// among the tokens taken.
struct score_top_p {
  float p = 0.5f;
  KVP_HOST_DEVICE float rank_key(float x, std::int32_t, std::int32_t) const noexcept { return x; }
  template <class Row>
  KVP_HOST_DEVICE std::int32_t row_keep_count(const Row& row, std::int32_t) const {
    const float total = row.sum(positive_part{});
    return row.fewest_reaching(final_score{}, positive_part{}, p * total);
  }
};
static_assert(kvp::ScoreDependentSelector<score_top_p> && !kvp::BudgetSelector<score_top_p>);
static_assert(kvp::Selector<score_top_p> && !kvp::uniform_counts<score_top_p>);

// Hard-KV's first step: the count from the scorer's own (raw) scores, ranked by them,
// before pooling changed them; the tokens kept are still the top of the final scores.
struct raw_top_p {
  float p = 0.5f;
  KVP_HOST_DEVICE float rank_key(float x, std::int32_t, std::int32_t) const noexcept { return x; }
  template <class Row>
  KVP_HOST_DEVICE std::int32_t row_keep_count(const Row& row, std::int32_t) const {
    return row.fewest_reaching(raw_score{}, raw_score{}, p * row.sum(raw_score{}));
  }
};

// The tokens among the top `n` by raw score whose final score is also at least the
// row's largest final score minus `margin`: exercises top(), max() and sum() together.
struct agreeing_top {
  std::int32_t n = 3;
  float margin = 1.0f;
  struct in_cut {
    kvp::rank_cut cut;
    float floor;
    KVP_HOST_DEVICE float operator()(const kvp::row_token& x) const {
      return cut.admits(x.raw, x.t) && x.score >= floor ? 1.0f : 0.0f;
    }
  };
  KVP_HOST_DEVICE float rank_key(float x, std::int32_t, std::int32_t) const noexcept { return x; }
  template <class Row>
  KVP_HOST_DEVICE std::int32_t row_keep_count(const Row& row, std::int32_t) const {
    const float best = row.max(final_score{});
    return static_cast<std::int32_t>(row.sum(in_cut{row.top(raw_score{}, n), best - margin}));
  }
};

// A key scorer that reads its head: element 0 of the key, scaled per (layer, head).
struct head_scaled_key {
  KVP_HOST_DEVICE float key_score(kvp::row_ref k, std::int32_t, std::int32_t, kvp::head_index h) const noexcept {
    return k[0] * static_cast<float>(1 + h.kv_head + 2 * h.layer);
  }
};
static_assert(kvp::KeyScorer<head_scaled_key>);

// Squared attention, written by hand on window attention's hooks (KV-Compress's L2
// metric with an excluded distance of 2): must equal the library's squared_attention.
struct hand_squared_attention : kvp::scorer::window_attention {
  KVP_HOST_DEVICE constexpr float transform(float p) const noexcept { return p * p; }
  KVP_HOST_DEVICE constexpr bool contributes(std::int32_t pj, std::int32_t t) const noexcept { return pj - t >= 2; }
};
static_assert(kvp::AttentionScorer<hand_squared_attention>);

// A layout of the user's own with compact's contract (destination(i) <= the i-th kept
// token's position): the executors move tokens for it as for layout::compact.
struct front_packing {
  static constexpr bool moves_tokens = true;
  KVP_HOST_DEVICE constexpr std::int32_t destination(std::int32_t kept_index) const noexcept { return kept_index; }
};
static_assert(kvp::Layout<front_packing>);

template <class Sel>
kvp::pipeline<table_scorer, none, none, Sel, none> table_pipeline(const std::vector<float>& s, Sel sel = {},
                                                                 kvp::protect pr = {.window = 0, .sinks = 0}) {
  kvp::pipeline<table_scorer, none, none, Sel, none> p;
  p.scorer = {s.data()};
  p.select = sel;
  p.protect = pr;
  return p;
}

}  // namespace

TEST_CASE("per-head counts: a budget selector that reads its head keeps a count per (layer, head)") {
  // 2 layers x 2 heads, T 12, budget 5: head 1 keeps 5, head 0 keeps 5 + layer.
  test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {12}, .seed = 3});
  const std::vector<float> s{9, 3, 8, 1, 7, 2, 6, 0, 5, 4, 10, 11};
  kvp::pipeline<table_scorer, none, none, per_head_top_k, kvp::layout::compact> p;
  p.scorer = {s.data()};
  p.protect = {.window = 0, .sinks = 0};
  const auto table = tc.raw_table();
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 5}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{5, 5, 6, 5});
  // The table serves every layer and head: its length is the largest count.
  CHECK(res.new_lengths[0] == 6);
  // Blocks past 6 tokens (block 2 of 3) go back; block 1 still holds tokens of layer 1 head 0.
  CHECK(res.released_blocks[0] == std::vector<std::int32_t>{table[tc.table_index(0, 2)]});
  // Layer 1, head 0 keeps the 6 highest, the others the 5 highest.
  CHECK(res.keep_masks[0][kvp_test::result_index(1, 0, 0, 2, 12)] == 1);  // 9, kept by both counts
  const mask five = mask_of(12, {0, 2, 4, 10, 11}), six = mask_of(12, {0, 2, 4, 6, 10, 11});
  for (int row = 0; row < 4; ++row) {
    const mask got(res.keep_masks[0].begin() + row * 12, res.keep_masks[0].begin() + (row + 1) * 12);
    CHECK(got == (row == 2 ? six : five));
  }
}

TEST_CASE("per-head counts: a count below the protected tokens is refused with the head named") {
  test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {12}, .seed = 3});
  const std::vector<float> s(12, 1.0f);
  kvp::pipeline<table_scorer, none, none, per_head_top_k, none> p;
  p.scorer = {s.data()};
  p.protect = {.window = 5, .sinks = 0};
  // Budget 4: heads 1 keep 4 < 5 protected; head 0 of layer 1 keeps 5.
  const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 4}};
  try {
    (void)kvp::host_executor{}.compress(p, tc.view(), kvp_test::make_batch(items));
    FAIL("no error for a head that keeps fewer tokens than are protected");
  } catch (const kvp::error& e) {
    CHECK(e.field() == "batch[0].budget");
    CHECK_MESSAGE(std::string(e.what()).find("layer 0 head 0") != std::string::npos, e.what());
  }
}

TEST_CASE("score-dependent count: top-p over the final scores, by hand") {
  // Positive mass 16: the top scores 8, 4, 2 reach 14 >= 12 (p 0.75); 8, 4 reach 12 >= 12.
  const std::vector<float> s{1, 8, 0.5f, 4, 0.25f, 2, 0.25f, 0};
  test_cache tc({.block_size = 2, .head_dim = 4, .lengths = {8}});
  auto res = kvp_test::run(table_pipeline(s, score_top_p{.p = 0.75f}), tc, {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{2});
  CHECK(res.keep_masks[0] == mask_of(8, {1, 3}));
  test_cache tc2({.block_size = 2, .head_dim = 4, .lengths = {8}});
  res = kvp_test::run(table_pipeline(s, score_top_p{.p = 0.8f}), tc2, {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{3});  // 12.8 needs the 2
  CHECK(res.keep_masks[0] == mask_of(8, {1, 3, 5}));
  // Protected tokens are kept and counted first: the window of 2 (0.25, 0) is +inf.
  test_cache tc3({.block_size = 2, .head_dim = 4, .lengths = {8}});
  res = kvp_test::run(table_pipeline(s, score_top_p{.p = 0.75f}, {.window = 2, .sinks = 0}), tc3,
                      {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{4});  // 2 protected + 8, 4 (12 of 15.75)
  CHECK(res.keep_masks[0] == mask_of(8, {1, 3, 6, 7}));
}

TEST_CASE("score-dependent count: ties among equal scores go to the more recent token") {
  // Every score 1: p 0.5 of 8 needs 4 tokens, the 4 most recent.
  const std::vector<float> s(8, 1.0f);
  test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {8}});
  const auto res = kvp_test::run(table_pipeline(s, score_top_p{.p = 0.5f}), tc, {{.seq = 0, .budget = 1}});
  CHECK(res.keep_masks[0] == mask_of(8, {4, 5, 6, 7}));
}

TEST_CASE("score-dependent count: the count comes from the raw scores, the tokens from the final ones") {
  // Max pool 3 turns raw {4, 0, 0, 0, 0, 0, 2, 2} into {4, 4, 0, 0, 0, 2, 2, 2}. The raw
  // top-p at p 0.5 (mass 8, need 4) is one token; the final top-1 is token 1 (the tie
  // of 4, 4 goes to the more recent).
  const std::vector<float> s{4, 0, 0, 0, 0, 0, 2, 2};
  test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {8}});
  kvp::pipeline<table_scorer, kvp::aggregate::pool, none, raw_top_p, none> p;
  p.scorer = {s.data()};
  p.aggregate = {.mode = kvp::aggregate::pool_mode::max, .kernel = 3};
  p.select = {.p = 0.5f};
  p.protect = {.window = 0, .sinks = 0};
  auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 1}});
  CHECK(res.scores[0] == std::vector<float>{4, 4, 0, 0, 0, 2, 2, 2});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{1});
  CHECK(res.keep_masks[0] == mask_of(8, {1}));
  // p 0.75 needs 6: the 4 and one 2 of the raw scores.
  test_cache tc2({.block_size = 4, .head_dim = 4, .lengths = {8}});
  p.select.p = 0.75f;
  res = kvp_test::run(p, tc2, {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{2});
  CHECK(res.keep_masks[0] == mask_of(8, {0, 1}));
}

TEST_CASE("score-dependent count: raw scores are those of the candidates, 0 past them") {
  // R-KV's scorer scores only the keys before the window; the selector's raw scores
  // past them are 0 (not whatever a buffer held). The count at p 0.6 is found by hand
  // from the raw scores, read back through a pipeline that only scores.
  const kvp_test::cache_config cfg{.block_size = 4, .kv_heads = 1, .head_dim = 4, .lengths = {20}, .window = 4, .seed = 19};
  kvp::pipeline<kvp::scorer::window_attention, none, none, none, none> scores_only;
  scores_only.scorer = {.window = 4, .keys_before_window = true};
  scores_only.protect = {.window = 0, .sinks = 0};
  test_cache a(cfg);
  const auto scored = kvp_test::run(scores_only, a, {{.seq = 0, .budget = 1}});
  std::vector<std::pair<float, int>> raw;  // (raw score, position), the candidates only: 0 past them
  for (int t = 0; t < 20; ++t) raw.emplace_back(t < 16 ? scored.scores[0][t] : 0.0f, t);
  std::sort(raw.begin(), raw.end(), [](const auto& x, const auto& y) { return kvp::ranks_before(x.first, x.second, y.first, y.second); });
  float total = 0.0f;
  for (const auto& r : raw) total += r.first;
  int want = 0;
  for (float acc = 0.0f; want < 20 && acc < 0.6f * total;) acc += raw[static_cast<std::size_t>(want++)].first;

  kvp::pipeline<kvp::scorer::window_attention, none, none, raw_top_p, none> p;
  p.scorer = scores_only.scorer;
  p.select = {.p = 0.6f};
  p.protect = {.window = 0, .sinks = 0};
  test_cache b(cfg);
  const auto res = kvp_test::run(p, b, {{.seq = 0, .budget = 1}});
  // At least the 4 non-candidates (+inf, kept as protect keeps them) are kept.
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{std::max(want, 4)});
}

TEST_CASE("score-dependent count: top, max and sum together") {
  // Raw top 3: tokens 5 (9), 2 (7), 6 (7; more recent than 2 at the tie). Best final
  // score 9, margin 2: of those three, final >= 7 holds for 5 and 6 and 2.
  const std::vector<float> s{1, 3, 7, 2, 5, 9, 7, 0};
  test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {8}});
  auto res = kvp_test::run(table_pipeline(s, agreeing_top{.n = 3, .margin = 2.0f}), tc, {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{3});
  CHECK(res.keep_masks[0] == mask_of(8, {2, 5, 6}));
  // Margin 1: only 5 (9) of them; the count 1 keeps the top final score.
  test_cache tc2({.block_size = 4, .head_dim = 4, .lengths = {8}});
  res = kvp_test::run(table_pipeline(s, agreeing_top{.n = 3, .margin = 1.0f}), tc2, {{.seq = 0, .budget = 1}});
  CHECK(res.kept_counts[0] == std::vector<std::int32_t>{1});
  CHECK(res.keep_masks[0] == mask_of(8, {5}));
}

TEST_CASE("selector row on the host: each operation on a small row") {
  const std::vector<float> score{3, 1, inf, 1, 2}, raw{0.5f, 0.25f, 0, 0.125f, 0.125f};
  const kvp::host::selector_row row(score, raw, 5, 1, {2, 1});
  CHECK(row.size() == 5);
  CHECK(row.candidates() == 5);
  CHECK(row.protected_count() == 1);
  CHECK(row.head() == kvp::head_index{2, 1});
  CHECK(row.sum(raw_score{}) == 1.0f);
  CHECK(row.max(raw_score{}) == 0.5f);
  CHECK(row.max(final_score{}) == inf);
  // Top 2 by final score: t 2 (+inf), t 0 (3).
  const kvp::rank_cut cut = row.top(final_score{}, 2);
  CHECK(cut.admits(inf, 2));
  CHECK(cut.admits(3.0f, 0));
  CHECK_FALSE(cut.admits(2.0f, 4));
  CHECK_FALSE(row.top(final_score{}, 0).admits(inf, 2));
  // By raw: 0.5 (t 0), 0.25 (t 1), 0.125 (t 4, the more recent), 0.125 (t 3), 0 (t 2).
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 0.0f) == 0);
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 0.5f) == 1);
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 0.75f) == 2);
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 0.8f) == 3);
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 1.0f) == 4);
  CHECK(row.fewest_reaching(raw_score{}, raw_score{}, 2.0f) == 5);  // never reached: the whole row
}

TEST_CASE("layer groups: merging the results of per-layer calls gives the one call's") {
  const std::vector<float> s{9, 3, 8, 1, 7, 2, 6, 0, 5, 4, 10, 11};
  kvp::pipeline<table_scorer, none, none, per_head_top_k, kvp::layout::compact> p;
  p.scorer = {s.data()};
  p.protect = {.window = 0, .sinks = 0};
  const kvp_test::cache_config cfg{.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {12, 12},
                              .seed = 5};
  const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 5}, {.seq = 1, .budget = 3}};
  test_cache whole(cfg), grouped(cfg);
  const auto one = kvp_test::run(p, whole, items);
  const std::vector<kvp::host_result> groups{kvp_test::run(p, grouped, items, 0, 1), kvp_test::run(p, grouped, items, 1, 1)};
  // Layer 0 alone keeps 5 (3) everywhere, so it would release one more block than the
  // table may: layer 1's head 0 keeps 6 (4).
  CHECK(groups[0].new_lengths == std::vector<std::int32_t>{5, 3});
  CHECK(groups[1].new_lengths == std::vector<std::int32_t>{6, 4});
  const kvp::host_result merged = kvp::merge_layer_groups(groups);
  CHECK(merged.new_lengths == one.new_lengths);
  CHECK(merged.kept_counts == one.kept_counts);
  CHECK(merged.released_blocks == one.released_blocks);
  CHECK(merged.keep_masks == one.keep_masks);
  CHECK(grouped.take_snapshot().buffers == whole.take_snapshot().buffers);
  CHECK_THROWS_AS(kvp::merge_layer_groups(std::span<const kvp::host_result>{}), kvp::error);
}

TEST_CASE("non-finite scores: NaN ranks below every finite score, infinities as themselves, all counted") {
  // Candidates: NaN, 1, -inf, +inf, 2, NaN, 0.5, -0. Ranked: +inf (3), 2 (4), 1 (1),
  // 0.5 (6), -0 (7), then -inf and both NaN level, the most recent first: NaN (5), -inf (2), NaN (0).
  const std::vector<float> s{nan_, 1, -inf, inf, 2, nan_, 0.5f, -0.0f};
  for (int k : {3, 5, 6, 7}) {
    CAPTURE(k);
    test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {8}});
    const auto res = kvp_test::run(table_pipeline(s, kvp::select::top_k{}), tc, {{.seq = 0, .budget = k}});
    CHECK(res.nonfinite_scores == std::vector<std::int32_t>{4});
    const mask want = k == 3   ? mask_of(8, {3, 4, 1})
                      : k == 5 ? mask_of(8, {3, 4, 1, 6, 7})
                      : k == 6 ? mask_of(8, {3, 4, 1, 6, 7, 5})
                               : mask_of(8, {3, 4, 1, 6, 7, 5, 2});
    CHECK(res.keep_masks[0] == want);
  }
  // +0 and -0 are one key: the tie goes to the more recent token, whatever the sign.
  const std::vector<float> zeros{-0.0f, 0.0f, -0.0f, 0.0f};
  test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {4}});
  const auto res = kvp_test::run(table_pipeline(zeros, kvp::select::top_k{}), tc, {{.seq = 0, .budget = 2}});
  CHECK(res.keep_masks[0] == mask_of(4, {2, 3}));
  CHECK(res.nonfinite_scores == std::vector<std::int32_t>{0});
}

TEST_CASE("user-written key scorer that reads its head") {
  test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {8}, .seed = 11});
  kvp::pipeline<head_scaled_key, none, none, kvp::select::top_k, none> p;
  p.protect = {.window = 0, .sinks = 0};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 4}});
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 8; ++t)
        CHECK(res.scores[0][kvp_test::result_index(l, h, t, 2, 8)] == tc.key(l, 0, t, h)[0] * static_cast<float>(1 + h + 2 * l));
}

TEST_CASE("user-written attention scorer equals the library's squared attention") {
  const kvp_test::cache_config cfg{.layers = 1, .block_size = 8, .kv_heads = 2, .head_dim = 8, .type = kvp::dtype::bf16,
                              .lengths = {40, 29}, .q_heads = 4, .window = 6, .seed = 13};
  const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 20}, {.seq = 1, .query_slot = 1, .budget = 12}};
  kvp::pipeline<hand_squared_attention, none, none, kvp::select::top_k, none> mine;
  mine.scorer.window = 6;
  mine.scorer.group = kvp::group_reduce::sum;
  mine.scorer.reduce = kvp::window_reduce::sum;
  mine.protect = {.window = 6, .sinks = 0};
  kvp::pipeline<kvp::scorer::squared_attention, none, none, kvp::select::top_k, none> library;
  library.scorer = {.window = 6, .group = kvp::group_reduce::sum, .reduce = kvp::window_reduce::sum,
                    .excluded_distance = 2};
  library.protect = mine.protect;
  test_cache a(cfg), b(cfg);
  const auto got = kvp_test::run(mine, a, items), want = kvp_test::run(library, b, items);
  CHECK(got.scores == want.scores);
  CHECK(got.keep_masks == want.keep_masks);
}

TEST_CASE("user-written layout moves the bytes layout::compact moves") {
  const kvp_test::cache_config cfg{.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 8, .type = kvp::dtype::f16,
                              .lengths = {23, 17}, .seed = 17};
  const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 9, .history_tokens = 0}, {.seq = 1, .budget = 6}};
  kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::global_score, none, kvp::select::top_k, front_packing> mine;
  mine.protect = {.window = 2, .sinks = 1};
  kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::global_score, none, kvp::select::top_k,
                kvp::layout::compact>
      library;
  library.protect = mine.protect;
  test_cache a(cfg), b(cfg);
  const auto got = kvp_test::run(mine, a, items), want = kvp_test::run(library, b, items);
  CHECK(got.new_lengths == want.new_lengths);
  CHECK(got.released_blocks == want.released_blocks);
  CHECK(a.take_snapshot().buffers == b.take_snapshot().buffers);
  CHECK(a.raw_f() == b.raw_f());
}
