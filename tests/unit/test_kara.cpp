// Kara (SPEC.md "Bidirectional window", "Token2Chunk"; kara.txt 4.1-4.3, C.2-C.4):
// the Token2Chunk rule on rows worked by hand, bidirectional scores against a hand
// computation, and the window-only compaction's properties. Every pipeline case
// runs through kvp_test::run, so the gpu_unit build checks the CUDA executor too.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "support/test_cache.hpp"

using kvp::none;
using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

using windowed = kvp::pipeline<kvp::scorer::bidirectional_window, none, none, kvp::select::token2chunk,
                               kvp::layout::window_compact>;

// keep_pattern's mask as the set of kept positions.
std::set<int> kept_of(const kvp::select::token2chunk& sel, const std::vector<float>& a, int k,
                      kvp::select::token2chunk::choice* choice = nullptr) {
  std::vector<std::uint8_t> keep(a.size(), 7);
  const auto c = sel.keep_pattern(a, k, keep);
  if (choice) *choice = c;
  std::set<int> out;
  for (std::size_t t = 0; t < a.size(); ++t) {
    REQUIRE((keep[t] == 0 || keep[t] == 1));
    if (keep[t]) out.insert(static_cast<int>(t));
  }
  return out;
}

// 20 tokens: 0.1 t everywhere but the anchors planted at `at` with `value`.
std::vector<float> planted(const std::vector<std::pair<int, float>>& anchors, int n = 20) {
  std::vector<float> a(static_cast<std::size_t>(n));
  for (int t = 0; t < n; ++t) a[t] = 0.1f * static_cast<float>(t);
  for (auto [t, v] : anchors) a[t] = v;
  return a;
}

}  // namespace

TEST_CASE("token2chunk: the paper's figure-7 setting (gamma 7, alpha 10) worked by hand") {
  // k 15 -> 5 anchors {2, 5, 9, 10, 17}; gaps 3 and 4 enclose chunks {3, 4} and
  // {6, 7, 8}; 9-10 is adjacent (no interior); 10-17 is exactly gamma: not a chunk.
  // floor(10 / 5) = 2 chunks, 5 tokens added; the other 5 of alpha go to the best
  // singles left: 19, 18, 16, 15, 14.
  const kvp::select::token2chunk sel{.gamma = 7, .alpha = 10};
  CHECK(sel.max_chunks() == 2);
  const auto a = planted({{2, 10.0f}, {5, 9.0f}, {9, 8.0f}, {10, 11.0f}, {17, 12.0f}});
  kvp::select::token2chunk::choice c;
  const auto kept = kept_of(sel, a, 15, &c);
  CHECK(c.anchors == std::vector<int>{2, 5, 9, 10, 17});
  CHECK(c.chunks == std::vector<std::pair<int, int>>{{2, 5}, {5, 9}});
  CHECK(c.fill == std::vector<int>{14, 15, 16, 18, 19});
  CHECK(kept == std::set<int>{2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18, 19});
  CHECK(sel.region_keep(20, 15) == 15);
}

TEST_CASE("token2chunk: gap gamma - 1 is a chunk, gap gamma is not") {
  const kvp::select::token2chunk sel{.gamma = 4, .alpha = 2};  // one chunk of at most 2 tokens
  kvp::select::token2chunk::choice c;
  // Anchors 3 and 6: gap 3 = gamma - 1, interior {4, 5}.
  kept_of(sel, planted({{3, 5.0f}, {6, 5.0f}}), 4, &c);
  CHECK(c.chunks == std::vector<std::pair<int, int>>{{3, 6}});
  CHECK(c.fill.empty());
  // Anchors 3 and 7: gap 4 = gamma, no chunk; both added tokens are singles.
  kept_of(sel, planted({{3, 5.0f}, {7, 5.0f}}), 4, &c);
  CHECK(c.chunks.empty());
  CHECK(c.fill == std::vector<int>{18, 19});
}

TEST_CASE("token2chunk: chunks ranked by (A_lo + A_hi) * interior, ties to the later chunk") {
  const kvp::select::token2chunk sel{.gamma = 8, .alpha = 6};  // one chunk (6 / 6)
  kvp::select::token2chunk::choice c;
  // Anchors 2, 4, 10: chunk (2, 4) scores (9 + 8) * 1 = 17, chunk (4, 10) (8 + 7) * 5 = 75.
  kept_of(sel, planted({{2, 9.0f}, {4, 8.0f}, {10, 7.0f}}), 9, &c);
  CHECK(c.chunks == std::vector<std::pair<int, int>>{{4, 10}});
  CHECK(c.fill == std::vector<int>{19});  // 6 - 5 added
  // Equal scores: anchors 2, 5, 8 all 6.0 -> both chunks (6 + 6) * 2 = 24; the later wins.
  kept_of(sel, planted({{2, 6.0f}, {5, 6.0f}, {8, 6.0f}}), 9, &c);
  CHECK(c.chunks == std::vector<std::pair<int, int>>{{5, 8}});
}

TEST_CASE("token2chunk: no eligible chunk, a budget below alpha, a budget past the region") {
  const kvp::select::token2chunk sel{.gamma = 8, .alpha = 4};
  kvp::select::token2chunk::choice c;
  // Adjacent anchors 5, 6 and a far one, 15: nothing encloses a chunk; all of alpha is singles.
  auto kept = kept_of(sel, planted({{5, 9.0f}, {6, 9.0f}, {15, 9.0f}}), 7, &c);
  CHECK(c.chunks.empty());
  CHECK(kept == std::set<int>{5, 6, 15, 16, 17, 18, 19});
  // k 3 < alpha: no anchors, the 3 best singles.
  kept = kept_of(sel, planted({}), 3, &c);
  CHECK(c.anchors.empty());
  CHECK(kept == std::set<int>{17, 18, 19});
  // k past the region: everything.
  kept = kept_of(sel, planted({}, 10), 30, &c);
  CHECK(kept.size() == 10u);
  CHECK(sel.region_keep(10, 30) == 10);
}

TEST_CASE("token2chunk: NaN ranks as -inf, ties between tokens go to the later one") {
  const kvp::select::token2chunk sel{.gamma = 3, .alpha = 0};
  std::vector<float> a(6, 1.0f);
  a[5] = std::nanf("");
  CHECK(kept_of(sel, a, 2) == std::set<int>{3, 4});
}

TEST_CASE("bidirectional_window: column sums of the window's softmax, computed by hand") {
  // One sequence: a block before the window, a window of 8 (buffer 2) and 3 tokens
  // after it. Queries: the window's 8, G = 2. Every score against an independent
  // computation; the buffer, the tail and the prefix are never candidates.
  const int b = 4;
  test_cache tc({.layers = 1, .block_size = b, .kv_heads = 1, .head_dim = 4, .lengths = {4 + 8 + 3}, .q_heads = 2,
                 .window = 8, .seed = 3});
  windowed p;
  p.scorer = {.window = 8, .buffer = 2};
  p.select = {.gamma = 3, .alpha = 1};
  p.protect = {.window = 0, .sinks = 0};
  const auto before = tc.take_snapshot();
  std::vector<float> want(6, 0.0f);
  for (int j = 0; j < 8; ++j)
    for (int g = 0; g < 2; ++g) {
      const auto q = tc.query(0, 0, j, g);
      std::vector<double> z(6);
      double m = -1e30, sum = 0;
      for (int t = 0; t < 6; ++t) {
        const auto k = tc.key(0, 0, 4 + t, 0);
        double dot = 0;
        for (int i = 0; i < 4; ++i) dot += double(q[i]) * k[i];
        z[t] = dot / 2.0;  // sqrt(d)
        m = std::max(m, z[t]);
      }
      for (double& x : z) sum += (x = std::exp(x - m));
      for (int t = 0; t < 6; ++t) want[t] += static_cast<float>(z[t] / sum);
    }
  const auto r = kvp_test::run(p, tc, {{.seq = 0, .query_slot = 0, .budget = 3, .window_begin = 4}});
  REQUIRE(r.scores[0].size() == 11u);  // the window and the tokens after it
  for (int t = 0; t < 6; ++t) CHECK(r.scores[0][t] == doctest::Approx(want[t]).epsilon(1e-5));
  for (int t = 6; t < 11; ++t) CHECK(std::isinf(r.scores[0][t]));
  CHECK(r.new_lengths[0] == 4 + 3 + 2 + 3);
  CHECK(r.kept_counts[0] == std::vector<int>{12});
  // The prefix block: untouched, and first in the new table.
  for (int t = 0; t < 4; ++t)
    for (auto kind : {kv_kind::k, kv_kind::v})
      CHECK(tc.token_bytes(kind, 0, 0, t, 0) == tc.token_bytes(before, kind, 0, 0, t, 0));
  REQUIRE(r.new_tables[0].size() == 3u);
  CHECK(r.new_tables[0][0] == tc.block(0, 0));
}

TEST_CASE("window_compact: nothing before the window changes, kept tokens move down in order, buffer and tail kept") {
  for (auto layout : kvp_test::all_layouts) {
    for (auto type : kvp_test::all_dtypes) {
      const int b = 4;
      // seq 0: 2 blocks before a window of 12 and 2 tokens after; seq 1: window at 0.
      test_cache tc({.layers = 2, .block_size = b, .kv_heads = 2, .head_dim = 8, .type = type,
                     .lengths = {8 + 12 + 2, 12 + 4}, .layout = layout, .q_heads = 4, .window = 12, .seed = 11});
      windowed p;
      p.scorer = {.window = 12, .buffer = 3};
      p.select = {.gamma = 4, .alpha = 2};
      p.protect = {.window = 0, .sinks = 0};
      const auto before = tc.take_snapshot();
      const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 1, .budget = 4, .window_begin = 8},
                                               {.seq = 1, .query_slot = 0, .budget = 5, .window_begin = 0}};
      const auto r = kvp_test::run(p, tc, items);
      INFO(kvp_test::layout_name(layout), " ", kvp::name_of(type));
      for (int i = 0; i < 2; ++i) {
        const int seq = items[i].seq, wb = items[i].window_begin, T = tc.length(seq) - wb;
        const int n = 12 - 3, kept_region = std::min(items[i].budget, n);
        CHECK(r.new_lengths[i] == wb + kept_region + (T - n));
        const int used = (wb + T + b - 1) / b, kept_blocks = (r.new_lengths[i] + b - 1) / b;
        CHECK(static_cast<int>(r.released_blocks[i].size()) == used - kept_blocks);
        for (int k = 0; k < kept_blocks; ++k) CHECK(r.new_tables[i][k] == tc.block(seq, k));
        for (int row = 0; row < 4; ++row) {
          const int l = row / 2, h = row % 2;
          CHECK(r.kept_counts[i][row] == r.new_lengths[i]);
          const std::uint8_t* keep = &r.keep_masks[i][std::size_t(row) * T];
          // Before the window: the same bytes.
          for (int t = 0; t < wb; ++t)
            for (auto kind : {kv_kind::k, kv_kind::v})
              CHECK(tc.token_bytes(kind, l, seq, t, h) == tc.token_bytes(before, kind, l, seq, t, h));
          // The buffer and the tail are kept, the region keeps its count.
          CHECK(std::count(keep, keep + n, 1) == kept_region);
          for (int t = n; t < T; ++t) CHECK(keep[t] == 1);
          // Kept tokens, in order, from wb on.
          int dst = wb;
          for (int t = 0; t < T; ++t)
            if (keep[t]) {
              for (auto kind : {kv_kind::k, kv_kind::v})
                CHECK(tc.token_bytes(kind, l, seq, dst, h) == tc.token_bytes(before, kind, l, seq, wb + t, h));
              ++dst;
            }
        }
      }
    }
  }
}

TEST_CASE("window_compact: refused windows name the field") {
  test_cache tc({.layers = 1, .block_size = 4, .kv_heads = 1, .head_dim = 4, .lengths = {20}, .window = 8});
  windowed p;
  p.scorer = {.window = 8, .buffer = 2};
  p.select = {.gamma = 3, .alpha = 1};
  p.protect = {.window = 0, .sinks = 0};
  const kvp::host_executor ex;
  auto refuses = [&](const auto& pipe, kvp::batch_item it, const char* field) {
    const std::vector<kvp::batch_item> items{it};
    const auto before = tc.take_snapshot();
    try {
      ex.compress(pipe, tc.view(), tc.queries(), tc.scores(), {items});
      FAIL("accepted, expected an error on ", field);
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
    }
    CHECK(tc.unchanged_since(before));
  };
  refuses(p, {.seq = 0, .budget = 3, .window_begin = 6}, "batch[0].window_begin");   // not on a block boundary
  refuses(p, {.seq = 0, .budget = 3, .window_begin = 20}, "batch[0].window_begin");  // past the sequence
  refuses(p, {.seq = 0, .budget = 3, .window_begin = 16}, "pipeline.scorer.window");  // 4 tokens: no room for 8
  kvp::presets::snapkv whole;
  whole.scorer.window = 4;
  whole.protect.window = 4;
  refuses(whole, {.seq = 0, .budget = 8, .window_begin = 4}, "batch[0].window_begin");  // not a window layout
  auto bad = p;
  bad.select.gamma = 2;
  refuses(bad, {.seq = 0, .budget = 3, .window_begin = 4}, "pipeline.select.gamma");
  bad = p;
  bad.protect.sinks = 1;
  refuses(bad, {.seq = 0, .budget = 3, .window_begin = 4}, "pipeline.protect");
  bad = p;
  bad.scorer.buffer = 8;
  refuses(bad, {.seq = 0, .budget = 3, .window_begin = 4}, "pipeline.scorer.buffer");
}

TEST_CASE("kara: the preset's defaults are the paper's") {
  const kvp::presets::kara k;
  CHECK(k.scorer.window == 768);
  CHECK(k.scorer.buffer == 32);
  CHECK(k.scorer.key_end(1000) == 736);
  CHECK(k.select.gamma == 8);
  CHECK(k.select.alpha == 16);
  CHECK(kvp::presets::kara::kara_budget + k.scorer.buffer == 257);
  CHECK(k.select.anchors(736, kvp::presets::kara::kara_budget) == 209);
}

TEST_CASE("kara: GQA 4, head dims 64 and 128, windows of several blocks, ragged tails, three sequences") {
  // The sizes the tensor-core scorer takes (16-bit, head dim a multiple of 16), with a
  // region (88) that is not a multiple of the 64-key tile, and the fp32 path beside.
  for (auto type : kvp_test::all_dtypes) {
    for (int d : {64, 128}) {
      const int b = 16;
      test_cache tc({.layers = 2, .block_size = b, .kv_heads = 2, .head_dim = d, .type = type,
                     .lengths = {3 * b + 96 + 5, 96 + 16, 2 * b + 96 + 1}, .q_heads = 8, .window = 96, .seed = 21});
      kvp::presets::kara p;
      p.scorer = {.window = 96, .buffer = 8};
      p.select = {.gamma = 5, .alpha = 6};
      const auto before = tc.take_snapshot();
      const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 2, .budget = 30, .window_begin = 3 * b},
                                               {.seq = 1, .query_slot = 0, .budget = 30, .window_begin = 0},
                                               {.seq = 2, .query_slot = 1, .budget = 40, .window_begin = 2 * b}};
      const auto r = kvp_test::run(p, tc, items);
      INFO(kvp::name_of(type), " d ", d);
      for (std::size_t i = 0; i < items.size(); ++i) {
        const int wb = items[i].window_begin, T = tc.length(items[i].seq) - wb;
        CHECK(r.new_lengths[i] == wb + items[i].budget + (T - 88));
        for (int row = 0; row < 4; ++row)
          for (int t = 0; t < wb; ++t)
            CHECK(tc.token_bytes(kv_kind::k, row / 2, items[i].seq, t, row % 2) ==
                  tc.token_bytes(before, kv_kind::k, row / 2, items[i].seq, t, row % 2));
      }
    }
  }
}
