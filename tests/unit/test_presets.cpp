// Presets (SPEC.md "Presets"): their defaults equal the table, their fields can be
// overridden, and each runs end to end on a small cache, twice (the second time with
// history_tokens > 0), matching an independent reference of its whole pipeline.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "support/reference_pipeline.hpp"
#include "support/test_cache.hpp"

using kvp::none;
using kvp_test::kv_kind;
using kvp_test::test_cache;
namespace agg = kvp::aggregate;
namespace presets = kvp::presets;

// ---- defaults, as types ----------------------------------------------------------
static_assert(std::is_same_v<presets::zipage::scorer_type, kvp::scorer::window_attention>);
static_assert(std::is_same_v<presets::zipage::aggregate_type, agg::then<agg::global_score, agg::pool>>);
static_assert(std::is_same_v<presets::zipage::redundancy_type, kvp::redundancy::lightning>);
static_assert(std::is_same_v<presets::zipage::select_type, kvp::select::top_k>);
static_assert(std::is_same_v<presets::zipage::layout_type, kvp::layout::compact>);
static_assert(std::is_same_v<presets::rkv::aggregate_type, agg::pool>);
static_assert(std::is_same_v<presets::rkv::redundancy_type, kvp::redundancy::full>);
static_assert(std::is_same_v<presets::gkv::aggregate_type, agg::global_score>);
static_assert(std::is_same_v<presets::gkv::redundancy_type, kvp::redundancy::full>);
static_assert(std::is_same_v<presets::snapkv::aggregate_type, agg::pool>);
static_assert(std::is_same_v<presets::snapkv::redundancy_type, none>);
static_assert(std::is_base_of_v<kvp::scorer::window_attention, presets::h2o::scorer_type>);
static_assert(std::is_same_v<presets::h2o::aggregate_type, agg::accumulate>);
static_assert(std::is_same_v<presets::h2o::redundancy_type, none>);
static_assert(std::is_same_v<presets::streaming_llm::scorer_type, none>);
static_assert(std::is_same_v<presets::streaming_llm::aggregate_type, none>);
static_assert(std::is_same_v<presets::streaming_llm::select_type, kvp::select::sinks_recent>);
static_assert(std::is_same_v<presets::streaming_llm::layout_type, kvp::layout::compact>);
// Presets are constant expressions and trivially copyable values.
static_assert(presets::zipage{}.scorer.window == 16);
static_assert(std::is_trivially_copyable_v<presets::zipage> && std::is_trivially_copyable_v<presets::rkv>);

TEST_CASE("presets: zipage defaults") {
  const presets::zipage z;
  CHECK(z.scorer.window == 16);
  CHECK(z.scorer.group == kvp::group_reduce::max);
  CHECK(z.scorer.reduce == kvp::window_reduce::mean);
  CHECK(z.scorer.causal);
  CHECK_FALSE(z.scorer.keys_before_window);
  CHECK(z.aggregate.first.mode == agg::global_mode::max);
  CHECK(z.aggregate.first.alpha == 0.8f);
  CHECK_FALSE(z.aggregate.first.max_norm);
  CHECK(z.aggregate.second.mode == agg::pool_mode::max);
  CHECK(z.aggregate.second.kernel == 5);
  CHECK(z.aggregate.second.first_only);
  CHECK(z.redundancy.tau == 0.4f);
  CHECK(z.redundancy.lambda == 0.2f);
  CHECK(z.redundancy.theta == 0.5f);
  CHECK(z.redundancy.eps == 1e-8f);
  CHECK(z.redundancy.form == kvp::redundancy::combine_form::weighted);
  CHECK(z.protect.window == 16);
  CHECK(z.protect.sinks == 0);
}

TEST_CASE("presets: rkv defaults") {
  const presets::rkv r;
  CHECK(r.scorer.window == 8);
  CHECK(r.scorer.group == kvp::group_reduce::max_logits);
  CHECK(r.scorer.reduce == kvp::window_reduce::mean);
  CHECK(r.scorer.keys_before_window);
  CHECK(r.aggregate.mode == agg::pool_mode::max);
  CHECK(r.aggregate.kernel == 7);
  CHECK_FALSE(r.aggregate.first_only);
  CHECK(r.redundancy.tau == 1.0f);
  CHECK(r.redundancy.lambda == 0.1f);
  CHECK(r.redundancy.theta == 0.5f);
  CHECK(r.protect.window == 8);
}

TEST_CASE("presets: gkv defaults") {
  const presets::gkv g;
  CHECK(g.scorer.window == 16);
  CHECK(g.scorer.group == kvp::group_reduce::max);
  CHECK(g.scorer.reduce == kvp::window_reduce::mean);
  CHECK(g.aggregate.mode == agg::global_mode::max);
  CHECK(g.aggregate.alpha == 0.8f);
  CHECK(g.aggregate.max_norm);
  CHECK(g.redundancy.lambda == 0.5f);
  CHECK(g.protect.window == 16);
}

TEST_CASE("presets: snapkv, h2o, streaming_llm defaults") {
  const presets::snapkv s;
  CHECK(s.scorer.group == kvp::group_reduce::mean);
  CHECK(s.scorer.reduce == kvp::window_reduce::sum);
  CHECK(s.aggregate.mode == agg::pool_mode::max);
  CHECK(s.aggregate.kernel == 7);
  CHECK(s.protect.window == s.scorer.window);
  const presets::h2o h;
  CHECK(h.scorer.reduce == kvp::window_reduce::sum);
  CHECK(h.protect.window == h.scorer.window);
  const presets::streaming_llm st;
  CHECK(st.select.sinks == 4);
  CHECK(st.protect.sinks == 4);
}

TEST_CASE("presets: fields can be overridden") {
  presets::zipage z;
  z.scorer.window = 4;
  z.protect.window = 4;
  z.aggregate.first.alpha = 0.5f;
  z.aggregate.second.kernel = 3;
  z.redundancy.lambda = 0.7f;
  z.redundancy.form = kvp::redundancy::combine_form::subtract;
  CHECK(z.scorer.window == 4);
  CHECK(z.aggregate.first.alpha == 0.5f);
  CHECK(z.aggregate.second.kernel == 3);
  CHECK(z.redundancy.lambda == 0.7f);
  // The overridden preset runs exactly as the same pipeline spelled out by hand.
  kvp::pipeline<kvp::scorer::window_attention, agg::then<agg::global_score, agg::pool>, kvp::redundancy::lightning,
                kvp::select::top_k, kvp::layout::compact>
      hand;
  hand.scorer = {.window = 4};
  hand.aggregate = {{.alpha = 0.5f}, {.kernel = 3, .first_only = true}};
  hand.redundancy = {.theta = 0.5f, .tau = 0.4f, .lambda = 0.7f, .form = kvp::redundancy::combine_form::subtract};
  hand.protect = {.window = 4, .sinks = 0};
  auto make = [] {
    return test_cache({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {20, 13}, .q_heads = 4,
                       .window = 4, .seed = 3});
  };
  test_cache a = make(), b = make();
  const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 1, .budget = 9}, {.seq = 1, .query_slot = 0, .budget = 6}};
  const auto ra = kvp_test::run(z, a, items);
  const auto rb = kvp_test::run(hand, b, items);
  CHECK(ra.keep_masks == rb.keep_masks);
  CHECK(ra.scores == rb.scores);
  CHECK(a.take_snapshot().buffers == b.take_snapshot().buffers);
  CHECK(a.raw_f() == b.raw_f());
  // ... and differently from the defaults.
  test_cache c = make();
  presets::zipage d;
  d.scorer.window = 4;
  d.protect.window = 4;
  CHECK(kvp_test::run(d, c, items).scores != ra.scores);
}

namespace {

// Runs preset p on tc over `items`, and checks it against the reference pipeline:
// final scores, keep mask = top budget of them, moved K / V / F, released blocks,
// lengths, nothing written outside the batch.
template <class P>
void check_round(const P& p, test_cache& tc, const std::vector<kvp::batch_item>& items, bool uses_f) {
  CAPTURE(tc.describe());
  const auto pp = kvp_test::ref::params_of(p);
  const int H = tc.kv_heads(), L = tc.num_layers(), b = tc.block_size();
  // Expected rows, from the cache as it is before the call.
  std::vector<std::vector<kvp_test::ref::row_result>> want(items.size());
  for (std::size_t i = 0; i < items.size(); ++i)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h)
        want[i].push_back(kvp_test::ref::expected_row(pp, tc, l, items[i].seq, items[i].query_slot, h,
                                                      items[i].history_tokens));
  const auto before = tc.take_snapshot();
  const auto region = tc.batch_region(items, 0, L);
  const auto res = kvp_test::run(p, tc, items);
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& it = items[i];
    const int T = before.lengths[it.seq];
    CAPTURE(it.seq);
    CAPTURE(it.history_tokens);
    CHECK(res.new_lengths[i] == it.budget);
    std::vector<int> released;
    for (int blk = (it.budget + b - 1) / b; blk < (T + b - 1) / b; ++blk) released.push_back(tc.block(it.seq, blk));
    CHECK(res.released_blocks[i] == released);
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        CAPTURE(l);
        CAPTURE(h);
        const auto& w = want[i][static_cast<std::size_t>(l) * H + h];
        const std::size_t row = kvp_test::result_index(l, h, 0, H, T);
        const std::vector<float> score(res.scores[i].begin() + row, res.scores[i].begin() + row + T);
        const std::vector<std::uint8_t> keep(res.keep_masks[i].begin() + row, res.keep_masks[i].begin() + row + T);
        if (!w.near_threshold)
          for (int t = 0; t < T; ++t) {
            CAPTURE(t);
            if (std::isinf(w.final_scores[t]))
              CHECK(score[t] == std::numeric_limits<float>::infinity());
            else
              CHECK(score[t] == doctest::Approx(w.final_scores[t]).epsilon(1e-5));
          }
        std::vector<float> rank(score);
        if constexpr (std::is_same_v<typename P::select_type, kvp::select::sinks_recent>)
          for (int t = 0; t < T; ++t)
            rank[t] = std::isinf(score[t]) ? score[t]
                      : t < p.select.sinks ? std::numeric_limits<float>::max()
                                           : static_cast<float>(t);
        std::vector<std::uint8_t> top(static_cast<std::size_t>(T), 0);
        for (int t : kvp_test::ref::top_k(rank, it.budget)) top[t] = 1;
        CHECK(keep == top);
        int next = 0;
        for (int t = 0; t < T; ++t) {
          if (!keep[t]) continue;
          CHECK(tc.token_bytes(kv_kind::k, l, it.seq, next, h) == tc.token_bytes(before, kv_kind::k, l, it.seq, t, h));
          CHECK(tc.token_bytes(kv_kind::v, l, it.seq, next, h) == tc.token_bytes(before, kv_kind::v, l, it.seq, t, h));
          if (uses_f && !w.near_threshold) CHECK(tc.f(l, it.seq, next, h) == doctest::Approx(w.f[t]).epsilon(1e-5));
          ++next;
        }
      }
  }
  CHECK(tc.writes_outside(before, region, uses_f ? region : tc.no_region()).empty());
  // The engine's side: lengths become the new lengths.
  for (std::size_t i = 0; i < items.size(); ++i) tc.set_length(items[i].seq, res.new_lengths[i]);
}

// Two rounds: compress, append tokens (and new queries), compress again with
// history_tokens = the previous budget.
template <class P>
void two_rounds(const P& p, int budget, bool uses_f) {
  for (auto layout : {kvp_test::cache_layout::nano_vllm, kvp_test::cache_layout::vllm_flash,
                      kvp_test::cache_layout::hnd}) {
    for (auto type : {kvp::dtype::bf16, kvp::dtype::f32}) {
      test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 8, .type = type,
                     .lengths = {44, 40, 48, 37}, .csr = layout == kvp_test::cache_layout::hnd, .layout = layout,
                     .q_heads = 4, .window = 32, .slots = 4, .seed = 21});
      // Plant near-duplicate keys so redundancy has something to find.
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h)
          for (int t = 20; t < 24; ++t) {
            auto k = tc.key(l, 0, t - 8, h);
            k[0] += 0.01f;
            tc.set_key(l, 0, t, h, k);
          }
      std::vector<kvp::batch_item> items{{.seq = 2, .query_slot = 0, .budget = budget},
                                         {.seq = 0, .query_slot = 3, .budget = budget},
                                         {.seq = 1, .query_slot = 1, .budget = budget}};
      check_round(p, tc, items, uses_f);
      // Append: up to 12 tokens, within the blocks the sequence had (the engine reuses them).
      for (auto& it : items) {
        const int T = std::min(tc.length(it.seq) + 12, static_cast<int>(tc.blocks(it.seq).size()) * 4);
        tc.randomize_tokens(it.seq, tc.length(it.seq), T);
        tc.set_length(it.seq, T);
        it.history_tokens = it.budget;
      }
      for (int l = 0; l < 2; ++l)
        for (int slot = 0; slot < 4; ++slot)
          for (int j = 0; j < 32; ++j)
            for (int qh = 0; qh < 4; ++qh) {
              std::vector<float> q(8);
              for (float& x : q) x = tc.uniform(-1.0f, 1.0f);
              tc.set_query(l, slot, j, qh, q);
            }
      check_round(p, tc, items, uses_f);
    }
  }
}

}  // namespace

TEST_CASE("presets end to end: zipage") { two_rounds(presets::zipage{}, 24, true); }
TEST_CASE("presets end to end: rkv") { two_rounds(presets::rkv{}, 16, false); }
TEST_CASE("presets end to end: gkv") { two_rounds(presets::gkv{}, 24, true); }
TEST_CASE("presets end to end: snapkv") { two_rounds(presets::snapkv{}, 36, false); }
TEST_CASE("presets end to end: h2o") { two_rounds(presets::h2o{}, 24, true); }
TEST_CASE("presets end to end: streaming_llm") { two_rounds(presets::streaming_llm{}, 24, false); }

TEST_CASE("presets end to end: zipage's second round combines F and skips pooling") {
  // A direct check of what the reference comparison implies: on the second round the
  // first history_tokens tokens combine max(0.8 F, S) and no pooling happens.
  test_cache tc({.block_size = 4, .head_dim = 4, .lengths = {40}, .q_heads = 2, .window = 16, .seed = 4});
  presets::zipage z;
  z.redundancy.lambda = 1.0f;  // weighted form with lambda 1: S unchanged by redundancy
  auto r1 = kvp_test::run(z, tc, {{.seq = 0, .budget = 24}});
  tc.set_length(0, 30);
  tc.randomize_tokens(0, 24, 30);
  std::vector<float> f_hist;
  for (int t = 0; t < 24; ++t) f_hist.push_back(tc.f(0, 0, t, 0));
  kvp::pipeline<kvp::scorer::window_attention, none, none, none, none> raw;
  raw.scorer = z.scorer;
  raw.protect = {.window = 0, .sinks = 0};
  const auto s = kvp_test::run(raw, tc, {{.seq = 0, .budget = 30}}).scores[0];
  const auto r2 = kvp_test::run(z, tc, {{.seq = 0, .budget = 24, .history_tokens = 24}});
  for (int t = 0; t < 30 - 16; ++t) {
    CAPTURE(t);
    const float want = t < 24 ? std::max(0.8f * f_hist[t], s[t]) : s[t];
    CHECK(r2.scores[0][t] == doctest::Approx(want).epsilon(1e-6));
  }
  CHECK(r1.new_lengths[0] == 24);
}
