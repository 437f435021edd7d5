// One warp's 16 x 64 tile of a key Gram matrix on tensor cores, and its folds into
// the redundancy state of the tile's 16 rows (R-KV sec. 3.3; Zipage C.5 and C.7):
// the sum of cosine similarities and the newest column over theta (lightning, one
// cache block), or the elements over theta alone (full, each pair once).
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
// their rows of `b` are never read. HeadDim: d as a constant (the loop unrolled, its
// offsets folded into the loads), or 0.
template <dtype Elem, int HeadDim = 0>
__device__ inline void gram_tile(float (&acc)[8][4], const std::uint16_t* a, const std::uint16_t* b,
                                 std::int32_t b_rows, std::int32_t d, std::int32_t pitch) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
  const std::uint16_t* a_lane = a + std::size_t(lane % 16) * pitch + (lane / 16) * 8;
  const std::uint16_t* b_lane = b + std::size_t(lane % 8 + (lane / 16) * 8) * pitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (std::int32_t k0 = 0; k0 < (HeadDim > 0 ? HeadDim : d); k0 += 16) {
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

// A lane's two rows (lane / 4 and lane / 4 + 8) of a 16-row tile. The fold works in
// x = acc * inv_v, the similarity before its row's factor inv_u: C = x * inv_u is
// over theta when x is over theta / inv_u (inv_u > 0 on every real row), so each
// element costs one multiply, not two, and finish() applies inv_u to the sum and
// the newest similarity once per row.
struct similarity_rows {
  float inv[2] = {0.0f, 0.0f};  // inverse norms; 0 for padding rows, whose state is never read
  float over[2] = {0.0f, 0.0f};  // theta / inv
  float sum[2] = {0.0f, 0.0f};
  std::int32_t near[2] = {-1, -1};  // newest column over theta, as col_pos0 + column
  float near_c[2] = {0.0f, 0.0f};

  __device__ void set_rows(float inv0, float inv1, float theta) {
    inv[0] = inv0;
    inv[1] = inv1;
    over[0] = theta / inv0;
    over[1] = theta / inv1;
  }
  // Row h's state in C's scale, once its columns are all folded.
  __device__ void finish(int h) {
    sum[h] *= inv[h];
    near_c[h] *= inv[h];
  }
};

// How a Gram tile is folded: every column real and off the diagonal (whole); every
// column real, the diagonal among them (diagonal); or column by column (checked).
enum class fold_mode { whole, diagonal, checked };

// Calls f(bit, col, h, x) for each element of a lane's two rows of a Gram tile that a
// fold takes: bit 2 nt + e, tile column col (nt * 8 + (lane % 4) * 2 + e), row half
// h, x = acc * inv_v (C = x * inv_u). `checked` skips columns >= cols and the
// diagonal (column diag[h] is row h itself). `diagonal` gives the diagonal the weight
// 0 instead of a test per column: x = 0 adds nothing to a row sum (s + 0 = s) and,
// with theta >= 0, is not over theta, so the result is that of leaving it out. Row
// lane / 4 + 8 h meets itself in column diag[h] = row_off + lane / 4 + 8 h (row_off a
// multiple of 8): fragment tile row_off / 8 + h, element lane / 4 - (lane % 4) * 2
// when that is 0 or 1. (Zeroing those accumulators instead would make ptxas
// serialise the wgmma pipeline.) A lane meets its columns in increasing order, so
// the last column over theta is the newest.
template <fold_mode Mode, int Tiles, class F>
__device__ inline void for_each_similarity(const float (&acc)[Tiles][4], const float* col_inv, std::int32_t cols,
                                           const std::int32_t (&diag)[2], F&& f) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
  const std::int32_t diag_tile = (diag[0] - lane / 4) / 8, diag_elem = lane / 4 - (lane % 4) * 2;
#pragma unroll
  for (int nt = 0; nt < Tiles; ++nt) {
    const std::int32_t c = nt * 8 + (lane % 4) * 2;
    float ci[2];
    if constexpr (Mode == fold_mode::checked) {
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
        if constexpr (Mode == fold_mode::checked) {
          if (c + e >= cols || c + e == diag[h]) continue;
        }
        float weight = ci[e];
        if constexpr (Mode == fold_mode::diagonal) weight = nt == diag_tile + h && e == diag_elem ? 0.0f : weight;
        f(nt * 2 + e, c + e, h, acc[nt][h * 2 + e] * weight);
      }
  }
}

// Folds a Gram tile into `st`: row sums, and the newest column over theta with its x.
template <fold_mode Mode, int Tiles>
__device__ inline void fold_similarities(similarity_rows& st, const float (&acc)[Tiles][4], const float* col_inv,
                                         std::int32_t col_pos0, std::int32_t cols, const std::int32_t (&diag)[2]) {
  for_each_similarity<Mode>(acc, col_inv, cols, diag, [&](int, std::int32_t col, int h, float x) {
    st.sum[h] += x;
    if (x > st.over[h]) {
      st.near[h] = col_pos0 + col;
      st.near_c[h] = x;
    }
  });
}

// The full kernel's fold (full_pairs_mma_kernel): only which elements of a lane's two
// rows are over theta, as one bit mask per row (bit 2 nt + e: column
// mask_column(bit)). An element costs a multiply, a compare and a predicated bit set;
// the row sums come from the keys' sum instead, and the few elements over theta are
// read again afterwards (masked_similarity).
template <fold_mode Mode, int Tiles>
__device__ inline void over_theta(std::uint32_t (&mask)[2], const float (&acc)[Tiles][4], const float* col_inv,
                                  const float (&over)[2], std::int32_t cols, const std::int32_t (&diag)[2]) {
  static_assert(Tiles <= 16, "two columns of each fragment tile in one 32-bit mask");
  for_each_similarity<Mode>(acc, col_inv, cols, diag, [&](int bit, std::int32_t, int h, float x) {
    if (x > over[h]) mask[h] |= 1u << bit;
  });
}

// The tile column of mask bit `bit` in this lane.
__device__ inline std::int32_t mask_column(std::int32_t bit) {
  return (bit >> 1) * 8 + static_cast<std::int32_t>(threadIdx.x % 4) * 2 + (bit & 1);
}

// x = acc * inv_v of the lane's element `bit` of row h (an unrolled select: a run-time
// index into acc would put it in local memory).
template <int Tiles>
__device__ inline float masked_similarity(const float (&acc)[Tiles][4], const float* col_inv, int h, std::int32_t bit) {
  float a = 0.0f;
#pragma unroll
  for (int k = 0; k < 2 * Tiles; ++k) a = k == bit ? acc[k / 2][h * 2 + k % 2] : a;
  return a * col_inv[mask_column(bit)];
}

// Calls f.template operator()<Mode>(diag) with the cheapest exact fold_mode for a
// warp's 16-row tile of Tiles * 8 columns whose rows start row_off columns into it (a
// multiple of 16: the tile holds the diagonal when 0 <= row_off < its width) and
// whose first `cols` columns are real.
template <int Tiles, class F>
__device__ inline void with_fold_mode(std::int32_t cols, std::int32_t row_off, float theta, F&& f) {
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32;
  const std::int32_t diag[2] = {row_off + lane / 4, row_off + lane / 4 + 8};
  const bool diagonal = row_off >= 0 && row_off < Tiles * 8;
  if (cols < Tiles * 8 || (diagonal && theta < 0.0f))
    f.template operator()<fold_mode::checked>(diag);
  else if (diagonal)
    f.template operator()<fold_mode::diagonal>(diag);
  else
    f.template operator()<fold_mode::whole>(diag);
}

// Folds a Gram tile (as with_fold_mode describes it) whose columns sit at positions
// col_pos0 on into similarity_rows.
template <int Tiles>
__device__ inline void fold_tile(similarity_rows& st, const float (&acc)[Tiles][4], const float* col_inv,
                                 std::int32_t col_pos0, std::int32_t cols, std::int32_t row_off, float theta) {
  with_fold_mode<Tiles>(cols, row_off, theta, [&]<fold_mode Mode>(const std::int32_t (&diag)[2]) {
    fold_similarities<Mode>(st, acc, col_inv, col_pos0, cols, diag);
  });
}

// over_theta of a Gram tile (as with_fold_mode describes it).
template <int Tiles>
__device__ inline void over_theta_tile(std::uint32_t (&mask)[2], const float (&acc)[Tiles][4], const float* col_inv,
                                       const float (&over)[2], std::int32_t cols, std::int32_t row_off, float theta) {
  with_fold_mode<Tiles>(cols, row_off, theta, [&]<fold_mode Mode>(const std::int32_t (&diag)[2]) {
    over_theta<Mode>(mask, acc, col_inv, over, cols, diag);
  });
}

}  // namespace cuda
KVP_NAMESPACE_END
