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
  // Window-only layouts (layout::window_compact, Kara): the window's first token, a
  // multiple of the block size. Tokens before it are neither read nor written; the
  // pipeline sees [window_begin, T) as the whole sequence, so the budget, query
  // window and history count within it. 0 for every other layout.
  std::int32_t window_begin = 0;

  constexpr bool compressed_before() const noexcept { return history_tokens > 0; }
};

// Fresh blocks for batch items whose leading blocks other requests share (prefix
// caching, Zipage 4.4), as CSR: item i's first count(i) logical blocks are read where
// they are and never written; the kept tokens that land in them are written to
// block(i, 0 .. count(i)) instead, and its own blocks take the rest. After the
// compression the item's table starts with those blocks and no longer holds the
// shared ones (docs/integration.md, "Prefix-shared blocks"). Null: no item has a
// shared prefix. In the executor's memory.
struct prefix_targets {
  const std::int32_t* indptr = nullptr;  // [items + 1], indptr[0] = 0, non-decreasing
  const std::int32_t* blocks = nullptr;  // [indptr[items]]: block ids, free in the cache

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return indptr == nullptr; }
  KVP_HOST_DEVICE constexpr std::int32_t count(std::int32_t item) const noexcept {
    return empty() ? 0 : indptr[item + 1] - indptr[item];
  }
  KVP_HOST_DEVICE constexpr std::int32_t block(std::int32_t item, std::int32_t j) const noexcept {
    return blocks[indptr[item] + j];
  }
};

struct compression_batch {
  std::span<const batch_item> items;  // host memory
  std::int32_t layer_begin = 0;       // layers [layer_begin, layer_begin + layer_count)
  std::int32_t layer_count = 0;       // 0: all layers of the cache from layer_begin on
  prefix_targets targets{};           // optional: fresh blocks for shared prefixes (host memory)
};

KVP_NAMESPACE_END
