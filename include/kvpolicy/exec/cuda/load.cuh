// Widening loads of cache rows into fp32, eight elements (16 bytes of f16/bf16) at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Elements [i, i + 4) of a row as fp32. Rows are 16-byte aligned (checked on the
// host), so f16/bf16 loads are 8 bytes and f32 loads 16.
__device__ inline float4 load4(const std::byte* row, dtype t, std::int32_t i) {
  if (t == dtype::f32) return *reinterpret_cast<const float4*>(row + std::size_t(i) * 4);
  const uint2 raw = *reinterpret_cast<const uint2*>(row + std::size_t(i) * 2);
  if (t == dtype::bf16) {
    const auto a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const auto b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return {a.x, a.y, b.x, b.y};
  }
  const auto a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const auto b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return {a.x, a.y, b.x, b.y};
}

// Loads `count` rows of d elements into shared memory as fp32 with row pitch `pitch`
// (floats); row r comes from row_of(r). All threads of the block take part.
template <class RowOf>
__device__ inline void load_rows(float* dst, std::int32_t count, std::int32_t d, std::int32_t pitch, dtype t,
                                 RowOf row_of) {
  const std::int32_t quads = d / 4;
  for (std::int32_t e = threadIdx.x; e < count * quads; e += blockDim.x) {
    const std::int32_t r = e / quads, i = (e % quads) * 4;
    *reinterpret_cast<float4*>(dst + std::size_t(r) * pitch + i) = load4(row_of(r), t, i);
  }
}

__device__ inline float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

}  // namespace cuda
KVP_NAMESPACE_END
