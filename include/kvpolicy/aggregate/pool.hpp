// SnapKV eq. 8: 1-D pooling of scores along the token axis.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace aggregate {

enum class pool_mode : std::uint8_t { max, avg };

// Kernel `kernel` (odd), stride 1, padding kernel / 2; windows are clipped at the
// ends of the candidate range, and avg divides by the clipped count.
struct pool {
  pool_mode mode = pool_mode::max;
  std::int32_t kernel = 5;
  // Pool only on a sequence's first compression (Zipage C.8): later rounds already
  // carry pooled history in F.
  bool first_only = false;

  KVP_HOST_DEVICE constexpr float identity() const noexcept {
    return mode == pool_mode::max ? -__builtin_huge_valf() : 0.0f;
  }
  KVP_HOST_DEVICE constexpr float reduce(float acc, float x) const noexcept {
    return mode == pool_mode::max ? (x > acc ? x : acc) : acc + x;
  }
  KVP_HOST_DEVICE constexpr float finish(float acc, std::int32_t count) const noexcept {
    return mode == pool_mode::max ? acc : acc / static_cast<float>(count);
  }
};

}  // namespace aggregate
KVP_NAMESPACE_END
