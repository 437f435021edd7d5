// What an engine knows of each running sequence between compressions, and how a
// compression's result updates it. Host only: the triggers (engine/triggers.hpp)
// read these states to build a step's compression_batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN

// One running sequence, as the engine tracks it. The engine owns an array of these
// (one per running sequence, in its running order), appends to them after every
// decode step and records each compression's result with record_compression.
struct sequence_state {
  // The query_slot of a sequence that holds none (Zipage 4.3's hybrid scheduling:
  // only the first M requests get a slot). Such a sequence is never put in a batch.
  static constexpr std::int32_t no_query_slot = -1;

  std::int32_t seq = 0;                    // row of the cache's block table and lengths
  std::int32_t query_slot = no_query_slot;  // slot of the query window view; give every sequence one
                                            // (0 will do) when the pipeline reads no queries
  std::int32_t length = 0;                 // tokens the cache holds now (the physical length)
  // Tokens decode steps appended since the last compression, or since the prefill for
  // a sequence never compressed (R-KV's buffer fills with these).
  std::int32_t generated_since_compression = 0;
  // The length the last compression left: the history_tokens the next compression
  // passes (docs/views.md, "Batch items"); 0 for a sequence never compressed.
  std::int32_t history_tokens = 0;
  std::int32_t compressions = 0;            // compressions recorded so far
  std::int64_t last_compression_step = -1;  // the engine's step of the last one; -1: never

  bool compressed_before() const noexcept { return compressions > 0; }

  // Kara C.4's per-sequence count of uncompressed trailing tokens: all of them,
  // prompt included, for a sequence never compressed; otherwise those generated since
  // the last compression. As in Kara, a compression resets it to 0, a window-only one
  // too, whose tokens after the window stay as they were: so length -
  // uncompressed_tail() is the length the last compression left, where the next
  // window may start at the earliest (trigger::periodic).
  std::int32_t uncompressed_tail() const noexcept {
    return compressed_before() ? generated_since_compression : length;
  }

  // After a decode step: `tokens` generated tokens were appended (1 per step). A
  // prefill sets `length` directly and generates nothing.
  void append(std::int32_t tokens = 1) {
    require(tokens >= 0, "tokens", "is {}; negative", tokens);
    require(std::int64_t{length} + tokens <= std::numeric_limits<std::int32_t>::max(), "tokens",
            "is {}; seq {}'s length {} would overflow int32", tokens, seq, length);
    length += tokens;
    generated_since_compression += tokens;
  }
};

// Records that `items` were compressed at the engine's `step`: new_lengths[i] (an
// executor's result, e.g. host_result::new_lengths) is item i's length now. The
// state whose `seq` is items[i].seq gets that length, history_tokens = the new length
// (the next compression's history; with uniform top-k, the budget), no generated
// tokens since (so uncompressed_tail() is 0, Kara C.4's reset; it then counts the
// tokens appended after), one more compression, last_compression_step = step. For a
// window-only item (batch_item::window_begin) new_lengths[i] is the whole
// sequence's, as the executors return it. Everything is checked first, so on a
// kvp::error no state has changed.
inline void record_compression(std::span<sequence_state> running, std::span<const batch_item> items,
                               std::span<const std::int32_t> new_lengths, std::int64_t step) {
  require(new_lengths.size() == items.size(), "new_lengths", "holds {} lengths; the batch has {} items",
          new_lengths.size(), items.size());
  require(step >= 0, "step", "is {}; negative", step);
  const auto state_of = [&](std::size_t i) -> std::size_t {
    std::size_t found = running.size();
    for (std::size_t j = 0; j < running.size(); ++j) {
      if (running[j].seq != items[i].seq) continue;
      require(found == running.size(), detail::path("running[{}].seq", j), "is {}, as is running[{}].seq",
              running[j].seq, found);
      found = j;
    }
    require(found < running.size(), detail::path("items[{}].seq", i), "is {}; no running sequence has it",
            items[i].seq);
    return found;
  };
  for (std::size_t i = 0; i < items.size(); ++i) {
    for (std::size_t k = 0; k < i; ++k)
      require(items[k].seq != items[i].seq, detail::path("items[{}].seq", i), "is {}, as is items[{}].seq",
              items[i].seq, k);
    const sequence_state& s = running[state_of(i)];
    require(new_lengths[i] > 0 && new_lengths[i] <= s.length, detail::path("new_lengths[{}]", i),
            "is {}; must lie in [1, {}], seq {}'s length before the compression", new_lengths[i], s.length, s.seq);
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    sequence_state& s = running[state_of(i)];
    s.length = new_lengths[i];
    s.history_tokens = new_lengths[i];
    s.generated_since_compression = 0;
    s.compressions += 1;
    s.last_compression_step = step;
  }
}

KVP_NAMESPACE_END
