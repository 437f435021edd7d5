// KV-Compress's metric on the GPU (scorer::squared_attention_metric is the law): after
// a prefill, each head's slots get the last w queries' squared probabilities, summed
// over the queries, max-pooled per query head and summed over the group; at a decode
// step, the newest query's squared probabilities summed over the group are added.
// One block per (item, layer, KV head); the group's query heads one after the other,
// so the sum over them runs in the host's order. fp32 FMA: the metric is a small part
// of an engine's step, and the tests compare it to the host within rounding.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/load.cuh"
#include "kvpolicy/scorer/squared_attention_metric.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What the metric kernels read per item: the sequence and its slot of the query view.
struct per_head_metric_space {
  const std::int32_t* seqs = nullptr;   // device [items]
  const std::int32_t* slots = nullptr;  // device [items]
  std::int32_t num_items = 0, num_layers = 0, num_heads = 0;
};

// Queries a block scores at once against each key: their logits live in registers.
inline constexpr int metric_query_chunk = 8;

// Online softmax statistics of one query: running max and sum of exp(z - max).
struct softmax_stats {
  float m, s;
  __device__ void add(float z) {
    if (z > m) {
      s = s * exp2_ftz((m - z) * 1.4426950408889634f) + 1.0f;
      m = z;
    } else {
      s += exp2_ftz((z - m) * 1.4426950408889634f);
    }
  }
  __device__ static softmax_stats merge(softmax_stats a, softmax_stats b) {
    if (b.m == -__builtin_huge_valf()) return a;
    if (a.m == -__builtin_huge_valf()) return b;
    const float m = a.m > b.m ? a.m : b.m;
    return {m, a.s * exp2_ftz((a.m - m) * 1.4426950408889634f) + b.s * exp2_ftz((b.m - m) * 1.4426950408889634f)};
  }
};

// The block's statistics of queries [j0, j0 + chunk) over keys t < visible(j): each
// thread its keys, then warps, then the block (result in stats[j]).
template <class Logit, class Visible>
__device__ void block_softmax_stats(Logit logit, Visible visible, std::int32_t T, std::int32_t j0, std::int32_t chunk,
                                    softmax_stats* stats, softmax_stats (*scratch)[metric_query_chunk]) {
  softmax_stats mine[metric_query_chunk];
#pragma unroll
  for (int j = 0; j < metric_query_chunk; ++j) mine[j] = {-__builtin_huge_valf(), 0.0f};
  for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) {
    float z[metric_query_chunk];
    logit(t, j0, chunk, z);
#pragma unroll
    for (int j = 0; j < metric_query_chunk; ++j)
      if (j < chunk && t < visible(j0 + j)) mine[j].add(z[j]);
  }
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int j = 0; j < metric_query_chunk; ++j) {
    softmax_stats v = mine[j];
    for (int o = 16; o > 0; o >>= 1)
      v = softmax_stats::merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
    if (lane == 0) scratch[warp][j] = v;
  }
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(chunk)) {
    softmax_stats v{-__builtin_huge_valf(), 0.0f};
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) v = softmax_stats::merge(v, scratch[w][threadIdx.x]);
    stats[j0 + static_cast<std::int32_t>(threadIdx.x)] = v;
  }
  __syncthreads();
}

// The logits of key t against queries [j0, j0 + chunk) held in shared memory as fp32
// ([n][d]), scaled by 1 / sqrt(d).
struct key_logits {
  const per_head_kv_view* c;
  const float* q;
  std::int32_t layer, seq, head, d;
  float scale;
  __device__ void operator()(std::int32_t t, std::int32_t j0, std::int32_t chunk, float (&z)[metric_query_chunk]) const {
#pragma unroll
    for (int j = 0; j < metric_query_chunk; ++j) z[j] = 0.0f;
    const std::byte* k = c->k_row(layer, seq, head, t);
    for (std::int32_t i = 0; i < d; i += 4) {
      const float4 kv = load4(k, c->type, i);
#pragma unroll
      for (int j = 0; j < metric_query_chunk; ++j)
        if (j < chunk) z[j] = dot4(kv, *reinterpret_cast<const float4*>(q + (j0 + j) * d + i), z[j]);
    }
#pragma unroll
    for (int j = 0; j < metric_query_chunk; ++j) z[j] *= scale;
  }
};

// After a prefill: `head` is workspace, [rows][capacity] floats (one query head's row
// before pooling). Dynamic shared memory: n x d floats of queries, n statistics.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_prefill_metric_kernel(scorer::squared_attention_metric m,
                                                                              per_head_kv_view c, query_window_view q,
                                                                              per_head_metric_space s, float* head,
                                                                              std::int64_t capacity,
                                                                              const std::int32_t* status) {
  extern __shared__ float smem[];
  __shared__ softmax_stats scratch[row_threads / 32][metric_query_chunk];
  if (*static_cast<const volatile std::int32_t*>(status) != 0) return;  // a malformed item: write nothing
  const auto row = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t kv = row % s.num_heads, layer = (row / s.num_heads) % s.num_layers;
  const std::int32_t item = row / (s.num_heads * s.num_layers);
  const std::int32_t seq = s.seqs[item], slot = s.slots[item];
  const std::int32_t T = c.length(layer, seq, kv), d = c.head_dim, b = c.block_size;
  if (T <= 0) return;
  const std::int32_t n = T < m.window ? T : m.window, G = q.num_q_heads / c.num_kv_heads;
  float* qs = smem;  // [n][d]
  auto* stats = reinterpret_cast<softmax_stats*>(smem + n * d);
  float* h = head + row * capacity;
  const std::int32_t* table = c.table.row(layer, seq, kv);
  const key_logits logits{&c, qs, layer, seq, kv, d, rsqrtf(static_cast<float>(d))};
  // Query j sits at position T - n + j and sees keys t <= T - n + j.
  auto visible = [&](std::int32_t j) { return T - n + j + 1; };
  for (std::int32_t g = 0; g < G; ++g) {
    load_rows(qs, n, d, d, q.type, [&](std::int32_t j) { return q.row(layer, slot, q.window - n + j, kv * G + g); });
    __syncthreads();
    for (std::int32_t j0 = 0; j0 < n; j0 += metric_query_chunk)
      block_softmax_stats(logits, visible, T, j0, n - j0 < metric_query_chunk ? n - j0 : metric_query_chunk, stats,
                          scratch);
    for (std::int32_t t = threadIdx.x; t < T; t += row_threads) {
      float sum = 0.0f;
      for (std::int32_t j0 = 0; j0 < n; j0 += metric_query_chunk) {
        const std::int32_t chunk = n - j0 < metric_query_chunk ? n - j0 : metric_query_chunk;
        float z[metric_query_chunk];
        logits(t, j0, chunk, z);
#pragma unroll
        for (int j = 0; j < metric_query_chunk; ++j) {
          const std::int32_t pj = T - n + j0 + j;
          if (j < chunk && t <= pj && pj - t >= m.excluded_distance) {
            const softmax_stats st = stats[j0 + j];
            const float p = exp2_ftz((z[j] - st.m) * 1.4426950408889634f) / st.s;
            sum += p * p;
          }
        }
      }
      h[t] = sum;
    }
    __syncthreads();
    const std::int32_t half = m.pool_kernel / 2;
    for (std::int32_t t = threadIdx.x; t < T; t += row_threads) {
      float v = h[t];
      for (std::int32_t u = t - half < 0 ? 0 : t - half; u <= (t + half < T - 1 ? t + half : T - 1); ++u)
        v = v > h[u] ? v : h[u];
      float& out = c.metric.at(layer, table[t / b], t % b);
      out = g == 0 ? v : out + v;
    }
    __syncthreads();
  }
}

// One decode step: the newest query of the slot's window (its position: the head's
// last token's, or `logical_length - 1` per item where positions are given) against
// every key of the head; each squared probability summed over the group is added to
// the key's metric.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_decode_metric_kernel(scorer::squared_attention_metric m,
                                                                             per_head_kv_view c, query_window_view q,
                                                                             per_head_metric_space s,
                                                                             const std::int32_t* query_positions,
                                                                             const std::int32_t* status) {
  extern __shared__ float smem[];
  __shared__ softmax_stats scratch[row_threads / 32][metric_query_chunk];
  if (*static_cast<const volatile std::int32_t*>(status) != 0) return;  // a malformed item: write nothing
  const auto row = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t kv = row % s.num_heads, layer = (row / s.num_heads) % s.num_layers;
  const std::int32_t item = row / (s.num_heads * s.num_layers);
  const std::int32_t seq = s.seqs[item], slot = s.slots[item];
  const std::int32_t T = c.length(layer, seq, kv), d = c.head_dim, b = c.block_size;
  if (T <= 0) return;
  const std::int32_t G = q.num_q_heads / c.num_kv_heads;
  const std::int32_t pq = query_positions ? query_positions[item] : T - 1;
  float* qs = smem;  // [1][d]
  auto* stats = reinterpret_cast<softmax_stats*>(smem + d);
  const std::int32_t* table = c.table.row(layer, seq, kv);
  const key_logits logits{&c, qs, layer, seq, kv, d, rsqrtf(static_cast<float>(d))};
  auto every = [&](std::int32_t) { return T; };
  for (std::int32_t g = 0; g < G; ++g) {
    load_rows(qs, 1, d, d, q.type, [&](std::int32_t) { return q.row(layer, slot, q.window - 1, kv * G + g); });
    __syncthreads();
    block_softmax_stats(logits, every, T, 0, 1, stats, scratch);
    const softmax_stats st = stats[0];
    for (std::int32_t t = threadIdx.x; t < T; t += row_threads) {
      float z[metric_query_chunk];
      logits(t, 0, 1, z);
      const std::int32_t blk = table[t / b], sl = t % b;
      const std::int32_t pt = c.positions.empty() ? t : c.positions.at(layer, blk, sl);
      if (pq - pt >= m.excluded_distance) {
        const float p = exp2_ftz((z[0] - st.m) * 1.4426950408889634f) / st.s;
        c.metric.at(layer, blk, sl) += p * p;
      }
    }
    __syncthreads();
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
