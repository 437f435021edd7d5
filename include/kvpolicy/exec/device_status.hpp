// How a device-side check reports a malformed input: a few int32 words the
// validation kernel writes, turned into the same kvp::error the host raises.
#pragma once

#include <cstdint>
#include <string>


#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN

enum class status_code : std::int32_t {
  ok = 0,
  seq_out_of_range,         // a = seq
  seq_repeated,             // a = seq
  length_out_of_range,      // a = seq, b = length, c = capacity in tokens
  length_over_max_tokens,   // a = seq, b = length, c = max_tokens
  block_out_of_range,       // a = seq, b = logical block, c = block id
  block_repeated,           // a = seq, b = logical block, c = block id, d = the other seq (in the batch, or itself)
  budget_not_positive,      // a = budget
  budget_over_length,       // a = budget, b = seq, c = length
  window_over_length,       // a = window, b = seq, c = length, d = 0 scorer / 1 protect
  history_out_of_range,     // a = history, b = length
  query_slot_out_of_range,  // a = slot, b = slots
  budget_under_protected,   // a = budget, b = keep count, c = protected, d = length, e = layer, f = KV head
  block_held_outside_batch,  // a = seq, b = logical block, c = block id, d = the other seq (not in the batch)
  block_marked_shared,       // a = seq, b = logical block, c = block id
  targets_over_blocks,       // a = targets given, b = seq, c = blocks the seq holds
  target_out_of_range,       // a = index into targets.blocks, b = block id
  target_held,               // a = block id, b = the sequence holding it, c = the item it is a target of
  target_marked_shared,      // a = index into targets.blocks, b = block id (cache.sharing marks it)
  prefix_block_written,      // a = seq, b = logical block, c = block id (another item's shared prefix)
  window_begin_invalid,      // a = window_begin, b = seq, c = length, d = block size
  window_without_layout,     // a = window_begin (a layout that is not window-only)
  // Per-head block caches (cuda_per_head_executor). Table entries: a = layer, b = seq, c = head.
  head_length_out_of_range,      // d = length, e = capacity in tokens
  head_block_out_of_range,       // d = logical block, e = block id, f = num_blocks
  head_block_repeated,           // d = logical block, e = block id; item = the holder's seq,
                                 // f = its layer x 65536 + its head
  blocks_to_free_negative,       // a = count (low 32 bits), b = high 32 bits, c = layer (-1: the item's count)
  per_layer_missing,             // a = layers (a per-layer budget with a null per_layer)
  logical_length_missing,        // a = logical_length (positions given, no position count)
  position_out_of_range,         // a = layer, b = head, c = token, d = position, e = logical length
  // Decode attention over a shared table with per-head counts (decode_head_counts).
  head_count_out_of_range,  // a = layer, b = seq, c = head, d = count, e = the sequence's length or tail_from
  tail_out_of_range,        // a = seq, b = tail_from, c = the sequence's length
  // A CSR block table's row that starts before its indices or ends before it starts.
  indptr_invalid,  // a = index into indptr, b = its value, c = the entry before it (a > 0)
};

// Words: [code, item, a, b, c, d, e, f]. The first error found wins (atomicCAS on code).
// The item is -1 for a sequence outside the batch.
inline constexpr int status_words = 8;

// Throws the kvp::error the host executor would have thrown for the same input.
inline void throw_if_error(const std::int32_t* w) {
  const auto code = static_cast<status_code>(w[0]);
  const std::int32_t i = w[1], a = w[2], b = w[3], c = w[4], d = w[5], e = w[6], f = w[7];
  auto item = [&](const char* field) { return detail::format("batch[{}].{}", i, field); };
  auto entry = [&] { return detail::format("cache.table[seq {}][{}]", a, b); };
  auto head_entry = [&] { return detail::format("cache.table[layer {}][seq {}][head {}][{}]", a, b, c, d); };
  switch (code) {
    case status_code::ok: return;
    case status_code::seq_out_of_range: throw error(item("seq"), detail::format("is {}; out of the cache's sequences", a));
    case status_code::seq_repeated: throw error(item("seq"), detail::format("is {}, which the batch names twice", a));
    case status_code::length_out_of_range:
      throw error(detail::format("cache.lengths[{}]", a),
                  detail::format("is {}; the block table holds room for {} tokens", b, c));
    case status_code::length_over_max_tokens:
      throw error("batch.max_tokens", detail::format("is {}; seq {} holds {} tokens", c, a, b));
    case status_code::block_out_of_range:
      throw error(entry(), detail::format("is block id {}; out of range", c));
    case status_code::block_repeated:
      throw error(entry(), detail::format("is block id {}, already used by seq {}; a block two sequences share is "
                                          "never written",
                                          c, d));
    case status_code::budget_not_positive: throw error(item("budget"), detail::format("is {}; must be positive", a));
    case status_code::budget_over_length:
      throw error(item("budget"), detail::format("is {}; larger than seq {}'s {} tokens", a, b, c));
    case status_code::window_over_length:
      throw error(d == 0 ? "pipeline.scorer.window" : "pipeline.protect.window",
                  detail::format("is {}; longer than seq {} (batch[{}]) of {} tokens", a, b, i, c));
    case status_code::history_out_of_range:
      throw error(item("history_tokens"), detail::format("is {}; must lie in [0, {}] (the sequence's length)", a, b));
    case status_code::query_slot_out_of_range:
      throw error(item("query_slot"), detail::format("is {}; the query window view has {} slots", a, b));
    case status_code::budget_under_protected:
      throw error(item("budget"), detail::format("is {}; it keeps {} tokens in layer {} head {}, but {} are protected of {}",
                                                 a, b, e, f, c, d));
    case status_code::block_held_outside_batch:
      throw error(entry(), detail::format("is block id {}, which seq {} (not in the batch) also holds; a block two "
                                          "sequences share is never written",
                                          c, d));
    case status_code::block_marked_shared:
      throw error(entry(), detail::format("is block id {}, which cache.sharing marks as shared with another request; "
                                          "a shared block is never written",
                                          c));
    case status_code::targets_over_blocks:
      throw error(detail::format("batch.targets (item {})", i),
                  detail::format("give {} target blocks; seq {} holds {} blocks", a, b, c));
    case status_code::target_out_of_range:
      throw error(detail::format("batch.targets.blocks[{}]", a), detail::format("is block id {}; out of range", b));
    case status_code::target_held:
      throw error(detail::format("batch.targets (item {})", c),
                  b < 0 ? detail::format("name block id {}, which a batch item reads as its shared prefix; a target "
                                         "must be free",
                                         a)
                        : detail::format("name block id {}, which seq {} holds (or names as a target too); a target "
                                         "must be free",
                                         a, b));
    case status_code::target_marked_shared:
      throw error(detail::format("batch.targets.blocks[{}]", a),
                  detail::format("is block id {}, which cache.sharing marks as shared; a target must be free", b));
    case status_code::prefix_block_written:
      throw error(entry(), detail::format("is block id {}, which another batch item reads as its shared prefix; a "
                                          "block two sequences share is never written",
                                          c));
    case status_code::window_begin_invalid:
      throw error(item("window_begin"),
                  a < 0 || a % d != 0 ? detail::format("is {}; a window starts on a block boundary (block size {})", a, d)
                             : detail::format("is {}; seq {} holds {} tokens", a, b, c));
    case status_code::window_without_layout:
      throw error(item("window_begin"),
                  detail::format("is {}; only a window-only layout (layout::window_compact) compresses a window", a));
    case status_code::head_length_out_of_range:
      throw error(detail::format("cache.lengths[layer {}][seq {}][head {}]", a, b, c),
                  detail::format("is {}; the block table holds room for {} tokens", d, e));
    case status_code::head_block_out_of_range:
      throw error(head_entry(), detail::format("is block id {}; valid ids are [0, {})", e, f));
    case status_code::head_block_repeated:
      throw error(head_entry(), detail::format("is block id {}, already held by layer {} seq {} head {}; a block holds "
                                               "one head of one layer",
                                               e, f / 65536, i, f % 65536));
    case status_code::blocks_to_free_negative: {
      const std::int64_t count = static_cast<std::int64_t>(static_cast<std::uint64_t>(static_cast<std::uint32_t>(b))
                                                           << 32 | static_cast<std::uint32_t>(a));
      throw error(c < 0 ? item("blocks_to_free") : detail::format("batch[{}].per_layer[{}]", i, c),
                  detail::format("is {}; must not be negative", count));
    }
    case status_code::per_layer_missing:
      throw error(item("per_layer"), detail::format("is a null pointer; a per-layer budget needs {} counts", a));
    case status_code::logical_length_missing:
      throw error(item("logical_length"),
                  detail::format("is {}; with cache.positions the protected window is read off positions, which "
                                 "needs the sequence's position count",
                                 a));
    case status_code::position_out_of_range:
      throw error(detail::format("cache.positions (batch[{}], layer {}, head {}, token {})", i, a, b, c),
                  detail::format("is {}; positions lie in [0, {})", d, e));
    case status_code::head_count_out_of_range:
      throw error(detail::format("counts[layer {}][seq {}][head {}]", a, b, c),
                  detail::format("is {}; at most {} (the sequence's length, or its tail_from where given)", d, e));
    case status_code::tail_out_of_range:
      throw error(detail::format("counts.tail_from[{}]", a), detail::format("is {}; the sequence holds {} tokens", b, c));
    case status_code::indptr_invalid:
      throw error(detail::format("cache.table.indptr[{}]", a),
                  b < 0 ? detail::format("is {}; must not be negative", b)
                        : detail::format("is {}; below indptr[{}] = {}", b, a - 1, c));
  }
  throw error("status", detail::format("unknown device status code {}", w[0]));
}

KVP_NAMESPACE_END
