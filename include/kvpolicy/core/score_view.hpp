// The global score cache F: one fp32 per cached (layer, block, slot, KV head).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Zipage C.3's `F in R^{L x N_total x b x h_kv}`, indexed by physical block so a
// token's score sits beside its K and V and moves with them.
struct score_view {
  float* base = nullptr;
  std::int64_t layer_stride = 0, block_stride = 0, token_stride = 0, head_stride = 1;

  static constexpr score_view contiguous(float* base, std::int32_t num_blocks, std::int32_t block_size,
                                         std::int32_t num_kv_heads) noexcept {
    const std::int64_t token = num_kv_heads, block = token * block_size, layer = block * num_blocks;
    return {base, layer, block, token, 1};
  }

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return base == nullptr; }

  KVP_HOST_DEVICE float& at(std::int32_t l, std::int32_t block, std::int32_t slot, std::int32_t h) const noexcept {
    return base[l * layer_stride + block * block_stride + slot * token_stride + h * head_stride];
  }
};

KVP_NAMESPACE_END
