// Invariants (SPEC.md "Invariants every implementation keeps") over random inputs:
// random shapes, dtypes (f32 / f16 / bf16), layouts (nano_vllm, vllm_flash,
// vllm_flash_blocks_first, nhd, hnd), dense and CSR tables, random batches and layer
// ranges, and pipelines from every stage. For each case:
//   - each (layer, head) row keeps exactly the budget; new length = budget;
//   - the keep mask is the top of the recorded final scores under the tie rule;
//   - window, sinks and non-candidates are always kept;
//   - the i-th kept token's K and V bytes at position i equal its bytes before (order kept);
//   - F moves with its token (checked exactly where its value is known);
//   - released blocks are exactly the table entries past the new length;
//   - nothing outside the batch's sequences, layers and first T tokens is written
//     (other sequences, other layers, unowned blocks, slots past the length, queries,
//     table, lengths), and F not at all by pipelines without a temporal aggregator.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/reference.hpp"
#include "support/test_cache.hpp"

using kvp::none;
using kvp_test::kv_kind;
using kvp_test::test_cache;
namespace agg = kvp::aggregate;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

enum class f_check {
  untouched,        // the pipeline does not use F: no F byte may change
  recorded_score,   // F <- S is the final score (no later stage): moved F = recorded score of its token
  identity,         // no scorer + accumulate: F of a token with history is unchanged, else 0
  written,          // F holds an intermediate score: only "nothing outside" is checked
};

struct random_case {
  std::mt19937 rng;
  explicit random_case(std::uint32_t seed) : rng(seed) {}
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
};

struct setup {
  std::vector<kvp::batch_item> items;
  int layer_begin = 0, layer_count = 0, layer_end = 0;
  int min_T = 0;
};

test_cache make_cache(random_case& r, std::uint32_t seed) {
  const int L = r.pick(1, 3), H = r.pick(1, 2), G = r.pick(1, 2), S = r.pick(1, 4);
  std::vector<int> lengths;
  for (int s = 0; s < S; ++s) lengths.push_back(r.pick(1, 24));
  return test_cache({.layers = L,
                     .spare_blocks = r.pick(0, 3),
                     .block_size = r.pick(1, 5),
                     .kv_heads = H,
                     .head_dim = r.pick(1, 4),
                     .type = kvp_test::all_dtypes[r.pick(0, 2)],
                     .lengths = lengths,
                     .capacity_blocks = r.pick(0, 1) ? r.pick(0, 8) : 0,
                     .csr = r.pick(0, 1) == 1,
                     .layout = kvp_test::all_layouts[r.pick(0, kvp_test::layout_count - 1)],
                     .q_heads = H * G,
                     .window = 6,
                     .slots = S + 1,
                     .q_type = kvp_test::all_dtypes[r.pick(0, 2)],
                     .seed = seed});
}

setup make_batch(random_case& r, const test_cache& tc) {
  setup s;
  std::vector<int> seqs(static_cast<std::size_t>(tc.num_seqs()));
  for (int i = 0; i < tc.num_seqs(); ++i) seqs[i] = i;
  std::shuffle(seqs.begin(), seqs.end(), r.rng);
  seqs.resize(static_cast<std::size_t>(r.pick(1, tc.num_seqs())));
  s.min_T = std::numeric_limits<int>::max();
  for (int seq : seqs) {
    s.items.push_back({.seq = seq, .query_slot = r.pick(0, tc.slots() - 1)});
    s.min_T = std::min(s.min_T, tc.length(seq));
  }
  s.layer_begin = r.pick(0, tc.num_layers() - 1);
  s.layer_count = r.pick(0, tc.num_layers() - s.layer_begin);
  s.layer_end = s.layer_count == 0 ? tc.num_layers() : s.layer_begin + s.layer_count;
  return s;
}

// Budgets (and histories) of a batch: budget in [max(1, protected), T].
void set_budgets(random_case& r, setup& s, const test_cache& tc, const kvp::protect& pr, int scorer_window,
                 bool keys_before_window, bool histories) {
  for (auto& it : s.items) {
    const int T = tc.length(it.seq);
    const int n = keys_before_window ? T - scorer_window : T;
    int must = 0;
    for (int t = 0; t < T; ++t) must += (t < pr.sinks || t >= T - pr.window || t >= n) ? 1 : 0;
    it.budget = r.pick(std::max(1, must), T);
    it.history_tokens = histories ? r.pick(0, T) : 0;
  }
}

// Runs p on the case and checks every invariant. `rank` maps (final score, t, T) to the
// selector's key (descending; ties to the larger t).
template <class P, class Rank>
void check_invariants(const P& p, test_cache& tc, const setup& s, f_check fc, Rank rank) {
  CAPTURE(tc.describe());
  CAPTURE(s.layer_begin);
  CAPTURE(s.layer_count);
  const auto before = tc.take_snapshot();
  const auto kv_region = tc.batch_region(s.items, s.layer_begin, s.layer_end);
  const auto f_region = fc == f_check::untouched ? tc.no_region() : kv_region;
  const auto res = kvp_test::run(p, tc, s.items, s.layer_begin, s.layer_count);
  const int H = tc.kv_heads(), b = tc.block_size();
  REQUIRE(res.new_lengths.size() == s.items.size());
  for (std::size_t i = 0; i < s.items.size(); ++i) {
    const auto& it = s.items[i];
    const int T = before.lengths[it.seq];
    CAPTURE(i);
    CAPTURE(it.seq);
    CAPTURE(T);
    CAPTURE(it.budget);
    CAPTURE(it.history_tokens);
    CHECK(res.new_lengths[i] == it.budget);
    // Released blocks: the table entries past the new length.
    std::vector<int> released;
    for (int blk = (it.budget + b - 1) / b; blk < (T + b - 1) / b; ++blk) released.push_back(tc.block(it.seq, blk));
    CHECK(res.released_blocks[i] == released);
    for (int l = s.layer_begin; l < s.layer_end; ++l)
      for (int h = 0; h < H; ++h) {
        CAPTURE(l);
        CAPTURE(h);
        const std::size_t row = kvp_test::result_index(l - s.layer_begin, h, 0, H, T);
        const std::vector<std::uint8_t> keep(res.keep_masks[i].begin() + row, res.keep_masks[i].begin() + row + T);
        const std::vector<float> score(res.scores[i].begin() + row, res.scores[i].begin() + row + T);
        // The mask is the top `budget` of the selector's keys.
        std::vector<float> key(static_cast<std::size_t>(T));
        for (int t = 0; t < T; ++t) key[t] = rank(score[t], t, T);
        std::vector<std::uint8_t> want(static_cast<std::size_t>(T), 0);
        for (int t : kvp_test::ref::top_k(key, it.budget)) want[t] = 1;
        CHECK(keep == want);
        // Protected tokens.
        for (int t = 0; t < T; ++t)
          if (t < p.protect.sinks || t >= T - p.protect.window) {
            CAPTURE(t);
            CHECK(keep[t] == 1);
            CHECK(score[t] == inf);
          }
        // Moved bytes, in order.
        int next = 0;
        for (int t = 0; t < T; ++t) {
          if (!keep[t]) continue;
          CAPTURE(t);
          CHECK(tc.token_bytes(kv_kind::k, l, it.seq, next, h) == tc.token_bytes(before, kv_kind::k, l, it.seq, t, h));
          CHECK(tc.token_bytes(kv_kind::v, l, it.seq, next, h) == tc.token_bytes(before, kv_kind::v, l, it.seq, t, h));
          // The original position moved with the token (the fixture starts with position t at t).
          CHECK(tc.position(l, it.seq, next, h) == t);
          const float f_now = tc.f(l, it.seq, next, h);
          if (fc == f_check::identity) {
            CHECK(f_now == (t < it.history_tokens ? tc.f(before, l, it.seq, t, h) : 0.0f));
          } else if (fc == f_check::recorded_score && score[t] != inf) {
            CHECK(f_now == score[t]);
          }
          ++next;
        }
        CHECK(next == it.budget);
      }
  }
  const auto outside = tc.writes_outside(before, kv_region, f_region);
  CHECK_MESSAGE(outside.empty(), (outside.empty() ? std::string() : outside.front()));
}

const auto by_score = [](float s, int, int) { return s; };

kvp::scorer::window_attention random_window_attention(random_case& r, int w) {
  return {.window = w,
          .group = static_cast<kvp::group_reduce>(r.pick(0, 3)),
          .reduce = static_cast<kvp::window_reduce>(r.pick(0, 1)),
          .causal = r.pick(0, 3) != 0,
          .keys_before_window = false};
}

agg::pool random_pool(random_case& r) {
  return {.mode = r.pick(0, 1) ? agg::pool_mode::max : agg::pool_mode::avg,
          .kernel = 1 + 2 * r.pick(0, 3),
          .first_only = r.pick(0, 1) == 1};
}

// One random case of pipeline kind `kind`.
void run_case(int kind, std::uint32_t seed) {
  random_case r(seed);
  test_cache tc = make_cache(r, seed);
  setup s = make_batch(r, tc);
  const int w = r.pick(1, std::min(4, s.min_T));
  kvp::protect pr{.window = r.pick(0, std::min(4, s.min_T)), .sinks = r.pick(0, 3)};
  CAPTURE(kind);
  CAPTURE(seed);
  switch (kind) {
    case 0: {  // window attention -> top-k (F untouched)
      kvp::pipeline<kvp::scorer::window_attention, none, none, kvp::select::top_k, kvp::layout::compact> p;
      p.scorer = random_window_attention(r, w);
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, false, r.pick(0, 1) == 1);
      check_invariants(p, tc, s, f_check::untouched, by_score);
      break;
    }
    case 1: {  // R-KV-like: keys before the window -> pool -> full redundancy
      kvp::pipeline<kvp::scorer::window_attention, agg::pool, kvp::redundancy::full, kvp::select::top_k,
                    kvp::layout::compact>
          p;
      p.scorer = random_window_attention(r, w);
      p.scorer.keys_before_window = true;
      p.aggregate = random_pool(r);
      p.redundancy = {.theta = 0.5f, .tau = 1.0f, .lambda = 0.1f,
                      .form = r.pick(0, 1) ? kvp::redundancy::combine_form::weighted
                                           : kvp::redundancy::combine_form::subtract};
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, true, r.pick(0, 1) == 1);
      check_invariants(p, tc, s, f_check::untouched, by_score);
      break;
    }
    case 2: {  // Zipage-like: global score then pool (first only) -> lightning redundancy; F written
      kvp::pipeline<kvp::scorer::window_attention, agg::then<agg::global_score, agg::pool>, kvp::redundancy::lightning,
                    kvp::select::top_k, kvp::layout::compact>
          p;
      p.scorer = random_window_attention(r, w);
      p.aggregate.first = {.mode = static_cast<agg::global_mode>(r.pick(0, 2)), .alpha = 0.8f,
                           .max_norm = r.pick(0, 1) == 1};
      p.aggregate.second = random_pool(r);
      p.redundancy = {.theta = 0.5f, .tau = 0.4f, .lambda = 0.2f};
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, false, true);
      check_invariants(p, tc, s, f_check::written, by_score);
      break;
    }
    case 3: {  // no scorer + accumulate: F of kept tokens must come through unchanged
      kvp::pipeline<none, agg::accumulate, none, kvp::select::top_k, kvp::layout::compact> p;
      p.protect = pr;
      set_budgets(r, s, tc, pr, 0, false, true);
      check_invariants(p, tc, s, f_check::identity, by_score);
      break;
    }
    case 4: {  // StreamingLLM: sinks + recent
      kvp::pipeline<none, none, none, kvp::select::sinks_recent, kvp::layout::compact> p;
      p.select = {.sinks = r.pick(0, 4)};
      p.protect = pr;
      set_budgets(r, s, tc, pr, 0, false, false);
      const int sinks = p.select.sinks;
      // Protected first, then the selector's sinks, then recency.
      check_invariants(p, tc, s, f_check::untouched, [sinks](float x, int t, int) {
        return x == inf ? inf : t < sinks ? std::numeric_limits<float>::max() : static_cast<float>(t);
      });
      break;
    }
    case 5: {  // squared attention -> avg pool
      kvp::pipeline<kvp::scorer::squared_attention, agg::pool, none, kvp::select::top_k, kvp::layout::compact> p;
      p.scorer = {.window = w, .excluded_distance = r.pick(0, 2)};
      p.aggregate = random_pool(r);
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, false, r.pick(0, 1) == 1);
      check_invariants(p, tc, s, f_check::untouched, by_score);
      break;
    }
    case 6: {  // H2O: window sum + accumulate; the final score is F
      kvp::pipeline<kvp::scorer::window_attention, agg::accumulate, none, kvp::select::top_k, kvp::layout::compact> p;
      p.scorer = random_window_attention(r, w);
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, false, true);
      check_invariants(p, tc, s, f_check::recorded_score, by_score);
      break;
    }
    default: {  // G-KV-like: global score (max-normalised) -> full redundancy
      kvp::pipeline<kvp::scorer::window_attention, agg::global_score, kvp::redundancy::full, kvp::select::top_k,
                    kvp::layout::compact>
          p;
      p.scorer = random_window_attention(r, w);
      p.aggregate = {.mode = static_cast<agg::global_mode>(r.pick(0, 2)), .alpha = 0.8f, .max_norm = true};
      p.redundancy = {.theta = 0.5f, .tau = 1.0f, .lambda = 0.5f};
      p.protect = pr;
      set_budgets(r, s, tc, pr, w, false, true);
      check_invariants(p, tc, s, f_check::written, by_score);
      break;
    }
  }
}

constexpr int kinds = 8;
// Random cases per kind: 1000 (8000 in all), or KVP_PROPERTY_CASES when set to a
// positive count (compute-sanitizer's racecheck runs a few hundred: each case is
// some hundred times slower under it).
int cases_per_kind() {
  static const int n = [] {
    const char* env = std::getenv("KVP_PROPERTY_CASES");
    const int v = env ? std::atoi(env) : 0;
    return v > 0 ? v : 1000;
  }();
  return n;
}

}  // namespace

TEST_CASE("properties: window attention + top-k") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(0, 1000000u + i);
}
TEST_CASE("properties: R-KV-like (keys before window, pool, full redundancy)") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(1, 2000000u + i);
}
TEST_CASE("properties: Zipage-like (global score then pool, lightning redundancy)") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(2, 3000000u + i);
}
TEST_CASE("properties: accumulate without a scorer moves F unchanged") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(3, 4000000u + i);
}
TEST_CASE("properties: sinks + recent") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(4, 5000000u + i);
}
TEST_CASE("properties: squared attention + pool") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(5, 6000000u + i);
}
TEST_CASE("properties: H2O (F is the final score)") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(6, 7000000u + i);
}
TEST_CASE("properties: G-KV-like (max-normalised global score, full redundancy)") {
  for (int i = 0; i < cases_per_kind(); ++i) run_case(7, 8000000u + i);
}
static_assert(kinds == 8);
