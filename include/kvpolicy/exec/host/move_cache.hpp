// Host reference of KV-Compress's MoveCache (alg. 1) for one (layer, seq, KV head) of
// a per-head block cache (per_head_kv_view.hpp; SPEC.md "Layouts", Per-head blocks).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
// The arguments of one head's MoveCache, checked before anything is written: indices
// in range, the mask as long as the head, the head's length within its table and its
// block ids in range and distinct. (The whole view: validate_per_head.)
inline void validate_move_cache(const per_head_kv_view& c, std::int32_t layer, std::int32_t seq, std::int32_t head,
                                std::span<const std::uint8_t> keep) {
  require(c.block_size > 0, "cache.block_size", "is {}; must be positive", c.block_size);
  require(c.table.valid(), "cache.table", "has neither a base pointer nor a layer table (null)");
  require(c.lengths.valid(), "cache.lengths", "has neither a base pointer nor a layer table (null)");
  require(layer >= 0 && layer < c.num_layers, "layer", "is {}; the cache has {} layers", layer, c.num_layers);
  require(seq >= 0 && seq < c.num_seqs, "seq", "is {}; the cache has {} sequences", seq, c.num_seqs);
  require(head >= 0 && head < c.num_kv_heads, "head", "is {}; the cache has {} KV heads", head, c.num_kv_heads);
  const std::int32_t T = c.length(layer, seq, head);
  const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
  require(T >= 0 && T <= capacity, detail::path("cache.lengths[layer {}][seq {}][head {}]", layer, seq, head),
          "is {}; the block table holds room for {} tokens", T, capacity);
  require(keep.size() == static_cast<std::size_t>(T), "keep",
          "has {} entries; layer {} seq {} head {} holds {} tokens", keep.size(), layer, seq, head, T);
  const std::int32_t blocks = c.blocks_for(T);
  for (std::int32_t i = 0; i < blocks; ++i) {
    const std::int32_t id = c.block(layer, seq, head, i);
    const auto field = detail::path("cache.table[layer {}][seq {}][head {}][{}]", layer, seq, head, i);
    require(id >= 0 && id < c.num_blocks, field, "is block id {}; valid ids are [0, {})", id, c.num_blocks);
    for (std::int32_t j = 0; j < i; ++j)
      require(c.block(layer, seq, head, j) != id, field, "is block id {}, as is entry {} of the same head", id, j);
  }
}
}  // namespace detail

namespace host {

// One token copied within a head: logical indices of the head, src >= new length > dst.
struct cache_move {
  std::int32_t src = 0, dst = 0;
  friend bool operator==(const cache_move&, const cache_move&) = default;
};

// What MoveCache does to one head, computed without touching the cache: the
// quantities KV-Compress's repository checks its kernels on.
struct move_plan {
  std::int32_t length = 0;              // T: tokens before
  std::int32_t new_length = 0;          // kept tokens: the head is dense in [0, new_length) after
  std::vector<std::int32_t> evicted;    // evicted logical indices, ascending
  std::vector<cache_move> moves;        // in execution order: newest surviving token first
  std::int32_t freed_blocks = 0;        // ceil(T / b) - ceil(new_length / b): the tail blocks freed

  std::int32_t evicted_count() const noexcept { return static_cast<std::int32_t>(evicted.size()); }
  std::int32_t move_count() const noexcept { return static_cast<std::int32_t>(moves.size()); }
};

// KV-Compress's rule: walk the head from its tail (T - 1 down to the new length, the
// range whose slots are given up); each surviving token met takes the lowest evicted
// slot not yet filled. Tokens below the new length stay where they are. The walk meets
// exactly as many survivors as there are evicted slots below the new length, so every
// destination lies below it and every source at or above it: no move reads a slot
// another move writes.
inline move_plan plan_move_cache(std::span<const std::uint8_t> keep, std::int32_t block_size) {
  require(block_size > 0, "block_size", "is {}; must be positive", block_size);
  move_plan p;
  p.length = static_cast<std::int32_t>(keep.size());
  for (std::int32_t t = 0; t < p.length; ++t)
    if (!keep[t]) p.evicted.push_back(t);
  p.new_length = p.length - p.evicted_count();
  std::size_t next = 0;  // the lowest evicted slot not yet filled
  for (std::int32_t src = p.length - 1; src >= p.new_length; --src) {
    if (!keep[src]) continue;  // evicted in the tail: dropped with its block
    p.moves.push_back({src, p.evicted[next++]});
  }
  const auto blocks = [&](std::int32_t n) { return (n + block_size - 1) / block_size; };
  p.freed_blocks = blocks(p.length) - blocks(p.new_length);
  return p;
}

// The moves as KV-Compress's flat physical slot indices (block id * b + slot) of the
// head (layer, seq, head) of c.
struct physical_move {
  std::int64_t src = 0, dst = 0;
  friend bool operator==(const physical_move&, const physical_move&) = default;
};
inline std::vector<physical_move> physical_moves(const per_head_kv_view& c, std::int32_t layer, std::int32_t seq,
                                                 std::int32_t head, const move_plan& p) {
  std::vector<physical_move> out;
  out.reserve(p.moves.size());
  for (const cache_move& m : p.moves)
    out.push_back({c.physical_slot(layer, seq, head, m.src), c.physical_slot(layer, seq, head, m.dst)});
  return out;
}


// Executes a plan of this head: K, V, the metric and the position of each move's
// source are copied to its destination (those present in the view).
inline void apply_moves(const per_head_kv_view& c, std::int32_t layer, std::int32_t seq, std::int32_t head,
                        const move_plan& p) {
  const std::int32_t b = c.block_size;
  const std::size_t bytes = static_cast<std::size_t>(c.row_bytes());
  for (const cache_move& m : p.moves) {
    const std::int32_t from = c.physical_block(layer, seq, head, m.src), to = c.physical_block(layer, seq, head, m.dst);
    const std::int32_t from_slot = m.src % b, to_slot = m.dst % b;
    std::memcpy(c.k_row_at(layer, to, to_slot), c.k_row_at(layer, from, from_slot), bytes);
    std::memcpy(c.v_row_at(layer, to, to_slot), c.v_row_at(layer, from, from_slot), bytes);
    if (!c.metric.empty()) c.metric.at(layer, to, to_slot) = c.metric.at(layer, from, from_slot);
    if (!c.positions.empty()) c.positions.at(layer, to, to_slot) = c.positions.at(layer, from, from_slot);
  }
}

struct move_cache_result {
  std::int32_t new_length = 0;
  std::int32_t moved = 0;                 // tokens copied
  std::vector<std::int32_t> freed_blocks;  // physical ids of the head's blocks past ceil(new_length / b), in table order
};

// MoveCache for head `head` of sequence `seq` in layer `layer`, given its keep mask
// (one entry per token of the head; 0 = evicted): after it the head's kept tokens fill
// [0, new_length), each with its K, V, metric and position bytes. Writes only the
// destination slots of the plan; never the table or the lengths (the engine sets the
// new length and frees the blocks returned). Throws kvp::error before writing if the
// arguments are malformed.
inline move_cache_result move_cache(const per_head_kv_view& c, std::int32_t layer, std::int32_t seq, std::int32_t head,
                                    std::span<const std::uint8_t> keep) {
  kvp::detail::validate_move_cache(c, layer, seq, head, keep);
  const move_plan p = plan_move_cache(keep, c.block_size);
  apply_moves(c, layer, seq, head, p);
  move_cache_result r{p.new_length, p.move_count(), {}};
  for (std::int32_t i = c.blocks_for(p.new_length); i < c.blocks_for(p.length); ++i)
    r.freed_blocks.push_back(c.block(layer, seq, head, i));
  return r;
}

}  // namespace host
KVP_NAMESPACE_END
