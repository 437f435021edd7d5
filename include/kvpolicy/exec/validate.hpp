// Input validation shared by the executors: every check names the field and the
// value, and all of it runs before any byte of the cache is written.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>


#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/validate_dims.hpp"
#include "kvpolicy/pipeline/pipeline.hpp"
#include "kvpolicy/pipeline/traits.hpp"
#include "kvpolicy/redundancy/redundancy.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {

inline void validate_strides(const kv_strides& s, const paged_kv_view& c, const char* name) {
  const std::int64_t d = c.head_dim;
  require(s.dim == 1, detail::path("cache.{}.dim", name),
          "is {}; rows of {} {} elements must be contiguous (dim stride 1)", s.dim, d, name_of(c.type));
  require(s.head >= d, detail::path("cache.{}.head", name), "is {}; must be at least head_dim {} so rows do not overlap",
          s.head, d);
  require(s.token >= d, detail::path("cache.{}.token", name), "is {}; must be at least head_dim {}", s.token, d);
  const std::int64_t block_elems = std::int64_t{c.block_size} * c.num_kv_heads * d;
  require(s.block >= block_elems, detail::path("cache.{}.block", name),
          "is {}; must be at least block_size * num_kv_heads * head_dim = {}", s.block, block_elems);
  // The rows of a block must not overlap one another: the smaller of the token and
  // head strides spans one row (checked above), the larger all rows of the smaller
  // (NHD, HND and padded forms of them all nest so). And a block's rows must end
  // within the block stride, or block p + 1 starts inside block p.
  const std::int64_t b = c.block_size, h = c.num_kv_heads;
  const bool token_inner = s.token <= s.head;
  const std::int64_t inner = token_inner ? s.token : s.head, inner_n = token_inner ? b : h;
  const std::int64_t outer = token_inner ? s.head : s.token, outer_n = token_inner ? h : b;
  require(outer_n == 1 || outer >= (inner_n - 1) * inner + d, detail::path("cache.{}", name),
          "token stride {} and head stride {} make the rows of {} tokens x {} heads x {} elements overlap", s.token,
          s.head, b, h, d);
  const std::int64_t extent = (b - 1) * s.token + (h - 1) * s.head + d;
  require(s.block >= extent, detail::path("cache.{}.block", name),
          "is {}; a block's rows span {} elements (token stride {}, head stride {})", s.block, extent, s.token, s.head);
}

// `host_tables`: whether a layer table, when used, may be read here (not when it
// lives in device memory).
inline void validate_bases(const layer_bases& b, const paged_kv_view& c, std::int32_t l0, std::int32_t l1,
                           const char* name, bool host_tables) {
  require(b.valid(), detail::path("cache.{}", name), "has neither a base pointer nor a layer table (null)");
  if (b.table && !host_tables) return;
  for (std::int32_t l = l0; l < l1; ++l) {
    require(!b.table || b.table[l] != nullptr, detail::path("cache.{}.table[{}]", name, l), "is a null pointer");
    const auto addr = reinterpret_cast<std::uintptr_t>(b.layer(l, c.type));
    require(addr % static_cast<std::uintptr_t>(size_of(c.type)) == 0, detail::path("cache.{} layer {}", name, l),
            "address {:#x} is not aligned to the {}-byte {} element", addr, size_of(c.type), name_of(c.type));
  }
}

// A paged view's own shape: dimensions, dtype, table and length pointers, K and V
// strides (the compress executors and decode attention start with it).
inline void validate_paged_view(const paged_kv_view& c) {
  validate_cache_dims(c);
  require(c.table.indices != nullptr, "cache.table.indices", "is a null pointer");
  require(c.table.is_csr() || c.table.row_stride > 0, "cache.table.row_stride",
          "is {}; a dense table needs a positive row stride", c.table.row_stride);
  require(c.lengths != nullptr, "cache.lengths", "is a null pointer");
  validate_strides(c.k_stride, c, "k_stride");
  validate_strides(c.v_stride, c, "v_stride");
}

}  // namespace detail

// Resolved layer range of a batch: [begin, end).
struct layer_range {
  std::int32_t begin = 0, end = 0;
};

inline layer_range resolve_layers(const compression_batch& batch, const paged_kv_view& cache) {
  require(batch.layer_begin >= 0 && batch.layer_begin < cache.num_layers, "batch.layer_begin",
          "is {}; the cache has {} layers", batch.layer_begin, cache.num_layers);
  const std::int32_t count = batch.layer_count == 0 ? cache.num_layers - batch.layer_begin : batch.layer_count;
  require(count > 0 && batch.layer_begin + count <= cache.num_layers, "batch.layer_count",
          "is {}; layers [{}, {}) exceed the cache's {} layers", batch.layer_count, batch.layer_begin,
          batch.layer_begin + count, cache.num_layers);
  return {batch.layer_begin, batch.layer_begin + count};
}

// Checks what does not depend on the engine's arrays: shapes, pointers, strides and
// the pipeline's parameters. Cheap; the CUDA executor runs it on the host with
// `host_tables` false, since its layer tables live in device memory.
template <class P>
void validate_shapes(const P& p, const paged_kv_view& cache, const query_window_view& queries,
                     const score_view& scores, const compression_batch& batch, bool host_tables = true) {
  detail::validate_paged_view(cache);
  const layer_range layers = resolve_layers(batch, cache);
  detail::validate_bases(cache.k, cache, layers.begin, layers.end, "k", host_tables);
  detail::validate_bases(cache.v, cache, layers.begin, layers.end, "v", host_tables);

  using S = typename P::scorer_type;
  if constexpr (AttentionScorer<S>) {
    require(p.scorer.window > 0, "pipeline.scorer.window", "is {}; must be positive", p.scorer.window);
    require(queries.base != nullptr, "queries.base", "is a null pointer; the scorer reads observation queries");
    require(is_known(queries.type), "queries.type", "is {}; must be f16 ({}), bf16 ({}) or f32 ({})",
            static_cast<int>(queries.type), static_cast<int>(dtype::f16), static_cast<int>(dtype::bf16),
            static_cast<int>(dtype::f32));
    require(queries.head_dim == cache.head_dim, "queries.head_dim", "is {}; the cache's head_dim is {}",
            queries.head_dim, cache.head_dim);
    require(queries.num_q_heads > 0 && queries.num_q_heads % cache.num_kv_heads == 0, "queries.num_q_heads",
            "is {}; must be a positive multiple of num_kv_heads {}", queries.num_q_heads, cache.num_kv_heads);
    require(queries.num_layers >= layers.end, "queries.num_layers", "is {}; the batch reaches layer {}",
            queries.num_layers, layers.end - 1);
    require(queries.window >= p.scorer.window, "queries.window",
            "is {}; the scorer's window of {} queries does not fit", queries.window, p.scorer.window);
    require(queries.num_slots > 0, "queries.num_slots", "is {}; must be positive", queries.num_slots);
    const auto addr = reinterpret_cast<std::uintptr_t>(queries.base);
    require(addr % static_cast<std::uintptr_t>(size_of(queries.type)) == 0, "queries.base",
            "address {:#x} is not aligned to its {}-byte {} element", addr, size_of(queries.type),
            name_of(queries.type));
  }
  if constexpr (uses_score_cache<typename P::aggregate_type>()) {
    require(!scores.empty(), "scores.base", "is a null pointer; the aggregator keeps its history in F");
  }
  if constexpr (!std::same_as<typename P::redundancy_type, none>) {
    require(p.redundancy.tau > 0.0f, "pipeline.redundancy.tau", "is {}; must be positive", p.redundancy.tau);
    require(p.redundancy.eps >= 0.0f, "pipeline.redundancy.eps", "is {}; must not be negative", p.redundancy.eps);
    require(p.redundancy.theta >= -1.0f && p.redundancy.theta <= 1.0f, "pipeline.redundancy.theta",
            "is {}; a cosine threshold lies in [-1, 1]", p.redundancy.theta);
  }
  auto check_aggregate = [&](const auto& a, const char* field) {
    using A = std::remove_cvref_t<decltype(a)>;
    if constexpr (SpatialAggregator<A>) {
      require(a.kernel > 0 && a.kernel % 2 == 1, detail::path("pipeline.{}.kernel", field),
              "is {}; a pooling kernel is odd and positive", a.kernel);
    }
  };
  if constexpr (detail::is_then<typename P::aggregate_type>::value) {
    check_aggregate(p.aggregate.first, "aggregate.first");
    check_aggregate(p.aggregate.second, "aggregate.second");
  } else {
    check_aggregate(p.aggregate, "aggregate");
  }
  require(p.protect.window >= 0, "pipeline.protect.window", "is {}; must not be negative", p.protect.window);
  require(p.protect.sinks >= 0, "pipeline.protect.sinks", "is {}; must not be negative", p.protect.sinks);
  if constexpr (requires { p.scorer.buffer; }) {
    require(p.scorer.buffer >= 0 && p.scorer.buffer < p.scorer.window, "pipeline.scorer.buffer",
            "is {}; the buffer is part of the window of {} tokens and leaves some to compress", p.scorer.buffer,
            p.scorer.window);
  }
  if constexpr (PatternSelector<typename P::select_type>) {
    // The pattern covers the candidates whole; what is never evicted is the rest.
    require(p.protect.window == 0 && p.protect.sinks == 0, "pipeline.protect",
            "is (window {}, sinks {}); a pattern selector keeps its own tokens and needs both 0", p.protect.window,
            p.protect.sinks);
  }
  if (!cache.live.empty()) {
    // Cautious update (core/live_view.hpp): the stages that leave dropped tokens out.
    // Full redundancy compares the held keys only; lightning's pairs are the slots of a
    // cache block, which dropped tokens leave ragged; a window or a pattern keeps
    // counts of its own that dropped tokens would break; the layout writes the bytes
    // of the slots it fills, which a layout that moves nothing has not.
    using R = typename P::redundancy_type;
    if constexpr (!std::same_as<R, none>) {
      require(R::pairs == redundancy::scope::full, "cache.live",
              "is set; cautious update does not support lightning redundancy (pipeline.redundancy, scope block)");
    }
    using L = typename P::layout_type;
    require(moves_tokens<L>() && !window_only<L>(), "cache.live",
            "is set; cautious update needs a layout that compacts whole rows (layout::compact or layout::fill)");
    require(!PatternSelector<typename P::select_type>, "cache.live",
            "is set; cautious update does not support a pattern selector (pipeline.select)");
    const live_view& lv = cache.live;
    require(lv.layer_stride >= 0 && lv.block_stride >= 0 && lv.token_stride >= 0 && lv.head_stride >= 0,
            "cache.live", "has strides (layer {}, block {}, token {}, head {}); must not be negative", lv.layer_stride,
            lv.block_stride, lv.token_stride, lv.head_stride);
  }
  // A selector's own parameters and state (docs/extending.md, "A policy's own checks").
  if constexpr (requires { p.select.validate(cache, queries); }) p.select.validate(cache, queries);
}

// Each item's window (batch_item::window_begin), before anything reads it: a
// multiple of the block size inside the sequence for window-only layouts
// (layout::window_compact), 0 for every other layout; no shared-prefix targets with
// a window (the blocks before it are never written anyway).
template <class P>
void validate_windows(const P&, const paged_kv_view& cache, const compression_batch& batch) {
  constexpr bool windowed = window_only<typename P::layout_type>();
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const batch_item& it = batch.items[i];
    const auto field = detail::path("batch[{}].window_begin", i);
    if constexpr (!windowed) {
      require(it.window_begin == 0, field, "is {}; only a window-only layout (layout::window_compact) compresses a window",
              it.window_begin);
    } else {
      require(it.seq >= 0 && it.seq < cache.num_seqs, detail::path("batch[{}].seq", i), "is {}; the cache has {} sequences",
              it.seq, cache.num_seqs);
      const std::int32_t T = cache.lengths[it.seq];
      require(it.window_begin >= 0 && it.window_begin % cache.block_size == 0, field,
              "is {}; a window starts on a block boundary (block size {})", it.window_begin, cache.block_size);
      require(it.window_begin < T, field, "is {}; seq {} holds {} tokens", it.window_begin, it.seq, T);
    }
  }
  if constexpr (fills_holes<typename P::layout_type>()) {
    require(batch.targets.empty(), "batch.targets",
            "are given, but the fill layout moves tokens within the sequence's own blocks; compress a shared prefix "
            "with layout::compact");
  }
  if constexpr (windowed) {
    require(batch.targets.empty(), "batch.targets",
            "are given, but a window-only layout writes no block before the window: no shared prefix needs targets");
  }
}

// Checks the batch against the engine's lengths and block table, and that no block a
// batch sequence writes is shared: held by another sequence of the view (in the
// batch or not), or marked by cache.sharing. The blocks of an item's shared prefix
// (compression_batch::targets) and the blocks before its window (window_begin, after
// validate_windows) are only read, and may be held by others; its targets must be
// free. Every block id a sequence holds is checked, those before a window too. Takes
// the engine's view (rows not shifted to windows); the budget, windows and history
// count within each item's window. Reads those arrays, so it runs where
// they live (the host executor calls it directly; the CUDA executor's validation
// kernels check the same on the device).
template <class P>
void validate_batch(const P& p, const paged_kv_view& cache, const query_window_view& queries,
                    const compression_batch& batch) {
  struct holder {
    std::int32_t seq, index;  // the sequence holding the block, and the block's index in its table
    bool read_only;           // in the item's shared prefix, or before its window
  };
  std::unordered_map<std::int32_t, holder> batch_blocks;  // block id -> the batch sequence holding it
  std::vector<bool> seen_seq(static_cast<std::size_t>(cache.num_seqs), false);
  const auto check_length = [&](std::int32_t seq) {
    if (cache.table.is_csr()) {
      // A CSR row that starts before the array or ends before it starts would be read
      // out of bounds (its capacity alone does not show the first).
      const std::int32_t* ptr = cache.table.indptr;
      require(ptr[seq] >= 0, detail::path("cache.table.indptr[{}]", seq), "is {}; must not be negative", ptr[seq]);
      require(ptr[seq + 1] >= ptr[seq], detail::path("cache.table.indptr[{}]", seq + 1), "is {}; below indptr[{}] = {}",
              ptr[seq + 1], seq, ptr[seq]);
    }
    const std::int32_t T = cache.lengths[seq];
    const std::int64_t capacity = cache.table.capacity(seq) * cache.block_size;
    require(T >= 0 && T <= capacity, detail::path("cache.lengths[{}]", seq),
            "is {}; the block table holds room for {} tokens", T, capacity);
    return (T + cache.block_size - 1) / cache.block_size;
  };
  const auto check_id = [&](std::int32_t seq, std::int32_t b) {
    const std::int32_t id = cache.table.block(seq, b);
    require(id >= 0 && id < cache.num_blocks, detail::path("cache.table[seq {}][{}]", seq, b),
            "is block id {}; valid ids are [0, {})", id, cache.num_blocks);
    return id;
  };
  const prefix_targets& targets = batch.targets;
  std::unordered_map<std::int32_t, std::int32_t> target_of;  // target block id -> its index in targets.blocks
  if (!targets.empty()) {
    require(moves_tokens<typename P::layout_type>(), "batch.targets",
            "are given, but the layout moves no token: a shared prefix would keep its shared blocks");
    require(targets.indptr[0] == 0, "batch.targets.indptr[0]", "is {}; must be 0", targets.indptr[0]);
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      require(targets.indptr[i + 1] >= targets.indptr[i], detail::path("batch.targets.indptr[{}]", i + 1),
              "is {}; below indptr[{}] = {}", targets.indptr[i + 1], i, targets.indptr[i]);
      for (std::int32_t k = targets.indptr[i]; k < targets.indptr[i + 1]; ++k) {
        const std::int32_t id = targets.blocks[k];
        require(id >= 0 && id < cache.num_blocks, detail::path("batch.targets.blocks[{}]", k),
                "is block id {}; valid ids are [0, {})", id, cache.num_blocks);
        const auto [pos, fresh] = target_of.emplace(id, k);
        require(fresh, detail::path("batch.targets.blocks[{}]", k), "is block id {}, as is blocks[{}]", id, pos->second);
        require(!cache.sharing.marked() || !cache.sharing.shared(id), detail::path("batch.targets.blocks[{}]", k),
                "is block id {}, which cache.sharing marks as shared; a target must be free", id);
      }
    }
  }
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const batch_item& it = batch.items[i];
    const auto field = [&](const char* name) { return detail::path("batch[{}].{}", i, name); };
    require(it.seq >= 0 && it.seq < cache.num_seqs, field("seq"), "is {}; the cache has {} sequences", it.seq,
            cache.num_seqs);
    require(!seen_seq[static_cast<std::size_t>(it.seq)], field("seq"), "is {}, which the batch names twice", it.seq);
    seen_seq[static_cast<std::size_t>(it.seq)] = true;

    const std::int32_t blocks = check_length(it.seq);
    const std::int32_t T = cache.lengths[it.seq] - it.window_begin;  // the item's tokens: its window's
    const std::int32_t before_window = it.window_begin / cache.block_size;
    const std::int32_t shared = targets.count(static_cast<std::int32_t>(i));
    require(shared <= blocks, detail::path("batch.targets (item {})", i),
            "give {} target blocks; seq {} holds {} blocks", shared, it.seq, blocks);
    for (std::int32_t b = 0; b < blocks; ++b) {
      const std::int32_t id = check_id(it.seq, b);
      const bool read_only = b < shared || b < before_window;
      const auto [pos, fresh] = batch_blocks.emplace(id, holder{it.seq, b, read_only});
      // Two items may read one block of their shared prefixes; no item may write a block another holds.
      require(fresh || (read_only && pos->second.read_only), detail::path("cache.table[seq {}][{}]", it.seq, b),
              "is block id {}, already used by seq {}; a block two sequences share is never written", id,
              pos->second.seq);
      require(read_only || !cache.sharing.marked() || !cache.sharing.shared(id),
              detail::path("cache.table[seq {}][{}]", it.seq, b),
              "is block id {}, which cache.sharing marks as shared with another request; a shared block is never "
              "written",
              id);
      const auto target = target_of.find(id);
      require(target == target_of.end(), detail::path("batch.targets.blocks[{}]", target == target_of.end() ? 0 : target->second),
              "is block id {}, which seq {} holds; a target must be free", id, it.seq);
    }

    require(it.budget > 0, field("budget"), "is {}; must be positive", it.budget);
    require(it.budget <= T, field("budget"), "is {}; larger than seq {}'s {} tokens", it.budget, it.seq, T);
    const std::int32_t w = scorer_window(p.scorer);
    require(w <= T, "pipeline.scorer.window", "is {}; longer than seq {} (batch[{}]) of {} tokens", w, it.seq, i, T);
    require(p.protect.window <= T, "pipeline.protect.window", "is {}; longer than seq {} (batch[{}]) of {} tokens",
            p.protect.window, it.seq, i, T);
    require(it.history_tokens >= 0 && it.history_tokens <= T, field("history_tokens"),
            "is {}; must lie in [0, {}] (the sequence's length)", it.history_tokens, T);
    if constexpr (AttentionScorer<typename P::scorer_type>) {
      require(it.query_slot >= 0 && it.query_slot < queries.num_slots, field("query_slot"),
              "is {}; the query window view has {} slots", it.query_slot, queries.num_slots);
    }
    using Sel = typename P::select_type;
    if constexpr (BudgetSelector<Sel> && !ScoreDependentSelector<Sel>) {
      // Score-dependent counts are checked by definition: they keep the protected
      // tokens and at most the row (SPEC.md, Selectors).
      const std::int32_t must = protected_count(T, candidate_end(p.scorer, T), p.protect.sinks, p.protect.window);
      const layer_range layers = resolve_layers(batch, cache);
      const std::int32_t heads = uniform_counts<Sel> ? 1 : cache.num_kv_heads;
      for (std::int32_t l = layers.begin; l < (uniform_counts<Sel> ? layers.begin + 1 : layers.end); ++l)
        for (std::int32_t h = 0; h < heads; ++h) {
          const std::int32_t keep = budget_keep_count(p.select, T, it.budget, head_index{l, h});
          require(keep >= must && keep <= T, field("budget"),
                  "is {}; it keeps {} tokens in layer {} head {}, but {} are protected (sinks {}, window {}) of {}",
                  it.budget, keep, l, h, must, p.protect.sinks, p.protect.window, T);
        }
    }
  }
  // The other sequences of the view: well-formed where they are read, and holding no
  // block of a batch sequence (a prefix they share would be overwritten under them).
  for (std::int32_t seq = 0; seq < cache.num_seqs; ++seq) {
    if (seen_seq[static_cast<std::size_t>(seq)]) continue;
    const std::int32_t blocks = check_length(seq);
    for (std::int32_t b = 0; b < blocks; ++b) {
      const std::int32_t id = check_id(seq, b);
      const auto target = target_of.find(id);
      require(target == target_of.end(), detail::path("batch.targets.blocks[{}]", target == target_of.end() ? 0 : target->second),
              "is block id {}, which seq {} holds; a target must be free", id, seq);
      const auto at = batch_blocks.find(id);
      if (at == batch_blocks.end() || at->second.read_only) continue;
      require(false, detail::path("cache.table[seq {}][{}]", at->second.seq, at->second.index),
              "is block id {}, which seq {} (not in the batch) also holds; a block two sequences share is never "
              "written",
              id, seq);
    }
  }
}

KVP_NAMESPACE_END
