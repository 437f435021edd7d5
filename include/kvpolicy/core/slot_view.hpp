// One value per cached (layer, physical block, slot, KV head): the shape of the side
// arrays an engine keeps beside K and V (F, positions, live bytes).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Indexed by physical block, so that a token's entry sits beside its K and V and a
// layout moves it with them; any strides (in elements), or `contiguous`.
template <class T>
struct slot_view {
  T* base = nullptr;
  std::int64_t layer_stride = 0, block_stride = 0, token_stride = 0, head_stride = 1;

  // Contiguous `[L, num_blocks, b, h_kv]`.
  static constexpr slot_view contiguous(T* base, std::int32_t num_blocks, std::int32_t block_size,
                                        std::int32_t num_kv_heads) noexcept {
    const std::int64_t token = num_kv_heads, block = token * block_size, layer = block * num_blocks;
    return {base, layer, block, token, 1};
  }

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return base == nullptr; }

  KVP_HOST_DEVICE T& at(std::int32_t l, std::int32_t block, std::int32_t slot, std::int32_t h) const noexcept {
    return base[l * layer_stride + block * block_stride + slot * token_stride + h * head_stride];
  }
};

KVP_NAMESPACE_END
