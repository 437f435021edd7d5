// dtype: exact widening of f16 / bf16 bit patterns, round-to-nearest-even narrowing,
// and round trips of every 16-bit pattern.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/kvpolicy.hpp"

namespace {

float half(std::uint16_t h) { return kvp::detail::half_bits_to_float(h); }
float bf16(std::uint16_t h) { return kvp::detail::bf16_bits_to_float(h); }
std::uint16_t to_half(float f) { return kvp::detail::float_to_half_bits(f); }
std::uint16_t to_bf16(float f) { return kvp::detail::float_to_bf16_bits(f); }
std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

}  // namespace

TEST_CASE("dtype: sizes and names") {
  CHECK(kvp::size_of(kvp::dtype::f32) == 4);
  CHECK(kvp::size_of(kvp::dtype::f16) == 2);
  CHECK(kvp::size_of(kvp::dtype::bf16) == 2);
  CHECK(kvp::name_of(kvp::dtype::f16) == "f16");
  CHECK(kvp::name_of(kvp::dtype::bf16) == "bf16");
  CHECK(kvp::name_of(kvp::dtype::f32) == "f32");
}

TEST_CASE("dtype: f16 widening of known bit patterns is exact") {
  CHECK(half(0x3C00) == 1.0f);
  CHECK(half(0xC000) == -2.0f);
  CHECK(half(0x3800) == 0.5f);
  CHECK(half(0x3555) == 0.333251953125f);
  CHECK(half(0x7BFF) == 65504.0f);                   // largest finite
  CHECK(half(0x0400) == std::ldexp(1.0f, -14));      // smallest normal
  CHECK(half(0x0001) == std::ldexp(1.0f, -24));      // smallest subnormal
  CHECK(half(0x03FF) == 1023.0f * std::ldexp(1.0f, -24));  // largest subnormal
  CHECK(half(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(bits(half(0x0000)) == 0x00000000u);
  CHECK(bits(half(0x8000)) == 0x80000000u);  // -0 keeps its sign
  CHECK(half(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(half(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(half(0x7E00)));
  CHECK(std::isnan(half(0x7C01)));
  CHECK(bits(half(0x3C01)) == 0x3F802000u);  // 1 + 2^-10
}

TEST_CASE("dtype: bf16 widening of known bit patterns is exact") {
  CHECK(bf16(0x3F80) == 1.0f);
  CHECK(bf16(0xC000) == -2.0f);
  CHECK(bf16(0x4049) == 3.140625f);
  CHECK(bits(bf16(0x7F7F)) == 0x7F7F0000u);  // largest finite
  CHECK(bf16(0x0001) == std::ldexp(1.0f, -133));
  CHECK(bits(bf16(0x8000)) == 0x80000000u);
  CHECK(bf16(0x7F80) == std::numeric_limits<float>::infinity());
  CHECK(bf16(0xFF80) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(bf16(0x7FC0)));
}

TEST_CASE("dtype: f16 narrowing rounds to nearest even") {
  CHECK(to_half(1.0f) == 0x3C00);
  CHECK(to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);      // tie -> even (down)
  CHECK(to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie -> even (up)
  CHECK(to_half(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)) == 0x3C01);  // above the tie
  CHECK(to_half(65504.0f) == 0x7BFF);
  CHECK(to_half(65519.0f) == 0x7BFF);
  CHECK(to_half(65520.0f) == 0x7C00);  // tie at the top rounds to infinity
  CHECK(to_half(1e9f) == 0x7C00);
  CHECK(to_half(-1e9f) == 0xFC00);
  CHECK(to_half(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK((to_half(std::numeric_limits<float>::quiet_NaN()) & 0x7C00) == 0x7C00);
  CHECK((to_half(std::numeric_limits<float>::quiet_NaN()) & 0x03FF) != 0);
  CHECK(to_half(std::ldexp(1.0f, -25)) == 0x0000);       // half of the smallest subnormal: tie -> 0
  CHECK(to_half(3 * std::ldexp(1.0f, -26)) == 0x0001);   // 0.75 ulp -> 1
  CHECK(to_half(3 * std::ldexp(1.0f, -25)) == 0x0002);   // 1.5 ulp: tie -> even 2
  CHECK(to_half(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)) == 0x0400);  // rounds up into the normals
  CHECK(to_half(-0.0f) == 0x8000);
  CHECK(to_half(1e-10f) == 0x0000);
}

TEST_CASE("dtype: bf16 narrowing rounds to nearest even") {
  CHECK(to_bf16(1.0f) == 0x3F80);
  CHECK(to_bf16(std::bit_cast<float>(0x3F808000u)) == 0x3F80);  // tie -> even (down)
  CHECK(to_bf16(std::bit_cast<float>(0x3F818000u)) == 0x3F82);  // tie -> even (up)
  CHECK(to_bf16(std::bit_cast<float>(0x3F808001u)) == 0x3F81);  // above the tie
  CHECK(to_bf16(std::bit_cast<float>(0x7F7FFFFFu)) == 0x7F80);  // FLT_MAX rounds to inf
  CHECK(to_bf16(-0.0f) == 0x8000);
  const std::uint16_t nan = to_bf16(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7F80) == 0x7F80);
  CHECK((nan & 0x007F) != 0);
  // A signalling NaN whose payload sits in the low bits stays a NaN.
  CHECK(std::isnan(bf16(to_bf16(std::bit_cast<float>(0x7F800001u)))));
}

TEST_CASE("dtype: every f16 and bf16 pattern round-trips through float") {
  int mismatches_half = 0, mismatches_bf16 = 0;
  for (std::uint32_t u = 0; u <= 0xFFFF; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    const float fh = half(h), fb = bf16(h);
    if (std::isnan(fh)) {
      CHECK(std::isnan(half(to_half(fh))));
    } else if (to_half(fh) != h) {
      ++mismatches_half;
    }
    if (std::isnan(fb)) {
      CHECK(std::isnan(bf16(to_bf16(fb))));
    } else if (to_bf16(fb) != h) {
      ++mismatches_bf16;
    }
  }
  CHECK(mismatches_half == 0);
  CHECK(mismatches_bf16 == 0);
}

TEST_CASE("dtype: load_as_float / store_from_float through a row") {
  std::uint16_t h[3]{};
  kvp::store_from_float(h, kvp::dtype::f16, 1, -1.5f);
  CHECK(h[1] == 0xBE00);
  CHECK(kvp::load_as_float(h, kvp::dtype::f16, 1) == -1.5f);
  kvp::store_from_float(h, kvp::dtype::bf16, 2, 3.140625f);
  CHECK(h[2] == 0x4049);
  CHECK(kvp::load_as_float(h, kvp::dtype::bf16, 2) == 3.140625f);
  CHECK(h[0] == 0);
  float f[2]{};
  kvp::store_from_float(f, kvp::dtype::f32, 1, 0.1f);
  CHECK(kvp::load_as_float(f, kvp::dtype::f32, 1) == 0.1f);
  const kvp::row_ref r{h, kvp::dtype::f16, 2};
  CHECK(r.size() == 2);
  CHECK(r[1] == -1.5f);
}
