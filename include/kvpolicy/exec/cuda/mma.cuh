// Warp-level tensor-core primitives (sm_80+): 16x8x16 MMA with fp32 accumulators on
// f16/bf16 inputs, ldmatrix fragment loads, and asynchronous 16-byte copies.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/exec/cuda/load.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

__device__ inline std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the address of one row (see callers).
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// c += a * b for one 16x8 tile, k = 16; a row-major, b column-major (rows of K).
template <dtype T>
__device__ inline void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  static_assert(T == dtype::bf16 || T == dtype::f16);
  if constexpr (T == dtype::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16-byte global -> shared copy that bypasses registers; `bytes` 0 fills zeros.
__device__ inline void cp_async_16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Lanes that share one row of d 16-bit elements (d / 8 chunks of 16 bytes): the
// whole warp for long rows, else one lane per chunk. The tensor-core path requires
// d / 8 to be a power of two or a multiple of 32, so groups never straddle a warp.
__device__ inline std::int32_t lanes_per_row(std::int32_t d) { return d / 8 < 32 ? d / 8 : 32; }

KVP_HOST_DEVICE constexpr bool row_groups_fit(std::int32_t d) {
  const std::int32_t vecs = d / 8;
  return d % 16 == 0 && (vecs >= 32 ? vecs % 32 == 0 : (vecs & (vecs - 1)) == 0);
}

// Loads `count` rows of d 16-bit elements (row r from row_of(r)) into shared memory
// with pitch `pitch` elements, rows [count, rows) zero-filled, asynchronously. A
// group of lanes takes a row, so each row's address (block table lookup) is
// computed once per group, not once per chunk.
template <class RowOf>
__device__ inline void copy_rows_async(std::uint16_t* dst, std::int32_t rows, std::int32_t count, std::int32_t d,
                                       std::int32_t pitch, RowOf row_of) {
  const std::int32_t vecs = d / 8, group = lanes_per_row(d);
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % group;
  const std::int32_t step = static_cast<std::int32_t>(blockDim.x) / group;
  for (std::int32_t r = static_cast<std::int32_t>(threadIdx.x) / group; r < rows; r += step) {
    const bool real = r < count;
    const std::byte* src = row_of(real ? r : 0);
    for (std::int32_t v = lane; v < vecs; v += group)
      cp_async_16(dst + std::size_t(r) * pitch + v * 8, src + std::size_t(v) * 16, real ? 16 : 0);
  }
}

// copy_rows_async for the keys [pos0, pos0 + count) of one (layer, seq, head) row of
// a paged cache: when the tile lies in one cache block (the usual case: block sizes
// are multiples of the tile), every row is the block's first row plus a stride, so
// the block table is read once per thread instead of once per row.
__device__ inline void copy_key_rows_async(std::uint16_t* dst, std::int32_t rows, std::int32_t count,
                                           std::int32_t pitch, const paged_kv_view& cache, std::int32_t layer,
                                           std::int32_t seq, std::int32_t head, std::int32_t pos0) {
  const std::int32_t b = cache.block_size, d = cache.head_dim;
  if (pos0 % b + rows <= b) {
    const std::byte* first = cache.k_row(layer, seq, pos0, head);
    const std::int64_t stride = cache.k_stride.token * size_of(cache.type);
    copy_rows_async(dst, rows, count, d, pitch, [&](std::int32_t r) { return first + r * stride; });
  } else {
    copy_rows_async(dst, rows, count, d, pitch,
                    [&](std::int32_t r) -> const std::byte* { return cache.k_row(layer, seq, pos0 + r, head); });
  }
}

// Eight 16-bit elements of type T widened to fp32.
template <dtype T>
__device__ inline void widen8(const uint4& raw, float (&x)[8]) {
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f;
    if constexpr (T == dtype::bf16) {
      f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    } else {
      f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Inverse norms of `count` rows of 16-bit keys in shared memory (a group of lanes per row).
template <dtype Elem>
__device__ inline void inverse_norms_16(const std::uint16_t* keys, float* inv, std::int32_t count, std::int32_t d,
                                        std::int32_t pitch, float eps) {
  const std::int32_t group = lanes_per_row(d), g_lane = static_cast<std::int32_t>(threadIdx.x) % group;
  for (std::int32_t r = static_cast<std::int32_t>(threadIdx.x) / group; r < (count + 15) / 16 * 16; r += blockDim.x / group) {
    float ss = 0.0f;
    for (std::int32_t v = g_lane; v < d / 8; v += group) {
      float x[8];
      widen8<Elem>(*reinterpret_cast<const uint4*>(keys + std::size_t(r) * pitch + v * 8), x);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(x[i], x[i], ss);
    }
    for (std::int32_t o = group / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (g_lane == 0 && r < count) inv[r] = 1.0f / (sqrtf(ss) + eps);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
