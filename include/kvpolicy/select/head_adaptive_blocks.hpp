// KV-Compress 4.2.2 (SPEC.md "Head-adaptive top-k"): head-adaptive, block-granular
// eviction over per-head paged blocks. Host reference of the schedule; the moves
// (MoveCache, alg. 1) and the device form come later.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <tuple>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/communicator.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace select {

// Whose blocks one count of blocks to free is spent over.
enum class block_budget : std::uint8_t {
  sequence,  // every layer and KV head of the sequence (KV-Compress)
  layer,     // each layer's KV heads, one count per layer
};

// Blocks to free for a token budget, as the authors' scheduler converts it
// (IsaacRe/vllm-kvcompress, `max_cache_tokens`): the sequence may keep
// `tokens_per_head` tokens per row on average over its `rows` rows (layers x KV heads
// for block_budget::sequence, one layer's KV heads for block_budget::layer), i.e.
// tokens_per_head x rows KVs in all. The budget is first rounded UP to whole blocks
// per row, ceil(tokens_per_head / b), so the sequence never ends under its budget;
// the blocks over it are freed: max(0, held_blocks - rows x ceil(tokens_per_head / b)).
// A negative budget frees nothing (the authors' "no token budget").
constexpr std::int64_t blocks_to_free_for_tokens(std::int64_t held_blocks, std::int64_t tokens_per_head,
                                                 std::int64_t rows, std::int32_t b) noexcept {
  if (tokens_per_head < 0 || b <= 0) return 0;
  const std::int64_t budget_blocks = (tokens_per_head + b - 1) / b * rows;
  return held_blocks > budget_blocks ? held_blocks - budget_blocks : 0;
}

// Blocks to free for a target compression rate r (the authors' `target_compression_rate`):
// each row keeps its protected window rounded up to whole blocks, P = ceil(window / b) x b
// positions, and the rest of the sequence's `logical_length` positions,
// C = logical_length - P, is compressed to r of its uncompressed size over `rows` rows:
// target = ceil(C x rows x r) + P x rows KVs; blocks to free = ceil(max(0, held_kvs - target) / b).
// The last step rounds UP (as the authors do): the sequence may end up to b - 1 KVs
// under the target. Nothing is freed when C <= 0 or r >= 1.
inline std::int64_t blocks_to_free_for_rate(std::int64_t held_kvs, std::int64_t logical_length, double rate,
                                            std::int64_t rows, std::int32_t b,
                                            std::int32_t protected_window) noexcept {
  if (b <= 0 || rate >= 1.0) return 0;
  const std::int64_t P = (std::int64_t{protected_window} + b - 1) / b * b;
  const std::int64_t C = logical_length - P;
  if (C <= 0) return 0;
  const auto target =
      static_cast<std::int64_t>(std::ceil(static_cast<double>(C) * static_cast<double>(rows) * rate)) + P * rows;
  const std::int64_t over = held_kvs - target;
  return over > 0 ? (over + b - 1) / b : 0;
}

// The schedule. Rows are the (layer, KV head) pairs of one sequence, row = layer x
// kv_heads + head; row r holds T_r tokens in ceil(T_r / b) blocks of its own, the last
// one holding hanging(T_r) = T_r mod b tokens, or b when that is 0.
//
//   1. A row's eviction order: its evictable tokens by the library's rank order reversed
//      (rank_order.hpp: smaller metric first, NaN as -inf, among equal metrics the
//      OLDER position first, since the more recent ranks higher), then its protected
//      tokens (never reached). Protected: the first `sinks` positions and the last
//      `protected_window` positions of the sequence, position >= logical_length -
//      protected_window. Slots past a row's length are not part of the row.
//   2. Evicting the row's e-th block (e = 1, 2, ...) evicts its first (e - 1) b +
//      hanging tokens in that order, and costs the metric of the last of them, at
//      offset (e - 1) b + hanging - 1 (KV-Compress eq. 17, with the partial last block
//      evicted first). Costs never decrease with e. A block is possible only while
//      (e - 1) b + hanging <= the row's evictable tokens (and e <= its blocks): the
//      authors give protected tokens +inf and let the count decide; here a token with
//      a true +inf metric stays evictable, ranked last among the evictable ones.
//   3. Per budget group (the sequence, or each layer), the possible blocks are ranked
//      by (cost, row, e): the cheapest cost first (as a float key: NaN as -inf, -0 as
//      +0), equal costs to the lower row (lower layer, then lower head), then the
//      earlier block of the row. The first min(asked, possible) are freed. So a row
//      always frees a prefix of its blocks, and evicts a prefix of its order:
//      evicted = (blocks - 1) b + hanging tokens, and its new length T_r - evicted is a
//      whole number of blocks, T_r rounded up to blocks minus `blocks` blocks.
//
// When the group has fewer possible blocks than asked, every possible one is freed
// and `freed` says how many. (The authors assert the count never exceeds the blocks
// outside the rounded-up windows instead.)
// A rank's KV heads among every rank's (tensor parallelism): heads [first, first + the
// rank's kv_heads) of `total`. total 0: one rank holding every head.
struct head_range {
  std::int32_t first = 0;
  std::int32_t total = 0;
};

struct head_adaptive_blocks {
  std::int32_t protected_window = 64;  // last positions of the sequence never evicted
  std::int32_t sinks = 0;              // first positions never evicted (StreamingLLM: 4)
  block_budget budget = block_budget::sequence;

  // One (layer, KV head) of the sequence: its metric per slot (T_r of them) and,
  // optionally, each slot's original position (empty: slot t holds position t). Higher
  // metric = keep. Positions are the rank order's tie-break and what protection reads.
  struct row {
    std::span<const float> metric;
    std::span<const std::int32_t> positions = {};
  };

  struct row_eviction {
    std::int32_t evicted = 0;         // tokens: (blocks - 1) b + hanging, 0 without blocks
    std::int32_t blocks = 0;          // blocks freed: the row's last `blocks` blocks after the moves
    std::vector<std::int32_t> slots;  // the evicted slots, in eviction order (a prefix of it)
  };

  struct schedule {
    std::vector<row_eviction> rows;  // [layer x kv_heads + head]
    std::vector<std::int64_t> freed;  // blocks freed per budget group (1 entry, or one per layer)
    std::int64_t nonfinite = 0;       // metrics that are NaN or +-inf, protected ones included
  };

  // Tokens in the last block of a row of T tokens.
  KVP_HOST_DEVICE static constexpr std::int32_t hanging(std::int32_t T, std::int32_t b) noexcept {
    return T % b == 0 ? b : T % b;
  }
  // Tokens evicted with `blocks` blocks of a row of T tokens.
  KVP_HOST_DEVICE static constexpr std::int32_t evicted_tokens(std::int32_t blocks, std::int32_t T,
                                                               std::int32_t b) noexcept {
    return blocks <= 0 ? 0 : (blocks - 1) * b + hanging(T, b);
  }
  // The most blocks a row of T tokens, `evictable` of them unprotected, can free.
  KVP_HOST_DEVICE static constexpr std::int32_t max_blocks(std::int32_t evictable, std::int32_t T,
                                                           std::int32_t b) noexcept {
    const std::int32_t h = hanging(T, b), held = (T + b - 1) / b;
    if (T <= 0 || evictable < h) return 0;
    const std::int32_t e = 1 + (evictable - h) / b;
    return e < held ? e : held;
  }
  KVP_HOST_DEVICE constexpr bool protects(std::int32_t position, std::int32_t logical_length) const noexcept {
    return position < sinks || position >= logical_length - protected_window;
  }

  // The schedule of one sequence. `kv_heads` splits rows into layers; `b` is the
  // cache's block size; blocks_to_free holds one count (block_budget::sequence) or one
  // per layer (block_budget::layer). `logical_length` is the sequence's position count
  // (one past its newest cached position); -1: each row's own length, which needs
  // slots to be positions (no positions given).
  schedule plan(std::span<const row> rows, std::int32_t kv_heads, std::int32_t b,
                std::span<const std::int64_t> blocks_to_free, std::int32_t logical_length = -1) const {
    return plan(rows, kv_heads, b, blocks_to_free, logical_length, head_range{}, single_rank{});
  }

  // Tensor parallelism: `rows` are this rank's KV heads, heads [ranks.first, ranks.first +
  // kv_heads) of ranks.total, and `comm` reduces over the ranks. The cut of step 3 is
  // made over every rank's blocks (a radix select of the cost keys, then the ties in
  // global (row, e) order), so each row frees what it frees in one plan over all heads.
  // Every rank calls with the same counts; `freed` and `nonfinite` are the whole group's.
  template <HostCommunicator C>
  schedule plan(std::span<const row> rows, std::int32_t kv_heads, std::int32_t b,
                std::span<const std::int64_t> blocks_to_free, std::int32_t logical_length, head_range ranks,
                const C& comm) const {
    if (ranks.total == 0) ranks = {0, kv_heads};
    require(ranks.first >= 0 && ranks.total >= ranks.first + kv_heads, "ranks",
            "heads [{}, {}) are not within the {} KV heads of all ranks", ranks.first, ranks.first + kv_heads,
            ranks.total);
    require(protected_window >= 0, "pipeline.select.protected_window", "is {}; must not be negative",
            protected_window);
    require(sinks >= 0, "pipeline.select.sinks", "is {}; must not be negative", sinks);
    require(b >= 1, "block_size", "is {}; must be at least 1", b);
    require(kv_heads >= 1 && rows.size() % static_cast<std::size_t>(kv_heads) == 0, "rows",
            "has {} rows for {} KV heads; must be layers x KV heads", rows.size(), kv_heads);
    const auto n_rows = static_cast<std::int32_t>(rows.size());
    const std::int32_t layers = n_rows / kv_heads;
    const std::int32_t groups = budget == block_budget::sequence ? 1 : layers;
    require(static_cast<std::int32_t>(blocks_to_free.size()) == groups, "blocks_to_free",
            "has {} counts; the budget takes {} (one per {})", blocks_to_free.size(), groups,
            budget == block_budget::sequence ? "sequence" : "layer");
    for (std::int32_t g = 0; g < groups; ++g)
      require(blocks_to_free[g] >= 0, detail::path("blocks_to_free[{}]", g), "is {}; must not be negative",
              blocks_to_free[g]);

    schedule out;
    out.rows.resize(rows.size());
    out.freed.assign(static_cast<std::size_t>(groups), 0);

    // 1. Each row's eviction order and how many blocks it could free.
    std::vector<std::vector<std::int32_t>> order(rows.size());
    std::vector<std::int32_t> possible(rows.size(), 0);
    for (std::int32_t r = 0; r < n_rows; ++r) {
      const row& in = rows[r];
      const auto T = static_cast<std::int32_t>(in.metric.size());
      const bool has_positions = !in.positions.empty();
      require(!has_positions || in.positions.size() == in.metric.size(), detail::path("rows[{}].positions", r),
              "has {} entries for {} metrics", in.positions.size(), in.metric.size());
      require(!has_positions || logical_length >= 0, "logical_length",
              "is {}; rows with positions need the sequence's position count", logical_length);
      const std::int32_t length = logical_length >= 0 ? logical_length : T;
      std::vector<std::tuple<std::uint64_t, std::int32_t>> keys;  // (rank bits, slot) of evictable tokens
      keys.reserve(in.metric.size());
      for (std::int32_t t = 0; t < T; ++t) {
        const std::int32_t p = has_positions ? in.positions[t] : t;
        require(p >= 0 && p < length, detail::path("rows[{}].positions[{}]", r, t),
                "is {}; positions lie in [0, {})", p, length);
        if (!std::isfinite(in.metric[t])) ++out.nonfinite;
        if (!protects(p, length)) keys.emplace_back(rank_bits(in.metric[t], p), t);
      }
      std::sort(keys.begin(), keys.end());
      order[r].reserve(keys.size());
      for (const auto& [key, t] : keys) order[r].push_back(t);
      possible[r] = max_blocks(static_cast<std::int32_t>(keys.size()), T, b);
    }

    // 2. Per budget group, the possible blocks by (cost, row, e); the first ones are freed.
    const std::int32_t rows_per_group = n_rows / groups;
    const bool alone = ranks.first == 0 && ranks.total == kv_heads;
    for (std::int32_t g = 0; g < groups; ++g) {
      std::vector<std::tuple<std::uint32_t, std::int32_t, std::int32_t>> blocks;  // (cost key, row, e)
      for (std::int32_t r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
        const auto T = static_cast<std::int32_t>(rows[r].metric.size());
        for (std::int32_t e = 1; e <= possible[r]; ++e) {
          const std::int32_t last = order[r][evicted_tokens(e, T, b) - 1];
          blocks.emplace_back(static_cast<std::uint32_t>(rank_bits(rows[r].metric[last], 0) >> 32), r, e);
        }
      }
      if (alone) {
        const auto take = static_cast<std::size_t>(
            std::min<std::int64_t>(blocks_to_free[g], static_cast<std::int64_t>(blocks.size())));
        std::partial_sort(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(take), blocks.end());
        for (std::size_t i = 0; i < take; ++i) ++out.rows[std::get<1>(blocks[i])].blocks;
        out.freed[g] = static_cast<std::int64_t>(take);
      } else {
        out.freed[g] = cut_over_ranks(blocks, blocks_to_free[g], kv_heads, ranks,
                                      budget == block_budget::sequence ? layers : 1, out, comm);
      }
    }
    if (!alone) {
      std::int32_t nonfinite[1] = {static_cast<std::int32_t>(out.nonfinite)};
      comm.all_reduce(std::span<std::int32_t>(nonfinite), reduce_op::sum);
      out.nonfinite = nonfinite[0];
    }

    // 3. Each row evicts the prefix of its order that its blocks cover.
    for (std::int32_t r = 0; r < n_rows; ++r) {
      row_eviction& e = out.rows[r];
      e.evicted = evicted_tokens(e.blocks, static_cast<std::int32_t>(rows[r].metric.size()), b);
      e.slots.assign(order[r].begin(), order[r].begin() + e.evicted);
    }
    return out;
  }

 private:
  // Step 3 over the ranks: frees the `asked` cheapest of every rank's `blocks` (this
  // rank's, with local rows) in the global (cost, row, e) order; returns how many the
  // group freed. `layers` is the group's layers (the row index is global: layer x total
  // heads + first + head). The same calls, in the same order, on every rank.
  template <HostCommunicator C>
  static std::int64_t cut_over_ranks(const std::vector<std::tuple<std::uint32_t, std::int32_t, std::int32_t>>& blocks,
                                     std::int64_t asked, std::int32_t kv_heads, head_range ranks,
                                     std::int32_t layers, schedule& out, const C& comm) {
    std::int32_t total[1] = {static_cast<std::int32_t>(blocks.size())};
    comm.all_reduce(std::span<std::int32_t>(total), reduce_op::sum);
    const std::int64_t take = std::min<std::int64_t>(asked, total[0]);
    if (take == total[0]) {  // every possible block (none when take is 0)
      for (const auto& [k, r, e] : blocks) ++out.rows[r].blocks;
      return take;
    }
    // The take-th smallest cost key over all ranks, 8 bits a pass; `need`: how many of
    // the blocks at that key are taken (at least 1).
    std::uint32_t key = 0;
    std::int64_t need = take;
    for (int shift = 24; shift >= 0; shift -= 8) {
      std::array<std::int32_t, 256> count{};
      const std::uint32_t high = shift == 24 ? 0u : ~0u << (shift + 8);
      for (const auto& [k, r, e] : blocks)
        if ((k & high) == key) ++count[(k >> shift) & 0xffu];
      comm.all_reduce(std::span<std::int32_t>(count), reduce_op::sum);
      std::uint32_t digit = 0;
      while (need > count[digit]) need -= count[digit++];
      key |= digit << shift;
    }
    // Below the key: freed. At the key: the first `need` in global row order; a row's
    // blocks at one key are consecutive e's (costs never decrease with e).
    const std::int32_t global_rows = layers * ranks.total;
    std::vector<std::int32_t> ties(static_cast<std::size_t>(global_rows), 0), local(ties.size(), -1);
    for (const auto& [k, r, e] : blocks) {
      if (k < key) {
        ++out.rows[r].blocks;
      } else if (k == key) {
        const std::int32_t g = (r / kv_heads % layers) * ranks.total + ranks.first + r % kv_heads;
        ++ties[static_cast<std::size_t>(g)];
        local[static_cast<std::size_t>(g)] = r;
      }
    }
    comm.all_reduce(std::span<std::int32_t>(ties), reduce_op::sum);
    std::int64_t before = 0;
    for (std::size_t g = 0; g < ties.size(); ++g) {
      if (local[g] >= 0) out.rows[local[g]].blocks += static_cast<std::int32_t>(std::clamp<std::int64_t>(need - before, 0, ties[g]));
      before += ties[g];
    }
    return take;
  }
};

}  // namespace select
KVP_NAMESPACE_END
