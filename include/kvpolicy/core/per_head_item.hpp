// One sequence of a per-head compression (KV-Compress), as the host and CUDA per-head
// executors and presets::kv_compress take it: a core type, so that a preset needs no
// executor to name it.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// How many blocks the sequence frees, over all its layers and heads
// (block_budget::sequence), or per layer (`per_layer`: num_layers counts,
// block_budget::layer). blocks_to_free_for_tokens / _for_rate turn a token budget or a
// rate into blocks. `logical_length`: the sequence's position count, when the cache
// carries positions (slots no longer are positions after a MoveCache).
struct per_head_item {
  std::int32_t seq = 0;
  std::int64_t blocks_to_free = 0;
  const std::int64_t* per_layer = nullptr;
  std::int32_t logical_length = -1;
};

KVP_NAMESPACE_END
