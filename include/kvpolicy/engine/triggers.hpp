// When to compress (SPEC.md, "Triggers"): host-side policies that read each running
// sequence's state after a decode step and return the step's batch items.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/engine/sequence_state.hpp"

KVP_NAMESPACE_BEGIN

// A trigger answers two questions about one sequence at the engine's decode step
// `step` (a counter of steps the engine has run, the first decode step being 1):
// whether it is due for compression, and to what budget. due_items asks them of every
// running sequence. Optional members, which due_items uses when present:
// - validate(): throws kvp::error naming a bad parameter; due_items calls it first
//   (due, budget_of and window_begin_of assume valid parameters);
// - window_begin_of(s) -> int32: the item's batch_item::window_begin, for triggers
//   that feed a window-only layout (layout::window_compact); budget_of(s) then counts
//   within [window_begin, length). Without it the window begins at 0;
// - max_items (int32): the most items one call returns, 0 for no cap.
template <class T>
concept Trigger = requires(const T& t, const sequence_state& s, std::int64_t step) {
  { t.due(s, step) } -> std::same_as<bool>;
  { t.budget_of(s) } -> std::same_as<std::int32_t>;
};

namespace trigger {

namespace detail {
inline void require_positive(std::int32_t v, std::string_view field) {
  require(v > 0, field, "is {}; must be positive", v);
}
// Whether a step-counting trigger fires at `step`: every `period` steps, the first
// time at step `period` (never at step 0, before any decode step).
inline bool on_period(std::int64_t step, std::int32_t period) noexcept { return step > 0 && step % period == 0; }
}  // namespace detail

// Zipage 4.1: after a decode step, a sequence that holds N >= N_max blocks with a
// full last block (its length is a multiple of b, at least N_max * b). It keeps
// (N_max - 1) * b tokens; block N_max is left for the next tokens.
struct threshold {
  std::int32_t block_size = 0;  // b
  std::int32_t max_blocks = 0;  // N_max, at least 2

  void validate() const {
    detail::require_positive(block_size, "threshold.block_size");
    require(max_blocks >= 2, "threshold.max_blocks", "is {}; must be at least 2 (the budget is (N_max - 1) * b)",
            max_blocks);
    require(std::int64_t{max_blocks} * block_size <= std::numeric_limits<std::int32_t>::max(), "threshold.max_blocks",
            "is {}; N_max * block_size {} overflows int32", max_blocks, std::int64_t{max_blocks} * block_size);
  }
  bool due(const sequence_state& s, std::int64_t /*step*/) const noexcept {
    return s.length >= std::int64_t{max_blocks} * block_size && s.length % block_size == 0;
  }
  std::int32_t budget_of(const sequence_state& /*s*/) const noexcept { return (max_blocks - 1) * block_size; }
};

// R-KV 3.1: every `size` (B_buffer) generated tokens, counted from the last
// compression (or the prefill), a sequence whose cache holds more than the budget
// (B_budget). A sequence still within its budget when its buffer fills waits for
// the next multiple of `size`, so the cache holds at most budget + size tokens.
struct buffer {
  std::int32_t size = 128;  // B_buffer
  std::int32_t budget = 0;  // B_budget: tokens kept, observation tokens included

  void validate() const {
    detail::require_positive(size, "buffer.size");
    detail::require_positive(budget, "buffer.budget");
  }
  bool due(const sequence_state& s, std::int64_t /*step*/) const noexcept {
    return s.generated_since_compression > 0 && s.generated_since_compression % size == 0 && s.length > budget;
  }
  std::int32_t budget_of(const sequence_state& /*s*/) const noexcept { return budget; }
};

// Kara C.4 (Alg. 1, KvLLM's setting by default): at the engine's global steps past
// the window (step > |W|) that are multiples of `period` (delta), every sequence whose
// window is all uncompressed tokens, compressed over its window alone
// (presets::kara, layout::window_compact). The window is the |W| tokens just before
// the sequence's last (possibly partial) block, which is never compressed: with
// length T, the last block starts at ((T - 1) / b) * b and the window at that minus
// |W| (window_begin_of; a multiple of b, as |W| is). Due when that is >= 0 and
// uncompressed_tail() >= T - window_begin, i.e. the window starts at or after the
// length the last compression left: it never holds a token a compression kept.
// (Tokens from that length to the next window's start are never compressed.)
// The item's budget counts within the window, as the window-only layouts do: the
// tokens kept of W \ U, window_keep - buffer (KvLLM keeps 257 of 768: 225 and the
// buffer; presets::kara::kara_budget). window and buffer must be the pipeline's
// scorer.window and scorer.buffer. KvLLM compresses at most 30 sequences per event:
// max_items keeps the first due items in running order (those holding a query slot);
// the others are still due at the next event, their windows having moved on.
struct periodic {
  std::int32_t period = 128;       // delta, in steps
  std::int32_t block_size = 0;     // b: the cache's block size
  std::int32_t window = 768;       // |W|: tokens compressed at once, a multiple of b
  std::int32_t buffer = 32;        // |U|: the window's newest tokens, kept
  std::int32_t window_keep = 257;  // tokens of the window kept, buffer included, in [buffer + 1, window]
  std::int32_t max_items = 30;     // items per event at most; 0: no cap

  void validate() const {
    detail::require_positive(period, "periodic.period");
    detail::require_positive(block_size, "periodic.block_size");
    require(window > 0 && window % block_size == 0, "periodic.window",
            "is {}; must be a positive multiple of block_size {} (the window is whole blocks)", window, block_size);
    require(buffer >= 0 && buffer < window, "periodic.buffer", "is {}; must lie in [0, window {})", buffer, window);
    require(window_keep > buffer && window_keep <= window, "periodic.window_keep",
            "is {}; must lie in [buffer + 1 = {}, window {}] (the budget is window_keep - buffer)", window_keep,
            buffer + 1, window);
    require(max_items >= 0, "periodic.max_items", "is {}; negative (0: no cap)", max_items);
  }
  // Negative when the sequence holds no whole window before its last block.
  std::int32_t window_begin_of(const sequence_state& s) const noexcept {
    return s.length <= 0 ? -window : (s.length - 1) / block_size * block_size - window;
  }
  bool due(const sequence_state& s, std::int64_t step) const noexcept {
    const std::int32_t begin = window_begin_of(s);
    return step > window && detail::on_period(step, period) && begin >= 0 && s.uncompressed_tail() >= s.length - begin;
  }
  std::int32_t budget_of(const sequence_state& /*s*/) const noexcept { return window_keep - buffer; }
};

// Hard-KV: every `period` (128) steps of the engine's global step counter, every
// sequence longer than `min_length` (Hard-KV's L_lower; default 0: all), to at most
// `budget` tokens (L_upper): its budget is min(budget, length). Hard-KV's head-adaptive
// selectors keep fewer than that by their scores; with uniform top-k a sequence at or
// below the budget keeps everything, so such an engine sets min_length = budget.
struct interval {
  std::int32_t period = 128;    // steps between compressions
  std::int32_t budget = 0;      // L_upper: the most tokens a sequence keeps
  std::int32_t min_length = 0;  // L_lower: sequences of this length or shorter are left alone

  void validate() const {
    detail::require_positive(period, "interval.period");
    detail::require_positive(budget, "interval.budget");
    require(min_length >= 0, "interval.min_length", "is {}; negative", min_length);
  }
  bool due(const sequence_state& s, std::int64_t step) const noexcept {
    return detail::on_period(step, period) && s.length > min_length;
  }
  std::int32_t budget_of(const sequence_state& s) const noexcept { return s.length < budget ? s.length : budget; }
};

}  // namespace trigger

// The batch items of decode step `step`: one per running sequence (in running order)
// that holds a query slot and that the trigger finds due, {seq, query_slot,
// trigger.budget_of(s), history_tokens, window_begin}, the first max_items of them
// when the trigger caps them. window_begin is trigger.window_begin_of(s) when the
// trigger has it, else 0; history_tokens counts within the window, as the
// pipeline sees it: max(0, s.history_tokens - window_begin). `out` is cleared first
// (its capacity kept from step to step). Throws kvp::error, naming the field, for a
// bad trigger parameter, a negative step, a malformed state ("running[3].length"), a
// window_begin outside [0, length) or a budget outside [1, length - window_begin].
template <Trigger T>
void due_items(const T& trigger, std::span<const sequence_state> running, std::int64_t step,
               std::vector<batch_item>& out) {
  if constexpr (requires { trigger.validate(); }) trigger.validate();
  require(step >= 0, "step", "is {}; negative", step);
  std::size_t cap = running.size();
  if constexpr (requires { { trigger.max_items } -> std::convertible_to<std::int32_t>; }) {
    const std::int32_t m = trigger.max_items;
    require(m >= 0, "max_items", "is {}; negative (0: no cap)", m);
    if (m > 0 && static_cast<std::size_t>(m) < cap) cap = static_cast<std::size_t>(m);
  }
  out.clear();
  for (std::size_t i = 0; i < running.size(); ++i) {
    const sequence_state& s = running[i];
    require(s.length >= 0, kvp::detail::path("running[{}].length", i), "is {}; negative", s.length);
    require(s.generated_since_compression >= 0 && s.generated_since_compression <= s.length,
            kvp::detail::path("running[{}].generated_since_compression", i), "is {}; must lie in [0, length {}]",
            s.generated_since_compression, s.length);
    require(s.history_tokens >= 0 && s.history_tokens <= s.length, kvp::detail::path("running[{}].history_tokens", i),
            "is {}; must lie in [0, length {}]", s.history_tokens, s.length);
    // Past the cap, the states are still checked: a malformed one is reported at
    // every step, not only at those where it would have made the batch.
    if (out.size() == cap || s.query_slot < 0 || !trigger.due(s, step)) continue;
    std::int32_t window_begin = 0;
    if constexpr (requires { { trigger.window_begin_of(s) } -> std::convertible_to<std::int32_t>; }) {
      window_begin = trigger.window_begin_of(s);
      require(window_begin >= 0 && window_begin < s.length, kvp::detail::path("running[{}]", i),
              "gets window_begin {} from the trigger; must lie in [0, length {})", window_begin, s.length);
    }
    const std::int32_t budget = trigger.budget_of(s);
    const std::int32_t span = s.length - window_begin;
    if (window_begin == 0) {
      require(budget > 0 && budget <= span, kvp::detail::path("running[{}]", i),
              "gets budget {} from the trigger; must lie in [1, length {}]", budget, s.length);
    } else {
      require(budget > 0 && budget <= span, kvp::detail::path("running[{}]", i),
              "gets budget {} from the trigger; must lie in [1, {}] (length {} - window_begin {})", budget, span,
              s.length, window_begin);
    }
    const std::int32_t history = s.history_tokens > window_begin ? s.history_tokens - window_begin : 0;
    out.push_back({.seq = s.seq,
                   .query_slot = s.query_slot,
                   .budget = budget,
                   .history_tokens = history,
                   .window_begin = window_begin});
  }
}

template <Trigger T>
std::vector<batch_item> due_items(const T& trigger, std::span<const sequence_state> running, std::int64_t step) {
  std::vector<batch_item> out;
  due_items(trigger, running, step, out);
  return out;
}

KVP_NAMESPACE_END
