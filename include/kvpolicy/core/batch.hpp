// One compression batch: which sequences, with which queries, to which budget.
#pragma once

#include <cstdint>
#include <span>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

struct batch_item {
  std::int32_t seq = 0;         // row of the cache's block table and lengths
  std::int32_t query_slot = 0;  // slot of the query window view
  std::int32_t budget = 0;      // k: tokens kept per (layer, KV head); Zipage (N_max - 1) * b
  // Leading tokens whose F holds a score from an earlier compression: 0 for a
  // sequence never compressed, the previous budget otherwise (Zipage alg. 2: all
  // but the blocks appended since).
  std::int32_t history_tokens = 0;

  constexpr bool compressed_before() const noexcept { return history_tokens > 0; }
};

struct compression_batch {
  std::span<const batch_item> items;  // host memory
  std::int32_t layer_begin = 0;       // layers [layer_begin, layer_begin + layer_count)
  std::int32_t layer_count = 0;       // 0: all layers of the cache from layer_begin on
};

KVP_NAMESPACE_END
