// Decode attention's kernels (flash-decoding): the items checked on the device, then
// each (item, KV head) row split over several blocks, each attending one span of the
// row's tokens for a chunk of the group's query heads (online softmax, partial output
// in the workspace), then one combine per row that joins the spans into the output
// and, optionally, adds each token's probabilities to its metric.
// host::decode_attention (attention/decode_attention_reference.hpp) is the law.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/decode_attention_sources.cuh"
#include "kvpolicy/exec/cuda/decode_attention_tuning.cuh"
#include "kvpolicy/exec/device_status.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What the three kernels share: the launch's shape and the workspace.
struct decode_space {
  const void* q = nullptr;
  std::int64_t q_item_stride = 0, q_head_stride = 0;  // bytes
  void* out = nullptr;
  std::int64_t out_item_stride = 0, out_head_stride = 0;  // bytes
  const std::int32_t* seqs = nullptr;
  const std::int32_t* query_positions = nullptr;
  std::int32_t num_items = 0, layer = 0, num_kv_heads = 0, group = 0, num_blocks = 0;
  std::int32_t split_tokens = 0, splits = 0, group_chunks = 0, max_tokens = 0, metric_tokens = 0;
  std::int64_t capacity = 0;  // tokens a per-head row's table holds (per-head caches)
  float scale_log2 = 0.0f;    // the softmax scale times log2(e): logits in base 2
  float2* stats = nullptr;    // [rows][splits][G]: (max, sum of 2^(z - max)) of each span
  float* partial = nullptr;   // [rows][splits][G][d]: each span's output, unnormalised
  float* logits = nullptr;    // [rows][G][max_tokens] (epilogue only), -inf where dropped
  std::int32_t* status = nullptr;
  decode_epilogue epilogue{};

  __device__ bool failed() const { return *static_cast<volatile const std::int32_t*>(status) != 0; }
  __device__ std::int32_t seq_of(std::int32_t item) const { return seqs ? seqs[item] : item; }
};

// ---------------------------------------------------------------------------------
// Validation: one block per item, as host::decode_attention checks on the host.
// ---------------------------------------------------------------------------------

template <int = 0>
__global__ void decode_validate_per_head_kernel(per_head_decode_source src, decode_space s) {
  const std::int32_t item = static_cast<std::int32_t>(blockIdx.x), seq = s.seq_of(item), l = s.layer;
  if (seq < 0 || seq >= src.c.num_seqs) {
    if (threadIdx.x == 0) report(s.status, status_code::seq_out_of_range, item, seq);
    return;
  }
  const std::int32_t b = src.c.block_size;
  for (std::int32_t h = 0; h < s.num_kv_heads; ++h) {
    const std::int32_t T = src.length(l, seq, h);
    if (T < 0 || T > s.capacity) {
      if (threadIdx.x == 0)
        report(s.status, status_code::head_length_out_of_range, item, l, seq, h, T,
               static_cast<std::int32_t>(s.capacity));
      return;
    }
    if (T > s.max_tokens) {
      if (threadIdx.x == 0) report(s.status, status_code::length_over_max_tokens, item, seq, T, s.max_tokens);
      return;
    }
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < (T + b - 1) / b; i += blockDim.x) {
      const std::int32_t id = src.block(l, seq, h, i);
      if (id < 0 || id >= s.num_blocks)
        report(s.status, status_code::head_block_out_of_range, item, l, seq, h, i, id, s.num_blocks);
    }
  }
}

template <bool Live>
__global__ void decode_validate_paged_kernel(paged_decode_source<Live> src, decode_space s) {
  const std::int32_t item = static_cast<std::int32_t>(blockIdx.x), seq = s.seq_of(item), l = s.layer;
  if (seq < 0 || seq >= src.c.num_seqs) {
    if (threadIdx.x == 0) report(s.status, status_code::seq_out_of_range, item, seq);
    return;
  }
  const std::int32_t b = src.c.block_size, L = src.c.lengths[seq];
  const std::int64_t capacity = src.c.table.capacity(seq) * b;
  if (L < 0 || L > capacity) {
    if (threadIdx.x == 0)
      report(s.status, status_code::length_out_of_range, item, seq, L, static_cast<std::int32_t>(capacity));
    return;
  }
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < (L + b - 1) / b; i += blockDim.x) {
    const std::int32_t id = src.c.table.block(seq, i);
    if (id < 0 || id >= s.num_blocks) report(s.status, status_code::block_out_of_range, item, seq, i, id);
  }
  const std::int32_t tail = src.tail(seq);
  if (tail < 0 || tail > L) {
    if (threadIdx.x == 0) report(s.status, status_code::tail_out_of_range, item, seq, tail, L);
    return;
  }
  for (std::int32_t h = static_cast<std::int32_t>(threadIdx.x); h < s.num_kv_heads; h += blockDim.x) {
    const std::int32_t n = src.count(l, seq, h), T = n + (L - tail);
    if (n < 0 || n > tail)
      report(s.status, status_code::head_count_out_of_range, item, l, seq, h, n, tail);
    else if (T > s.max_tokens)
      report(s.status, status_code::length_over_max_tokens, item, seq, T, s.max_tokens);
  }
}

// ---------------------------------------------------------------------------------
// Element conversions: 16 bytes of bf16 / f16 to 8 floats and back.
// ---------------------------------------------------------------------------------

template <class E>
__device__ inline void unpack8(const uint4& r, float (&f)[8]) {
  const std::uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<E, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

template <class E>
__device__ inline std::uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&x);
  } else {
    const __half2 x = __floats2half2_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&x);
  }
}

// 2^(a - m) where a may be -inf (a span or token with nothing attended): 0, never NaN.
__device__ inline float rescale(float a, float m) { return a == -__builtin_huge_valf() ? 0.0f : exp2_ftz(a - m); }

// ---------------------------------------------------------------------------------
// Split: one block per (row, span of split_tokens tokens, chunk of GC query heads);
// the chunks of one span are adjacent in the grid, so they read its K and V from L2.
// A group of D / 8 lanes holds one token's row, 16 bytes a lane; each group takes
// `tokens_per_load` tokens at a time, all their K and V loads issued before any use.
// ---------------------------------------------------------------------------------

template <class Source, int D, int GC, class E>
__global__ void __launch_bounds__(decode_attention_tuning::threads, decode_attention_tuning::blocks_per_sm)
    decode_attention_split_kernel(Source src, decode_space s) {
  using tuning = decode_attention_tuning;
  constexpr int LPT = D / 8, TPW = 32 / LPT, WARPS = tuning::threads / 32, GROUPS = WARPS * TPW;
  constexpr int U = tuning::tokens_per_load, TILE = GROUPS * U;
  extern __shared__ std::int32_t table_slice[];
  __shared__ float red_m[WARPS][GC], red_s[WARPS][GC];
  __shared__ float4 red_o[WARPS][GC][D / 4];
  if (s.failed()) return;

  const std::int32_t flat = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t zc = flat % s.group_chunks, span = (flat / s.group_chunks) % s.splits;
  const std::int32_t row = flat / (s.group_chunks * s.splits);
  const std::int32_t item = row / s.num_kv_heads, h = row % s.num_kv_heads, l = s.layer;
  const std::int32_t seq = s.seq_of(item);
  const decode_row_span rs = src.span(l, seq, h);
  const std::int32_t T = rs.length, t0 = span * s.split_tokens;
  if (t0 >= T) return;
  const std::int32_t t1 = min(T, t0 + s.split_tokens), b = src.block_size();
  // The blocks of the span's tokens below the count, then of those past it (the tail).
  const std::int32_t c0 = min(t1, max(t0, rs.count));
  const std::int32_t first1 = t0 / b, n1 = c0 > t0 ? (c0 - 1) / b - first1 + 1 : 0;
  const std::int32_t first2 = (c0 + rs.gap) / b, n2 = t1 > c0 ? (t1 - 1 + rs.gap) / b - first2 + 1 : 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n1 + n2; i += tuning::threads)
    table_slice[i] = src.block(l, seq, h, i < n1 ? first1 + i : first2 + i - n1);

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int sub = lane / LPT, li = lane % LPT, grp = warp * TPW + sub;
  const std::int32_t g0 = zc * GC, G = s.group;
  const int gn = min(GC, G - g0);
  float q[GC][8];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    if (g < gn) {
      const auto* qrow =
          static_cast<const std::byte*>(s.q) + item * s.q_item_stride + (h * G + g0 + g) * s.q_head_stride;
      unpack8<E>(*reinterpret_cast<const uint4*>(qrow + li * 16), q[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] *= s.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] = 0.0f;
    }
  }
  const decode_head_rows rows = src.rows(l, h);
  float m[GC], sum[GC], o[GC][8];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    m[g] = -__builtin_huge_valf();
    sum[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[g][i] = 0.0f;
  }
  float* logits = s.logits ? s.logits + (std::int64_t{row} * G + g0) * s.max_tokens : nullptr;
  __syncthreads();

  for (std::int32_t base = t0; base < t1; base += TILE) {
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::int32_t j = base + grp * U + u;
      ok[u] = j < t1;
      if (ok[u]) {
        const bool in_tail = j >= rs.count;
        const std::int32_t t = in_tail ? j + rs.gap : j;
        const std::int32_t blk = table_slice[in_tail ? t / b - first2 + n1 : t / b - first1], slot = t % b;
        kr[u] = __ldg(reinterpret_cast<const uint4*>(rows.key(blk, slot)) + li);
        vr[u] = __ldg(reinterpret_cast<const uint4*>(rows.value(blk, slot)) + li);
        if constexpr (Source::live) ok[u] = src.alive(l, blk, slot, h);
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    float z[U][GC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[8];
      unpack8<E>(kr[u], k);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = fmaf(q[g][i], k[i], acc);
        z[u][g] = acc;
      }
    }
#pragma unroll
    for (int off = LPT / 2; off >= 1; off /= 2)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int g = 0; g < GC; ++g) z[u][g] += __shfl_xor_sync(0xffffffffu, z[u][g], off);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int g = 0; g < GC; ++g)
        if (!ok[u]) z[u][g] = -__builtin_huge_valf();
    if (logits) {
      // The group's lanes share its gn x U logits: lane li writes (u, g) = (e % U, e / U)
      // for e = li, li + LPT, ... (after the shuffles every lane holds them all).
      for (int e = li; e < gn * U; e += LPT) {
        const int u = e % U, g = e / U;
        float v = 0.0f;
#pragma unroll
        for (int uu = 0; uu < U; ++uu)
#pragma unroll
          for (int gg = 0; gg < GC; ++gg)
            if (uu == u && gg == g) v = z[uu][gg];
        const std::int32_t t = base + grp * U + u;
        if (t < t1) logits[std::int64_t{g} * s.max_tokens + t] = v;
      }
    }
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float mx = z[0][g];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = fmaxf(mx, z[u][g]);
      const float mn = fmaxf(m[g], mx);
      if (mn == -__builtin_huge_valf()) continue;  // nothing attended yet
      const float r = rescale(m[g], mn);
      m[g] = mn;
      sum[g] *= r;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[g][i] *= r;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v[8];
      unpack8<E>(vr[u], v);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        const float p = rescale(z[u][g], m[g]);
        sum[g] += p;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[g][i] = fmaf(p, v[i], o[g][i]);
      }
    }
  }

  // Join the warp's lane groups (same li, different sub), then the warps.
#pragma unroll
  for (int off = LPT; off < 32; off *= 2)
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off), so = __shfl_xor_sync(0xffffffffu, sum[g], off);
      const float mn = fmaxf(m[g], mo), a = rescale(m[g], mn), c = rescale(mo, mn);
      sum[g] = sum[g] * a + so * c;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[g][i] = o[g][i] * a + __shfl_xor_sync(0xffffffffu, o[g][i], off) * c;
      m[g] = mn;
    }
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      if (li == 0) red_m[warp][g] = m[g], red_s[warp][g] = sum[g];
      red_o[warp][g][2 * li] = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
      red_o[warp][g][2 * li + 1] = make_float4(o[g][4], o[g][5], o[g][6], o[g][7]);
    }
  }
  __syncthreads();
  const std::int64_t at = (std::int64_t{row} * s.splits + span) * G + g0;
  for (int e = static_cast<int>(threadIdx.x); e < gn * (D / 4); e += tuning::threads) {
    const int g = e / (D / 4), i = e % (D / 4);
    float mn = red_m[0][g];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) mn = fmaxf(mn, red_m[w][g]);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float c = rescale(red_m[w][g], mn);
      const float4 x = red_o[w][g][i];
      acc.x = fmaf(x.x, c, acc.x);
      acc.y = fmaf(x.y, c, acc.y);
      acc.z = fmaf(x.z, c, acc.z);
      acc.w = fmaf(x.w, c, acc.w);
      total = fmaf(red_s[w][g], c, total);
    }
    reinterpret_cast<float4*>(s.partial + (at + g) * D)[i] = acc;
    if (i == 0) s.stats[at + g] = make_float2(mn, total);
  }
}

// ---------------------------------------------------------------------------------
// Combine: one block per (row, span of metric_tokens tokens). Every block joins the
// row's span statistics; the first writes the output (zeros where the head attended
// nothing); with the epilogue each adds its tokens' probabilities, summed over the
// group, to their metric (atomically: sequences sharing a block add both).
// ---------------------------------------------------------------------------------

template <class Source, int D, class E>
__global__ void __launch_bounds__(decode_attention_tuning::combine_threads)
    decode_attention_combine_kernel(Source src, decode_space s) {
  extern __shared__ float2 joined[];  // [G]: (max, sum) of the whole row
  if (s.failed()) return;
  const std::int32_t row = static_cast<std::int32_t>(blockIdx.x), part = static_cast<std::int32_t>(blockIdx.y);
  const std::int32_t item = row / s.num_kv_heads, h = row % s.num_kv_heads, l = s.layer, G = s.group;
  const std::int32_t seq = s.seq_of(item);
  const decode_row_span rs = src.span(l, seq, h);
  const std::int32_t T = rs.length, spans = (T + s.split_tokens - 1) / s.split_tokens;
  if (part > 0 && part * s.metric_tokens >= T) return;
  const float2* st = s.stats + std::int64_t{row} * s.splits * G;
  for (std::int32_t g = static_cast<std::int32_t>(threadIdx.x); g < G; g += blockDim.x) {
    float mn = -__builtin_huge_valf();
    for (std::int32_t k = 0; k < spans; ++k) mn = fmaxf(mn, st[k * G + g].x);
    float total = 0.0f;
    for (std::int32_t k = 0; k < spans; ++k) total = fmaf(st[k * G + g].y, rescale(st[k * G + g].x, mn), total);
    joined[g] = make_float2(mn, total);
  }
  __syncthreads();
  if (part == 0) {
    for (std::int32_t e = static_cast<std::int32_t>(threadIdx.x); e < G * (D / 4); e += blockDim.x) {
      const std::int32_t g = e / (D / 4), i = e % (D / 4);
      const float2 j = joined[g];
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (std::int32_t k = 0; k < spans; ++k) {
        const float c = rescale(st[k * G + g].x, j.x);
        const float4 x =
            reinterpret_cast<const float4*>(s.partial + ((std::int64_t{row} * s.splits + k) * G + g) * D)[i];
        acc.x = fmaf(x.x, c, acc.x);
        acc.y = fmaf(x.y, c, acc.y);
        acc.z = fmaf(x.z, c, acc.z);
        acc.w = fmaf(x.w, c, acc.w);
      }
      const float inv = j.y > 0.0f ? 1.0f / j.y : 0.0f;
      auto* out = static_cast<std::byte*>(s.out) + item * s.out_item_stride + (h * G + g) * s.out_head_stride;
      reinterpret_cast<uint2*>(out)[i] =
          make_uint2(pack2<E>(acc.x * inv, acc.y * inv), pack2<E>(acc.z * inv, acc.w * inv));
    }
  }
  if (s.logits == nullptr) return;
  const bool squared = s.epilogue.kind == decode_metric::squared;
  const std::int32_t b = src.block_size(), end = min(T, (part + 1) * s.metric_tokens);
  const std::int32_t pq = s.query_positions ? s.query_positions[item] : rs.token(T - 1);
  const float* z = s.logits + std::int64_t{row} * G * s.max_tokens;
  for (std::int32_t j = part * s.metric_tokens + static_cast<std::int32_t>(threadIdx.x); j < end; j += blockDim.x) {
    float add = 0.0f;
    bool attended = false;
    for (std::int32_t g = 0; g < G; ++g) {
      const float zg = z[std::int64_t{g} * s.max_tokens + j];
      if (zg == -__builtin_huge_valf()) continue;  // dropped (the whole group sees the same tokens)
      attended = true;
      const float p = exp2_ftz(zg - joined[g].x) / joined[g].y;
      add += squared ? p * p : p;
    }
    if (!attended) continue;
    const std::int32_t t = rs.token(j), blk = src.block(l, seq, h, t / b), slot = t % b;
    if (pq - src.position(l, blk, slot, h, t) >= s.epilogue.excluded_distance)
      atomicAdd(src.metric(s.epilogue, l, blk, slot, h), add);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
