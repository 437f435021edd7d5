// The fill layout (SPEC.md "Layouts", Fill; KV-Compress's MoveCache on shared
// tables): the evicted slots below the kept count take the kept tokens past it, lowest
// slot first, newest token first, with F and positions; nothing else moves.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

// Scores are element 0 of each key; F <- S (accumulate, first compression).
using scored_fill = kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::accumulate, none, kvp::select::top_k,
                                  kvp::layout::fill>;

}  // namespace

TEST_CASE("fill: holes below the count take the newest kept tokens past it, with F and positions, by hand") {
  // Head 0 keeps 0 2 4 6 of 8: holes 1 3, movers (newest first) 6 4 -> slots 0..3 hold
  // tokens 0 6 2 4. Head 1 keeps 1 3 5 7: holes 0 2, movers 7 5 -> tokens 7 1 5 3.
  for (auto layout : kvp_test::all_layouts) {
    CAPTURE(kvp_test::layout_name(layout));
    test_cache tc({.block_size = 3, .kv_heads = 2, .head_dim = 4, .lengths = {8}, .layout = layout});
    kvp_test::set_first_elements(tc, 0, 0, 0, {5, 1, 7, 2, 8, 0, 6, 3});
    kvp_test::set_first_elements(tc, 0, 0, 1, {0, 9, 1, 9, 2, 9, 3, 9});
    const auto before = tc.take_snapshot();
    scored_fill p;
    p.protect = {.window = 0, .sinks = 0};
    const auto res = kvp_test::run(p, tc, {{.seq = 0, .budget = 4}});
    CHECK(res.new_lengths[0] == 4);
    CHECK(res.released_blocks[0].size() == 1u);  // 3 blocks -> 2
    const std::vector<std::vector<int>> slots{{0, 6, 2, 4}, {7, 1, 5, 3}};
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) {
        CAPTURE(h);
        CAPTURE(i);
        const int from = slots[h][i];
        CHECK(tc.position(0, 0, i, h) == from);
        CHECK(tc.token_bytes(kv_kind::k, 0, 0, i, h) == tc.token_bytes(before, kv_kind::k, 0, 0, from, h));
        CHECK(tc.token_bytes(kv_kind::v, 0, 0, i, h) == tc.token_bytes(before, kv_kind::v, 0, 0, from, h));
        CHECK(tc.f(tc.take_snapshot(), 0, 0, i, h) == tc.key(0, 0, i, h)[0]);  // F is the token's own score
      }
  }
}

TEST_CASE("fill: random rows: every kept token once below the count, kept tokens below it unmoved, no other write") {
  for (auto layout : kvp_test::all_layouts) {
    for (auto type : kvp_test::all_dtypes) {
      CAPTURE(kvp_test::layout_name(layout));
      CAPTURE(kvp::name_of(type));
      test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 8, .type = type, .lengths = {29, 17, 40},
                     .layout = layout, .seed = 7});
      const auto before = tc.take_snapshot();
      scored_fill p;
      p.protect = {.window = 3, .sinks = 1};
      const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 12}, {.seq = 2, .budget = 21}};
      const auto res = kvp_test::run(p, tc, items);
      for (std::size_t i = 0; i < items.size(); ++i) {
        const int seq = items[i].seq, T = before.lengths[seq], k = items[i].budget;
        CHECK(res.new_lengths[i] == k);
        for (int row = 0; row < 4; ++row) {
          const int l = row / 2, h = row % 2;
          const std::uint8_t* keep = &res.keep_masks[i][std::size_t(row) * T];
          std::vector<int> want;  // kept tokens below k stay; the rest fill the holes
          for (int t = 0; t < T; ++t)
            if (keep[t]) want.push_back(t);
          std::vector<int> got;
          for (int slot = 0; slot < k; ++slot) {
            const int from = tc.position(l, seq, slot, h);
            got.push_back(from);
            if (keep[slot]) CHECK(from == slot);
            CHECK(tc.token_bytes(kv_kind::k, l, seq, slot, h) == tc.token_bytes(before, kv_kind::k, l, seq, from, h));
            CHECK(tc.token_bytes(kv_kind::v, l, seq, slot, h) == tc.token_bytes(before, kv_kind::v, l, seq, from, h));
          }
          std::sort(got.begin(), got.end());
          CHECK(got == want);
        }
      }
      // Sequence 1 is not in the batch: untouched.
      for (int t = 0; t < 17; ++t)
        CHECK(tc.token_bytes(kv_kind::k, 1, 1, t, 1) == tc.token_bytes(before, kv_kind::k, 1, 1, t, 1));
    }
  }
}

TEST_CASE("fill: zipage with fill keeps zipage's masks, lengths and released blocks") {
  const kvp_test::cache_config cfg{.layers = 2, .block_size = 8, .kv_heads = 2, .head_dim = 16,
                                   .type = kvp::dtype::bf16, .lengths = {72, 64}, .q_heads = 4, .window = 16, .seed = 9};
  test_cache a(cfg), b(cfg);
  const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 56}, {.seq = 1, .query_slot = 1, .budget = 48}};
  const auto compact = kvp_test::run(kvp::presets::zipage{}, a, items);
  const auto fill = kvp_test::run(kvp::with_layout(kvp::presets::zipage{}, kvp::layout::fill{}), b, items);
  CHECK(fill.keep_masks == compact.keep_masks);
  CHECK(fill.new_lengths == compact.new_lengths);
  CHECK(fill.released_blocks == compact.released_blocks);
}

TEST_CASE("fill: shared-prefix targets are refused, naming the field") {
  test_cache tc({.block_size = 4, .kv_heads = 1, .head_dim = 4, .lengths = {12}});
  scored_fill p;
  p.protect = {.window = 0, .sinks = 0};
  const std::vector<kvp::batch_item> items{{.seq = 0, .budget = 4}};
  const std::vector<std::int32_t> indptr{0, 1}, blocks{tc.num_blocks() - 1};
  const auto before = tc.take_snapshot();
  try {
    kvp::host_executor{}.compress(p, tc.view(), tc.queries(), tc.scores(), {items, 0, 0, {indptr.data(), blocks.data()}});
    FAIL("accepted targets with the fill layout");
  } catch (const kvp::error& e) {
    CHECK(e.field() == "batch.targets");
  }
  CHECK(tc.unchanged_since(before));
}
