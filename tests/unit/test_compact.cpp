// The compact layout (Zipage alg. 4): kept tokens move, in order, to the first
// positions of the sequence's blocks with their F; new length = kept count; the
// blocks past it are released. SPEC.md "Layouts".
#include <doctest/doctest.h>

#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

// Scores are element 0 of each key; F <- S (accumulate, first compression).
using scored_compact = kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::accumulate, none,
                                     kvp::select::top_k, kvp::layout::compact>;

}  // namespace

TEST_CASE("compact: the hook") {
  const kvp::layout::compact c;
  CHECK(kvp::layout::compact::moves_tokens);
  for (int i = 0; i < 10; ++i) CHECK(c.destination(i) == i);
}

TEST_CASE("compact: kept tokens move in order to the front, F with them, blocks past the length released") {
  for (auto layout : kvp_test::all_layouts) {
    for (auto type : kvp_test::all_dtypes) {
      test_cache tc({.block_size = 3, .kv_heads = 2, .head_dim = 2, .type = type, .lengths = {8}, .layout = layout});
      CAPTURE(tc.describe());
      // Head 0 keeps {0, 2, 6, 7}; head 1 keeps {1, 3, 5, 7} (7 is the protected window).
      kvp_test::set_first_elements(tc, 0, 0, 0, {5, 1, 4, 0, 3, 2, 9, 8});
      kvp_test::set_first_elements(tc, 0, 0, 1, {0, 7, 1, 6, 2, 5, 3, 4});
      const auto before = tc.take_snapshot();
      scored_compact p;
      p.protect = {.window = 1, .sinks = 0};
      const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 4}});
      CHECK(res.new_lengths == std::vector<int>{4});
      CHECK(res.keep_masks[0] == std::vector<std::uint8_t>{1, 0, 1, 0, 0, 0, 1, 1, /* head 1 */ 0, 1, 0, 1, 0, 1, 0, 1});
      CHECK(res.released_blocks == std::vector<std::vector<int>>{{tc.block(0, 2)}});
      const int kept[2][4] = {{0, 2, 6, 7}, {1, 3, 5, 7}};
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          CAPTURE(h);
          CAPTURE(i);
          const int t = kept[h][i];
          CHECK(tc.token_bytes(kv_kind::k, 0, 0, i, h) == tc.token_bytes(before, kv_kind::k, 0, 0, t, h));
          CHECK(tc.token_bytes(kv_kind::v, 0, 0, i, h) == tc.token_bytes(before, kv_kind::v, 0, 0, t, h));
          CHECK(tc.f(0, 0, i, h) == tc.key(0, 0, i, h)[0]);  // F <- S = key[0], moved with the token
        }
      // Nothing outside the sequence's first T tokens was written; the table and lengths not at all.
      const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 4}};
      CHECK(tc.writes_outside(before, tc.batch_region(items, 0, 1), tc.batch_region(items, 0, 1)).empty());
    }
  }
}

TEST_CASE("compact: a batch of several sequences, budgets per item; other sequences untouched") {
  test_cache tc({.layers = 3, .block_size = 2, .kv_heads = 2, .head_dim = 3, .type = kvp::dtype::bf16,
                 .lengths = {9, 6, 11, 4}, .csr = true, .layout = kvp_test::cache_layout::vllm_flash});
  const auto before = tc.take_snapshot();
  const std::vector<kvp::batch_item> items{{.seq = 2, .budget = 5}, {.seq = 0, .budget = 3}};
  scored_compact p;
  p.protect = {.window = 1, .sinks = 1};
  const auto res = kvp_test::run(p, tc, items, 1, 2);  // layers 1, 2
  CHECK(res.new_lengths == std::vector<int>{5, 3});
  CHECK(res.released_blocks[0] == std::vector<int>{tc.block(2, 3), tc.block(2, 4), tc.block(2, 5)});
  CHECK(res.released_blocks[1] == std::vector<int>{tc.block(0, 2), tc.block(0, 3), tc.block(0, 4)});
  for (std::size_t i = 0; i < items.size(); ++i) {
    const int seq = items[i].seq, T = before.lengths[seq], H = 2;
    for (int lo = 0; lo < 2; ++lo)
      for (int h = 0; h < H; ++h) {
        int next = 0;
        for (int t = 0; t < T; ++t) {
          if (!res.keep_masks[i][kvp_test::result_index(lo, h, t, H, T)]) continue;
          CHECK(tc.token_bytes(kv_kind::k, 1 + lo, seq, next, h) == tc.token_bytes(before, kv_kind::k, 1 + lo, seq, t, h));
          CHECK(tc.token_bytes(kv_kind::v, 1 + lo, seq, next, h) == tc.token_bytes(before, kv_kind::v, 1 + lo, seq, t, h));
          ++next;
        }
        CHECK(next == items[i].budget);
      }
  }
  const auto region = tc.batch_region(items, 1, 3);
  CHECK(tc.writes_outside(before, region, region).empty());
}

TEST_CASE("compact: keeping everything moves nothing") {
  test_cache tc({.block_size = 2, .kv_heads = 2, .head_dim = 2, .lengths = {5}});
  const auto before = tc.take_snapshot();
  kvp::pipeline<kvp_test::first_element_scorer, none, none, kvp::select::top_k, kvp::layout::compact> p;
  p.protect = {.window = 0, .sinks = 0};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 5}});
  CHECK(res.new_lengths[0] == 5);
  CHECK(res.released_blocks[0].empty());
  CHECK(tc.unchanged_since(before));
}

TEST_CASE("compact: the budget ends on a block boundary, and within one") {
  for (int budget : {1, 2, 3, 4, 5, 6}) {
    test_cache tc({.block_size = 2, .head_dim = 1, .lengths = {7}});
    kvp::pipeline<kvp_test::first_element_scorer, none, none, kvp::select::top_k, kvp::layout::compact> p;
    p.protect = {.window = 0, .sinks = 0};
    const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = budget}});
    std::vector<int> released;
    for (int blk = (budget + 1) / 2; blk < 4; ++blk) released.push_back(tc.block(0, blk));
    CAPTURE(budget);
    CHECK(res.new_lengths[0] == budget);
    CHECK(res.released_blocks[0] == released);
  }
}

TEST_CASE("layout none: keep masks produced, nothing moves, nothing released") {
  test_cache tc({.block_size = 2, .kv_heads = 2, .head_dim = 2, .lengths = {7}});
  const auto before = tc.take_snapshot();
  kvp::pipeline<kvp_test::first_element_scorer, none, none, kvp::select::top_k, none> p;
  p.protect = {.window = 0, .sinks = 0};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 2}});
  int kept = 0;
  for (auto x : res.keep_masks[0]) kept += x;
  CHECK(kept == 4);  // 2 per head
  CHECK(res.new_lengths[0] == 7);
  CHECK(res.released_blocks[0].empty());
  CHECK(tc.unchanged_since(before));
}

TEST_CASE("compact: each token's original position moves with it, per head") {
  // Two heads keep different tokens (their keys differ); the positions view, with the
  // original position of each token, ends with the kept positions in order, per head.
  for (auto layout : kvp_test::all_layouts) {
    CAPTURE(kvp_test::layout_name(layout));
    test_cache tc({.block_size = 3, .kv_heads = 2, .head_dim = 4, .lengths = {8}, .layout = layout});
    kvp_test::set_first_elements(tc, 0, 0, 0, {5, 1, 7, 2, 8, 0, 6, 3});  // head 0 keeps 0 2 4 6
    kvp_test::set_first_elements(tc, 0, 0, 1, {0, 9, 1, 9, 2, 9, 3, 9});  // head 1 keeps 1 3 5 7
    const auto before = tc.take_snapshot();
    scored_compact p;
    p.protect = {.window = 0, .sinks = 0};
    const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 4}});
    CHECK(res.new_lengths[0] == 4);
    const std::vector<std::vector<int>> kept{{0, 2, 4, 6}, {1, 3, 5, 7}};
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) {
        CAPTURE(h);
        CAPTURE(i);
        CHECK(tc.position(0, 0, i, h) == kept[h][i]);
        CHECK(tc.token_bytes(kv_kind::k, 0, 0, i, h) == tc.token_bytes(before, kv_kind::k, 0, 0, kept[h][i], h));
      }
  }
}
