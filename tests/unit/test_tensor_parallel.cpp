// Tensor parallelism on the host: each simulated rank (a thread) compresses its slice
// of the KV heads (slice_heads) with an in-process communicator; every rank's lengths,
// tables and released blocks, and every head's bytes, equal one call over all heads
// (paged presets through host_executor; KV-Compress's global block cut through
// host::compress_per_head).
#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "support/prefilled_cache.hpp"
#include "support/test_cache.hpp"

namespace {

using kvp_test::test_cache;

// R ranks in one process: each all_reduce waits for every rank's values, reduces them,
// and waits again before the buffers are reused. Records what each rank brought.
class in_process_ranks {
 public:
  explicit in_process_ranks(int ranks) : ranks_(ranks), sync_(ranks), values_(static_cast<std::size_t>(ranks)) {}

  struct communicator {
    in_process_ranks* group = nullptr;
    int rank = 0;
    template <class T>
    void all_reduce(std::span<T> v, kvp::reduce_op op) const {
      group->reduce(rank, v, op);
    }
  };
  communicator rank(int r) { return {this, r}; }

  // Per call, per rank, the values it brought (before the reduction).
  std::vector<std::vector<std::vector<double>>> calls;

 private:
  template <class T>
  void reduce(int rank, std::span<T> v, kvp::reduce_op op) {
    values_[static_cast<std::size_t>(rank)].assign(v.begin(), v.end());
    sync_.arrive_and_wait();
    for (std::size_t j = 0; j < v.size(); ++j) {
      double acc = values_[0].at(j);
      for (int r = 1; r < ranks_; ++r) {
        const double x = values_[static_cast<std::size_t>(r)].at(j);
        acc = op == kvp::reduce_op::max ? std::max(acc, x) : acc + x;
      }
      v[j] = static_cast<T>(acc);
    }
    if (rank == 0) {
      const std::lock_guard<std::mutex> hold(mutex_);
      calls.push_back(values_);
    }
    sync_.arrive_and_wait();
  }

  int ranks_;
  std::barrier<> sync_;
  std::mutex mutex_;
  std::vector<std::vector<double>> values_;
};

static_assert(kvp::HostCommunicator<in_process_ranks::communicator>);

kvp_test::cache_config config(kvp::dtype type, bool live) {
  return {.layers = 2, .block_size = 8, .kv_heads = 4, .head_dim = 16, .type = type, .lengths = {120, 96, 57},
          .capacity_blocks = 16, .layout = kvp_test::cache_layout::hnd, .q_heads = 8, .window = 32, .seed = 23,
          .live = live};
}

// One call over every head, then `ranks` calls over slices of the same cache (a second
// copy), and compares.
template <class Preset>
void check_ranks(Preset p, int ranks, bool live, bool expect_coupling) {
  for (const auto type : {kvp::dtype::f32, kvp::dtype::bf16}) {
    CAPTURE(kvp::name_of(type));
    CAPTURE(ranks);
    test_cache whole(config(type, live)), split(config(type, live));
    const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 48},
                                             {.seq = 2, .query_slot = 2, .budget = 40}};
    const kvp::compression_batch batch{.items = items};
    const kvp::host_result one = kvp::host_executor{}.compress(p, whole.view(), whole.queries(), whole.scores(), batch);

    const int H = 4, per = H / ranks, L = 2;
    in_process_ranks group(ranks);
    std::vector<kvp::host_result> results(static_cast<std::size_t>(ranks));
    {
      std::vector<std::jthread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          const kvp::paged_kv_view view = kvp::slice_heads(split.view(), r * per, per);
          const kvp::query_window_view queries = kvp::slice_heads(split.queries(), r * per, per, H);
          const kvp::score_view scores = kvp::slice_heads(split.scores(), r * per, per, H);
          results[static_cast<std::size_t>(r)] =
              kvp::host_executor{}.compress(p, view, queries, scores, batch, group.rank(r));
        });
    }
    REQUIRE(group.calls.size() == 1);  // one reduction per compression
    bool coupled = false;
    for (std::size_t i = 0; i < items.size(); ++i)
      for (int r = 1; r < ranks; ++r) coupled = coupled || group.calls[0][r][i] != group.calls[0][0][i];
    CHECK(coupled == expect_coupling);  // whether the ranks' own longest heads differed

    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const kvp::host_result& mine = results[static_cast<std::size_t>(r)];
      CHECK(mine.new_lengths == one.new_lengths);
      CHECK(mine.new_tables == one.new_tables);
      CHECK(mine.released_blocks == one.released_blocks);
      for (std::size_t i = 0; i < items.size(); ++i)
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < per; ++h)
            CHECK(mine.kept_counts[i][static_cast<std::size_t>(l * per + h)] ==
                  one.kept_counts[i][static_cast<std::size_t>(l * H + r * per + h)]);
    }
    // Every byte: K, V, F, positions and live bytes of every head, moved or not.
    const auto a = whole.take_snapshot(), b = split.take_snapshot();
    CHECK(a.buffers == b.buffers);
    CHECK(a.f == b.f);
    CHECK(a.positions == b.positions);
    CHECK(a.live == b.live);
  }
}

TEST_CASE("tensor parallelism: Hard-KV's heads on 2 and 4 ranks release past the largest count of all ranks") {
  kvp::presets::hard_kv p;
  p.protect = {.window = 8, .sinks = 1};
  for (const int ranks : {2, 4}) check_ranks(p, ranks, /*live=*/true, /*expect_coupling=*/true);
}

TEST_CASE("tensor parallelism: Hard-KV over R-KV's scores on 2 ranks") {
  kvp::presets::hard_kv_rkv p;
  p.protect = {.window = 8, .sinks = 1};
  check_ranks(p, 2, /*live=*/true, /*expect_coupling=*/true);
}

TEST_CASE("tensor parallelism: uniform presets compress each rank's slice alone (the reduction changes nothing)") {
  for (const int ranks : {2, 4}) {
    check_ranks(kvp::presets::zipage{}, ranks, false, false);
    check_ranks(kvp::presets::snapkv{}, ranks, false, false);
    check_ranks(kvp::presets::rkv{}, ranks, false, false);
  }
}

TEST_CASE("slice_heads: a slice outside the cache's heads is refused, naming it") {
  test_cache tc(config(kvp::dtype::f32, false));
  CHECK_THROWS_WITH_AS(kvp::slice_heads(tc.view(), 3, 2), doctest::Contains("heads"), kvp::error);
  CHECK_THROWS_WITH_AS(kvp::slice_heads(tc.view(), 0, 0), doctest::Contains("not a non-empty slice"), kvp::error);
  CHECK_THROWS_WITH_AS(kvp::slice_heads(tc.queries(), -1, 2, 4), doctest::Contains("heads"), kvp::error);
  auto q = tc.queries();
  q.num_q_heads = 6;
  CHECK_THROWS_WITH_AS(kvp::slice_heads(q, 0, 2, 4), doctest::Contains("queries.num_q_heads"), kvp::error);
  // A slice's head h is the whole's head first + h, its query heads first * G onwards.
  const kvp::paged_kv_view whole = tc.view(), part = kvp::slice_heads(whole, 2, 2);
  CHECK(part.num_kv_heads == 2);
  CHECK(part.k_row(1, 0, 5, 1) == whole.k_row(1, 0, 5, 3));
  CHECK(part.v_row(0, 1, 9, 0) == whole.v_row(0, 1, 9, 2));
  const auto qs = kvp::slice_heads(tc.queries(), 2, 2, 4);
  CHECK(qs.num_q_heads == 4);
  CHECK(qs.row(1, 0, 3, 1) == tc.queries().row(1, 0, 3, 5));
}

}  // namespace

namespace {

// A per-head block cache (tests/support/prefilled_cache.hpp): L layers, S sequences, H
// KV heads, each head holding the sequence's last positions and some older ones (as
// earlier compressions leave them), the metric in quarters so that the cut often falls
// inside a run of equal costs.
struct per_head_case : kvp_test::prefilled_cache {
  static constexpr int L = 2, S = 2, H = 4, P = 40;  // P: each sequence's positions
  explicit per_head_case(std::uint32_t seed) : prefilled_cache(L, S, H, 4, 4, rows(seed), seed) {
    std::mt19937 rng(seed + 100);
    std::uniform_int_distribution<int> quarter(0, 7);
    for (std::size_t r = 0; r < row_positions.size(); ++r)
      for (int t = 0; t < lengths[r]; ++t) metric[slot(r, t)] = 0.25f * static_cast<float>(quarter(rng));
  }
  static std::vector<std::vector<std::int32_t>> rows(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> held(8, P);
    std::vector<std::vector<std::int32_t>> out;
    for (int r = 0; r < L * S * H; ++r) {
      std::vector<std::int32_t> older(P - 8);
      std::iota(older.begin(), older.end(), 0);
      std::shuffle(older.begin(), older.end(), rng);
      older.resize(static_cast<std::size_t>(held(rng) - 8));
      std::sort(older.begin(), older.end());
      for (int p = P - 8; p < P; ++p) older.push_back(p);
      out.push_back(std::move(older));
    }
    return out;
  }
};

void check_kv_compress_ranks(kvp::select::block_budget budget, int ranks, std::uint32_t seed) {
  CAPTURE(ranks);
  CAPTURE(seed);
  using C = per_head_case;
  per_head_case whole(seed), split(seed);
  kvp::select::head_adaptive_blocks sel{.protected_window = 6, .sinks = 1, .budget = budget};
  const std::vector<std::int64_t> per_layer{5, 3};  // budget "layer": blocks each layer frees
  const std::vector<kvp::per_head_item> items{
      {.seq = 1, .blocks_to_free = 9, .per_layer = per_layer.data(), .logical_length = C::P},
      {.seq = 0, .blocks_to_free = 4, .per_layer = per_layer.data(), .logical_length = C::P}};
  const kvp::per_head_result one = kvp::host::compress_per_head(sel, whole.view(), items);

  const int per = C::H / ranks;
  in_process_ranks group(ranks);
  std::vector<kvp::per_head_result> results(static_cast<std::size_t>(ranks));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        const kvp::per_head_kv_view mine = kvp::slice_heads(split.view(), r * per, per);
        results[static_cast<std::size_t>(r)] =
            kvp::host::compress_per_head(sel, mine, items, {.first = r * per, .total = C::H}, group.rank(r));
      });
  }
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const kvp::per_head_result& mine = results[static_cast<std::size_t>(r)];
    CHECK(mine.freed == one.freed);
    CHECK(mine.nonfinite == one.nonfinite);
    for (std::size_t i = 0; i < items.size(); ++i)
      for (int l = 0; l < C::L; ++l)
        for (int h = 0; h < per; ++h) {
          const std::size_t local = static_cast<std::size_t>(l * per + h), all = static_cast<std::size_t>(l * C::H + r * per + h);
          CHECK(mine.new_lengths[i][local] == one.new_lengths[i][all]);
          CHECK(mine.evicted[i][local] == one.evicted[i][all]);
          CHECK(mine.moved[i][local] == one.moved[i][all]);
          CHECK(mine.freed_blocks[i][local] == one.freed_blocks[i][all]);
        }
  }
  // Every byte of the pool: K, V, the metric and the positions moved with their token.
  CHECK(whole.k == split.k);
  CHECK(whole.v == split.v);
  CHECK(whole.metric == split.metric);
  CHECK(whole.positions == split.positions);
}

}  // namespace

TEST_CASE("tensor parallelism: KV-Compress's cut over 2 and 4 ranks equals one schedule over all heads") {
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u})
    for (const int ranks : {2, 4}) {
      check_kv_compress_ranks(kvp::select::block_budget::sequence, ranks, seed);
      check_kv_compress_ranks(kvp::select::block_budget::layer, ranks, seed);
    }
}

TEST_CASE("slice_heads: a per-head cache's heads, and per-layer tables refused") {
  per_head_case c(9);
  const kvp::per_head_kv_view whole = c.view(), part = kvp::slice_heads(whole, 1, 2);
  CHECK(part.num_kv_heads == 2);
  CHECK(part.length(1, 1, 0) == whole.length(1, 1, 1));
  CHECK(part.block(0, 1, 1, 0) == whole.block(0, 1, 2, 0));
  auto listed = whole;
  const std::int32_t* layers[2] = {c.table.data(), c.table.data()};
  listed.table = kvp::per_head_array::per_layer(layers, per_head_case::H, c.max_blocks);
  CHECK_THROWS_WITH_AS(kvp::slice_heads(listed, 0, 2), doctest::Contains("cache.table"), kvp::error);
}
