// Softmax statistics of window attention over one cache block's keys, computed where
// those keys already sit in shared memory (the lightning redundancy kernel), so that
// the score kernel need not read every key a first time for them: it joins the
// blocks' statistics and makes its probability pass alone.
#pragma once

#include <concepts>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Statistics per block: two halves (alternate 32-key chunks) of round32(w G) query
// rows in chunk order (query_order), each (max, sum of 2^(z - max)) in log2 units.
KVP_HOST_DEVICE constexpr std::int64_t block_statistics_count(std::int32_t w, std::int32_t G) {
  return 2 * std::int64_t{round32(w * G)};
}

// The statistics of the keys [pos0, pos0 + count) of one row (candidates, in shared
// memory at `keys`, laid out by `at`, rows past count zero or unread) for the
// row's window queries, written to out[half][query row]: (-inf, 0) where a query
// sees none of them. A warp takes 16 queries and one half; its query fragments are
// loaded once, from global memory (a row's queries are few and read by every block,
// so they stay in L2), the keys' from shared memory. The whole block calls it;
// requires reduces_in_fragments (G a power of two up to 8).
template <dtype Elem, int D, AttentionScorer S, class Layout>
__device__ void block_softmax_statistics(const S& s, const query_window_view& q, std::int32_t layer, std::int32_t slot,
                                         std::int32_t head, std::int32_t G, std::int32_t T, const std::uint16_t* keys,
                                         Layout at, std::int32_t pos0, std::int32_t count, float2* out) {
  const std::int32_t w = s.window, rows = round32(w * G), end = pos0 + count;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const query_order order{true, G, __ffs(G) - 1};
  const float ninf = -__builtin_huge_valf();
  const float scale = 1.0f / sqrtf(static_cast<float>(D)) * 1.4426950408889634f;
  // Keys below plain_end are visible to every window query: chunks under it skip the
  // mask test (padding query rows are left out by the score kernel's window reduce).
  std::int32_t plain_end = 0;
  if constexpr (requires { { s.visible_end(0) } -> std::same_as<std::int32_t>; }) {
    plain_end = end;
    for (std::int32_t j = 0; j < w; ++j) plain_end = min(plain_end, s.visible_end(T - w + j));
  }
  for (std::int32_t piece = warp; piece < (rows / 16) * 2; piece += warps) {
    const std::int32_t m0 = (piece / 2) * 16, half = piece % 2;
    // mma.sync's A fragment of rows m0 + lane / 4 (+ 8): per 16 dims, 32-bit words
    // lane % 4 and 4 + lane % 4 of each row's 8; padding rows are zero.
    std::uint32_t a[D / 16][4];
    bool real[2];
    std::int32_t pj[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int32_t r = m0 + lane / 4 + h * 8, j = order.position(r);
      real[h] = j < w;
      pj[h] = T - w + j;
      const auto* row =
          reinterpret_cast<const std::uint32_t*>(q.row(layer, slot, q.window - w + (real[h] ? j : 0), head * G + order.head(r)));
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        a[kk][h] = real[h] ? row[kk * 8 + lane % 4] : 0u;
        a[kk][h + 2] = real[h] ? row[kk * 8 + 4 + lane % 4] : 0u;
      }
    }
    float2 run[2] = {{ninf, 0.0f}, {ninf, 0.0f}};
    for (std::int32_t c0 = half * 32; c0 < count; c0 += 64) {
      float acc[4][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          std::uint32_t bf[4];
          ldmatrix_x4(bf, keys + at(c0 + np * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
          mma_16816<Elem>(acc[np * 2], a[kk], bf[0], bf[1]);
          mma_16816<Elem>(acc[np * 2 + 1], a[kk], bf[2], bf[3]);
        }
      const bool plain = pos0 + c0 + 32 <= plain_end;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float z[8];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const std::int32_t t = pos0 + c0 + nt * 8 + (lane % 4) * 2 + e;
            z[2 * nt + e] = plain || (real[h] && t < end && s.visible(pj[h], t)) ? acc[nt][h * 2 + e] : ninf;
          }
        // The quad holds the row's 32 keys: max and sum in two shuffles each.
        float m = ninf;
#pragma unroll
        for (int k = 0; k < 8; ++k) m = fmaxf(m, z[k]);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float ms = m == ninf ? 0.0f : m * scale;  // all masked: every term is 0
        float e = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) e += exp2_ftz(fmaf(z[k], scale, -ms));
        e += __shfl_xor_sync(0xffffffffu, e, 1);
        e += __shfl_xor_sync(0xffffffffu, e, 2);
        if (m != ninf) run[h] = merge_nonempty(run[h], ms, e);
      }
    }
    if (lane % 4 == 0) {
      out[half * rows + m0 + lane / 4] = run[0];
      out[half * rows + m0 + lane / 4 + 8] = run[1];
    }
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
