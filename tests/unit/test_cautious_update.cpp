// Cautious update (SPEC.md "Calibrated top-p", Hard-KV's option; core/live_view.hpp):
// with a live view, a token a head dropped stays dropped at every later compression
// (scored as absent, never kept, not counted as protected), the layout writes which
// slots each head holds, and a budget past a head's held tokens keeps what it holds.
// A hand case, the dead keys' bytes shown not to matter, three hard_kv and hard_kv_rkv
// rounds with an engine appending between them, full redundancy over the held keys, and
// the refusals. (The CUDA build of this file runs every compression on both executors
// and compares them, live bytes included.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::first_element_scorer;
using kvp_test::kv_kind;
using kvp_test::set_first_elements;
using kvp_test::test_cache;

namespace {

// Head 0 keeps the budget, every other head half of it: per-head counts from a budget.
struct halving_top_k {
  KVP_HOST_DEVICE constexpr float rank_key(float score, std::int32_t, std::int32_t) const noexcept { return score; }
  KVP_HOST_DEVICE constexpr std::int32_t keep_count(std::int32_t T, std::int32_t budget, kvp::head_index h) const noexcept {
    const std::int32_t k = h.kv_head == 0 ? budget : budget / 2;
    return k < T ? k : T;
  }
};

// The positions a head holds in slots [0, T) of seq, live ones only.
std::vector<int> held_positions(test_cache& tc, int l, int seq, int h) {
  std::vector<int> out;
  for (int t = 0; t < tc.length(seq); ++t)
    if (tc.live(l, seq, t, h)) out.push_back(tc.position(l, seq, t, h));
  return out;
}

std::vector<int> live_bytes(test_cache& tc, int l, int seq, int h, int T) {
  std::vector<int> out;
  for (int t = 0; t < T; ++t) out.push_back(tc.live(l, seq, t, h));
  return out;
}

// The engine's append: tokens [T, T_new) of seq get random K/V, their positions, and
// are live in every layer and head.
void append(test_cache& tc, int seq, int T_new, int first_position) {
  const int T = tc.length(seq);
  tc.randomize_tokens(seq, T, T_new);
  tc.set_length(seq, T_new);
  for (int l = 0; l < tc.num_layers(); ++l)
    for (int h = 0; h < tc.kv_heads(); ++h)
      for (int t = T; t < T_new; ++t) {
        tc.live(l, seq, t, h) = 1;
        tc.position(l, seq, t, h) = first_position + (t - T);
      }
}

}  // namespace

TEST_CASE("cautious update: a dropped token stays dropped, by hand") {
  test_cache tc({.block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {8, 8}, .seed = 3, .live = true});
  set_first_elements(tc, 0, 0, 0, {5, 1, 7, 3, 8, 2, 6, 4});
  set_first_elements(tc, 0, 0, 1, {1, 9, 2, 8, 3, 7, 4, 6});
  const auto untouched = tc.take_snapshot();

  // Round 1: head 0 keeps 6 (drops t 1 and 5), head 1 keeps 3 (t 1, 3, 5).
  kvp::pipeline<first_element_scorer, none, none, halving_top_k, kvp::layout::compact> halving;
  halving.protect = {.window = 0, .sinks = 0};
  auto r = kvp_test::run(halving, tc, {{.seq = 0, .budget = 6}});
  CHECK(r.kept_counts[0] == std::vector<int>{6, 3});
  CHECK(r.new_lengths[0] == 6);
  CHECK(r.released_blocks[0].empty());
  CHECK(held_positions(tc, 0, 0, 0) == std::vector<int>{0, 2, 3, 4, 6, 7});
  CHECK(held_positions(tc, 0, 0, 1) == std::vector<int>{1, 3, 5});
  // The layout wrote every slot of the row: held ones 1, the rest 0.
  CHECK(live_bytes(tc, 0, 0, 0, 8) == std::vector<int>{1, 1, 1, 1, 1, 1, 0, 0});
  CHECK(live_bytes(tc, 0, 0, 1, 8) == std::vector<int>{1, 1, 1, 0, 0, 0, 0, 0});
  // The other sequence: not a byte, live ones included.
  for (int t = 0; t < 8; ++t)
    for (int h = 0; h < 2; ++h) {
      CHECK(tc.token_bytes(kv_kind::k, 0, 1, t, h) == tc.token_bytes(untouched, kv_kind::k, 0, 1, t, h));
      CHECK(tc.live(0, 1, t, h) == 1);
    }

  // The engine appends positions 8 and 9; head 1's leftovers (slots 3..5, dropped)
  // get scores that would win if they were still candidates.
  tc.set_length(0, 6);
  append(tc, 0, 8, 8);
  set_first_elements(tc, 0, 0, 0, {5, 7, 3, 8, 6, 4, 0.5f, 9.5f});
  set_first_elements(tc, 0, 0, 1, {9, 8, 7, 100, 100, 100, 0.5f, 9.5f});

  // Round 2: plain top-k of 6 with the last 3 slots protected. Head 0 holds 8: the
  // window (slots 5, 6, 7) and the best 3 of the rest (slots 3, 1, 4). Head 1 holds 5
  // (slots 0, 1, 2, 6, 7): a budget of 6 keeps those 5; its window's dead slot 5 is not kept.
  kvp::pipeline<first_element_scorer, none, none, kvp::select::top_k, kvp::layout::compact> top;
  top.protect = {.window = 3, .sinks = 0};
  r = kvp_test::run(top, tc, {{.seq = 0, .budget = 6}});
  CHECK(r.kept_counts[0] == std::vector<int>{6, 5});
  CHECK(r.new_lengths[0] == 6);
  const auto& keep = r.keep_masks[0];
  CHECK(std::vector<int>(keep.begin(), keep.begin() + 8) == std::vector<int>{0, 1, 0, 1, 1, 1, 1, 1});
  CHECK(std::vector<int>(keep.begin() + 8, keep.end()) == std::vector<int>{1, 1, 1, 0, 0, 0, 1, 1});
  CHECK(held_positions(tc, 0, 0, 0) == std::vector<int>{2, 4, 6, 7, 8, 9});
  CHECK(held_positions(tc, 0, 0, 1) == std::vector<int>{1, 3, 5, 8, 9});
  CHECK(live_bytes(tc, 0, 0, 1, 8) == std::vector<int>{1, 1, 1, 1, 1, 0, 0, 0});
}

TEST_CASE("cautious update: the bytes of dropped keys change nothing") {
  // Window attention over a cache whose heads hold different counts: rewriting the
  // leftover keys of the dropped slots leaves every score, mask and moved byte as it
  // was (were they in the softmax, every live token's score would move).
  const kvp_test::cache_config cfg{.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 8, .lengths = {40},
                                   .q_heads = 4, .window = 8, .seed = 11, .live = true};
  kvp::presets::snapkv snap;
  snap.scorer.window = 8;
  snap.protect = {.window = 8, .sinks = 0};
  const auto compress_twice = [&](bool scramble) {
    test_cache tc(cfg);
    kvp::pipeline<first_element_scorer, none, none, halving_top_k, kvp::layout::compact> halving;
    halving.protect = {.window = 0, .sinks = 0};
    const auto r1 = kvp_test::run(halving, tc, {{.seq = 0, .budget = 32}});
    tc.set_length(0, r1.new_lengths[0]);
    append(tc, 0, 40, 40);
    if (scramble)
      for (int l = 0; l < 2; ++l)
        for (int t = 16; t < 32; ++t) {  // head 1's dropped slots (it kept 16 of 32)
          REQUIRE(tc.live(l, 0, t, 1) == 0);
          std::vector<float> k(8);
          for (float& x : k) x = tc.uniform(-4.0f, 4.0f);
          tc.set_key(l, 0, t, 1, k);
        }
    auto r2 = kvp_test::run(snap, tc, {{.seq = 0, .budget = 24}});
    std::vector<std::vector<float>> held;
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < r2.kept_counts[0][static_cast<std::size_t>(l * 2 + h)]; ++t) held.push_back(tc.key(l, 0, t, h));
    return std::pair{r2, held};
  };
  const auto [plain, plain_keys] = compress_twice(false);
  const auto [scrambled, scrambled_keys] = compress_twice(true);
  CHECK(plain.kept_counts == scrambled.kept_counts);
  CHECK(plain.keep_masks == scrambled.keep_masks);
  CHECK(plain.scores == scrambled.scores);  // the same fp32 operations on the same live keys
  CHECK(plain_keys == scrambled_keys);
  // Head 1 held 24 tokens (16 kept + 8 appended): a budget of 24 keeps all of them.
  CHECK(plain.kept_counts[0] == std::vector<int>{24, 24, 24, 24});
  // Dropped slots score 0 (absent from the softmax) and are never kept.
  const auto& s = plain.scores[0];
  for (int l = 0; l < 2; ++l)
    for (int t = 16; t < 32; ++t) {
      CHECK(s[kvp_test::result_index(l, 1, t, 2, 40)] == -std::numeric_limits<float>::infinity());
      CHECK(plain.keep_masks[0][kvp_test::result_index(l, 1, t, 2, 40)] == 0);
    }
}

namespace {

// Three rounds of a Hard-KV preset over a live view, the engine appending between them:
// each head holds a subset of what it held, dense at the front; temperatures reused.
template <class Preset>
void three_rounds() {
  for (const auto type : {kvp::dtype::f32, kvp::dtype::bf16}) {
    CAPTURE(kvp::name_of(type));
    const int L = 2, H = 4, b = 8;
    test_cache tc({.layers = L, .block_size = b, .kv_heads = H, .head_dim = 16, .type = type, .lengths = {120, 96},
                   .capacity_blocks = 24, .q_heads = 8, .window = 8, .seed = 17, .live = true});
    std::vector<float> temperature(static_cast<std::size_t>(2) * L * H, 0.0f);
    std::vector<kvp::calibration_outcome> outcome(temperature.size(), kvp::calibration_outcome::unsolved);
    Preset p;
    p.select.state = {temperature.data(), outcome.data(), 2, L, H};
    p.protect = {.window = 8, .sinks = 1};
    std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 24}, {.seq = 1, .query_slot = 1, .budget = 24}};
    std::vector<float> solved;
    int next_position[2] = {120, 96};
    for (int round = 0; round < 3; ++round) {
      CAPTURE(round);
      std::vector<std::set<int>> before;
      for (const auto& it : items)
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < H; ++h) {
            const auto held = held_positions(tc, l, it.seq, h);
            before.emplace_back(held.begin(), held.end());
          }
      const auto r = kvp_test::run(p, tc, items);
      int rows_with_dropped = 0;
      for (std::size_t i = 0; i < items.size(); ++i) {
        const int seq = items[i].seq, T = tc.length(seq);
        const auto& counts = r.kept_counts[i];
        CHECK(r.new_lengths[i] == *std::max_element(counts.begin(), counts.end()));
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < H; ++h) {
            const std::size_t row = static_cast<std::size_t>(l * H + h);
            const auto held = held_positions(tc, l, seq, h);
            // Held now: exactly the count, dense at the front, and a subset of what the
            // head held before (a dropped token never comes back).
            CHECK(static_cast<int>(held.size()) == counts[row]);
            std::vector<int> want(static_cast<std::size_t>(T), 0);
            std::fill(want.begin(), want.begin() + counts[row], 1);
            CHECK(live_bytes(tc, l, seq, h, T) == want);
            const auto& was = before[i * L * H + row];
            for (int pos : held) CHECK_MESSAGE(was.count(pos) == 1, "position ", pos, " came back (layer ", l, " head ", h, ")");
            CHECK(std::is_sorted(held.begin(), held.end()));  // compaction keeps order
          }
        for (int row = 0; row < L * H; ++row) rows_with_dropped += static_cast<int>(before[i * L * H + row].size()) < T;
      }
      // After the first round heads held different counts: some rows started with dropped slots.
      if (round > 0) CHECK(rows_with_dropped > 0);
      // Temperatures: solved in the first round, read back after.
      if (round == 0) {
        for (const auto o : outcome) CHECK(o != kvp::calibration_outcome::unsolved);
        solved = temperature;
      } else {
        CHECK(temperature == solved);
      }
      // The engine: new lengths, then up to 24 new tokens per sequence (live in every
      // head), within the blocks the sequence has.
      for (std::size_t i = 0; i < items.size(); ++i) {
        const int seq = items[i].seq;
        const int room = static_cast<int>(tc.blocks(seq).size()) * b;
        tc.set_length(seq, r.new_lengths[i]);
        append(tc, seq, std::min(r.new_lengths[i] + 24, room), next_position[seq]);
        next_position[seq] += 24;
      }
      for (int l = 0; l < L; ++l)
        for (int slot = 0; slot < 2; ++slot)
          for (int j = 0; j < 8; ++j)
            for (int qh = 0; qh < 8; ++qh) {
              std::vector<float> q(16);
              for (float& x : q) x = tc.uniform(-1.0f, 1.0f);
              tc.set_query(l, slot, j, qh, q);
            }
    }
  }
}

}  // namespace

TEST_CASE("cautious update: three hard_kv rounds, the engine appending between them") {
  three_rounds<kvp::presets::hard_kv>();
}

TEST_CASE("cautious update: three hard_kv_rkv rounds (full redundancy over the held keys)") {
  three_rounds<kvp::presets::hard_kv_rkv>();
}

TEST_CASE("cautious update: fill writes the same live bytes") {
  test_cache tc({.block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {8}, .seed = 5, .live = true});
  set_first_elements(tc, 0, 0, 0, {5, 1, 7, 3, 8, 2, 6, 4});
  set_first_elements(tc, 0, 0, 1, {1, 9, 2, 8, 3, 7, 4, 6});
  kvp::pipeline<first_element_scorer, none, none, halving_top_k, kvp::layout::fill> halving;
  halving.protect = {.window = 0, .sinks = 0};
  const auto r = kvp_test::run(halving, tc, {{.seq = 0, .budget = 6}});
  CHECK(r.kept_counts[0] == std::vector<int>{6, 3});
  CHECK(live_bytes(tc, 0, 0, 0, 8) == std::vector<int>{1, 1, 1, 1, 1, 1, 0, 0});
  CHECK(live_bytes(tc, 0, 0, 1, 8) == std::vector<int>{1, 1, 1, 0, 0, 0, 0, 0});
  auto held = held_positions(tc, 0, 0, 1);
  std::sort(held.begin(), held.end());
  CHECK(held == std::vector<int>{1, 3, 5});
}

TEST_CASE("cautious update: full redundancy compares the held keys only") {
  // One KV head that dropped tokens 10..19 and 36..39: its redundancy over the 26 held
  // keys is that of a cache holding those keys alone, in order (1 / n and the softmax
  // over the held ones). theta -0.5 makes almost every pair similar, so each key's
  // newest neighbour would be a dropped one (39) were dropped keys compared. f32 takes
  // the fp32 kernels on the GPU, bf16 the tensor cores.
  const auto dropped = [](int t) { return (t >= 10 && t < 20) || t >= 36; };
  for (const auto type : {kvp::dtype::f32, kvp::dtype::bf16})
    for (const float theta : {0.5f, -0.5f}) {
      CAPTURE(kvp::name_of(type));
      CAPTURE(theta);
      test_cache with_dropped({.block_size = 4, .head_dim = 16, .type = type, .lengths = {40}, .seed = 12, .live = true});
      for (int t = 0; t < 6; ++t) {  // near-copies, so that theta's newest neighbours matter
        auto k = with_dropped.key(0, 0, t, 0);
        k[0] += 0.01f;
        with_dropped.set_key(0, 0, t + 25, 0, k);
      }
      test_cache held_only({.block_size = 4, .head_dim = 16, .type = type, .lengths = {26}, .seed = 13});
      std::vector<int> held;
      for (int t = 0; t < 40; ++t) {
        if (dropped(t)) {
          with_dropped.live(0, 0, t, 0) = 0;
          continue;
        }
        held_only.set_key(0, 0, static_cast<int>(held.size()), 0, with_dropped.key(0, 0, t, 0));
        held.push_back(t);
      }
      REQUIRE(held.size() == 26);
      kvp::redundancy::full r;
      r.theta = theta;
      r.lambda = 0.0f;
      r.form = kvp::redundancy::combine_form::weighted;  // final score -R
      kvp::pipeline<none, none, kvp::redundancy::full, kvp::select::top_k, kvp::layout::compact> p;
      p.redundancy = r;
      p.protect = {.window = 0, .sinks = 0};
      const auto a = kvp_test::run(p, with_dropped, {{.seq = 0, .budget = 40}});
      const auto b = kvp_test::run(p, held_only, {{.seq = 0, .budget = 26}});
      CHECK(a.kept_counts[0][0] == 26);
      for (std::size_t i = 0; i < held.size(); ++i) CHECK(a.scores[0][held[i]] == b.scores[0][i]);
      for (int t = 0; t < 40; ++t)
        if (dropped(t)) CHECK(a.keep_masks[0][t] == 0);
    }
}

TEST_CASE("cautious update: what it does not support is refused, naming the field") {
  test_cache tc({.block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {16}, .q_heads = 2, .window = 8,
                 .live = true});
  const auto before = tc.take_snapshot();
  const kvp::host_executor ex;
  const auto refuses = [&](const auto& p, const std::string& what) {
    CAPTURE(what);
    try {
      ex.compress(p, tc.view(), tc.queries(), tc.scores(), kvp_test::make_batch({{.seq = 0, .budget = 8}}));
      FAIL("accepted");
    } catch (const kvp::error& e) {
      CHECK(e.field() == "cache.live");
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
    CHECK(tc.unchanged_since(before));
  };
  kvp::pipeline<first_element_scorer, none, kvp::redundancy::lightning, kvp::select::top_k, kvp::layout::compact>
      lightning;
  lightning.protect = {.window = 0, .sinks = 0};
  refuses(lightning, "lightning");
  kvp::pipeline<first_element_scorer, none, none, kvp::select::top_k, none> in_place;
  refuses(in_place, "compacts whole rows");
}
