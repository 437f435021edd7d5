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
// running sequence. A trigger may also have validate(), which throws kvp::error
// naming a bad parameter; due_items calls it first (due and budget_of assume valid
// parameters).
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

// Kara C.4 (Alg. 1): every `period` (delta) steps of the engine's global step counter,
// once it has passed the window (step > |W|), the sequences whose trailing `window`
// (|W|) tokens are all uncompressed (sequence_state::uncompressed_tail, reset at each
// compression). Kara compresses that window to `window_keep` tokens (KvLLM: 768 to
// 257) and leaves the rest as it is, so the item's budget is what the whole sequence
// keeps: length - window + window_keep. (The executors here select over the whole
// sequence; a layout that compresses only the window is Kara's issue.)
// KvLLM compresses at most 30 sequences per event: an engine that caps the batch
// keeps the first items; the others stay due at the next event.
struct periodic {
  std::int32_t period = 128;     // delta, in steps
  std::int32_t window = 0;       // |W|: trailing tokens compressed at once
  std::int32_t window_keep = 0;  // tokens of the window the compression keeps, in [1, window]

  void validate() const {
    detail::require_positive(period, "periodic.period");
    detail::require_positive(window, "periodic.window");
    require(window_keep > 0 && window_keep <= window, "periodic.window_keep", "is {}; must lie in [1, window {}]",
            window_keep, window);
  }
  bool due(const sequence_state& s, std::int64_t step) const noexcept {
    return step > window && detail::on_period(step, period) && s.uncompressed_tail() >= window;
  }
  std::int32_t budget_of(const sequence_state& s) const noexcept { return s.length - window + window_keep; }
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
// trigger.budget_of(s), s.history_tokens}. `out` is cleared first (its capacity kept
// from step to step). Throws kvp::error, naming the field, for a bad trigger
// parameter, a negative step, a malformed state ("running[3].length") or a budget
// outside [1, length].
template <Trigger T>
void due_items(const T& trigger, std::span<const sequence_state> running, std::int64_t step,
               std::vector<batch_item>& out) {
  if constexpr (requires { trigger.validate(); }) trigger.validate();
  require(step >= 0, "step", "is {}; negative", step);
  out.clear();
  for (std::size_t i = 0; i < running.size(); ++i) {
    const sequence_state& s = running[i];
    require(s.length >= 0, kvp::detail::path("running[{}].length", i), "is {}; negative", s.length);
    require(s.generated_since_compression >= 0 && s.generated_since_compression <= s.length,
            kvp::detail::path("running[{}].generated_since_compression", i), "is {}; must lie in [0, length {}]",
            s.generated_since_compression, s.length);
    require(s.history_tokens >= 0 && s.history_tokens <= s.length, kvp::detail::path("running[{}].history_tokens", i),
            "is {}; must lie in [0, length {}]", s.history_tokens, s.length);
    if (s.query_slot < 0 || !trigger.due(s, step)) continue;
    const std::int32_t budget = trigger.budget_of(s);
    require(budget > 0 && budget <= s.length, kvp::detail::path("running[{}]", i),
            "gets budget {} from the trigger; must lie in [1, length {}]", budget, s.length);
    out.push_back({.seq = s.seq, .query_slot = s.query_slot, .budget = budget, .history_tokens = s.history_tokens});
  }
}

template <Trigger T>
std::vector<batch_item> due_items(const T& trigger, std::span<const sequence_state> running, std::int64_t step) {
  std::vector<batch_item> out;
  due_items(trigger, running, step, out);
  return out;
}

KVP_NAMESPACE_END
