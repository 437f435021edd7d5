// The one rank order of every selector, on host and device alike.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// True when token ta (key a) ranks before token tb (key b): the larger key first,
// equal keys to the more recent token; NaN ranks as -inf.
KVP_HOST_DEVICE constexpr bool ranks_before(float a, std::int32_t ta, float b, std::int32_t tb) noexcept {
  if (a != a) a = -__builtin_huge_valf();
  if (b != b) b = -__builtin_huge_valf();
  return a > b || (a == b && ta > tb);
}

KVP_NAMESPACE_END
