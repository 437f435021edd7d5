// The seed systems, one type each: `kvp::presets::zipage{}` is Zipage's configuration
// (SPEC.md, Presets), and every field can be overridden on the value.
// presets::kv_compress (per-head blocks, not a pipeline) is in kv_compress_preset.hpp.
#pragma once

#include "kvpolicy/aggregate/accumulate.hpp"
#include "kvpolicy/aggregate/global_score.hpp"
#include "kvpolicy/aggregate/pool.hpp"
#include "kvpolicy/aggregate/then.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/layout/compact.hpp"
#include "kvpolicy/layout/fill.hpp"
#include "kvpolicy/layout/window_compact.hpp"
#include "kvpolicy/pipeline/kv_compress_preset.hpp"
#include "kvpolicy/pipeline/pipeline.hpp"
#include "kvpolicy/redundancy/redundancy.hpp"
#include "kvpolicy/scorer/bidirectional_window.hpp"
#include "kvpolicy/scorer/window_attention.hpp"
#include "kvpolicy/select/calibrated_top_p.hpp"
#include "kvpolicy/select/sinks_recent.hpp"
#include "kvpolicy/select/token2chunk.hpp"
#include "kvpolicy/select/top_k.hpp"

KVP_NAMESPACE_BEGIN
namespace presets {

// Window attention (group max, window mean, w 16) -> global score (max, alpha 0.8)
// -> max pool 5 on the first compression -> lightning redundancy (tau 0.4,
// lambda 0.2) -> top-k -> compact.
struct zipage : pipeline<scorer::window_attention, aggregate::then<aggregate::global_score, aggregate::pool>,
                         redundancy::lightning, select::top_k, layout::compact> {
  constexpr zipage() noexcept {
    scorer = {.window = 16, .group = group_reduce::max, .reduce = window_reduce::mean};
    aggregate.first = {.mode = aggregate::global_mode::max, .alpha = 0.8f};
    aggregate.second = {.mode = aggregate::pool_mode::max, .kernel = 5, .first_only = true};
    redundancy = {.theta = 0.5f, .tau = 0.4f, .lambda = 0.2f};
    protect = {.window = 16, .sinks = 0};
  }
};

// R-KV: window attention over the keys before the window (group max_logits, mean,
// w 8) -> max pool 7 -> full redundancy (tau 1, lambda 0.1) -> top-k -> compact.
struct rkv : pipeline<scorer::window_attention, aggregate::pool, redundancy::full, select::top_k, layout::compact> {
  constexpr rkv() noexcept {
    scorer = {.window = 8, .group = group_reduce::max_logits, .reduce = window_reduce::mean, .keys_before_window = true};
    aggregate = {.mode = aggregate::pool_mode::max, .kernel = 7};
    redundancy = {.theta = 0.5f, .tau = 1.0f, .lambda = 0.1f};
    protect = {.window = 8, .sinks = 0};
  }
};

// G-KV: window attention (group max, mean, w 16) -> global score (max, alpha 0.8,
// max-normalised as in G-KV) -> full redundancy (lambda 0.5) -> top-k -> compact.
struct gkv : pipeline<scorer::window_attention, aggregate::global_score, redundancy::full, select::top_k,
                      layout::compact> {
  constexpr gkv() noexcept {
    scorer = {.window = 16, .group = group_reduce::max, .reduce = window_reduce::mean};
    aggregate = {.mode = aggregate::global_mode::max, .alpha = 0.8f, .max_norm = true};
    redundancy = {.theta = 0.5f, .tau = 1.0f, .lambda = 0.5f};
    protect = {.window = 16, .sinks = 0};
  }
};

// SnapKV: window attention (group mean, window sum, w 32) -> max pool 7 -> top-k -> compact.
struct snapkv : pipeline<scorer::window_attention, aggregate::pool, none, select::top_k, layout::compact> {
  constexpr snapkv() noexcept {
    scorer = {.window = 32, .group = group_reduce::mean, .reduce = window_reduce::sum};
    aggregate = {.mode = aggregate::pool_mode::max, .kernel = 7};
    protect = {.window = 32, .sinks = 0};
  }
};

// H2O: window attention summed over the window (w 16) -> accumulate -> top-k -> compact.
struct h2o : pipeline<scorer::h2o, aggregate::accumulate, none, select::top_k, layout::compact> {
  constexpr h2o() noexcept { protect = {.window = 16, .sinks = 0}; }
};

// StreamingLLM: no scores; keep 4 sinks and the most recent tokens -> compact.
struct streaming_llm : pipeline<none, none, none, select::sinks_recent, layout::compact> {
  constexpr streaming_llm() noexcept {
    select = {.sinks = 4};
    protect = {.window = 16, .sinks = 4};
  }
};

// Hard-KV with SnapKV's scores: window attention (group max_logits, mean, w 8) -> max
// pool 7 -> calibrated top-p (p 0.9, at most 2048 per head) -> compact, each head
// to its own count. Window 32 and one sink as in Hard-KV's code. Give
// `select.state` to solve each request's temperatures once and reuse them.
struct hard_kv : pipeline<scorer::window_attention, aggregate::pool, none, select::calibrated_top_p, layout::compact> {
  constexpr hard_kv() noexcept {
    scorer = {.window = 8, .group = group_reduce::max_logits, .reduce = window_reduce::mean};
    aggregate = {.mode = aggregate::pool_mode::max, .kernel = 7};
    select = {.p = 0.9f, .upper = 2048};
    protect = {.window = 32, .sinks = 1};
  }
};

// Hard-KV with R-KV's scores: R-KV's stages (keys before the window, max pool 7, full
// redundancy tau 1, lambda 0.1) and calibrated top-p as in hard_kv.
struct hard_kv_rkv : pipeline<scorer::window_attention, aggregate::pool, redundancy::full, select::calibrated_top_p,
                              layout::compact> {
  constexpr hard_kv_rkv() noexcept {
    scorer = {.window = 8, .group = group_reduce::max_logits, .reduce = window_reduce::mean, .keys_before_window = true};
    aggregate = {.mode = aggregate::pool_mode::max, .kernel = 7};
    redundancy = {.theta = 0.5f, .tau = 1.0f, .lambda = 0.1f};
    select = {.p = 0.9f, .upper = 2048};
    protect = {.window = 32, .sinks = 1};
  }
};

// Kara (KvLLM's setting): over each item's window of 768 tokens (batch_item::
// window_begin), bidirectional window attention (group sum, colsum over the window's
// 768 queries) of the first 736 -> Token2Chunk (gamma 8, alpha 16) -> compaction of
// the window alone. The buffer (32) and the tokens after the window stay. Each item's
// budget is the region's kept tokens: kara_budget (225) keeps 257 of the window.
struct kara : pipeline<scorer::bidirectional_window, none, none, select::token2chunk, layout::window_compact> {
  // KvLLM retains 257 tokens of each 768-token window: 225 of W \ U and the buffer.
  static constexpr std::int32_t kara_budget = 225;

  constexpr kara() noexcept {
    scorer = {.window = 768, .buffer = 32, .group = group_reduce::sum, .reduce = window_reduce::sum};
    select = {.gamma = 8, .alpha = 16};
    protect = {.window = 0, .sinks = 0};
  }
};

}  // namespace presets
KVP_NAMESPACE_END
