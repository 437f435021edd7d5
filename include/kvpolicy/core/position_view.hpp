// Each cached token's original position: one int32 per cached (layer, block, slot,
// KV head), beside K, V and F, moved with its token by every layout.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Optional (paged_kv_view::positions). After a compression a sequence's cache is
// shorter than the sequence: token i of a head's kept prefix was generated at
// position at(l, block, slot, h), which an engine needs for the RoPE of the next
// tokens and for attention masks (docs/integration.md), and which order-free layouts
// need to keep order. The executors never write it but to move it; the engine writes
// each new token's position when it appends the token. Indexed by physical block, as
// F is (score_view.hpp); where the executor runs (host or device memory).
struct position_view {
  std::int32_t* base = nullptr;
  std::int64_t layer_stride = 0, block_stride = 0, token_stride = 0, head_stride = 1;

  // Contiguous `[L, num_blocks, b, h_kv]`, as F.
  static constexpr position_view contiguous(std::int32_t* base, std::int32_t num_blocks, std::int32_t block_size,
                                            std::int32_t num_kv_heads) noexcept {
    const std::int64_t token = num_kv_heads, block = token * block_size, layer = block * num_blocks;
    return {base, layer, block, token, 1};
  }

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return base == nullptr; }

  KVP_HOST_DEVICE std::int32_t& at(std::int32_t l, std::int32_t block, std::int32_t slot,
                                   std::int32_t h) const noexcept {
    return base[l * layer_stride + block * block_stride + slot * token_stride + h * head_stride];
  }
};

KVP_NAMESPACE_END
