// Scorer stage on the GPU: window attention over paged keys (Zipage C.2) and
// per-key scorers. One block per (item, layer, KV head) row.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/row_ref.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/load.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Keys per tile: one per lane.
inline constexpr int score_tile = 32;
// Query heads of a group whose dot products a lane keeps in registers at once.
inline constexpr int group_chunk = 8;

// Shared memory of the attention kernel, in floats: the row's w * G queries and one
// key tile (pitch d + 4 keeps float4 alignment and spreads lanes over banks), the
// softmax statistics per query, and the per-warp partial window sums.
KVP_HOST_DEVICE constexpr std::size_t attention_smem_floats(std::int32_t w, std::int32_t G, std::int32_t d) {
  const std::size_t pitch = std::size_t(d) + 4;
  return std::size_t(w) * G * pitch + score_tile * pitch + 2 * std::size_t(w) * G + (row_threads / 32) * score_tile;
}

// Softmax over all candidates without a logit matrix: pass 0 streams the key tiles
// and keeps an online max and sum per query (or per window position for
// max_logits); pass 1 streams them again and reduces normalised probabilities over
// the group and the window into one score per key.
template <AttentionScorer S>
__global__ void __launch_bounds__(row_threads) attention_score_kernel(S s, paged_kv_view cache, query_window_view q,
                                                                      row_space rs, float* scores,
                                                                      std::int32_t* ready_out) {
  extern __shared__ float4 smem4[];
  const prerequisites_at_exit after_redundancy;  // as in attention_score_mma_kernel
  allow_dependents();
  if (failed(rs)) return;
  const row_coord rc = decode_row(rs, blockIdx.x);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T);
  const std::int32_t d = cache.head_dim, pitch = d + 4, w = s.window;
  const std::int32_t G = q.num_q_heads / cache.num_kv_heads, QW = w * G;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const bool by_logits = s.group == group_reduce::max_logits;
  const float ninf = -__builtin_huge_valf();
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const bool cautious = !cache.live.empty();

  float* qs = reinterpret_cast<float*>(smem4);
  float* ks = qs + std::size_t(QW) * pitch;
  float* stat_m = ks + score_tile * pitch;
  float* stat_l = stat_m + QW;
  float* part = stat_l + QW;

  load_rows(qs, QW, d, pitch, q.type, [&](std::int32_t r) {
    return q.row(rc.layer, it.query_slot, q.window - w + r / G, rc.head * G + r % G);
  });
  for (std::int32_t i = threadIdx.x; i < QW; i += blockDim.x) {
    stat_m[i] = ninf;
    stat_l[i] = 0.0f;
  }

  // Online softmax statistics of one query over this tile's 32 logits (one per lane).
  auto accumulate_stats = [&](std::int32_t qi, float z) {
    const float m_old = stat_m[qi];
    const float m_new = fmaxf(m_old, warp_max(z));
    if (m_new == ninf) return;
    const float e = warp_sum(z == ninf ? 0.0f : expf(z - m_new));
    __syncwarp();
    if (lane == 0) {
      stat_l[qi] = stat_l[qi] * expf(m_old - m_new) + e;
      stat_m[qi] = m_new;
    }
    __syncwarp();
  };

  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      __syncthreads();
      for (std::int32_t i = threadIdx.x; i < QW; i += blockDim.x) stat_l[i] = 1.0f / stat_l[i];
    }
    for (std::int32_t tile = 0; tile < n; tile += score_tile) {
      const std::int32_t count = min(score_tile, n - tile);
      __syncthreads();
      load_rows(ks, count, d, pitch, cache.type,
                [&](std::int32_t r) { return cache.k_row(rc.layer, it.seq, tile + r, rc.head); });
      __syncthreads();
      const std::int32_t t = tile + lane;
      const bool valid = lane < count;
      // Cautious update: keys the head dropped are masked like keys no query sees.
      const bool held = valid && (!cautious || cache.alive(rc.layer, it.seq, t, rc.head));
      const float* krow = ks + std::size_t(valid ? lane : 0) * pitch;
      float window_acc = 0.0f;
      for (std::int32_t j = warp; j < w; j += warps) {
        const std::int32_t pj = T - w + j;
        const bool seen = held && s.visible(pj, t);
        float zmax = ninf, gacc = s.group == group_reduce::max ? ninf : 0.0f;
        for (std::int32_t g0 = 0; g0 < G; g0 += group_chunk) {
          float acc[group_chunk];
#pragma unroll
          for (int gg = 0; gg < group_chunk; ++gg) acc[gg] = 0.0f;
          for (std::int32_t i = 0; i < d; i += 4) {
            const float4 kv = *reinterpret_cast<const float4*>(krow + i);
#pragma unroll
            for (int gg = 0; gg < group_chunk; ++gg)
              if (g0 + gg < G)
                acc[gg] = dot4(*reinterpret_cast<const float4*>(qs + std::size_t(j * G + g0 + gg) * pitch + i), kv,
                               acc[gg]);
          }
#pragma unroll
          for (int gg = 0; gg < group_chunk; ++gg) {
            if (g0 + gg >= G) break;
            const std::int32_t qi = j * G + g0 + gg;
            const float z = seen ? acc[gg] * scale : ninf;
            if (by_logits) {
              zmax = fmaxf(zmax, z);
            } else if (pass == 0) {
              accumulate_stats(qi, z);
            } else {
              const float p = s.transform(z == ninf ? 0.0f : expf(z - stat_m[qi]) * stat_l[qi]);
              gacc = s.group == group_reduce::max ? fmaxf(gacc, p) : gacc + p;
            }
          }
        }
        if (by_logits) {
          if (pass == 0) {
            accumulate_stats(j, zmax);
          } else if (valid && s.contributes(pj, t)) {
            window_acc += s.transform(zmax == ninf ? 0.0f : expf(zmax - stat_m[j]) * stat_l[j]);
          }
        } else if (pass == 1 && valid && s.contributes(pj, t)) {
          window_acc += s.group == group_reduce::mean ? gacc / static_cast<float>(G) : gacc;
        }
      }
      if (pass == 1) {
        part[warp * score_tile + lane] = window_acc;
        __syncthreads();
        if (warp == 0 && valid) {
          float total = 0.0f;
          for (std::int32_t v = 0; v < warps; ++v) total += part[v * score_tile + lane];
          if (s.reduce == window_reduce::mean) total *= 1.0f / static_cast<float>(w);
          scores[blockIdx.x * std::int64_t{rs.max_tokens} + t] = total;
        }
      }
    }
  }
  publish_scores(ready_out, blockIdx.x);
}

// score[t] = s.key_score(k_t, t, T[, (layer, head)]), one thread per token.
template <KeyScorer S>
__global__ void key_score_kernel(S s, paged_kv_view cache, row_space rs, float* scores, std::int32_t* ready_out) {
  const prerequisites_at_exit after_redundancy;  // as in attention_score_mma_kernel
  allow_dependents();
  if (failed(rs)) return;
  const row_coord rc = decode_row(rs, blockIdx.x);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq];
  for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x)
    scores[blockIdx.x * std::int64_t{rs.max_tokens} + t] = key_score_of(
        s, row_ref{cache.k_row(rc.layer, it.seq, t, rc.head), cache.type, cache.head_dim}, t, T, {rc.layer, rc.head});
  publish_scores(ready_out, blockIdx.x);
}

}  // namespace cuda
KVP_NAMESPACE_END
