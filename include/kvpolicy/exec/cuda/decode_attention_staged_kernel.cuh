// Decode attention's split step with its K and V staged through shared memory
// (cuda_decode_attention::staged): the same blocks, the same math and the same
// workspace as decode_attention_split_kernel, but each lane copies its tokens' 16-byte
// chunks with cp.async `decode_attention_tuning::stages - 1` tiles ahead of the tile it
// computes, so its loads stay in flight while it computes instead of being issued and
// awaited within one tile. Each lane reads back only what it copied, so the stages need
// no block barrier. With a live view the span's bytes are read into shared memory
// first and dropped tokens' K and V are not read at all.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/decode_attention_kernel.cuh"
#include "kvpolicy/exec/cuda/decode_attention_sources.cuh"
#include "kvpolicy/exec/cuda/decode_attention_tuning.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Dynamic shared memory of the staged kernel: the stages, then the span's table slice,
// then (live views) its live bytes.
struct decode_staged_layout {
  static constexpr std::size_t stage_bytes =
      std::size_t{decode_attention_tuning::tokens_per_load} * 2 * decode_attention_tuning::threads * 16;
  static constexpr std::size_t stages_bytes = stage_bytes * decode_attention_tuning::stages;
  KVP_HOST_DEVICE static std::size_t table_entries(std::int32_t split_tokens, std::int32_t block_size) {
    return static_cast<std::size_t>(split_tokens / block_size + 4);
  }
  static std::size_t bytes(std::int32_t split_tokens, std::int32_t block_size, bool live) {
    return stages_bytes + table_entries(split_tokens, block_size) * 4 +
           (live ? static_cast<std::size_t>(split_tokens) : 0);
  }
};

template <class Source, int D, int GC, class E>
__global__ void __launch_bounds__(decode_attention_tuning::threads, decode_attention_tuning::staged_blocks_per_sm)
    decode_attention_staged_kernel(Source src, decode_space s) {
  using tuning = decode_attention_tuning;
  constexpr int T_ = tuning::threads, LPT = D / 8, TPW = 32 / LPT, WARPS = T_ / 32, GROUPS = WARPS * TPW;
  constexpr int U = tuning::tokens_per_load, TILE = GROUPS * U, STAGES = tuning::stages;
  extern __shared__ __align__(16) std::byte staged_smem[];
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
  auto* stages = reinterpret_cast<uint4*>(staged_smem);
  auto* table_slice = reinterpret_cast<std::int32_t*>(staged_smem + decode_staged_layout::stages_bytes);
  auto* live_slice =
      reinterpret_cast<std::uint8_t*>(table_slice + decode_staged_layout::table_entries(s.split_tokens, b));
  const std::int32_t c0 = min(t1, max(t0, rs.count));
  const std::int32_t first1 = t0 / b, n1 = c0 > t0 ? (c0 - 1) / b - first1 + 1 : 0;
  const std::int32_t first2 = (c0 + rs.gap) / b, n2 = t1 > c0 ? (t1 - 1 + rs.gap) / b - first2 + 1 : 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n1 + n2; i += T_)
    table_slice[i] = src.block(l, seq, h, i < n1 ? first1 + i : first2 + i - n1);
  // Token j's physical block and slot, through the slice.
  auto where = [&](std::int32_t j, std::int32_t& blk, std::int32_t& slot) {
    const bool in_tail = j >= rs.count;
    const std::int32_t t = in_tail ? j + rs.gap : j;
    blk = table_slice[in_tail ? t / b - first2 + n1 : t / b - first1];
    slot = t % b;
  };
  if constexpr (Source::live) {
    __syncthreads();  // the slice
    for (std::int32_t j = t0 + static_cast<std::int32_t>(threadIdx.x); j < t1; j += T_) {
      std::int32_t blk, slot;
      where(j, blk, slot);
      live_slice[j - t0] = src.alive(l, blk, slot, h) ? 1 : 0;
    }
  }

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
  __syncthreads();  // the slice and the live bytes

  // Whether the lane's token u of the tile at `base` is attended.
  auto attended = [&](std::int32_t j) {
    if (j >= t1) return false;
    if constexpr (Source::live) return live_slice[j - t0] != 0;
    return true;
  };
  // Chunk (u, kv) of the lane in stage k: consecutive lanes, consecutive 16 bytes.
  auto chunk = [&](int k, int u, int kv) { return stages + ((k * U + u) * 2 + kv) * T_ + threadIdx.x; };
  auto issue = [&](std::int32_t tile) {
    const std::int32_t base = t0 + tile * TILE;
    const int k = tile % STAGES;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::int32_t j = base + grp * U + u;
      if (attended(j)) {
        std::int32_t blk, slot;
        where(j, blk, slot);
        cp_async_16(chunk(k, u, 0), reinterpret_cast<const uint4*>(rows.key(blk, slot)) + li);
        cp_async_16(chunk(k, u, 1), reinterpret_cast<const uint4*>(rows.value(blk, slot)) + li);
      }
    }
  };
  const std::int32_t tiles = (t1 - t0 + TILE - 1) / TILE;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    if (k < tiles) issue(k);
    cp_async_commit();
  }
  for (std::int32_t tile = 0; tile < tiles; ++tile) {
    // The stage this issue fills was read by this lane in the previous tile.
    if (tile + STAGES - 1 < tiles) issue(tile + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // this lane's copies of `tile`
    const std::int32_t base = t0 + tile * TILE;
    const int k = tile % STAGES;
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ok[u] = attended(base + grp * U + u);
      kr[u] = ok[u] ? *chunk(k, u, 0) : make_uint4(0, 0, 0, 0);
      vr[u] = ok[u] ? *chunk(k, u, 1) : make_uint4(0, 0, 0, 0);
    }
    float z[U][GC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<E>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = fmaf(q[g][i], kf[i], acc);
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
      for (int e = li; e < gn * U; e += LPT) {
        const int u = e % U, g = e / U;
        float v = 0.0f;
#pragma unroll
        for (int uu = 0; uu < U; ++uu)
#pragma unroll
          for (int gg = 0; gg < GC; ++gg)
            if (uu == u && gg == g) v = z[uu][gg];
        const std::int32_t j = base + grp * U + u;
        if (j < t1) logits[std::int64_t{g} * s.max_tokens + j] = v;
      }
    }
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float mx = z[0][g];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = fmaxf(mx, z[u][g]);
      const float mn = fmaxf(m[g], mx);
      if (mn == -__builtin_huge_valf()) continue;
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
  cp_async_wait<0>();

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
  for (int e = static_cast<int>(threadIdx.x); e < gn * (D / 4); e += T_) {
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

}  // namespace cuda
KVP_NAMESPACE_END
