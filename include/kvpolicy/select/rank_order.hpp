// The one rank order of every selector, on host and device alike.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"

KVP_NAMESPACE_BEGIN

// True when token ta (key a) ranks before token tb (key b): the larger key first,
// equal keys to the more recent token; NaN ranks as -inf (below every finite key,
// level with -inf, so ties with it go to the more recent token).
KVP_HOST_DEVICE constexpr bool ranks_before(float a, std::int32_t ta, float b, std::int32_t tb) noexcept {
  if (a != a) a = -__builtin_huge_valf();
  if (b != b) b = -__builtin_huge_valf();
  return a > b || (a == b && ta > tb);
}

// The same order as one 64-bit integer per token: rank_bits(a, ta) > rank_bits(b, tb)
// exactly when ranks_before(a, ta, b, tb). No two tokens of a row share one, so "the n
// largest" is always a set of exactly n tokens. The executors' radix selects and the
// host's sorts both rank by it.
KVP_HOST_DEVICE inline std::uint64_t rank_bits(float key, std::int32_t t) noexcept {
  if (key != key) key = -__builtin_huge_valf();
  if (key == 0.0f) key = 0.0f;  // -0 ranks with +0, as the float comparison does
  std::uint32_t u = detail::float_to_bits(key);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving float -> unsigned
  return (static_cast<std::uint64_t>(u) << 32) | static_cast<std::uint32_t>(t);
}

// The top of a row by some key: the tokens whose (key, position) rank at or above a
// threshold, as a score-dependent selector's row.top(key, n) returns it.
struct rank_cut {
  std::uint64_t threshold = ~std::uint64_t{0};  // nothing ranks at or above it: an empty cut

  KVP_HOST_DEVICE bool admits(float key, std::int32_t t) const noexcept { return rank_bits(key, t) >= threshold; }
};

KVP_NAMESPACE_END
