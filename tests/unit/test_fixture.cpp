// The test fixture itself, and the layout constructors it is checked against: every
// view built by kvp::layouts::* addresses exactly the bytes the fixture's own index
// math does, for every layout, dtype and table form.
#include <doctest/doctest.h>

#include <set>

#include "support/test_cache.hpp"

using kvp_test::cache_config;
using kvp_test::cache_layout;
using kvp_test::kv_kind;
using kvp_test::test_cache;

TEST_CASE("fixture: layout views address the fixture's bytes") {
  for (cache_layout layout : kvp_test::all_layouts) {
    for (kvp::dtype type : kvp_test::all_dtypes) {
      for (bool csr : {false, true}) {
        test_cache tc({.layers = 3, .block_size = 3, .kv_heads = 2, .head_dim = 5, .type = type,
                       .lengths = {7, 1, 9}, .csr = csr, .layout = layout, .seed = 11});
        CAPTURE(tc.describe());
        const kvp::paged_kv_view v = tc.view();
        CHECK(v.row_bytes() == 5 * kvp::size_of(type));
        std::set<const std::byte*> seen;
        for (int l = 0; l < 3; ++l)
          for (int s = 0; s < 3; ++s)
            for (int t = 0; t < tc.length(s); ++t)
              for (int h = 0; h < 2; ++h) {
                const int blk = tc.block_of_token(s, t);
                CHECK(v.physical_block(s, t) == blk);
                CHECK(v.k_row(l, s, t, h) == tc.row_ptr(kv_kind::k, l, blk, t % 3, h));
                CHECK(v.v_row(l, s, t, h) == tc.row_ptr(kv_kind::v, l, blk, t % 3, h));
                CHECK(seen.insert(v.k_row(l, s, t, h)).second);
                CHECK(seen.insert(v.v_row(l, s, t, h)).second);
              }
      }
    }
  }
}

TEST_CASE("fixture: shuffled table, ownership, spare blocks") {
  test_cache tc({.spare_blocks = 3, .block_size = 2, .lengths = {5, 4, 1}});
  CHECK(tc.num_blocks() == 3 + 2 + 1 + 3);
  std::vector<int> all;
  for (int s = 0; s < 3; ++s)
    for (int b : tc.blocks(s)) all.push_back(b);
  bool identity = true;
  for (std::size_t i = 0; i < all.size(); ++i) identity = identity && all[i] == static_cast<int>(i);
  CHECK_FALSE(identity);
  std::set<int> unique(all.begin(), all.end());
  CHECK(unique.size() == all.size());
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < static_cast<int>(tc.blocks(s).size()); ++i) CHECK(tc.owner(tc.block(s, i)) == std::pair{s, i});
  int unowned = 0;
  for (int b = 0; b < tc.num_blocks(); ++b) unowned += tc.owner(b).first < 0;
  CHECK(unowned == 3);
  // Dense table: rows padded with -1 past a sequence's blocks.
  const auto q = tc.sequences();
  CHECK_FALSE(q.table.is_csr());
  CHECK(q.table.row_stride == 3);
  CHECK(q.table.indices[1 * 3 + 2] == -1);
  CHECK(q.table.block(1, 1) == tc.block(1, 1));
}

TEST_CASE("fixture: CSR table with spare capacity") {
  test_cache tc({.block_size = 4, .lengths = {5, 12}, .capacity_blocks = 3, .csr = true});
  const auto q = tc.sequences();
  REQUIRE(q.table.is_csr());
  CHECK(q.table.capacity(0) == 3);
  CHECK(q.table.capacity(1) == 3);
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < static_cast<int>(tc.blocks(s).size()); ++i) CHECK(q.table.block(s, i) == tc.block(s, i));
}

TEST_CASE("fixture: set by hand, snapshot, writes outside a region") {
  for (kvp::dtype type : kvp_test::all_dtypes) {
    test_cache tc({.layers = 2, .block_size = 2, .kv_heads = 2, .head_dim = 2, .type = type, .lengths = {3, 2},
                   .q_heads = 4, .window = 2});
    tc.set_key(1, 0, 2, 1, {0.5f, -2.0f});
    CHECK(tc.key(1, 0, 2, 1) == std::vector<float>{0.5f, -2.0f});
    tc.set_query(1, 1, 0, 3, {1.0f, 0.25f});
    CHECK(tc.query(1, 1, 0, 3) == std::vector<float>{1.0f, 0.25f});
    // The query view reads what the fixture wrote.
    const auto qv = tc.queries();
    CHECK(kvp::load_as_float(qv.row(1, 1, 0, 3), type, 1) == 0.25f);
    tc.f(0, 1, 1, 1) = 7.0f;
    CHECK(tc.scores().at(0, tc.block_of_token(1, 1), 1, 1) == 7.0f);

    const auto snap = tc.take_snapshot();
    CHECK(tc.unchanged_since(snap));
    tc.set_value(0, 1, 0, 0, {3.0f, 3.0f});
    CHECK_FALSE(tc.unchanged_since(snap));
    const std::vector<kvp::batch_item> items{{.seq = 1, .budget = 1}};
    CHECK(tc.writes_outside(snap, tc.batch_region(items, 0, 1), tc.no_region()).empty());
    CHECK(tc.writes_outside(snap, tc.batch_region(items, 1, 2), tc.no_region()).size() == 1);
    tc.f(1, 0, 0, 0) += 1.0f;
    CHECK(tc.writes_outside(snap, tc.batch_region(items, 0, 1), tc.batch_region(items, 0, 2)).size() == 1);
  }
}
