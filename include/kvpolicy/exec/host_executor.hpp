// The host executor: runs any pipeline with plain loops over host memory. It
// defines the semantics every other executor reproduces byte for byte.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/communicator.hpp"
#include "kvpolicy/core/destination_table.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/host/aggregate.hpp"
#include "kvpolicy/exec/host/compact.hpp"
#include "kvpolicy/exec/host/fill.hpp"
#include "kvpolicy/exec/host/redundancy.hpp"
#include "kvpolicy/exec/host/scores.hpp"
#include "kvpolicy/exec/host/select.hpp"
#include "kvpolicy/exec/host/window.hpp"
#include "kvpolicy/exec/result.hpp"
#include "kvpolicy/exec/validate.hpp"
#include "kvpolicy/pipeline/pipeline.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN

namespace host {

// Applies an aggregator (or a `then` of two) to one row of candidate scores.
template <class A>
void apply_aggregate(const A& a, std::span<float> s, std::span<float> f, std::int32_t history) {
  if constexpr (TemporalAggregator<A>) {
    apply_temporal(a, s, f, history);
  } else if constexpr (SpatialAggregator<A>) {
    if (!a.first_only || history == 0) apply_pool(a, s);
  } else if constexpr (detail::is_then<A>::value) {
    apply_aggregate(a.first, s, f, history);
    apply_aggregate(a.second, s, f, history);
  }
}

}  // namespace host

struct host_executor {
  bool record_keep_masks = false;  // fill host_result::keep_masks
  bool record_scores = false;      // fill host_result::scores

  // Compresses every (item, layer, KV head) of the batch in place: scores, keeps
  // the selected tokens, moves them (and F) per the layout. Throws kvp::error
  // before writing anything when an input is malformed.
  // A window-only layout (layout::window_compact) compresses [window_begin, T) of
  // each item as if it were the whole sequence; its masks and scores cover the window.
  //
  // Tensor parallelism: `cache` (and queries, F) describe this rank's KV heads
  // (slice_heads, core/head_slice.hpp), `comm` the engine's communicator; every rank
  // makes the same call. Each rank scores, selects and moves its own heads; the items'
  // new lengths are reduced (max) over the ranks before blocks are released, so every
  // rank returns the same lengths, tables and released blocks, and each head the bytes
  // a single-rank call over all heads gives it.
  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L, HostCommunicator C = single_rank>
  host_result compress(const pipeline<S, A, R, Sel, L>& p, const paged_kv_view& cache,
                       const query_window_view& queries, const score_view& scores,
                       const compression_batch& batch, const C& comm = {}) const {
    validate_shapes(p, cache, queries, scores, batch);
    validate_windows(p, cache, batch);
    // On the engine's rows, before any is shifted to its window: the blocks before a
    // window are checked too, and another item may not write one of them.
    validate_batch(p, cache, queries, batch);
    if constexpr (window_only<L>()) {
      const host::window_rows windows(cache, batch.items);
      host_result out = compress_rows(p, windows.view(), queries, scores, batch, comm);
      windows.restore(out, cache, batch.items);
      return out;
    } else {
      return compress_rows(p, cache, queries, scores, batch, comm);
    }
  }

  // For pipelines that read neither queries nor F.
  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L>
  host_result compress(const pipeline<S, A, R, Sel, L>& p, const paged_kv_view& cache,
                       const compression_batch& batch) const {
    return compress(p, cache, query_window_view{}, score_view{}, batch);
  }

 private:
  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L, HostCommunicator C>
  host_result compress_rows(const pipeline<S, A, R, Sel, L>& p, const paged_kv_view& cache,
                            const query_window_view& queries, const score_view& scores,
                            const compression_batch& batch, const C& comm) const {
    const layer_range layers = resolve_layers(batch, cache);
    const std::int32_t H = cache.num_kv_heads, d = cache.head_dim, b = cache.block_size;
    constexpr bool with_f = uses_score_cache<A>();

    host_result out;
    const std::size_t items = batch.items.size();
    out.new_lengths.resize(items);
    out.kept_counts.resize(items);
    out.released_blocks.resize(items);
    out.new_tables.resize(items);
    out.unshared_blocks.resize(items);
    out.nonfinite_scores.assign(items, 0);
    if (record_keep_masks) out.keep_masks.resize(items);
    if (record_scores) out.scores.resize(items);

    using clock = std::chrono::steady_clock;
    auto timed = [&](stage st, auto&& fn) {
      const auto t0 = clock::now();
      fn();
      out.times[st] += std::chrono::duration<double>(clock::now() - t0).count();
    };

    for (std::size_t i = 0; i < items; ++i) {
      const batch_item& it = batch.items[i];
      const std::int32_t T = cache.lengths[it.seq];
      const std::int32_t n = candidate_end(p.scorer, T);
      const std::int32_t must = protected_count(T, n, p.protect.sinks, p.protect.window);
      const std::size_t row_count = static_cast<std::size_t>(layers.end - layers.begin) * H;
      // Where kept tokens go: the own table, or fresh targets for a shared prefix,
      // whose blocks (and F) are only read.
      const destination_table to = destination_table::of(cache.table, it.seq, batch.targets, static_cast<std::int32_t>(i));
      const std::int32_t prefix_tokens = std::min(T, to.shared * b);
      if (record_keep_masks) out.keep_masks[i].assign(row_count * T, 1);
      if (record_scores) out.scores[i].assign(row_count * T, 0.0f);
      out.kept_counts[i].assign(row_count, T);
      std::int32_t new_length = moves_tokens<L>() ? 0 : T;

      for (std::int32_t l = layers.begin; l < layers.end; ++l) {
        for (std::int32_t h = 0; h < H; ++h) {
          const std::size_t row = static_cast<std::size_t>(l - layers.begin) * H + h;
          const head_index head{l, h};
          std::vector<float> s(static_cast<std::size_t>(T), 0.0f), keys, raw;
          std::vector<float> prefix_f(static_cast<std::size_t>(prefix_tokens), 0.0f);  // F of the shared prefix
          const std::span<float> cand(s.data(), static_cast<std::size_t>(n));
          // Cautious update: the tokens this head still holds (read before the layout writes them).
          std::vector<std::uint8_t> alive;
          std::int32_t live = T, must_live = must;
          if (!cache.live.empty()) {
            alive.resize(static_cast<std::size_t>(T));
            live = must_live = 0;
            for (std::int32_t t = 0; t < T; ++t) {
              alive[t] = cache.alive(l, it.seq, t, h);
              live += alive[t];
              must_live += alive[t] && (p.protect.covers(t, T) || t >= n);
            }
          }

          timed(stage::score, [&] {
            if constexpr (AttentionScorer<S> || !std::same_as<R, none>) keys = host::gather_keys(cache, l, it.seq, h, T);
            if constexpr (AttentionScorer<S>) {
              host::attention_scores(p.scorer, queries, l, it.query_slot, h, H, keys, T, d, cand, alive);
            } else if constexpr (KeyScorer<S>) {
              host::key_scores(p.scorer, cache, l, it.seq, h, T, s);
            }
            if constexpr (ScoreDependentSelector<Sel>) raw = s;  // what the selector sees as `raw`
            // A dropped token enters aggregation with no score (what attention gives it).
            for (std::int32_t t = 0; t < n && !alive.empty(); ++t)
              if (!alive[t]) s[t] = 0.0f;
          });

          timed(stage::aggregate, [&] {
            if constexpr (with_f) {
              auto f_at = [&](std::int32_t t) -> float& {
                return scores.at(l, cache.physical_block(it.seq, t), t % b, h);
              };
              std::vector<float> f(static_cast<std::size_t>(n));
              for (std::int32_t t = 0; t < std::min(n, it.history_tokens); ++t) f[t] = f_at(t);
              host::apply_aggregate(p.aggregate, cand, f, it.history_tokens);
              for (std::int32_t t = 0; t < T; ++t) {
                const float value = t < n ? f[t] : 0.0f;  // past the candidates: no score, no history
                (t < prefix_tokens ? prefix_f[t] : f_at(t)) = value;
              }
            } else {
              host::apply_aggregate(p.aggregate, cand, {}, it.history_tokens);
            }
          });

          if constexpr (!std::same_as<R, none>) {
            timed(stage::redundancy, [&] {
              const std::vector<float> red = alive.empty()
                                                 ? host::redundancy_scores(p.redundancy, keys, n, d, b)
                                                 : host::held_redundancy_scores(p.redundancy, keys, n, d, alive);
              for (std::int32_t t = 0; t < n; ++t) s[t] = p.redundancy.combine(s[t], red[t]);
            });
          }

          std::vector<std::uint8_t> keep;
          std::vector<float> before;  // the final scores before protect, for a selector that reads them
          std::int32_t kept = T;
          timed(stage::select, [&] {
            out.nonfinite_scores[i] += host::count_nonfinite(cand);
            if constexpr (sees_protected_scores<Sel>) before = host::scores_before_protect(s, n, alive);
            host::apply_protect(p.protect, s, n);
            // Dropped tokens: never kept, whatever protects their slots.
            for (std::int32_t t = 0; t < T && !alive.empty(); ++t)
              if (!alive[t]) s[t] = -std::numeric_limits<float>::infinity();
            if constexpr (PatternSelector<Sel>) {
              keep.assign(static_cast<std::size_t>(T), 1);  // the non-candidates stay
              p.select.keep_pattern(cand, it.budget, std::span<std::uint8_t>(keep.data(), static_cast<std::size_t>(n)));
              kept = T - n + p.select.region_keep(n, it.budget);
            } else {
              kept = host::keep_count(p.select, s, raw, before, n, must_live, it.budget, head, it.query_slot, live);
              keep = host::select_top(p.select, s, kept, alive);
            }
          });
          out.kept_counts[i][row] = kept;
          if (record_scores) std::copy(s.begin(), s.end(), out.scores[i].begin() + row * T);
          if (record_keep_masks) std::copy(keep.begin(), keep.end(), out.keep_masks[i].begin() + row * T);

          timed(stage::layout, [&] {
            if constexpr (fills_holes<L>()) {
              new_length = std::max(new_length, host::fill_row(cache, with_f ? scores : score_view{}, l, it.seq, h, keep));
            } else if constexpr (moves_tokens<L>()) {
              new_length = std::max(new_length, host::compact_row(p.layout, cache, with_f ? scores : score_view{},
                                                                  prefix_f, to, l, it.seq, h, keep));
            }
          });
        }
      }
      out.new_lengths[i] = new_length;
    }
    // A block is free once no head of any rank holds a token in it.
    comm.all_reduce(std::span<std::int32_t>(out.new_lengths), reduce_op::max);
    for (std::size_t i = 0; i < items; ++i) {
      const batch_item& it = batch.items[i];
      const std::int32_t T = cache.lengths[it.seq];
      const destination_table to = destination_table::of(cache.table, it.seq, batch.targets, static_cast<std::int32_t>(i));
      const std::int32_t used = (T + b - 1) / b, kept_blocks = (out.new_lengths[i] + b - 1) / b;
      for (std::int32_t blk = 0; blk < kept_blocks; ++blk) out.new_tables[i].push_back(to.block(blk));
      for (std::int32_t blk = kept_blocks; blk < used; ++blk) out.released_blocks[i].push_back(to.block(blk));
      for (std::int32_t blk = 0; blk < to.shared; ++blk) out.unshared_blocks[i].push_back(cache.table.block(it.seq, blk));
    }
    return out;
  }
};

KVP_NAMESPACE_END
