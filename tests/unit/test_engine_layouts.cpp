// The engine layouts of issue 34 (SGLang's token pool, TensorRT-LLM's block pools)
// against the same cache in another layout: every token's K, V, F and position
// copied across, the same compression, the same results and the same moved rows.
// docs/views.md, "Layout constructors"; docs/integration.md.
#include <doctest/doctest.h>

#include <utility>
#include <vector>

#include "support/test_cache.hpp"

using kvp_test::cache_layout;
using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

// `to` holds `from`'s tokens: every (layer, seq, token, head)'s K and V rows, F and
// position (the two fixtures share their block tables: same seed, same shape).
void copy_tokens(const test_cache& from, test_cache& to) {
  REQUIRE(from.raw_table() == to.raw_table());
  for (int seq = 0; seq < from.num_seqs(); ++seq)
    for (int l = 0; l < from.num_layers(); ++l)
      for (int t = 0; t < from.length(seq); ++t)
        for (int h = 0; h < from.kv_heads(); ++h) {
          to.set_row(kv_kind::k, l, seq, t, h, from.key(l, seq, t, h));
          to.set_row(kv_kind::v, l, seq, t, h, from.value(l, seq, t, h));
        }
  to.raw_f() = from.raw_f();
  to.raw_positions() = from.raw_positions();
  to.raw_queries() = from.raw_queries();
}

// A compression of `items` over both caches gives the same results, and every token
// each one keeps has the same bytes afterwards.
template <class P>
void check_same_compression(const P& p, test_cache& a, test_cache& b, const std::vector<kvp::batch_item>& items) {
  CAPTURE(a.describe());
  CAPTURE(b.describe());
  const auto ra = kvp_test::run(p, a, items), rb = kvp_test::run(p, b, items);
  CHECK(ra.new_lengths == rb.new_lengths);
  CHECK(ra.kept_counts == rb.kept_counts);
  CHECK(ra.released_blocks == rb.released_blocks);
  CHECK(ra.keep_masks == rb.keep_masks);
  CHECK(ra.scores == rb.scores);
  CHECK(a.raw_f() == b.raw_f());
  CHECK(a.raw_positions() == b.raw_positions());
  for (std::size_t i = 0; i < items.size(); ++i)
    for (int l = 0; l < a.num_layers(); ++l)
      for (int t = 0; t < ra.new_lengths[i]; ++t)
        for (int h = 0; h < a.kv_heads(); ++h)
          for (kv_kind kind : {kv_kind::k, kv_kind::v})
            CHECK(a.token_bytes(kind, l, items[i].seq, t, h) == b.token_bytes(kind, l, items[i].seq, t, h));
}

kvp::presets::zipage small_zipage(int w) {
  kvp::presets::zipage z;
  z.scorer.window = w;
  z.protect.window = w;
  z.redundancy = {.theta = 0.5f, .tau = 0.4f, .lambda = 0.2f};
  return z;
}

}  // namespace

TEST_CASE("engine layouts: SGLang's token pool (blocks of one token) against nano-vllm's") {
  for (auto type : kvp_test::all_dtypes) {
    const kvp_test::cache_config cfg{.layers = 2, .block_size = 1, .kv_heads = 2, .head_dim = 8, .type = type,
                                     .lengths = {23, 17, 30}, .q_heads = 4, .window = 4, .seed = 29};
    kvp_test::cache_config sg = cfg, nano = cfg;
    sg.layout = cache_layout::sglang;
    nano.layout = cache_layout::nano_vllm;
    test_cache a(sg), b(nano);
    copy_tokens(a, b);
    // Lightning's blocks are single tokens here: its redundancy is 0, as any other b 1 cache's.
    check_same_compression(small_zipage(4), a, b, {{.seq = 0, .query_slot = 0, .budget = 12}, {.seq = 2, .query_slot = 2, .budget = 9}});
  }
}

TEST_CASE("engine layouts: TensorRT-LLM's block pools against vLLM's and FlashInfer's") {
  const std::pair<cache_layout, cache_layout> pairs[] = {{cache_layout::trtllm_blocks_first, cache_layout::vllm_flash},
                                                         {cache_layout::trtllm_layers_first, cache_layout::hnd}};
  for (const auto& [trt, other] : pairs)
    for (bool csr : {false, true}) {
      const kvp_test::cache_config cfg{.layers = 3, .block_size = 8, .kv_heads = 2, .head_dim = 8,
                                       .type = kvp::dtype::bf16, .lengths = {37, 50, 24}, .csr = csr, .q_heads = 8,
                                       .window = 4, .seed = 31};
      kvp_test::cache_config x = cfg, y = cfg;
      x.layout = trt;
      y.layout = other;
      test_cache a(x), b(y);
      copy_tokens(a, b);
      check_same_compression(small_zipage(4), a, b,
                             {{.seq = 1, .query_slot = 1, .budget = 20, .history_tokens = 0},
                              {.seq = 2, .query_slot = 2, .budget = 16}});
    }
}
