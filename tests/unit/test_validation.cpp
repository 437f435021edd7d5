// Malformed input (SPEC.md invariant 5): every case throws kvp::error naming the field
// and the value, before any byte of the cache, F or the queries is written.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/test_cache.hpp"

using kvp::none;
using kvp_test::test_cache;

namespace {

// Zipage's pipeline with a small window: reads queries, keeps F, pools, redundancy.
kvp::presets::zipage small_zipage() {
  kvp::presets::zipage z;
  z.scorer.window = 4;
  z.protect.window = 4;
  return z;
}

test_cache make(kvp_test::cache_layout layout = kvp_test::cache_layout::nhd, bool csr = false) {
  return test_cache({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .type = kvp::dtype::f32,
                     .lengths = {12, 9}, .csr = csr, .layout = layout, .q_heads = 4, .window = 4, .slots = 2, .seed = 7});
}

struct call {
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;
  std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 8}, {.seq = 1, .query_slot = 1, .budget = 6}};
  int layer_begin = 0, layer_count = 0;

  explicit call(test_cache& tc) : cache(tc.view()), queries(tc.queries()), scores(tc.scores()) {}
};

// Runs p and expects a kvp::error naming `field` whose message holds `value`; nothing written.
template <class P>
void expect_error(const P& p, test_cache& tc, const call& c, const std::string& field, const std::string& value) {
  const auto before = tc.take_snapshot();
  bool thrown = false;
  try {
    (void)kvp::host_executor{}.compress(p, c.cache, c.queries, c.scores,
                                        kvp_test::make_batch(c.items, c.layer_begin, c.layer_count));
  } catch (const kvp::error& e) {
    thrown = true;
    CHECK(e.field() == field);
    CHECK_MESSAGE(std::string(e.what()).find(value) != std::string::npos, e.what());
    CHECK_MESSAGE(std::string(e.what()).find(field) != std::string::npos, e.what());
  }
  CHECK_MESSAGE(thrown, "no kvp::error for " << field);
  CHECK(tc.unchanged_since(before));
}

}  // namespace

TEST_CASE("validation: a well-formed call goes through (the baseline of every case below)") {
  test_cache tc = make();
  call c(tc);
  const auto res = kvp::host_executor{}.compress(small_zipage(), c.cache, c.queries, c.scores, kvp_test::make_batch(c.items));
  CHECK(res.new_lengths == std::vector<int>{8, 6});
}

TEST_CASE("validation: block ids") {
  SUBCASE("out of range, dense") {
    test_cache tc = make();
    tc.raw_table()[tc.table_index(0, 1)] = 77;
    expect_error(small_zipage(), tc, call(tc), "cache.table[seq 0][1]", "77");
  }
  SUBCASE("negative, CSR") {
    test_cache tc = make(kvp_test::cache_layout::nano_vllm, true);
    tc.raw_table()[tc.table_index(1, 2)] = -3;
    expect_error(small_zipage(), tc, call(tc), "cache.table[seq 1][2]", "-3");
  }
  SUBCASE("repeated within a sequence") {
    test_cache tc = make();
    const int id = tc.block(0, 0);
    tc.raw_table()[tc.table_index(0, 2)] = id;
    expect_error(small_zipage(), tc, call(tc), "cache.table[seq 0][2]", std::to_string(id));
  }
  SUBCASE("shared by two sequences of the batch") {
    test_cache tc = make();
    const int id = tc.block(0, 1);
    tc.raw_table()[tc.table_index(1, 0)] = id;
    expect_error(small_zipage(), tc, call(tc), "cache.table[seq 1][0]", std::to_string(id));
  }
}

TEST_CASE("validation: a block another sequence holds is never written (prefix sharing)") {
  SUBCASE("held by a sequence outside the batch") {
    test_cache tc = make();
    tc.raw_table()[tc.table_index(1, 0)] = tc.block(0, 1);  // seq 1's first block is seq 0's second
    call c(tc);
    c.items = {{.seq = 0, .query_slot = 0, .budget = 8}};
    expect_error(small_zipage(), tc, c, "cache.table[seq 0][1]", "seq 1 (not in the batch)");
  }
  SUBCASE("the outside sequence compressed, the prefix owner not") {
    test_cache tc = make();
    tc.raw_table()[tc.table_index(1, 0)] = tc.block(0, 0);
    call c(tc);
    c.items = {{.seq = 1, .query_slot = 1, .budget = 6}};
    expect_error(small_zipage(), tc, c, "cache.table[seq 1][0]", "seq 0 (not in the batch)");
  }
  SUBCASE("three sequences share a prefix block, one of them compressed") {
    test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4, .type = kvp::dtype::f32,
                   .lengths = {12, 9, 10}, .q_heads = 4, .window = 4, .slots = 3, .seed = 7});
    tc.raw_table()[tc.table_index(1, 0)] = tc.block(0, 0);
    tc.raw_table()[tc.table_index(2, 0)] = tc.block(0, 0);
    call c(tc);
    c.items = {{.seq = 2, .query_slot = 2, .budget = 6}};
    expect_error(small_zipage(), tc, c, "cache.table[seq 2][0]", "not in the batch");
  }
  SUBCASE("marked shared by the engine's refcounts") {
    test_cache tc = make();
    std::vector<std::int32_t> refcounts(static_cast<std::size_t>(tc.num_blocks()), 1);
    refcounts[static_cast<std::size_t>(tc.block(0, 2))] = 2;
    call c(tc);
    c.cache.sharing.refcounts = refcounts.data();
    expect_error(small_zipage(), tc, c, "cache.table[seq 0][2]", "cache.sharing");
  }
  SUBCASE("marked shared by the engine's bitmask") {
    test_cache tc = make();
    std::vector<std::uint32_t> bits(static_cast<std::size_t>(tc.num_blocks() + 31) / 32, 0u);
    const int id = tc.block(1, 1);
    bits[static_cast<std::size_t>(id / 32)] |= 1u << (id % 32);
    call c(tc);
    c.cache.sharing.bitmask = bits.data();
    expect_error(small_zipage(), tc, c, "cache.table[seq 1][1]", "cache.sharing");
  }
  SUBCASE("a marker on blocks the batch does not hold is no error") {
    test_cache tc = make();
    std::vector<std::int32_t> refcounts(static_cast<std::size_t>(tc.num_blocks()), 3);
    for (int b = 0; b < 3; ++b) refcounts[static_cast<std::size_t>(tc.block(0, b))] = 1;
    call c(tc);
    c.cache.sharing.refcounts = refcounts.data();
    c.items = {{.seq = 0, .query_slot = 0, .budget = 8}};
    const auto res = kvp::host_executor{}.compress(small_zipage(), c.cache, c.queries, c.scores, kvp_test::make_batch(c.items));
    CHECK(res.new_lengths == std::vector<int>{8});
  }
  SUBCASE("a sequence outside the batch with a length its table cannot hold") {
    test_cache tc = make();
    tc.raw_lengths()[1] = 999;
    call c(tc);
    c.items = {{.seq = 0, .query_slot = 0, .budget = 8}};
    expect_error(small_zipage(), tc, c, "cache.lengths[1]", "999");
  }
}

TEST_CASE("validation: budgets, windows, histories") {
  test_cache tc = make();
  SUBCASE("budget larger than the sequence") {
    call c(tc);
    c.items[1].budget = 10;  // seq 1 holds 9
    expect_error(small_zipage(), tc, c, "batch[1].budget", "10");
  }
  SUBCASE("budget not positive") {
    call c(tc);
    c.items[0].budget = 0;
    expect_error(small_zipage(), tc, c, "batch[0].budget", "0");
  }
  SUBCASE("budget smaller than the protected count") {
    call c(tc);
    auto z = small_zipage();
    z.protect.sinks = 2;  // window 4 + sinks 2 = 6 protected
    c.items[0].budget = 5;
    expect_error(z, tc, c, "batch[0].budget", "5");
  }
  SUBCASE("scorer window longer than the sequence") {
    tc.set_length(1, 3);
    call c(tc);
    c.items[1].budget = 2;
    auto z = small_zipage();
    z.protect.window = 1;
    expect_error(z, tc, c, "pipeline.scorer.window", "4");
  }
  SUBCASE("protect window longer than the sequence") {
    call c(tc);
    auto z = small_zipage();
    z.protect.window = 10;  // seq 1 holds 9
    c.items[0].budget = 12;
    c.items[1].budget = 9;
    expect_error(z, tc, c, "pipeline.protect.window", "10");
  }
  SUBCASE("history past the length") {
    call c(tc);
    c.items[0].history_tokens = 13;
    expect_error(small_zipage(), tc, c, "batch[0].history_tokens", "13");
  }
  SUBCASE("negative protect window") {
    call c(tc);
    auto z = small_zipage();
    z.protect.window = -1;
    expect_error(z, tc, c, "pipeline.protect.window", "-1");
  }
}

TEST_CASE("validation: the batch's sequences, slots and layers") {
  test_cache tc = make();
  SUBCASE("duplicate sequence") {
    call c(tc);
    c.items[1].seq = 0;
    expect_error(small_zipage(), tc, c, "batch[1].seq", "0");
  }
  SUBCASE("sequence out of range") {
    call c(tc);
    c.items[0].seq = 5;
    expect_error(small_zipage(), tc, c, "batch[0].seq", "5");
  }
  SUBCASE("query slot out of range") {
    call c(tc);
    c.items[1].query_slot = 2;
    expect_error(small_zipage(), tc, c, "batch[1].query_slot", "2");
  }
  SUBCASE("negative query slot") {
    call c(tc);
    c.items[0].query_slot = -1;
    expect_error(small_zipage(), tc, c, "batch[0].query_slot", "-1");
  }
  SUBCASE("layer_begin out of range") {
    call c(tc);
    c.layer_begin = 2;
    expect_error(small_zipage(), tc, c, "batch.layer_begin", "2");
  }
  SUBCASE("negative layer_begin") {
    call c(tc);
    c.layer_begin = -1;
    expect_error(small_zipage(), tc, c, "batch.layer_begin", "-1");
  }
  SUBCASE("layer range past the cache") {
    call c(tc);
    c.layer_begin = 1;
    c.layer_count = 2;
    expect_error(small_zipage(), tc, c, "batch.layer_count", "2");
  }
  SUBCASE("length past the table's room") {
    tc.raw_lengths()[1] = 13;  // 3 blocks of 4 in a dense row of 3
    call c(tc);
    expect_error(small_zipage(), tc, c, "cache.lengths[1]", "13");
  }
  SUBCASE("the error is in the second item: the first is not written either") {
    call c(tc);
    c.items[1].budget = 99;
    expect_error(small_zipage(), tc, c, "batch[1].budget", "99");
  }
}

TEST_CASE("validation: null pointers") {
  test_cache tc = make(kvp_test::cache_layout::vllm_flash);
  SUBCASE("cache.lengths") {
    call c(tc);
    c.cache.lengths = nullptr;
    expect_error(small_zipage(), tc, c, "cache.lengths", "null");
  }
  SUBCASE("cache.table.indices") {
    call c(tc);
    c.cache.table.indices = nullptr;
    expect_error(small_zipage(), tc, c, "cache.table.indices", "null");
  }
  SUBCASE("cache.k") {
    call c(tc);
    c.cache.k = {};
    expect_error(small_zipage(), tc, c, "cache.k", "null");
  }
  SUBCASE("cache.v") {
    call c(tc);
    c.cache.v = {};
    expect_error(small_zipage(), tc, c, "cache.v", "null");
  }
  SUBCASE("a null layer in the layer table") {
    call c(tc);
    std::vector<void*> layers{c.cache.k.table[0], nullptr};
    c.cache.k.table = layers.data();
    expect_error(small_zipage(), tc, c, "cache.k.table[1]", "null");
  }
  SUBCASE("queries.base") {
    call c(tc);
    c.queries.base = nullptr;
    expect_error(small_zipage(), tc, c, "queries.base", "null");
  }
  SUBCASE("scores.base when the pipeline keeps F") {
    call c(tc);
    c.scores = {};
    expect_error(small_zipage(), tc, c, "scores.base", "null");
    // Also with no scorer and accumulate (F is the only input besides the cache).
    kvp::pipeline<none, kvp::aggregate::accumulate, none, kvp::select::top_k, kvp::layout::compact> acc;
    acc.protect = {.window = 2, .sinks = 0};
    expect_error(acc, tc, c, "scores.base", "null");
  }
  SUBCASE("scores.base may be null when the pipeline does not use F") {
    call c(tc);
    c.scores = {};
    auto r = kvp::presets::rkv{};
    r.scorer.window = 4;
    r.protect.window = 4;
    CHECK_NOTHROW((void)kvp::host_executor{}.compress(r, c.cache, c.queries, c.scores, kvp_test::make_batch(c.items)));
  }
}

TEST_CASE("validation: strides and alignment") {
  test_cache tc = make(kvp_test::cache_layout::nano_vllm);
  SUBCASE("dim stride not 1") {
    call c(tc);
    c.cache.k_stride.dim = 2;
    expect_error(small_zipage(), tc, c, "cache.k_stride.dim", "2");
  }
  SUBCASE("V dim stride not 1") {
    call c(tc);
    c.cache.v_stride.dim = 0;
    expect_error(small_zipage(), tc, c, "cache.v_stride.dim", "0");
  }
  SUBCASE("head stride overlapping the rows of a token") {
    call c(tc);
    c.cache.k_stride.head = 2;  // d = 4
    expect_error(small_zipage(), tc, c, "cache.k_stride.head", "2");
  }
  SUBCASE("token stride overlapping the rows") {
    call c(tc);
    c.cache.v_stride.token = 3;
    expect_error(small_zipage(), tc, c, "cache.v_stride.token", "3");
  }
  SUBCASE("block stride smaller than a block") {
    call c(tc);
    c.cache.k_stride.block = 16;  // b * h * d = 32
    expect_error(small_zipage(), tc, c, "cache.k_stride.block", "16");
  }
  SUBCASE("misaligned K base") {
    call c(tc);
    c.cache.k.base = static_cast<std::byte*>(c.cache.k.base) + 2;
    const auto addr = reinterpret_cast<std::uintptr_t>(c.cache.k.base);
    expect_error(small_zipage(), tc, c, "cache.k layer 0", fmt::format("{:#x}", addr));
  }
  SUBCASE("misaligned V base through its offset") {
    call c(tc);
    c.cache.v.base = static_cast<std::byte*>(c.cache.v.base) + 1;
    expect_error(small_zipage(), tc, c, "cache.v layer 0", "not aligned");
  }
  SUBCASE("misaligned queries") {
    call c(tc);
    c.queries.base = static_cast<const std::byte*>(c.queries.base) + 2;
    const auto addr = reinterpret_cast<std::uintptr_t>(c.queries.base);
    expect_error(small_zipage(), tc, c, "queries.base", fmt::format("{:#x}", addr));
  }
}

TEST_CASE("validation: token and head strides whose rows overlap although each is >= head_dim") {
  // token stride = head stride = d with 2 heads: token 1 head 0 is token 0 head 1.
  test_cache tc = make();
  call c(tc);
  c.cache.k_stride.token = 4;
  c.cache.k_stride.head = 4;
  expect_error(small_zipage(), tc, c, "cache.k_stride", "4");
}

TEST_CASE("validation: a padded token stride needs a larger block stride") {
  // Rows padded to 2 d per head: a block spans b * h * 2d = 64 elements, but the block
  // stride says 32, so block p + 1 starts inside block p.
  test_cache tc = make();
  call c(tc);
  c.cache.v_stride.token = 16;
  c.cache.v_stride.head = 8;
  c.cache.v_stride.block = 32;
  expect_error(small_zipage(), tc, c, "cache.v_stride.block", "32");
}

TEST_CASE("validation: query window view") {
  test_cache tc = make();
  SUBCASE("head_dim differs from the cache's") {
    call c(tc);
    c.queries.head_dim = 8;
    expect_error(small_zipage(), tc, c, "queries.head_dim", "8");
  }
  SUBCASE("query heads not a multiple of the KV heads") {
    call c(tc);
    c.queries.num_q_heads = 3;
    expect_error(small_zipage(), tc, c, "queries.num_q_heads", "3");
  }
  SUBCASE("window shorter than the scorer's") {
    call c(tc);
    c.queries.window = 3;
    expect_error(small_zipage(), tc, c, "queries.window", "3");
  }
  SUBCASE("too few layers") {
    call c(tc);
    c.queries.num_layers = 1;
    expect_error(small_zipage(), tc, c, "queries.num_layers", "1");
  }
}

TEST_CASE("validation: pipeline parameters") {
  test_cache tc = make();
  SUBCASE("even pooling kernel (then<global, pool>)") {
    call c(tc);
    auto z = small_zipage();
    z.aggregate.second.kernel = 4;
    expect_error(z, tc, c, "pipeline.aggregate.second.kernel", "4");
  }
  SUBCASE("even pooling kernel (pool alone)") {
    call c(tc);
    auto r = kvp::presets::rkv{};
    r.scorer.window = 4;
    r.protect.window = 4;
    r.aggregate.kernel = 6;
    expect_error(r, tc, c, "pipeline.aggregate.kernel", "6");
  }
  SUBCASE("non-positive kernel") {
    call c(tc);
    auto z = small_zipage();
    z.aggregate.second.kernel = -1;
    expect_error(z, tc, c, "pipeline.aggregate.second.kernel", "-1");
  }
  SUBCASE("redundancy tau") {
    call c(tc);
    auto z = small_zipage();
    z.redundancy.tau = 0.0f;
    expect_error(z, tc, c, "pipeline.redundancy.tau", "0");
  }
  SUBCASE("redundancy theta outside [-1, 1]") {
    call c(tc);
    auto z = small_zipage();
    z.redundancy.theta = 1.5f;
    expect_error(z, tc, c, "pipeline.redundancy.theta", "1.5");
  }
  SUBCASE("scorer window not positive") {
    call c(tc);
    auto z = small_zipage();
    z.scorer.window = 0;
    expect_error(z, tc, c, "pipeline.scorer.window", "0");
  }
  SUBCASE("negative sinks") {
    call c(tc);
    auto z = small_zipage();
    z.protect.sinks = -2;
    expect_error(z, tc, c, "pipeline.protect.sinks", "-2");
  }
}

TEST_CASE("validation: cache shape") {
  test_cache tc = make();
  SUBCASE("no layers") {
    call c(tc);
    c.cache.num_layers = 0;
    expect_error(small_zipage(), tc, c, "cache.num_layers", "0");
  }
  SUBCASE("no KV heads") {
    call c(tc);
    c.cache.num_kv_heads = 0;
    expect_error(small_zipage(), tc, c, "cache.num_kv_heads", "0");
  }
  SUBCASE("dense table without a row stride") {
    call c(tc);
    c.cache.table.row_stride = 0;
    expect_error(small_zipage(), tc, c, "cache.table.row_stride", "0");
  }
}
