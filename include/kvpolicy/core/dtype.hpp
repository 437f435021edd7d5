// Element types of the cache and the query window, and exact widening to fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

enum class dtype : std::uint8_t { f16, bf16, f32 };

KVP_HOST_DEVICE constexpr int size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

// Whether t is one of the three types: a value cast from an engine's integer may not
// be, and every other function here would read it as some type of the wrong size.
KVP_HOST_DEVICE constexpr bool is_known(dtype t) noexcept {
  return t == dtype::f16 || t == dtype::bf16 || t == dtype::f32;
}

constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::f32: return "f32";
  }
  return "?";
}

namespace detail {

KVP_HOST_DEVICE inline float bits_to_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

KVP_HOST_DEVICE inline std::uint32_t float_to_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// IEEE binary16 -> binary32. Exact (every half is a float), handles subnormals,
// infinities and NaN, so host and device read the same value from the same bits.
KVP_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // Subnormal half: value = man * 2^-24, exactly representable as a float.
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

KVP_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t h) noexcept {
  return bits_to_float(static_cast<std::uint32_t>(h) << 16);
}

// Round-to-nearest-even narrowing, used to build test and demo caches.
inline std::uint16_t float_to_bf16_bits(float f) noexcept {
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t u = float_to_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                                                     // subnormal or zero
    const float v = bits_to_float(abs) * 16777216.0f;                          // * 2^24
    auto m = static_cast<std::uint32_t>(v);
    const float rem = v - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

}  // namespace detail

// Reads element i of a row stored as `t`, widened to fp32 (exact for all three).
KVP_HOST_DEVICE inline float load_as_float(const void* base, dtype t, std::int64_t i) noexcept {
  switch (t) {
    case dtype::f16: return detail::half_bits_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case dtype::bf16: return detail::bf16_bits_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// Writes fp32 value v as element i of type t (round to nearest even). Host side.
inline void store_from_float(void* base, dtype t, std::int64_t i, float v) noexcept {
  switch (t) {
    case dtype::f16: static_cast<std::uint16_t*>(base)[i] = detail::float_to_half_bits(v); break;
    case dtype::bf16: static_cast<std::uint16_t*>(base)[i] = detail::float_to_bf16_bits(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

KVP_NAMESPACE_END
