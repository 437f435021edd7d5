// Kara eq. 4 on the GPU: every query of the window against the keys of W \ U, no
// causal mask, softmax over the keys, summed over the queries. One block per (item,
// layer, KV head) row, the row's keys resident in shared memory for both passes over
// them (statistics, then probabilities), so they are read from the cache once.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/load.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

inline constexpr int bidirectional_warps = row_threads / 32;

// Query rows of the window are (position j, query head g of the group): row r is
// j = r / G, g = r % G, so a GQA group's heads are neighbours.
__device__ inline const std::byte* window_query(const query_window_view& q, std::int32_t l, std::int32_t slot,
                                                std::int32_t entry0, std::int32_t kv_head, std::int32_t G,
                                                std::int32_t r) {
  return q.row(l, slot, entry0 + r / G, kv_head * G + r % G);
}

// ---------------------------------------------------------------------------
// fp32 arithmetic, any cache type and head dim, every group reduce: a warp takes one
// window position at a time, its G queries' logits in shared memory, and adds the
// group-reduced probabilities to its own column sums; the warps' sums are added in
// warp order at the end (no atomics: the same result on every run).

// Shared memory, in floats: per warp the G x n logits, the column sums and a query.
KVP_HOST_DEVICE constexpr std::size_t bidirectional_smem_floats(std::int32_t n, std::int32_t G, std::int32_t d) {
  return std::size_t(bidirectional_warps) * (std::size_t(G) * n + n + d);
}

template <AttentionScorer S>
__global__ void __launch_bounds__(row_threads) bidirectional_score_kernel(S s, paged_kv_view cache,
                                                                          query_window_view q, row_space rs,
                                                                          float* scores, std::int32_t* ready_out) {
  extern __shared__ float4 smem4[];
  const prerequisites_at_exit done;
  allow_dependents();
  if (failed(rs)) return;
  const row_coord rc = decode_row(rs, blockIdx.x);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T), d = cache.head_dim, w = s.window;
  const std::int32_t G = q.num_q_heads / cache.num_kv_heads, entry0 = q.window - w;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float scale = 1.0f / sqrtf(static_cast<float>(d)), ninf = -__builtin_huge_valf();
  float* z = reinterpret_cast<float*>(smem4) + std::size_t(warp) * (std::size_t(G) * n + n + d);
  float* colsum = z + std::size_t(G) * n;
  float* qv = colsum + n;
  for (std::int32_t t = lane; t < n; t += 32) colsum[t] = 0.0f;

  for (std::int32_t j = warp; j < w; j += bidirectional_warps) {
    float m[8], inv[8];  // per group head (G <= 8 per pass of g0)
    for (std::int32_t g0 = 0; g0 < G; g0 += 8) {
      const std::int32_t gn = min(8, G - g0);
      for (std::int32_t gg = 0; gg < gn; ++gg) {
        const std::int32_t g = g0 + gg;
        __syncwarp();
        const std::byte* qrow = window_query(q, rc.layer, it.query_slot, entry0, rc.head, G, j * G + g);
        for (std::int32_t i = lane * 4; i < d; i += 128) {
          const float4 v = load4(qrow, q.type, i);
          qv[i] = v.x, qv[i + 1] = v.y, qv[i + 2] = v.z, qv[i + 3] = v.w;
        }
        __syncwarp();
        float mx = ninf;
        for (std::int32_t t = lane; t < n; t += 32) {
          const std::byte* krow = cache.k_row(rc.layer, it.seq, t, rc.head);
          float acc = 0.0f;
          for (std::int32_t i = 0; i < d; i += 4)
            acc = dot4(float4{qv[i], qv[i + 1], qv[i + 2], qv[i + 3]}, load4(krow, cache.type, i), acc);
          const float zt = acc * scale;
          z[std::size_t(g) * n + t] = zt;
          mx = fmaxf(mx, zt);
        }
        m[gg] = warp_max(mx);
      }
      if (s.group == group_reduce::max_logits) continue;  // one softmax over the group's max, below
      for (std::int32_t gg = 0; gg < gn; ++gg) {
        float sum = 0.0f;
        for (std::int32_t t = lane; t < n; t += 32) sum += expf(z[std::size_t(g0 + gg) * n + t] - m[gg]);
        inv[gg] = 1.0f / warp_sum(sum);
      }
      for (std::int32_t t = lane; t < n; t += 32) {
        float acc = s.group == group_reduce::max ? ninf : 0.0f;
        for (std::int32_t gg = 0; gg < gn; ++gg) {
          const float p = s.transform(expf(z[std::size_t(g0 + gg) * n + t] - m[gg]) * inv[gg]);
          acc = s.group == group_reduce::max ? fmaxf(acc, p) : acc + p;
        }
        z[std::size_t(g0) * n + t] = acc;  // the chunk's reduction, where its first head's logits were
      }
    }
    __syncwarp();
    if (s.group == group_reduce::max_logits) {
      float mx = ninf;
      for (std::int32_t t = lane; t < n; t += 32) {
        float v = ninf;
        for (std::int32_t g = 0; g < G; ++g) v = fmaxf(v, z[std::size_t(g) * n + t]);
        z[t] = v;
        mx = fmaxf(mx, v);
      }
      mx = warp_max(mx);
      float sum = 0.0f;
      for (std::int32_t t = lane; t < n; t += 32) sum += expf(z[t] - mx);
      const float inv_sum = 1.0f / warp_sum(sum);
      for (std::int32_t t = lane; t < n; t += 32) colsum[t] += s.transform(expf(z[t] - mx) * inv_sum);
    } else {
      for (std::int32_t t = lane; t < n; t += 32) {
        float acc = s.group == group_reduce::max ? ninf : 0.0f;
        for (std::int32_t g0 = 0; g0 < G; g0 += 8) {
          const float v = z[std::size_t(g0) * n + t];
          acc = s.group == group_reduce::max ? fmaxf(acc, v) : acc + v;
        }
        colsum[t] += s.group == group_reduce::mean ? acc / static_cast<float>(G) : acc;
      }
    }
    __syncwarp();
  }
  __syncthreads();
  const float per_query = s.reduce == window_reduce::mean ? 1.0f / static_cast<float>(w) : 1.0f;
  for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
    float total = 0.0f;
    for (std::int32_t v = 0; v < bidirectional_warps; ++v)
      total += reinterpret_cast<const float*>(smem4)[std::size_t(v) * (std::size_t(G) * n + n + d) + G * std::size_t(n) + t];
    scores[blockIdx.x * std::int64_t{rs.max_tokens} + t] = total * per_query;
  }
  publish_scores(ready_out, blockIdx.x);
}

// ---------------------------------------------------------------------------
// Tensor cores, f16/bf16, group sum or mean (linear in the probabilities, so every
// (position, head) query row is alike): the n keys of W \ U in shared memory
// (padded rows, ldmatrix), each warp 16 or 32 query rows at a time with their A fragments
// in registers, loaded straight from the query view. Pass 1 keeps each row's online
// max and sum over the key tiles of 64, pass 2 turns the logits into probabilities
// and adds each column over the warp's rows (a butterfly over the 8 lanes that share
// a column) into the warp's own column sums. Rows of the last tile past n are
// zero in shared memory and masked to -inf.

inline constexpr int bidirectional_key_tile = 64;

// Shared memory, in bytes: the keys (rows of d + 8 elements, n rounded up to 16) and
// the warps' column sums.
KVP_HOST_DEVICE constexpr std::size_t bidirectional_mma_smem_bytes(std::int32_t n, std::int32_t d) {
  const std::size_t rows = (std::size_t(n) + 15) / 16 * 16;
  return rows * (std::size_t(d) + 8) * 2 + std::size_t(bidirectional_warps) * rows * sizeof(float);
}

template <AttentionScorer S, dtype Elem, int HeadDim>
__global__ void __launch_bounds__(row_threads) bidirectional_score_mma_kernel(S s, paged_kv_view cache,
                                                                              query_window_view q, row_space rs,
                                                                              float* scores,
                                                                              std::int32_t* ready_out) {
  extern __shared__ float4 smem4[];
  const prerequisites_at_exit done;
  allow_dependents();
  if (failed(rs)) return;
  const row_coord rc = decode_row(rs, blockIdx.x);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T), d = HeadDim > 0 ? HeadDim : cache.head_dim;
  const std::int32_t rows = (n + 15) / 16 * 16, pitch = d + 8;
  const std::int32_t G = q.num_q_heads / cache.num_kv_heads, QR = s.window * G, entry0 = q.window - s.window;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4;
  auto* ks = reinterpret_cast<std::uint16_t*>(smem4);
  float* colsum = reinterpret_cast<float*>(ks + std::size_t(rows) * pitch) + std::size_t(warp) * rows;

  copy_rows_async(ks, rows, n, d, padded_rows{pitch}, [&](std::int32_t r) {
    return cache.k_row(rc.layer, it.seq, r, rc.head);
  });
  cp_async_commit();
  for (std::int32_t t = lane; t < rows; t += 32) colsum[t] = 0.0f;
  cp_async_wait<0>();
  __syncthreads();

  constexpr int max_ksteps = HeadDim > 0 ? HeadDim / 16 : 16;  // runtime head dims up to 256
  // 16-row tiles of queries a warp takes at once: each B fragment read from shared
  // memory then feeds MT MMAs, and each column's butterfly sums 16 MT rows. Two for
  // the constant head dims (their A fragments and accumulators fit the registers).
  constexpr int MT = HeadDim > 0 ? 2 : 1;
  const std::int32_t ksteps = d / 16;
  const float log2e_scale = 1.4426950408889634f / sqrtf(static_cast<float>(d));
  const float ninf = -__builtin_huge_valf();
  const std::uint16_t* b_lane = ks + std::size_t(lane % 8 + (lane / 16) * 8) * pitch + ((lane / 8) % 2) * 8;

  // acc[mt] = Q K^T for the warp's row tiles (fragments af) and key tile [t0, t0 + 64).
  const auto tile = [&](float (&acc)[MT][8][4], const std::uint32_t (&af)[MT][max_ksteps][4], std::int32_t t0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < max_ksteps; ++k) {
      if (HeadDim == 0 && k >= ksteps) break;
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (t0 + np * 16 >= rows) break;
        std::uint32_t bf[4];
        ldmatrix_x4(bf, b_lane + std::size_t(t0 + np * 16) * pitch + k * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<Elem>(acc[mt][np * 2], af[mt][k], bf[0], bf[1]);
          mma_16816<Elem>(acc[mt][np * 2 + 1], af[mt][k], bf[2], bf[3]);
        }
      }
    }
  };

  for (std::int32_t r0 = warp * 16 * MT; r0 < QR; r0 += bidirectional_warps * 16 * MT) {
    // A fragments of rows r0 + 16 mt + lane / 4 (h 0) and 8 rows further (h 1): words at
    // elements k * 16 + 2 quad (+ 8), as ldmatrix would give them.
    std::uint32_t af[MT][max_ksteps][4];
    bool real_row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const std::int32_t ra = r0 + mt * 16 + lane / 4, rb = ra + 8;
      real_row[mt][0] = ra < QR;
      real_row[mt][1] = rb < QR;
      const auto* qa = reinterpret_cast<const std::uint32_t*>(
          window_query(q, rc.layer, it.query_slot, entry0, rc.head, G, real_row[mt][0] ? ra : 0));
      const auto* qb = reinterpret_cast<const std::uint32_t*>(
          window_query(q, rc.layer, it.query_slot, entry0, rc.head, G, real_row[mt][1] ? rb : 0));
#pragma unroll
      for (int k = 0; k < max_ksteps; ++k) {
        if (HeadDim == 0 && k >= ksteps) break;
        af[mt][k][0] = real_row[mt][0] ? qa[k * 8 + quad] : 0u;
        af[mt][k][1] = real_row[mt][1] ? qb[k * 8 + quad] : 0u;
        af[mt][k][2] = real_row[mt][0] ? qa[k * 8 + 4 + quad] : 0u;
        af[mt][k][3] = real_row[mt][1] ? qb[k * 8 + 4 + quad] : 0u;
      }
    }
    // Pass 1: each row's max and sum, in log2 units (the lane's share of the sum; the
    // max is the quad's).
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = ninf, l[mt][0] = l[mt][1] = 0.0f;
    for (std::int32_t t0 = 0; t0 < n; t0 += bidirectional_key_tile) {
      float acc[MT][8][4];
      tile(acc, af, t0);
      const bool edge = t0 + bidirectional_key_tile > n;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = ninf;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& z = acc[mt][nt][h * 2 + e];
              z = !edge || t0 + nt * 8 + quad * 2 + e < n ? z * log2e_scale : ninf;
              mx = fmaxf(mx, z);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][h], mx);  // finite: every tile has a real column
          float sum = l[mt][h] * exp2_ftz(m[mt][h] - m_new);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            sum += exp2_ftz(acc[mt][nt][h * 2] - m_new) + exp2_ftz(acc[mt][nt][h * 2 + 1] - m_new);
          m[mt][h] = m_new;
          l[mt][h] = sum;
        }
    }
    float inv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = l[mt][h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[mt][h] = real_row[mt][h] ? 1.0f / sum : 0.0f;  // padding rows add nothing
      }
    // Pass 2: probabilities, summed over the warp's 16 MT rows per column.
    for (std::int32_t t0 = 0; t0 < n; t0 += bidirectional_key_tile) {
      float acc[MT][8][4];
      tile(acc, af, t0);
      const bool edge = t0 + bidirectional_key_tile > n;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool real = !edge || t0 + nt * 8 + quad * 2 + e < n;
          float v = 0.0f;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            v += exp2_ftz(fmaf(acc[mt][nt][e], log2e_scale, -m[mt][0])) * inv[mt][0] +
                 exp2_ftz(fmaf(acc[mt][nt][2 + e], log2e_scale, -m[mt][1])) * inv[mt][1];
          v = real ? v : 0.0f;
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (lane < 4 && real) colsum[t0 + nt * 8 + quad * 2 + e] += v;
        }
    }
  }
  __syncthreads();
  const auto* all = reinterpret_cast<const float*>(ks + std::size_t(rows) * pitch);
  const float per = (s.group == group_reduce::mean ? 1.0f / static_cast<float>(G) : 1.0f) *
                    (s.reduce == window_reduce::mean ? 1.0f / static_cast<float>(s.window) : 1.0f);
  for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
    float total = 0.0f;
    for (std::int32_t v = 0; v < bidirectional_warps; ++v) total += all[std::size_t(v) * rows + t];
    scores[blockIdx.x * std::int64_t{rs.max_tokens} + t] = total * per;
  }
  publish_scores(ready_out, blockIdx.x);
}

}  // namespace cuda
KVP_NAMESPACE_END
