// Window attention on tensor cores for f16/bf16 caches: the Q.K^T tiles of
// attention_score_kernel computed with mma.sync (fp32 accumulators), key tiles
// double-buffered with cp.async, the softmax and the reductions in fp32 as before.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Keys per tile of the tensor-core scorer.
inline constexpr int mma_key_tile = 64;

KVP_HOST_DEVICE constexpr std::int32_t round16(std::int32_t x) { return (x + 15) / 16 * 16; }

// Shared memory, in bytes: queries [round16(w G)][d + 8] and two key tiles
// [64][d + 8] of 16-bit elements (the 8-element pad puts the 8 rows of an ldmatrix
// on distinct banks), the tile's logits [round16(w G)][68] and the softmax statistics.
KVP_HOST_DEVICE constexpr std::size_t attention_mma_smem_bytes(std::int32_t w, std::int32_t G, std::int32_t d) {
  const std::size_t rows = static_cast<std::size_t>(round16(w * G)), pitch = std::size_t(d) + 8;
  return (rows + 2 * mma_key_tile) * pitch * 2 + rows * (mma_key_tile + 4) * 4 + 2 * std::size_t(w) * G * 4;
}

template <AttentionScorer S, dtype Elem>
__global__ void __launch_bounds__(row_threads) attention_score_mma_kernel(S s, paged_kv_view cache,
                                                                          query_window_view q, row_space rs,
                                                                          float* scores) {
  extern __shared__ uint4 smem16[];
  if (failed(rs)) return;
  const row_coord rc = decode_row(rs, blockIdx.x);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T);
  const std::int32_t d = cache.head_dim, w = s.window, G = q.num_q_heads / cache.num_kv_heads;
  const std::int32_t QW = w * G, rows = round16(QW), pitch = d + 8, zp = mma_key_tile + 4;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const bool by_logits = s.group == group_reduce::max_logits;
  const float ninf = -__builtin_huge_valf();
  const float scale = 1.0f / sqrtf(static_cast<float>(d));

  auto* qs = reinterpret_cast<std::uint16_t*>(smem16);
  // Two key tiles; buffer i starts at kbase + i * tile_elems (no array: a run-time
  // index into one would put it in local memory).
  std::uint16_t* kbase = qs + std::size_t(rows) * pitch;
  const std::size_t tile_elems = std::size_t(mma_key_tile) * pitch;
  auto* zs = reinterpret_cast<float*>(kbase + 2 * tile_elems);
  float* stat_m = zs + std::size_t(rows) * zp;
  float* stat_l = stat_m + QW;

  for (std::int32_t e = threadIdx.x; e < rows * (d / 8); e += blockDim.x) {
    const std::int32_t r = e / (d / 8), v = e % (d / 8);
    uint4 val{0, 0, 0, 0};
    if (r < QW)
      val = reinterpret_cast<const uint4*>(q.row(rc.layer, it.query_slot, q.window - w + r / G, rc.head * G + r % G))[v];
    *reinterpret_cast<uint4*>(qs + std::size_t(r) * pitch + v * 8) = val;
  }
  for (std::int32_t i = threadIdx.x; i < QW; i += blockDim.x) {
    stat_m[i] = ninf;
    stat_l[i] = 0.0f;
  }
  auto key_row = [&](std::int32_t tile) {
    return [&, tile](std::int32_t r) -> const std::byte* { return cache.k_row(rc.layer, it.seq, tile + r, rc.head); };
  };
  // Online softmax statistics of one row of values, two per lane (keys lane, lane + 32).
  auto accumulate_stats = [&](std::int32_t i, float z0, float z1) {
    const float m_old = stat_m[i];
    const float m_new = fmaxf(m_old, warp_max(fmaxf(z0, z1)));
    if (m_new == ninf) return;
    const float e = warp_sum((z0 == ninf ? 0.0f : expf(z0 - m_new)) + (z1 == ninf ? 0.0f : expf(z1 - m_new)));
    __syncwarp();
    if (lane == 0) {
      stat_l[i] = stat_l[i] * expf(m_old - m_new) + e;
      stat_m[i] = m_new;
    }
    __syncwarp();
  };

  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
    if (pass == 1)
      for (std::int32_t i = threadIdx.x; i < QW; i += blockDim.x) stat_l[i] = 1.0f / stat_l[i];
    copy_rows_async(kbase, mma_key_tile, min(mma_key_tile, n), d, pitch, key_row(0));
    cp_async_commit();
    int buf = 0;
    for (std::int32_t tile = 0; tile < n; tile += mma_key_tile, buf ^= 1) {
      const std::int32_t next = tile + mma_key_tile;
      if (next < n) {
        copy_rows_async(kbase + (buf ^ 1) * tile_elems, mma_key_tile, min(mma_key_tile, n - next), d, pitch, key_row(next));
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();

      // Logits of the tile: warps take (16 queries x 32 keys) pieces.
      const std::uint16_t* kb = kbase + buf * tile_elems;
      for (std::int32_t piece = warp; piece < (rows / 16) * 2; piece += warps) {
        const std::int32_t m0 = (piece / 2) * 16, n0 = (piece % 2) * 32;
        float acc[4][4] = {};
        for (std::int32_t k0 = 0; k0 < d; k0 += 16) {
          std::uint32_t a[4];
          ldmatrix_x4(a, qs + std::size_t(m0 + lane % 16) * pitch + k0 + (lane / 16) * 8);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            std::uint32_t b[4];
            ldmatrix_x4(b, kb + std::size_t(n0 + np * 16 + lane % 8 + (lane / 16) * 8) * pitch + k0 + ((lane / 8) % 2) * 8);
            mma_16816<Elem>(acc[np * 2], a, b[0], b[1]);
            mma_16816<Elem>(acc[np * 2 + 1], a, b[2], b[3]);
          }
        }
        // The thread's two query rows and their window positions, once per piece.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::int32_t qi = m0 + lane / 4 + h * 8, pj = T - w + qi / G;
          float* zrow = zs + std::size_t(qi) * zp;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const std::int32_t key = n0 + nt * 8 + (lane % 4) * 2, t = tile + key;
            float2 z;
            z.x = qi < QW && t < n && s.visible(pj, t) ? acc[nt][h * 2] * scale : ninf;
            z.y = qi < QW && t + 1 < n && s.visible(pj, t + 1) ? acc[nt][h * 2 + 1] * scale : ninf;
            *reinterpret_cast<float2*>(zrow + key) = z;
          }
        }
      }
      __syncthreads();

      if (pass == 0) {
        // Statistics per query (or per window position, of the group's max logit).
        const std::int32_t stat_rows = by_logits ? w : QW;
        for (std::int32_t i = warp; i < stat_rows; i += warps) {
          float z0 = ninf, z1 = ninf;
          if (by_logits) {
            for (std::int32_t g = 0; g < G; ++g) {
              z0 = fmaxf(z0, zs[std::size_t(i * G + g) * zp + lane]);
              z1 = fmaxf(z1, zs[std::size_t(i * G + g) * zp + lane + 32]);
            }
          } else {
            z0 = zs[std::size_t(i) * zp + lane];
            z1 = zs[std::size_t(i) * zp + lane + 32];
          }
          accumulate_stats(i, z0, z1);
        }
      } else {
        // Scores: four threads per key split the window, then add in a fixed order.
        const std::int32_t key = threadIdx.x / 4, sub = threadIdx.x % 4, t = tile + key;
        const bool valid = t < n;
        float acc = 0.0f;
        for (std::int32_t j = sub; valid && j < w; j += 4) {
          const std::int32_t pj = T - w + j;
          if (!s.contributes(pj, t)) continue;
          if (by_logits) {
            float zz = ninf;
            for (std::int32_t g = 0; g < G; ++g) zz = fmaxf(zz, zs[std::size_t(j * G + g) * zp + key]);
            acc += s.transform(zz == ninf ? 0.0f : expf(zz - stat_m[j]) * stat_l[j]);
          } else {
            float gacc = s.group == group_reduce::max ? ninf : 0.0f;
            for (std::int32_t g = 0; g < G; ++g) {
              const std::int32_t qi = j * G + g;
              const float z = zs[std::size_t(qi) * zp + key];
              const float p = s.transform(z == ninf ? 0.0f : expf(z - stat_m[qi]) * stat_l[qi]);
              gacc = s.group == group_reduce::max ? fmaxf(gacc, p) : gacc + p;
            }
            acc += s.group == group_reduce::mean ? gacc / static_cast<float>(G) : gacc;
          }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (sub == 0 && valid)
          scores[blockIdx.x * std::int64_t{rs.max_tokens} + t] =
              s.reduce == window_reduce::mean ? acc * (1.0f / static_cast<float>(w)) : acc;
      }
      __syncthreads();
    }
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
