// The tuning constants of decode attention (cuda_decode_attention). A comment says
// why each knob exists; the figures behind the values are in bench/results/README.md
// ("Decode attention over head-adaptive caches").
#pragma once

#include <cstdint>
#include <string>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct decode_attention_tuning {
  // The split kernel: four warps; each token's K row is read by a group of d / 8 lanes
  // (16 bytes each), so a warp reads 2 (d 128) or 4 (d 64) tokens per load.
  static constexpr int threads = 128;
  // Register cap: blocks per SM the grid is sized for. Enough warps that the loads in
  // flight cover the memory latency.
  static constexpr int blocks_per_sm = 4;
  // Grid target: this many waves of blocks_per_sm blocks on every SM, so that rows of
  // different lengths leave little of the last wave idle.
  static constexpr int waves = 2;
  // Tokens a lane group loads (K and V: twice this many 16-byte loads in flight per
  // lane) before it uses any.
  static constexpr int tokens_per_load = 4;
  // Query heads one block attends at once: each lane holds 8 dims of each one's query
  // and output in registers. A larger group is split over several blocks next to one
  // another in the grid, which read the same K and V mostly from L2.
  static constexpr int max_group_chunk = 4;
  // Tokens per split (a block's share of a row): at least enough that the block's
  // partial result stays small beside its K and V; at most what bounds its slice of
  // the block table in shared memory.
  static constexpr std::int32_t min_split_tokens = 256;
  static constexpr std::int32_t max_split_tokens = 8192;
  // The staged variant (cuda_decode_attention::staged): tiles each lane has in flight
  // through shared memory (cp.async) while it computes one, and the blocks per SM its
  // registers are capped for (the stages take 48 KB a block).
  static constexpr int stages = 3;
  static constexpr int staged_blocks_per_sm = 4;
  // The combine kernel; with the metric epilogue, tokens per block.
  static constexpr int combine_threads = 128;
  static constexpr std::int32_t metric_tokens = 2048;
};

inline std::string describe_decode_attention_tuning() {
  using t = decode_attention_tuning;
  return detail::format(
      "decode attention: {} threads, {} blocks/SM x {} waves, {} tokens per load, groups of {} query heads, splits of "
      "{} to {} tokens; staged: {} stages, {} blocks/SM; combine {} threads, {} metric tokens per block",
      t::threads, t::blocks_per_sm, t::waves, t::tokens_per_load, t::max_group_chunk, t::min_split_tokens,
      t::max_split_tokens, t::stages, t::staged_blocks_per_sm, t::combine_threads, t::metric_tokens);
}

}  // namespace cuda
KVP_NAMESPACE_END
