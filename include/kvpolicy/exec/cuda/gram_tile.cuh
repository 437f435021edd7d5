// One warp's 16 x 64 tile of a key Gram matrix on tensor cores, and its fold into
// the redundancy state of the tile's 16 rows: the sum of cosine similarities and
// the newest column over theta (R-KV sec. 3.3; Zipage C.5 and C.7). Shared by the
// lightning (one cache block) and the full (all pairs) redundancy kernels.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/exec/cuda/mma.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Columns of one Gram tile: a warp holds 16 rows x 64 columns in 32 accumulators.
inline constexpr int gram_tile_columns = 64;

// acc = A B^T for the 16 rows at `a` and the first min(64, b_rows) rows at `b` (both
// 16-bit, pitch `pitch` elements, d a multiple of 16); columns past b_rows stay 0 and
// their rows of `b` are never read.
template <dtype Elem>
__device__ inline void gram_tile(float (&acc)[8][4], const std::uint16_t* a, const std::uint16_t* b,
                                 std::int32_t b_rows, std::int32_t d, std::int32_t pitch) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
  const std::uint16_t* a_lane = a + std::size_t(lane % 16) * pitch + (lane / 16) * 8;
  const std::uint16_t* b_lane = b + std::size_t(lane % 8 + (lane / 16) * 8) * pitch + ((lane / 8) % 2) * 8;
  for (std::int32_t k0 = 0; k0 < d; k0 += 16) {
    std::uint32_t af[4];
    ldmatrix_x4(af, a_lane + k0);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np * 16 >= b_rows) break;
      std::uint32_t bf[4];
      ldmatrix_x4(bf, b_lane + std::size_t(np * 16) * pitch + k0);
      mma_16816<Elem>(acc[np * 2], af, bf[0], bf[1]);
      mma_16816<Elem>(acc[np * 2 + 1], af, bf[2], bf[3]);
    }
  }
}

// A lane's two rows (lane / 4 and lane / 4 + 8) of a 16-row tile.
struct similarity_rows {
  float inv[2] = {0.0f, 0.0f};  // inverse norms; 0 for padding rows, whose state is never read
  float sum[2] = {0.0f, 0.0f};
  std::int32_t near[2] = {-1, -1};  // newest column over theta, as col_pos0 + column
  float near_c[2] = {0.0f, 0.0f};
};

// Folds a Gram tile into `st`: C(u, v) = acc * (inv_u * inv_v), the host's form.
// `Checked` skips columns >= cols and the diagonal (column diag[h] is row h itself);
// without it every column is real and off the diagonal, which the caller decides
// once per tile. A lane meets its columns in increasing order, so the last column
// over theta is the newest.
template <bool Checked>
__device__ inline void fold_similarities(similarity_rows& st, const float (&acc)[8][4], const float* col_inv,
                                         std::int32_t col_pos0, std::int32_t cols, const std::int32_t (&diag)[2],
                                         float theta) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const std::int32_t c = nt * 8 + (lane % 4) * 2;
    float ci[2];
    if constexpr (Checked) {
      ci[0] = c < cols ? col_inv[c] : 0.0f;
      ci[1] = c + 1 < cols ? col_inv[c + 1] : 0.0f;
    } else {
      const float2 pair = *reinterpret_cast<const float2*>(col_inv + c);
      ci[0] = pair.x;
      ci[1] = pair.y;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (Checked) {
          if (c + e >= cols || c + e == diag[h]) continue;
        }
        const float sim = acc[nt][h * 2 + e] * (st.inv[h] * ci[e]);
        st.sum[h] += sim;
        if (sim > theta) {
          st.near[h] = col_pos0 + c + e;
          st.near_c[h] = sim;
        }
      }
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
