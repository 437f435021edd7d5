// KV-Compress on the host over a per-head cache (issue 31): each item's block schedule
// across its layers and KV heads, from the metric the cache holds per slot, then
// MoveCache on every head that evicts. The reference a GPU executor reproduces.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/communicator.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_item.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/host/move_cache.hpp"
#include "kvpolicy/exec/validate_per_head.hpp"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

KVP_NAMESPACE_BEGIN

struct per_head_result {
  std::vector<std::vector<std::int32_t>> new_lengths;               // [item][layer * h_kv + head]
  std::vector<std::vector<std::vector<std::int32_t>>> freed_blocks;  // [item][layer * h_kv + head]: physical ids
  std::vector<std::vector<std::int32_t>> evicted;                   // [item][layer * h_kv + head]: tokens
  std::vector<std::vector<std::int32_t>> moved;                     // [item][layer * h_kv + head]: tokens copied
  std::vector<std::int64_t> freed;                                  // [item]: blocks freed in all
  std::vector<std::int64_t> nonfinite;                              // [item]: NaN or infinite metrics
};

namespace host {

// Every schedule is made (and every argument checked) before the first byte moves.
// The metric is the cache's (`cache.metric`: KV-Compress accumulates it at decode,
// and an engine writes a prefill metric, squared_attention_metric, into it first).
//
// Tensor parallelism: `c` holds this rank's KV heads, heads [ranks.first, ranks.first +
// c.num_kv_heads) of ranks.total, and `comm` reduces over the ranks: each item's blocks
// are ranked against its budget over every rank's heads (head_adaptive_blocks::plan),
// so each head evicts, moves and frees what one call over all heads gives it; `freed`
// and `nonfinite` are the whole sequence's. Every rank makes the same call.
template <HostCommunicator C = single_rank>
per_head_result compress_per_head(const select::head_adaptive_blocks& sel, const per_head_kv_view& c,
                                  std::span<const per_head_item> items, select::head_range ranks = {},
                                  const C& comm = {}) {
  validate_per_head(c);
  require(!c.metric.empty(), "cache.metric", "is a null pointer; KV-Compress evicts by the metric each slot holds");
  const std::int32_t L = c.num_layers, H = c.num_kv_heads, b = c.block_size;
  std::vector<bool> seen(static_cast<std::size_t>(c.num_seqs), false);
  std::vector<select::head_adaptive_blocks::schedule> plans;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const per_head_item& it = items[i];
    require(it.seq >= 0 && it.seq < c.num_seqs, detail::path("batch[{}].seq", i), "is {}; the cache has {} sequences",
            it.seq, c.num_seqs);
    require(!seen[static_cast<std::size_t>(it.seq)], detail::path("batch[{}].seq", i), "is {}, which the batch names twice",
            it.seq);
    seen[static_cast<std::size_t>(it.seq)] = true;
    require(sel.budget == select::block_budget::sequence || it.per_layer != nullptr, detail::path("batch[{}].per_layer", i),
            "is a null pointer; a per-layer budget needs {} counts", L);
    require(c.positions.empty() || it.logical_length >= 0, detail::path("batch[{}].logical_length", i),
            "is {}; with cache.positions the protected window is read off positions, which needs the sequence's "
            "position count",
            it.logical_length);
    // The counts and positions, named by item as the device names them (the schedule's
    // own checks know rows, not items).
    require(sel.budget != select::block_budget::sequence || it.blocks_to_free >= 0,
            detail::path("batch[{}].blocks_to_free", i), "is {}; must not be negative", it.blocks_to_free);
    for (std::int32_t l = 0; l < L && sel.budget == select::block_budget::layer; ++l)
      require(it.per_layer[l] >= 0, detail::path("batch[{}].per_layer[{}]", i, l), "is {}; must not be negative",
              it.per_layer[l]);
    for (std::int32_t l = 0; l < L && !c.positions.empty(); ++l)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t t = 0; t < c.length(l, it.seq, h); ++t) {
          const std::int32_t p = c.positions.at(l, c.physical_block(l, it.seq, h, t), t % b);
          require(p >= 0 && p < it.logical_length,
                  detail::path("cache.positions (batch[{}], layer {}, head {}, token {})", i, l, h, t),
                  "is {}; positions lie in [0, {})", p, it.logical_length);
        }
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    const per_head_item& it = items[i];
    // The rows' metric and positions in logical order (slot t of the head).
    std::vector<std::vector<float>> metric(static_cast<std::size_t>(L) * H);
    std::vector<std::vector<std::int32_t>> positions(static_cast<std::size_t>(L) * H);
    std::vector<select::head_adaptive_blocks::row> rows;
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::size_t r = static_cast<std::size_t>(l) * H + h;
        const std::int32_t T = c.length(l, it.seq, h);
        for (std::int32_t t = 0; t < T; ++t) {
          metric[r].push_back(c.metric.at(l, c.physical_block(l, it.seq, h, t), t % b));
          if (!c.positions.empty()) positions[r].push_back(c.positions.at(l, c.physical_block(l, it.seq, h, t), t % b));
        }
        rows.push_back({metric[r], positions[r]});
      }
    const std::int64_t one[1] = {it.blocks_to_free};
    const std::span<const std::int64_t> asked = sel.budget == select::block_budget::sequence
                                                    ? std::span<const std::int64_t>(one)
                                                    : std::span<const std::int64_t>(it.per_layer, static_cast<std::size_t>(L));
    plans.push_back(sel.plan(rows, H, b, asked, it.logical_length, ranks, comm));
  }

  per_head_result out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const per_head_item& it = items[i];
    const auto& plan = plans[i];
    auto& lengths = out.new_lengths.emplace_back();
    auto& freed = out.freed_blocks.emplace_back();
    auto& evicted = out.evicted.emplace_back();
    auto& moved_tokens = out.moved.emplace_back();
    std::int64_t total = 0;
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const auto& row = plan.rows[static_cast<std::size_t>(l) * H + h];
        std::vector<std::uint8_t> keep(static_cast<std::size_t>(c.length(l, it.seq, h)), 1);
        for (std::int32_t t : row.slots) keep[static_cast<std::size_t>(t)] = 0;
        move_cache_result moved = move_cache(c, l, it.seq, h, keep);
        lengths.push_back(moved.new_length);
        evicted.push_back(row.evicted);
        moved_tokens.push_back(moved.moved);
        total += static_cast<std::int64_t>(moved.freed_blocks.size());
        freed.push_back(std::move(moved.freed_blocks));
      }
    out.freed.push_back(total);
    out.nonfinite.push_back(plan.nonfinite);
  }
  if (ranks.total != 0 && ranks.total != H) {  // blocks freed by every rank's heads
    std::vector<std::int32_t> freed(out.freed.begin(), out.freed.end());
    comm.all_reduce(std::span<std::int32_t>(freed), reduce_op::sum);
    std::copy(freed.begin(), freed.end(), out.freed.begin());
  }
  return out;
}

}  // namespace host
KVP_NAMESPACE_END
