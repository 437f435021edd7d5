// Warp-level tensor-core primitives (sm_80+): 16x8x16 MMA with fp32 accumulators on
// f16/bf16 inputs, ldmatrix fragment loads, and asynchronous 16-byte copies.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"

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

// Loads `count` rows of d 16-bit elements (row r from row_of(r)) into shared memory
// with pitch `pitch` elements, rows [count, rows) zero-filled, asynchronously.
template <class RowOf>
__device__ inline void copy_rows_async(std::uint16_t* dst, std::int32_t rows, std::int32_t count, std::int32_t d,
                                       std::int32_t pitch, RowOf row_of) {
  const std::int32_t vecs = d / 8;
  for (std::int32_t e = threadIdx.x; e < rows * vecs; e += blockDim.x) {
    const std::int32_t r = e / vecs, v = e % vecs;
    const bool real = r < count;
    const std::byte* src = row_of(real ? r : 0) + std::size_t(v) * 16;
    cp_async_16(dst + std::size_t(r) * pitch + v * 8, src, real ? 16 : 0);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
