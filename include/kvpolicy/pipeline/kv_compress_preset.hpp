// KV-Compress's configuration (SPEC.md "Presets"; KV-Compress sec. 4): the metric, the
// block schedule and the budget in one value. Not a pipeline<S, A, R, Sel, L>: it runs
// over a per-head block cache (per_head_kv_view) through host::compress_per_head or
// cuda_per_head_executor, which take `select`; the engine writes `metric` into the
// cache's per-slot metric after a prefill (and accumulates decode steps into it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_item.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/scorer/squared_attention_metric.hpp"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

KVP_NAMESPACE_BEGIN
namespace presets {

// Defaults: the authors' engine (IsaacRe/vllm-kvcompress, EngineArgs) and the paper.
//   metric: squared attention of the prefill's last 32 queries, max-pooled (kernel 7)
//           per query head, summed over the group, no excluded distance
//           (prefill_metric_collection_window_size 32, maxpool_metrics, L2-sum,
//           metric_collection_buffer_size 0).
//   select: the last 64 positions never evicted (protected_window_size 64), no sinks
//           (the authors have none), one block count per sequence over all its layers
//           and KV heads.
//   budget: as the authors' engine takes it, a token budget per (layer, KV head) or a
//           target compression rate, at most one of them. Both default to "none", as
//           there: the paper's LongBench runs set max_cache_tokens (its max-cache-size
//           C: 128, 256, 512, 1024), its throughput runs a rate (2x to 64x: 1/2 to 1/64).
// The cache's block size is the engine's (the paper's is 16).
struct kv_compress {
  scorer::squared_attention_metric metric{.window = 32, .pool_kernel = 7, .excluded_distance = 0};
  select::head_adaptive_blocks select{.protected_window = 64, .sinks = 0, .budget = select::block_budget::sequence};
  // Tokens each (layer, KV head) of a budget group keeps on average, rounded up to whole
  // blocks per row (select::blocks_to_free_for_tokens); negative: no token budget.
  std::int32_t max_cache_tokens = -1;
  // Fraction of the compressible positions (all but the protected window rounded up to
  // whole blocks) kept over the group's rows (select::blocks_to_free_for_rate), in
  // (0, 1]; 1: no rate.
  double compression_rate = 1.0;

  constexpr bool has_budget() const noexcept { return max_cache_tokens >= 0 || compression_rate < 1.0; }

  // The budget's fields. The metric and the selector check theirs where they run.
  void check() const {
    require(compression_rate > 0.0 && compression_rate <= 1.0, "kv_compress.compression_rate",
            "is {}; must lie in (0, 1] (1: no rate)", compression_rate);
    require(max_cache_tokens < 0 || compression_rate >= 1.0, "kv_compress.max_cache_tokens",
            "is {} with compression_rate {}; set one budget, not both", max_cache_tokens, compression_rate);
    // As the authors: a budget under the window could never be reached.
    require(max_cache_tokens < 0 || max_cache_tokens >= select.protected_window, "kv_compress.max_cache_tokens",
            "is {}; must be at least select.protected_window ({})", max_cache_tokens, select.protected_window);
  }

  // Blocks one budget group frees: it holds `held_blocks` blocks and `held_kvs` tokens
  // over `rows` (layer, KV head) rows (layers x KV heads for a sequence budget, KV heads
  // for a per-layer one), of a sequence of `logical_length` positions (read by the rate
  // only), in a cache of `b` tokens a block. 0 without a budget.
  std::int64_t blocks_to_free(std::int64_t held_blocks, std::int64_t held_kvs, std::int64_t logical_length,
                              std::int64_t rows, std::int32_t b) const {
    check();
    require(b >= 1, "block_size", "is {}; must be at least 1", b);
    require(rows >= 1, "rows", "is {}; must be at least 1", rows);
    require(held_blocks >= 0, "held_blocks", "is {}; must not be negative", held_blocks);
    require(held_kvs >= 0 && held_kvs <= held_blocks * b, "held_kvs", "is {}; {} blocks of {} hold at most {}",
            held_kvs, held_blocks, b, held_blocks * b);
    if (max_cache_tokens >= 0) return select::blocks_to_free_for_tokens(held_blocks, max_cache_tokens, rows, b);
    if (compression_rate >= 1.0) return 0;
    require(logical_length >= 0, "logical_length", "is {}; a rate compresses the sequence's positions",
            logical_length);
    return select::blocks_to_free_for_rate(held_kvs, logical_length, compression_rate, rows, b,
                                           select.protected_window);
  }

  // The same read off a host cache's lengths for sequence `seq`: one count per budget
  // group into `out` (1 for a sequence budget, num_layers for a per-layer one).
  // `logical_length`: the sequence's position count; -1: its longest head's length,
  // right until its first compression (every head then holds every position).
  void blocks_to_free(const per_head_kv_view& cache, std::int32_t seq, std::int32_t logical_length,
                      std::span<std::int64_t> out) const {
    const std::int32_t L = cache.num_layers, H = cache.num_kv_heads;
    require(seq >= 0 && seq < cache.num_seqs, "seq", "is {}; the cache has {} sequences", seq, cache.num_seqs);
    require(cache.lengths.valid(), "cache.lengths", "is a null pointer");
    const bool per_layer = select.budget == select::block_budget::layer;
    const std::size_t groups = per_layer ? static_cast<std::size_t>(L) : 1;
    require(out.size() == groups, "out", "has {} entries; the budget takes {} (one per {})", out.size(), groups,
            per_layer ? "layer" : "sequence");
    std::int32_t longest = 0;
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) longest = std::max(longest, cache.length(l, seq, h));
    const std::int32_t positions = logical_length >= 0 ? logical_length : longest;
    std::vector<std::int64_t> blocks(groups, 0), kvs(groups, 0);
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::int32_t T = cache.length(l, seq, h);
        require(T >= 0, detail::path("cache.lengths[layer {}][seq {}][head {}]", l, seq, h),
                "is {}; must not be negative", T);
        blocks[per_layer ? l : 0] += cache.blocks_for(T);
        kvs[per_layer ? l : 0] += T;
      }
    const std::int64_t rows = per_layer ? H : std::int64_t{L} * H;
    for (std::size_t g = 0; g < groups; ++g)
      out[g] = blocks_to_free(blocks[g], kvs[g], positions, rows, cache.block_size);
  }

  // The compression item of `seq` under a sequence budget (a per-layer budget needs
  // storage for its counts: fill it with blocks_to_free above, point per_layer at it).
  per_head_item item(const per_head_kv_view& cache, std::int32_t seq, std::int32_t logical_length = -1) const {
    require(select.budget == select::block_budget::sequence, "kv_compress.select.budget",
            "is per layer; item() makes a sequence's one count (use blocks_to_free(cache, seq, logical_length, "
            "out) and per_head_item::per_layer)");
    std::int64_t count = 0;
    blocks_to_free(cache, seq, logical_length, std::span<std::int64_t>(&count, 1));
    return {.seq = seq, .blocks_to_free = count, .per_layer = nullptr, .logical_length = logical_length};
  }
};

}  // namespace presets
KVP_NAMESPACE_END
