// Hopper warpgroup MMA (wgmma, sm_90a): 64 x 64 x 16 and 64 x 32 x 16 tiles with fp32 accumulators
// on f16/bf16 operands read straight from shared memory in the core_matrices layout
// (mma.cuh). Four warps issue it together and it runs asynchronously, so no
// ldmatrix is spent on operands. Device code compiled for any other target gets
// KVP_CUDA_WGMMA 0 and must take the mma.sync path instead.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/exec/cuda/mma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVP_CUDA_WGMMA 1
#else
#define KVP_CUDA_WGMMA 0
#endif

KVP_NAMESPACE_BEGIN
namespace cuda {

// Shared-memory matrix descriptor of a K-major operand without swizzle, in two
// 32-bit halves. lo: start address, then the byte distance between core matrices
// along K (128: they are adjacent), each in 16-byte units; hi: the distance between
// row groups (d * 16). The next 16 elements along K are two core matrices on: lo +
// 16, a 32-bit add that never carries out of the 14-bit address field, since the
// result is the address of those core matrices, which lie in shared memory.
struct wgmma_descriptor {
  std::uint32_t lo, hi;
  __device__ wgmma_descriptor(const std::uint16_t* tile, std::int32_t d)
      : lo(((smem_address(tile) & 0x3FFFF) >> 4) | ((128 >> 4) << 16)), hi(static_cast<std::uint32_t>(d * 16) >> 4) {}
  // The 64-bit descriptor of k-step k (16 elements of K each).
  __device__ std::uint64_t at(int k) const {
    return (std::uint64_t{hi} << 32) | (lo + static_cast<std::uint32_t>(k) * (256 >> 4));
  }
};

__device__ inline void wgmma_fence() {
#if KVP_CUDA_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ inline void wgmma_commit() {
#if KVP_CUDA_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Shared memory written by ordinary stores or cp.async becomes visible to wgmma
// (the async proxy) only after this fence, then a barrier.
__device__ inline void fence_async_shared() {
#if KVP_CUDA_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// acc (+)= A B^T for A = 64 rows at desc_a and B = N rows at desc_b, k = 16; acc is
// the warp's 16 rows x N columns in mma.sync's C-fragment order ([N / 8][4]).
// `accumulate` false overwrites acc.
#define KVP_WGMMA_OUT8(c, i)                                                                             \
  "+f"(c[i]), "+f"(c[i + 1]), "+f"(c[i + 2]), "+f"(c[i + 3]), "+f"(c[i + 4]), "+f"(c[i + 5]), "+f"(c[i + 6]), \
      "+f"(c[i + 7])
// One m64n64k16 / m64n32k16 instruction; TYPE is the PTX name of both operands' type.
#define KVP_WGMMA_64X64X16(TYPE, c, desc_a, desc_b, scale_d)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                       \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,"   \
               "%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                     \
               : KVP_WGMMA_OUT8(c, 0), KVP_WGMMA_OUT8(c, 8), KVP_WGMMA_OUT8(c, 16), KVP_WGMMA_OUT8(c, 24)       \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define KVP_WGMMA_64X32X16(TYPE, c, desc_a, desc_b, scale_d)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                                       \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"        \
               : KVP_WGMMA_OUT8(c, 0), KVP_WGMMA_OUT8(c, 8)                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
// MMA(TYPE, args...) for the operand type T: the PTX type name is a string literal
// pasted into the asm, so each type is its own expansion.
#define KVP_WGMMA_FOR_TYPE(T, MMA, ...) \
  if constexpr (T == dtype::bf16) {     \
    MMA("bf16", __VA_ARGS__);           \
  } else {                              \
    MMA("f16", __VA_ARGS__);            \
  }
template <dtype T, int N>
__device__ inline void wgmma_64xNx16(float (&acc)[N / 8][4], std::uint64_t desc_a, std::uint64_t desc_b,
                                     bool accumulate) {
  static_assert(T == dtype::bf16 || T == dtype::f16);
  static_assert(N == 64 || N == 32, "the 64- and 32-column tiles are the ones instantiated and tested");
#if KVP_CUDA_WGMMA
  float* c = &acc[0][0];
  const int scale_d = accumulate;
  if constexpr (N == 64) {
    KVP_WGMMA_FOR_TYPE(T, KVP_WGMMA_64X64X16, c, desc_a, desc_b, scale_d);
  } else {
    KVP_WGMMA_FOR_TYPE(T, KVP_WGMMA_64X32X16, c, desc_a, desc_b, scale_d);
  }
#else
  (void)acc, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // callers test KVP_CUDA_WGMMA first
#endif
}
// The same with A from registers: each warp's 16 rows of the 64 in mma.sync's
// A-fragment order (a[0..3] as mma_16816 takes them), B from shared memory.
#define KVP_WGMMA_64X32X16_RS(TYPE, c, a, desc_b, scale_d)                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                   \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                                       \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n" \
               : KVP_WGMMA_OUT8(c, 0), KVP_WGMMA_OUT8(c, 8)                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
template <dtype T>
__device__ inline void wgmma_64x32x16_rs(float (&acc)[4][4], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                         bool accumulate) {
  static_assert(T == dtype::bf16 || T == dtype::f16);
#if KVP_CUDA_WGMMA
  float* c = &acc[0][0];
  const int scale_d = accumulate;
  KVP_WGMMA_FOR_TYPE(T, KVP_WGMMA_64X32X16_RS, c, a, desc_b, scale_d);
#else
  (void)acc, (void)a, (void)desc_b, (void)accumulate;
  __trap();  // callers test KVP_CUDA_WGMMA first
#endif
}
#undef KVP_WGMMA_64X64X16
#undef KVP_WGMMA_64X32X16
#undef KVP_WGMMA_64X32X16_RS
#undef KVP_WGMMA_FOR_TYPE
#undef KVP_WGMMA_OUT8

// Keeps the compiler from moving accesses of acc across the asynchronous MMA.
template <int Tiles>
__device__ inline void wgmma_fence_operands(float (&acc)[Tiles][4]) {
#pragma unroll
  for (int i = 0; i < Tiles; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}

// The K / 16 MMAs of one Gram tile as one commit group, not waited for. Each case of
// wgmma_gram's switch commits its own: a commit where the cases join costs every
// call a fence and an empty MMA (ptxas C7519).
template <dtype Elem, int N, int Steps>
__device__ inline void wgmma_gram_steps(float (&acc)[N / 8][4], const wgmma_descriptor& a, const wgmma_descriptor& b) {
  wgmma_fence();  // acc was last touched by ordinary instructions
#pragma unroll
  for (int k = 0; k < Steps; ++k) wgmma_64xNx16<Elem, N>(acc, a.at(k), b.at(k), k > 0);
  wgmma_commit();
}
// The same for k-steps [k0, k0 + Steps) of a longer product, added to acc past the
// first chunk (head dims over 256, in chunks of 16 k-steps).
template <dtype Elem, int N, int Steps>
__device__ inline void wgmma_gram_steps_from(float (&acc)[N / 8][4], const wgmma_descriptor& a,
                                             const wgmma_descriptor& b, std::int32_t k0) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < Steps; ++k) wgmma_64xNx16<Elem, N>(acc, a.at(k0 + k), b.at(k0 + k), k0 + k > 0);
  wgmma_commit();
}

// Warp-uniform by construction: a value broadcast from lane 0 lets ptxas keep what
// is computed from it (the tile offsets, so the wgmma descriptors) in uniform
// registers instead of moving them there before every MMA.
__device__ inline std::int32_t warp_uniform(std::int32_t v) { return __shfl_sync(0xffffffffu, v, 0); }

// Calls f.template operator()<s>() for s = steps, 1 <= steps <= Max (8 or 16), so
// that MMAs unroll per step count: in a loop with a run-time count ptxas waits for
// each wgmma before issuing the next, and register fragments indexed at run time
// would go to local memory. Max is the default case: its own case, or empty cases
// past it, changed the register allocation (more spills in lightning's kernels for a
// run-time head dim).
template <int Max, class F>
__device__ __forceinline__ void with_step_count(std::int32_t steps, F&& f) {
  static_assert(Max == 8 || Max == 16, "one case per step count");
#define KVP_STEP_COUNT(s) \
  case s:                 \
    f.template operator()<s>(); \
    break;
  if constexpr (Max == 8) {
    switch (steps) {
      KVP_STEP_COUNT(1) KVP_STEP_COUNT(2) KVP_STEP_COUNT(3) KVP_STEP_COUNT(4)
      KVP_STEP_COUNT(5) KVP_STEP_COUNT(6) KVP_STEP_COUNT(7)
      default: f.template operator()<8>();
    }
  } else {
    switch (steps) {
      KVP_STEP_COUNT(1) KVP_STEP_COUNT(2) KVP_STEP_COUNT(3) KVP_STEP_COUNT(4)
      KVP_STEP_COUNT(5) KVP_STEP_COUNT(6) KVP_STEP_COUNT(7) KVP_STEP_COUNT(8)
      KVP_STEP_COUNT(9) KVP_STEP_COUNT(10) KVP_STEP_COUNT(11) KVP_STEP_COUNT(12)
      KVP_STEP_COUNT(13) KVP_STEP_COUNT(14) KVP_STEP_COUNT(15)
      default: f.template operator()<16>();
    }
  }
#undef KVP_STEP_COUNT
}

// acc = A B^T over d (a multiple of 16) for the 64 rows at `a` and the N rows at `b`
// (both in core_matrices layout for this d), issued by a whole warpgroup and left
// running: acc must not be touched until wgmma_gram_wait. Each warp gets its 16
// rows of A against all N columns.
template <dtype Elem, int N>
__device__ inline void wgmma_gram_issue(float (&acc)[N / 8][4], const std::uint16_t* a, const std::uint16_t* b,
                                        std::int32_t d) {
  const wgmma_descriptor da(a, d), db(b, d);
  wgmma_fence_operands(acc);
  // Unrolled for every head dim up to 256; head dims past it (rare) in unrolled chunks
  // of 16 k-steps (a loop with a run-time count makes ptxas serialise the MMAs).
  if (d <= 256) {
    with_step_count<16>(d / 16, [&]<int Steps>() { wgmma_gram_steps<Elem, N, Steps>(acc, da, db); });
  } else {
    for (std::int32_t k0 = 0; k0 < d / 16; k0 += 16)
      with_step_count<16>(min(16, d / 16 - k0),
                          [&]<int Steps>() { wgmma_gram_steps_from<Elem, N, Steps>(acc, da, db, k0); });
  }
}
// Waits for the warpgroup's MMAs issued by wgmma_gram_issue.
template <int Tiles>
__device__ inline void wgmma_gram_wait(float (&acc)[Tiles][4]) {
#if KVP_CUDA_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
  wgmma_fence_operands(acc);
}
// Both: the Gram tile, complete.
template <dtype Elem, int N>
__device__ inline void wgmma_gram(float (&acc)[N / 8][4], const std::uint16_t* a, const std::uint16_t* b,
                                  std::int32_t d) {
  wgmma_gram_issue<Elem, N>(acc, a, b, d);
  wgmma_gram_wait(acc);
}

}  // namespace cuda
KVP_NAMESPACE_END
