// The observation queries: Zipage's query cache `[L, slots, w, h_q, d]`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"

KVP_NAMESPACE_BEGIN

// Each compressible request owns one slot holding the queries of its last `window`
// positions, oldest first: entry j is the query of position `T - window + j`.
struct query_window_view {
  const void* base = nullptr;
  std::int32_t num_layers = 0;
  std::int32_t num_slots = 0;
  std::int32_t window = 0;  // w: positions per slot
  std::int32_t num_q_heads = 0;
  std::int32_t head_dim = 0;
  dtype type = dtype::bf16;
  // Element strides over (layer, slot, position, head); the dim stride is 1.
  std::int64_t layer_stride = 0, slot_stride = 0, pos_stride = 0, head_stride = 0;

  // Contiguous `[L, slots, w, h_q, d]`.
  static constexpr query_window_view contiguous(const void* base, std::int32_t layers, std::int32_t slots,
                                                std::int32_t w, std::int32_t h_q, std::int32_t d,
                                                dtype t) noexcept {
    const std::int64_t head = d, pos = head * h_q, slot = pos * w, layer = slot * slots;
    return {base, layers, slots, w, h_q, d, t, layer, slot, pos, head};
  }

  // Query row of (layer, slot, position-in-window, query head).
  KVP_HOST_DEVICE const std::byte* row(std::int32_t l, std::int32_t slot, std::int32_t j,
                                       std::int32_t h) const noexcept {
    return static_cast<const std::byte*>(base) +
           (l * layer_stride + slot * slot_stride + j * pos_stride + h * head_stride) * size_of(type);
  }
};

KVP_NAMESPACE_END
