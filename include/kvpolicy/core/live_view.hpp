// Cautious update (Hard-KV): which cached tokens each (layer, KV head) still holds.
// One byte per cached (layer, block, slot, KV head), beside K, V, F and positions.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Optional (paged_kv_view::live). A head-adaptive selector keeps a count per (layer,
// KV head) in a table the heads share, so after a compaction a head holds its kept
// tokens in slots [0, count) and leftovers in [count, new length): tokens it dropped.
// With this view set, every compression treats a token whose byte is 0 as gone from
// that head (a dropped token stays dropped: the new mask is the old one AND the new
// selection): attention scorers leave it out of their softmax, it enters aggregation
// with score 0, it is never kept, and protect does not count it. The layout writes
// the bytes of each row it compacts (1 in [0, count), 0 in [count, T)); a layout that
// moves nothing clears those of the tokens it drops. The engine writes 1 for every
// layer and head of each token it appends, and its attention reads only live tokens
// (docs/integration.md). Nonzero is live. Where the executor runs (host or device memory).
struct live_view {
  std::uint8_t* base = nullptr;
  std::int64_t layer_stride = 0, block_stride = 0, token_stride = 0, head_stride = 1;

  // Contiguous `[L, num_blocks, b, h_kv]`, as F and the positions.
  static constexpr live_view contiguous(std::uint8_t* base, std::int32_t num_blocks, std::int32_t block_size,
                                        std::int32_t num_kv_heads) noexcept {
    const std::int64_t token = num_kv_heads, block = token * block_size, layer = block * num_blocks;
    return {base, layer, block, token, 1};
  }

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return base == nullptr; }

  KVP_HOST_DEVICE std::uint8_t& at(std::int32_t l, std::int32_t block, std::int32_t slot,
                                   std::int32_t h) const noexcept {
    return base[l * layer_stride + block * block_stride + slot * token_stride + h * head_stride];
  }
};

KVP_NAMESPACE_END
