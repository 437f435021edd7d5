// What the host executor returns: new lengths, released blocks, and what it saw.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

enum class stage : std::uint8_t { score, aggregate, redundancy, select, layout };
inline constexpr std::array<std::string_view, 5> stage_names{"score", "aggregate", "redundancy", "select", "layout"};

struct stage_times {
  std::array<double, 5> seconds{};

  double& operator[](stage s) noexcept { return seconds[static_cast<std::size_t>(s)]; }
  double operator[](stage s) const noexcept { return seconds[static_cast<std::size_t>(s)]; }
  double total() const noexcept {
    double t = 0;
    for (double s : seconds) t += s;
    return t;
  }
};

struct host_result {
  // Per batch item: the length of the item's block table after the layout: the
  // largest kept count of every (layer, KV head) of the batch (the sequence's old
  // length where the layout moves nothing).
  std::vector<std::int32_t> new_lengths;
  // Per batch item: tokens each (layer, KV head) keeps, `[layer][kv_head]` (layers of
  // the batch only); with a layout that moves tokens, the valid prefix of each head.
  // Uniform selectors keep the same count everywhere.
  std::vector<std::vector<std::int32_t>> kept_counts;
  // Per batch item: physical blocks past the new length, now free for the engine
  // (with a shared prefix, its unused targets too). Layers share a block table: when
  // an item's layers are compressed in several calls, release only what
  // merge_layer_groups (exec/layer_groups.hpp) returns.
  std::vector<std::vector<std::int32_t>> released_blocks;
  // Per batch item: its block table after the compression, the blocks of its new
  // length (the targets of a shared prefix first, then its own blocks).
  std::vector<std::vector<std::int32_t>> new_tables;
  // Per batch item with a shared prefix (compression_batch::targets): the shared
  // blocks it no longer holds, whose reference counts the engine lowers.
  std::vector<std::vector<std::int32_t>> unshared_blocks;
  // Per batch item: candidate scores that were NaN or infinite before protect (they
  // rank by the rule of docs/pipeline.md, "Non-finite scores"), for the engine's log.
  std::vector<std::int32_t> nonfinite_scores;
  // Per batch item, when asked for: `[layer][kv_head][T]` (layers of the batch only).
  std::vector<std::vector<std::uint8_t>> keep_masks;
  // Per batch item, when asked for: final scores after protect, `[layer][kv_head][T]`.
  std::vector<std::vector<float>> scores;
  stage_times times;
};

KVP_NAMESPACE_END
