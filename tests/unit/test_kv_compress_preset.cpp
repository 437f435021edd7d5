// presets::kv_compress: the paper's and the authors' defaults, overriding, the budget's
// conversion to blocks worked by hand, and one host run end to end: the preset's
// prefill metric written into a per-head cache, host::compress_per_head with the
// preset's selector and blocks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "support/prefilled_cache.hpp"

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;

template <class F>
void refuses(F&& f, const char* field) {
  try {
    f();
    FAIL("accepted, expected an error on ", field);
  } catch (const kvp::error& e) {
    CHECK(e.field() == field);
  }
}

using kvp_test::prefilled_cache;


// Row positions: every position of [0, P) (a prefill), or `T` of them: the last
// `recent` positions and T - recent others drawn from before them (an earlier compression).
std::vector<i32> all_positions(i32 P) {
  std::vector<i32> p(static_cast<std::size_t>(P));
  std::iota(p.begin(), p.end(), 0);
  return p;
}
std::vector<i32> some_positions(i32 P, i32 T, i32 recent, std::mt19937& rng) {
  std::vector<i32> older(static_cast<std::size_t>(P - recent));
  std::iota(older.begin(), older.end(), 0);
  std::shuffle(older.begin(), older.end(), rng);
  older.resize(static_cast<std::size_t>(T - recent));
  for (i32 p = P - recent; p < P; ++p) older.push_back(p);
  std::sort(older.begin(), older.end());
  return older;
}

}  // namespace

TEST_CASE("kv_compress: defaults are the paper's and the authors' engine's") {
  constexpr kvp::presets::kv_compress p{};
  // Prefill metric: the last 32 queries, squared, max pool 7 per query head, no excluded distance.
  static_assert(p.metric.window == 32 && p.metric.pool_kernel == 7 && p.metric.excluded_distance == 0);
  // Schedule: the last 64 positions protected, no sinks, one count over the whole sequence.
  static_assert(p.select.protected_window == 64 && p.select.sinks == 0);
  static_assert(p.select.budget == kvp::select::block_budget::sequence);
  // Budget: none until the engine sets one (the authors' max_cache_tokens -1, rate 1.0).
  static_assert(p.max_cache_tokens == -1 && p.compression_rate == 1.0 && !p.has_budget());
  CHECK(p.blocks_to_free(52, 800, 200, 4, 16) == 0);
}

TEST_CASE("kv_compress: every field overridable, by designated initializers or on the value") {
  constexpr kvp::presets::kv_compress w8{.metric = {.window = 8}, .max_cache_tokens = 128};
  static_assert(w8.metric.window == 8 && w8.metric.pool_kernel == 7);  // KVC-w8-L2, C = 128
  static_assert(w8.select.protected_window == 64 && w8.max_cache_tokens == 128 && w8.has_budget());

  kvp::presets::kv_compress p;
  p.metric.excluded_distance = 10;  // KVC-full's v
  p.metric.pool_kernel = 1;
  p.select.protected_window = 32;
  p.select.sinks = 4;
  p.select.budget = kvp::select::block_budget::layer;
  p.compression_rate = 0.125;  // 8x
  CHECK(p.metric.window == 32);
  CHECK(p.metric.excluded_distance == 10);
  CHECK(p.select.sinks == 4);
  CHECK(p.has_budget());
  CHECK_NOTHROW(p.check());
}

TEST_CASE("kv_compress: a token budget in blocks, by hand") {
  // b 16, 4 rows (2 layers x 2 KV heads) of 100, 90, 80 and 70 tokens: 7 + 6 + 5 + 5 = 23
  // blocks. 64 tokens a row are 4 blocks a row, 16 in all: 7 freed. 70 tokens a row
  // round up to 5 blocks, 20 in all: 3 freed. 100 a row: 7 blocks, over what is held.
  kvp::presets::kv_compress p{.max_cache_tokens = 64};
  CHECK(p.blocks_to_free(23, 340, 100, 4, 16) == 7);
  p.max_cache_tokens = 70;
  CHECK(p.blocks_to_free(23, 340, 100, 4, 16) == 3);
  p.max_cache_tokens = 100;
  CHECK(p.blocks_to_free(23, 340, 100, 4, 16) == 0);
  // The logical length does not enter a token budget.
  p.max_cache_tokens = 64;
  CHECK(p.blocks_to_free(23, 340, -1, 4, 16) == 7);
}

TEST_CASE("kv_compress: a compression rate in blocks, by hand") {
  // 4 rows of 200 tokens, b 16: 800 tokens in 52 blocks. The window of 64 is 4 whole
  // blocks, P = 64 positions a row; C = 200 - 64 = 136 compressible positions.
  kvp::presets::kv_compress p{.compression_rate = 0.25};
  // 4x: target ceil(136 x 4 x 0.25) + 64 x 4 = 136 + 256 = 392; 408 over it, 25.5 blocks: 26.
  CHECK(p.blocks_to_free(52, 800, 200, 4, 16) == 26);
  // 8x: 68 + 256 = 324; 476 over, 29.75 blocks: 30.
  p.compression_rate = 0.125;
  CHECK(p.blocks_to_free(52, 800, 200, 4, 16) == 30);
  // A window of 70 rounds up to 80 positions: C 120, target 60 + 320 = 380; 420 over: 26.25 -> 27.
  p.select.protected_window = 70;
  CHECK(p.blocks_to_free(52, 800, 200, 4, 16) == 27);
  // Nothing compressible: the sequence is no longer than its rounded window.
  CHECK(p.blocks_to_free(52, 800, 80, 4, 16) == 0);
  // A sequence compressed before: 4 rows now hold 300 tokens in 20 blocks of its 200
  // positions; the target is still 324 (P 80: 60 + 320 = 380), under nothing freed.
  CHECK(p.blocks_to_free(20, 300, 200, 4, 16) == 0);
}

TEST_CASE("kv_compress: the budget read off a cache's lengths, per sequence and per layer") {
  // 2 layers, 1 sequence, 2 KV heads of 37, 37, 37, 37 tokens, b 4: 10 blocks a row, 40.
  std::vector<std::vector<i32>> rows(4, all_positions(37));
  prefilled_cache c(2, 1, 2, 4, 8, rows, 3);
  kvp::presets::kv_compress p{.select = {.protected_window = 8}, .max_cache_tokens = 16};
  // 16 tokens: 4 blocks a row. Sequence: 40 - 16 = 24. Per layer: 20 - 8 = 12 each.
  CHECK(p.item(c.view(), 0, 37).blocks_to_free == 24);
  CHECK(p.item(c.view(), 0).blocks_to_free == 24);
  p.select.budget = kvp::select::block_budget::layer;
  std::vector<i64> per_layer(2, -1);
  p.blocks_to_free(c.view(), 0, 37, per_layer);
  CHECK(per_layer == std::vector<i64>{12, 12});
  // Rate 0.5: P 8, C 29. Sequence: ceil(29 x 4 x 0.5) + 32 = 90 of 148 held: 58 over,
  // 15 blocks. Per layer: 29 + 16 = 45 of 74: 29 over, 8 blocks. The logical length
  // defaults to the longest head's.
  p.max_cache_tokens = -1;
  p.compression_rate = 0.5;
  p.blocks_to_free(c.view(), 0, -1, per_layer);
  CHECK(per_layer == std::vector<i64>{8, 8});
  p.select.budget = kvp::select::block_budget::sequence;
  CHECK(p.item(c.view(), 0, 37).blocks_to_free == 15);
}

TEST_CASE("kv_compress: refusals name the field") {
  refuses([] { kvp::presets::kv_compress{.compression_rate = 0.0}.check(); }, "kv_compress.compression_rate");
  refuses([] { kvp::presets::kv_compress{.compression_rate = 1.5}.check(); }, "kv_compress.compression_rate");
  refuses([] { kvp::presets::kv_compress{.compression_rate = std::nan("")}.check(); },
          "kv_compress.compression_rate");
  refuses([] { kvp::presets::kv_compress{.max_cache_tokens = 128, .compression_rate = 0.5}.check(); },
          "kv_compress.max_cache_tokens");
  refuses([] { kvp::presets::kv_compress{.max_cache_tokens = 32}.check(); }, "kv_compress.max_cache_tokens");
  const kvp::presets::kv_compress rate{.compression_rate = 0.5};
  refuses([&] { rate.blocks_to_free(52, 800, -1, 4, 16); }, "logical_length");
  refuses([&] { rate.blocks_to_free(52, 800, 200, 4, 0); }, "block_size");
  refuses([&] { rate.blocks_to_free(52, 800, 200, 0, 16); }, "rows");
  refuses([&] { rate.blocks_to_free(52, 833, 200, 4, 16); }, "held_kvs");

  std::vector<std::vector<i32>> rows(4, all_positions(37));
  prefilled_cache c(2, 1, 2, 4, 8, rows, 3);
  kvp::presets::kv_compress layer{.select = {.protected_window = 8, .budget = kvp::select::block_budget::layer},
                                  .max_cache_tokens = 16};
  refuses([&] { layer.item(c.view(), 0, 37); }, "kv_compress.select.budget");
  std::vector<i64> one(1);
  refuses([&] { layer.blocks_to_free(c.view(), 0, 37, one); }, "out");
  refuses([&] { layer.blocks_to_free(c.view(), 1, 37, one); }, "seq");
}

TEST_CASE("kv_compress: end to end on the host, prefill metric to freed blocks") {
  // 2 layers, 2 sequences, 2 KV heads, G 2, d 8, b 4. Sequence 0 is a fresh prefill of
  // 37 tokens in every head. Sequence 1 has 50 positions and an earlier compression
  // left its heads ragged: 50, 41, 46 and 33 tokens, each holding its last 8 positions.
  const i32 L = 2, S = 2, H = 2, G = 2, b = 4, d = 8;
  std::mt19937 rng(11);
  const std::vector<i32> logical{37, 50};
  const i32 ragged[4] = {50, 41, 46, 33};
  std::vector<std::vector<i32>> rows;
  for (i32 l = 0; l < L; ++l)
    for (i32 s = 0; s < S; ++s)
      for (i32 h = 0; h < H; ++h)
        rows.push_back(s == 0 ? all_positions(37) : some_positions(50, ragged[l * H + h], 8, rng));
  prefilled_cache c(L, S, H, b, d, rows, 5);

  // The preset with a window of 8 (the rows are short) and 16 tokens a head.
  kvp::presets::kv_compress p{.select = {.protected_window = 8}, .max_cache_tokens = 16};
  c.write_prefill_metric(p.metric, G, 7);
  const prefilled_cache before = c;

  // Blocks asked, by hand: 16 tokens are 4 blocks a head, 16 a sequence. Sequence 0
  // holds 4 x 10 = 40 blocks: 24 freed. Sequence 1 holds 13 + 11 + 12 + 9 = 45: 29.
  // Every head can give that many: its evictable tokens (all but its last 8 positions)
  // cover 8 blocks a head in sequence 0, 11 + 9 + 10 + 7 in sequence 1.
  const std::vector<kvp::per_head_item> items{p.item(c.view(), 0, logical[0]), p.item(c.view(), 1, logical[1])};
  CHECK(items[0].blocks_to_free == 24);
  CHECK(items[1].blocks_to_free == 29);
  const kvp::per_head_result r = kvp::host::compress_per_head(p.select, c.view(), items);

  for (i32 i = 0; i < S; ++i) {
    CAPTURE(i);
    CHECK(r.freed[i] == items[i].blocks_to_free);
    CHECK(r.nonfinite[i] == 0);
    i64 evicted = 0, removed = 0, blocks_after = 0;
    for (i32 l = 0; l < L; ++l)
      for (i32 h = 0; h < H; ++h) {
        CAPTURE(l);
        CAPTURE(h);
        const std::size_t row = before.row(l, i, h), out = static_cast<std::size_t>(l * H + h);
        const i32 T = before.lengths[row], n = r.new_lengths[i][out], e = r.evicted[i][out];
        evicted += e;
        removed += T - n;
        CHECK(n == T - e);
        // Block granular: a head that evicts ends on a block boundary, having given up
        // its tail blocks, those of the table past its new length.
        const i32 freed_here = before.blocks_for(T) - before.blocks_for(n);
        if (e > 0) CHECK(n % b == 0);
        blocks_after += before.blocks_for(n);
        REQUIRE(static_cast<i32>(r.freed_blocks[i][out].size()) == freed_here);
        for (i32 k = 0; k < freed_here; ++k)
          CHECK(r.freed_blocks[i][out][k] == before.table[row * before.max_blocks + before.blocks_for(n) + k]);

        // Dense: slots [0, n) hold n distinct tokens of the head, each with the K, V and
        // metric it had; the protected window among them.
        std::map<i32, i32> old_slot;  // position -> slot before
        for (i32 t = 0; t < T; ++t) old_slot[before.row_positions[row][t]] = t;
        std::set<i32> kept;
        for (i32 t = 0; t < n; ++t) {
          const i32 pos = c.positions[c.slot(row, t)];
          REQUIRE(old_slot.count(pos) == 1);
          CHECK(kept.insert(pos).second);
          const std::size_t from = before.slot(row, old_slot[pos]), to = c.slot(row, t);
          CHECK(std::memcmp(&c.k[to * d], &before.k[from * d], d * sizeof(float)) == 0);
          CHECK(std::memcmp(&c.v[to * d], &before.v[from * d], d * sizeof(float)) == 0);
          CHECK(c.metric[to] == before.metric[from]);
        }
        for (i32 pos = logical[i] - p.select.protected_window; pos < logical[i]; ++pos) CHECK(kept.count(pos) == 1);
        // The evicted tokens are the head's lowest metrics: none above an unprotected kept one.
        float evicted_max = -std::numeric_limits<float>::infinity();
        float kept_min = std::numeric_limits<float>::infinity();
        for (const auto& [pos, t] : old_slot) {
          const float m = before.metric[before.slot(row, t)];
          if (!kept.count(pos)) evicted_max = std::max(evicted_max, m);
          else if (pos < logical[i] - p.select.protected_window) kept_min = std::min(kept_min, m);
        }
        CHECK(evicted_max <= kept_min);
      }
    // What the sequence gave up is what was scheduled, and its blocks are the budget's.
    CHECK(evicted == removed);
    CHECK(blocks_after == 16);
  }
  // Sequence 0 was a prefill, every head 37 tokens: its heads' evictions still differ.
  std::set<i32> counts(r.evicted[0].begin(), r.evicted[0].end());
  CHECK(counts.size() > 1);
  // Blocks no head holds are never written.
  std::set<i32> held(before.table.begin(), before.table.end());
  for (i32 blk = 0; blk < c.num_blocks; ++blk)
    if (!held.count(blk))
      CHECK(std::memcmp(&c.k[static_cast<std::size_t>(blk) * b * d], &before.k[static_cast<std::size_t>(blk) * b * d],
                        static_cast<std::size_t>(b) * d * sizeof(float)) == 0);
}
