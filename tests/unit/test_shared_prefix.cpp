// Requests that share prefix blocks (prefix caching), compressed into fresh target
// blocks (Zipage 4.4; compression_batch::targets): the shared blocks are read and
// never written, the kept tokens that land in the prefix go to the targets, the
// request's own blocks take the rest. The reference is the same request holding a
// private copy of the prefix, compressed in place: the same masks, scores and moved
// bytes. docs/integration.md, "Prefix-shared blocks".
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "support/test_cache.hpp"

using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

constexpr int b = 4;

// Three sequences; `share[s]` leading blocks of seq s are seq 0's (its prefix), the
// rest its own. Seq s's tokens in the prefix then hold seq 0's K and V.
kvp_test::cache_config config(kvp::dtype type) {
  return {.layers = 2, .spare_blocks = 8, .block_size = b, .kv_heads = 2, .head_dim = 8, .type = type,
          .lengths = {14, 13, 11}, .q_heads = 4, .window = 4, .seed = 41};
}

// Block ids no sequence holds, in increasing order.
std::vector<int> free_blocks(const test_cache& tc) {
  std::set<int> held;
  for (int s = 0; s < tc.num_seqs(); ++s)
    for (int j = 0; j < (tc.length(s) + b - 1) / b; ++j) held.insert(tc.block(s, j));
  std::vector<int> out;
  for (int id = 0; id < tc.num_blocks(); ++id)
    if (!held.count(id)) out.push_back(id);
  return out;
}

// Makes seq s's first `n` table entries seq 0's (the fixture's dense table), after
// copying seq 0's K, V, F and positions of those tokens into seq s's own blocks, so
// that `private_copy`, the same fixture untouched by this, holds the same tokens in
// private blocks.
void share_prefix(test_cache& tc, int s, int n) {
  for (int j = 0; j < n; ++j) tc.raw_table()[tc.table_index(s, j)] = tc.block(0, j);
}
void copy_prefix(test_cache& tc, int s, int n) {
  for (int l = 0; l < tc.num_layers(); ++l)
    for (int t = 0; t < n * b; ++t)
      for (int h = 0; h < tc.kv_heads(); ++h) {
        tc.set_row(kv_kind::k, l, s, t, h, tc.key(l, 0, t, h));
        tc.set_row(kv_kind::v, l, s, t, h, tc.value(l, 0, t, h));
        tc.f(l, s, t, h) = tc.f(l, 0, t, h);
        tc.position(l, s, t, h) = tc.position(l, 0, t, h);
      }
}

kvp::presets::zipage small_zipage() {
  kvp::presets::zipage z;
  z.scorer.window = 4;
  z.protect.window = 4;
  return z;
}

// The K, V, F and position of token slot (block, slot) of every layer and head.
struct slot_state {
  std::vector<std::byte> k, v;
  float f;
  int position;
  bool operator==(const slot_state&) const = default;
};
slot_state state_at(const test_cache& tc, int l, int block, int slot, int h) {
  auto& m = const_cast<test_cache&>(tc);
  return {tc.row_bytes(kv_kind::k, l, block, slot, h), tc.row_bytes(kv_kind::v, l, block, slot, h),
          m.f_at(l, block, slot, h),
          m.raw_positions()[tc.position_index(l, block, slot, h)]};
}
std::vector<slot_state> block_state(const test_cache& tc, int block) {
  std::vector<slot_state> out;
  for (int l = 0; l < tc.num_layers(); ++l)
    for (int slot = 0; slot < b; ++slot)
      for (int h = 0; h < tc.kv_heads(); ++h) out.push_back(state_at(tc, l, block, slot, h));
  return out;
}

// Compresses `items` of `shared` (whose prefixes are shared) into targets, and the
// same items of `reference` (private prefixes) in place, and checks that they agree
// token for token, that every shared block is unchanged, and the results' tables.
void check_against_private_copy(test_cache& shared, test_cache& reference, const std::vector<kvp::batch_item>& items,
                                const std::vector<int>& prefix_blocks) {
  const auto p = small_zipage();
  std::vector<int> indptr{0}, targets, free = free_blocks(shared);
  std::size_t next = 0;
  for (const auto& it : items) {
    for (int j = 0; j < prefix_blocks[static_cast<std::size_t>(&it - items.data())]; ++j) targets.push_back(free.at(next++));
    indptr.push_back(static_cast<int>(targets.size()));
  }
  std::set<int> shared_ids;
  for (std::size_t i = 0; i < items.size(); ++i)
    for (int j = 0; j < prefix_blocks[i]; ++j) shared_ids.insert(shared.block(items[i].seq, j));
  std::vector<std::vector<slot_state>> before;
  for (int id : shared_ids) before.push_back(block_state(shared, id));
  std::vector<std::vector<int>> old_tables;
  for (const auto& it : items) {
    old_tables.emplace_back();
    for (int j = 0; j < (shared.length(it.seq) + b - 1) / b; ++j)
      old_tables.back().push_back(shared.raw_table()[shared.table_index(it.seq, j)]);
  }

  const auto got = kvp_test::run(p, shared, items, 0, 0, kvp_test::prefix_targets_of(indptr, targets));
  const auto want = kvp_test::run(p, reference, items);
  CHECK(got.keep_masks == want.keep_masks);
  CHECK(got.scores == want.scores);
  CHECK(got.new_lengths == want.new_lengths);
  CHECK(got.kept_counts == want.kept_counts);
  // The shared blocks: not a byte changed.
  std::size_t k = 0;
  for (int id : shared_ids) {
    CAPTURE(id);
    CHECK(block_state(shared, id) == before[k++]);
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    CAPTURE(i);
    const int seq = items[i].seq, n = got.new_lengths[i], kept_blocks = (n + b - 1) / b, share = prefix_blocks[i];
    const int used = (shared.length(seq) + b - 1) / b;
    // The new table: the targets first, then the own blocks; the released ones: what
    // is past the new length (unused targets too); the shared ones it no longer holds.
    std::vector<int> table, released, unshared;
    for (int j = 0; j < used; ++j) {
      const int id = j < share ? targets[static_cast<std::size_t>(indptr[i] + j)] : old_tables[i][j];
      (j < kept_blocks ? table : released).push_back(id);
    }
    for (int j = 0; j < share; ++j) unshared.push_back(old_tables[i][j]);
    CHECK(got.new_tables[i] == table);
    CHECK(got.released_blocks[i] == released);
    CHECK(got.unshared_blocks[i] == unshared);
    // Every kept token, read through the new table, equals the reference's.
    for (int l = 0; l < shared.num_layers(); ++l)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < shared.kv_heads(); ++h) {
          CAPTURE(l);
          CAPTURE(t);
          CAPTURE(h);
          CHECK(state_at(shared, l, table[static_cast<std::size_t>(t / b)], t % b, h) ==
                state_at(reference, l, reference.block(seq, t / b), t % b, h));
        }
  }
}

}  // namespace

TEST_CASE("shared prefix: one of two requests compressed into target blocks") {
  for (auto type : kvp_test::all_dtypes) {
    CAPTURE(kvp::name_of(type));
    test_cache shared(config(type)), reference(config(type));
    copy_prefix(reference, 1, 2);
    copy_prefix(shared, 1, 2);
    share_prefix(shared, 1, 2);
    check_against_private_copy(shared, reference, {{.seq = 1, .query_slot = 1, .budget = 7}}, {2});
  }
}

TEST_CASE("shared prefix: three requests share a block, all compressed in one batch") {
  test_cache shared(config(kvp::dtype::bf16)), reference(config(kvp::dtype::bf16));
  for (int s : {1, 2}) {
    copy_prefix(reference, s, 1);
    copy_prefix(shared, s, 1);
    share_prefix(shared, s, 1);
  }
  // Seq 0 owns the block and shares it too: every holder compresses into a target.
  check_against_private_copy(shared, reference,
                             {{.seq = 0, .query_slot = 0, .budget = 9, .history_tokens = 0},
                              {.seq = 1, .query_slot = 1, .budget = 6},
                              {.seq = 2, .query_slot = 2, .budget = 5}},
                             {1, 1, 1});
}

TEST_CASE("shared prefix: the prefix's owner compressed, the requests sharing it outside the batch") {
  test_cache shared(config(kvp::dtype::f16)), reference(config(kvp::dtype::f16));
  for (int s : {1, 2}) {
    copy_prefix(shared, s, 2);
    share_prefix(shared, s, 2);
  }
  check_against_private_copy(shared, reference, {{.seq = 0, .query_slot = 0, .budget = 8, .history_tokens = 4}}, {2});
}

TEST_CASE("shared prefix: what is refused, with nothing written") {
  const auto refused = [](test_cache& tc, const std::vector<kvp::batch_item>& items, std::vector<int> indptr,
                          std::vector<int> targets, const std::string& field, const std::string& value,
                          auto pipeline) {
    const auto before = tc.take_snapshot();
    try {
      const kvp::compression_batch batch{items, 0, 0, kvp_test::prefix_targets_of(indptr, targets)};
      (void)kvp::host_executor{}.compress(pipeline, tc.view(), tc.queries(), tc.scores(), batch);
      FAIL("no kvp::error for ", field);
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
      CHECK_MESSAGE(std::string(e.what()).find(value) != std::string::npos, e.what());
    }
    CHECK(tc.unchanged_since(before));
  };
  test_cache tc(config(kvp::dtype::f32));
  share_prefix(tc, 1, 2);
  const auto free = free_blocks(tc);
  const std::vector<kvp::batch_item> one{{.seq = 1, .query_slot = 1, .budget = 7}};
  const auto z = small_zipage();
  // Without targets the shared prefix is refused, as before.
  refused(tc, one, {0, 0}, {}, "cache.table[seq 1][0]", "not in the batch", z);
  // A target another sequence holds, a target given twice, more targets than blocks.
  refused(tc, one, {0, 2}, {free[0], tc.block(2, 1)}, "batch.targets.blocks[1]", "seq 2 holds", z);
  refused(tc, one, {0, 2}, {free[0], free[0]}, "batch.targets.blocks[1]", "as is blocks[0]", z);
  refused(tc, one, {0, 5}, {free[0], free[1], free[2], free[3], free[4]}, "batch.targets (item 0)", "holds 4 blocks", z);
  // Targets for one block while two are shared: the second is written in place.
  refused(tc, one, {0, 1}, {free[0]}, "cache.table[seq 1][1]", "not in the batch", z);
  // A layout that moves nothing cannot leave the shared blocks.
  kvp::pipeline<kvp::scorer::window_attention, kvp::none, kvp::none, kvp::select::top_k, kvp::none> masks_only;
  masks_only.scorer.window = 4;
  masks_only.protect.window = 4;
  refused(tc, one, {0, 2}, {free[0], free[1]}, "batch.targets", "moves no token", masks_only);
  // A prefix block another item of the batch writes (its own block there).
  test_cache tc2(config(kvp::dtype::f32));
  share_prefix(tc2, 1, 1);
  const auto free2 = free_blocks(tc2);
  refused(tc2, {{.seq = 0, .query_slot = 0, .budget = 9}, {.seq = 1, .query_slot = 1, .budget = 7}}, {0, 0, 1},
          {free2[0]}, "cache.table[seq 1][0]", "already used by seq 0", z);
}
