// Redundancy stage on the GPU (R-KV sec. 3.3): lightning (pairs within a cache block,
// Zipage C.7) and full (all pairs, Zipage's flash redundancy with O(T) extra memory).
// Both write red(t) * (1/n) / tau per candidate; the epilogue applies the softmax.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/load.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Columns u a warp compares at once against its lane's key v.
inline constexpr int pair_chunk = 4;
// Keys per tile of the full scope.
inline constexpr int full_tile = 64;

// inv[r] = 1 / (||k_r|| + eps) for `count` rows of pitch `pitch` in shared memory.
__device__ inline void inverse_norms(const float* keys, float* inv, std::int32_t count, std::int32_t d,
                                     std::int32_t pitch, float eps) {
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (std::int32_t r = warp; r < count; r += warps) {
    float ss = 0.0f;
    for (std::int32_t i = lane; i < d; i += 32) ss = fmaf(keys[std::size_t(r) * pitch + i], keys[std::size_t(r) * pitch + i], ss);
    ss = warp_sum(ss);
    if (lane == 0) inv[r] = 1.0f / (sqrtf(ss) + eps);
  }
}

// For columns u0 .. u0 + pair_chunk of `us` against the `count` keys of `vs` (lane
// v, v + 32, ...): row sums of C(u, .) without the diagonal and the newest v with
// C(u, v) > theta. Positions are u_pos0 + c and v_pos0 + v. `compared(c, v)`: whether
// the pair counts at all (under cautious update, both keys held).
struct column_state {
  float rowsum[pair_chunk];
  std::int32_t newest[pair_chunk];
  float newest_c[pair_chunk];
};

struct every_pair {
  __device__ bool operator()(std::int32_t, std::int32_t) const { return true; }
};
template <class Compared = every_pair>
__device__ inline void compare_columns(column_state& st, const float* us, const float* u_inv, std::int32_t u_count,
                                       std::int32_t u_pos0, const float* vs, const float* v_inv, std::int32_t v_count,
                                       std::int32_t v_pos0, std::int32_t d, std::int32_t pitch, float theta,
                                       Compared compared = {}) {
  const std::int32_t lane = threadIdx.x % 32;
  for (std::int32_t v = lane; v < v_count; v += 32) {
    float acc[pair_chunk];
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) acc[c] = 0.0f;
    const float* vrow = vs + std::size_t(v) * pitch;
    for (std::int32_t i = 0; i < d; i += 4) {
      const float4 kv = *reinterpret_cast<const float4*>(vrow + i);
#pragma unroll
      for (int c = 0; c < pair_chunk; ++c)
        if (c < u_count) acc[c] = dot4(*reinterpret_cast<const float4*>(us + std::size_t(c) * pitch + i), kv, acc[c]);
    }
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) {
      if (c >= u_count || u_pos0 + c == v_pos0 + v || !compared(c, v)) continue;
      const float sim = acc[c] * (u_inv[c] * v_inv[v]);
      st.rowsum[c] += sim;
      if (sim > theta && v_pos0 + v > st.newest[c]) {
        st.newest[c] = v_pos0 + v;
        st.newest_c[c] = sim;
      }
    }
  }
}

// Folds a column's per-lane state over groups of `Lanes` adjacent lanes (the warp,
// or the quad of an MMA fragment row): sum of row sums, and the newest neighbour
// with its similarity. Every lane of the group ends with the result.
template <int Lanes = 32>
__device__ inline void reduce_column(float& rowsum, std::int32_t& newest, float& newest_c) {
  for (int o = Lanes / 2; o > 0; o >>= 1) {
    rowsum += __shfl_xor_sync(0xffffffffu, rowsum, o);
    const std::int32_t n2 = __shfl_xor_sync(0xffffffffu, newest, o);
    const float c2 = __shfl_xor_sync(0xffffffffu, newest_c, o);
    if (n2 > newest) {
      newest = n2;
      newest_c = c2;
    }
  }
}

// Shared memory of the lightning kernel, in floats: the block's keys, their inverse
// norms, and per column its row sum and dropped similarities (64-bit, 8-byte aligned).
KVP_HOST_DEVICE constexpr std::size_t lightning_smem_floats(std::int32_t block, std::int32_t d) {
  return std::size_t(block) * (std::size_t(d) + 4) + 4 * std::size_t(block) + 1;
}

// The similarities C(u, t) that red(t) leaves out (u's newest neighbour is t), summed
// per t in 64-bit fixed point (2^-40) by atomics: every row adds its own at once, and
// the sum does not depend on their order (an ordered walk by one warp behind a
// barrier was slower on keys with near-copies). Any |C| of 2^-16 or more (C
// of a newest neighbour is over theta) is exact in it, and a row's |C| <= 1 stay far
// below the 2^63 bound. `words` in shared memory, or (Global) in global memory, read
// back past L1 once a barrier follows the adds.
template <bool Global = false>
struct dropped_sums {
  unsigned long long* words;  // [rows], zero before the first add
  __device__ void clear(std::int32_t rows) const {
    for (std::int32_t t = threadIdx.x; t < rows; t += blockDim.x) words[t] = 0ull;
  }
  __device__ void add(std::int32_t t, float c) const {
    atomicAdd(&words[t], static_cast<unsigned long long>(__float2ll_rn(c * 0x1p40f)));
  }
  __device__ float of(std::int32_t t) const {
    unsigned long long w;
    if constexpr (Global)
      w = __ldcg(words + t);
    else
      w = words[t];
    return __ll2float_rn(static_cast<long long>(w)) * 0x1p-40f;
  }
};

// One block per (row, cache block of b tokens): all pairs of the block in shared
// memory; n = b. Writes red(t) / b / tau for the block's candidates.
template <class P>
__global__ void __launch_bounds__(row_threads) lightning_kernel(P p, paged_kv_view cache, row_space rs,
                                                                float* red_out) {
  extern __shared__ float4 smem4[];
  allow_dependents();  // the score kernel may start in this kernel's last wave
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const std::int32_t b = cache.block_size, pos0 = static_cast<std::int32_t>(blockIdx.y) * b;
  if (pos0 >= n) return;
  const std::int32_t count = min(b, n - pos0), d = cache.head_dim, pitch = d + 4;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

  float* keys = reinterpret_cast<float*>(smem4);
  float* inv = keys + std::size_t(b) * pitch;
  float* rowsum = inv + b;
  const dropped_sums<> dropped{reinterpret_cast<unsigned long long*>(rowsum + b + (std::size_t(b) * (pitch + 2)) % 2)};
  dropped.clear(count);

  load_rows(keys, count, d, pitch, cache.type,
            [&](std::int32_t r) { return cache.k_row(rc.layer, it.seq, pos0 + r, rc.head); });
  __syncthreads();
  inverse_norms(keys, inv, count, d, pitch, p.redundancy.eps);
  __syncthreads();

  for (std::int32_t u0 = warp * pair_chunk; u0 < count; u0 += warps * pair_chunk) {
    column_state st;
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) {
      st.rowsum[c] = 0.0f;
      st.newest[c] = -1;
      st.newest_c[c] = 0.0f;
    }
    compare_columns(st, keys + std::size_t(u0) * pitch, inv + u0, min(pair_chunk, count - u0), pos0 + u0, keys, inv,
                    count, pos0, d, pitch, p.redundancy.theta);
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) {
      reduce_column(st.rowsum[c], st.newest[c], st.newest_c[c]);
      if (lane == 0 && u0 + c < count) {
        rowsum[u0 + c] = st.rowsum[c];
        if (st.newest[c] >= 0) dropped.add(st.newest[c] - pos0, st.newest_c[c]);
      }
    }
  }
  __syncthreads();
  const float inv_n = 1.0f / static_cast<float>(b);
  for (std::int32_t t = threadIdx.x; t < count; t += blockDim.x)
    red_out[row * rs.max_tokens + pos0 + t] = (rowsum[t] - dropped.of(t)) * inv_n / p.redundancy.tau;
}

// Shared memory of the full kernel, in floats: a tile of columns u and a tile of keys
// v, with their inverse norms and (cautious update) whether the head holds them.
KVP_HOST_DEVICE constexpr std::size_t full_smem_floats(std::int32_t d) {
  return 2 * std::size_t(full_tile) * (std::size_t(d) + 4) + 4 * full_tile;
}

// A full-scope block of keys u on the flat grid of (row, tile of `tile` keys)
// (decode_row_tile): its row, the row's candidate count n, its first key u_pos0 and
// its key count (0 or less: the tile lies past the candidates).
struct key_tile_block {
  std::int64_t row;
  row_coord rc;
  batch_item it;
  std::int32_t n, u_pos0, u_count;
};
template <class P>
__device__ inline key_tile_block decode_key_tile_block(const P& p, const paged_kv_view& cache, const row_space& rs,
                                                       std::int32_t tile) {
  const row_tile rt = decode_row_tile(tiles_per_row(rs.max_tokens, tile));
  const row_coord rc = decode_row(rs, rt.row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t n = candidate_end(p.scorer, cache.lengths[it.seq]), u_pos0 = static_cast<std::int32_t>(rt.tile) * tile;
  return {rt.row, rc, it, n, u_pos0, min(tile, n - u_pos0)};
}

// Full scope, first half: one block per (row, tile of 64 columns u), on a flat grid
// (decode_row_tile), streams every key tile v and writes, per u, its row sum and
// newest similar neighbour. O(T) memory.
template <class P>
__global__ void __launch_bounds__(row_threads) full_columns_kernel(P p, paged_kv_view cache, row_space rs,
                                                                   float* rowsum_out, std::int32_t* newest_out,
                                                                   float* newest_c_out) {
  extern __shared__ float4 smem4[];
  if (failed(rs)) return;
  const key_tile_block kb = decode_key_tile_block(p, cache, rs, full_tile);
  if (kb.u_count <= 0) return;
  const std::int64_t row = kb.row;
  const std::int32_t n = kb.n, u_pos0 = kb.u_pos0, u_count = kb.u_count, d = cache.head_dim, pitch = d + 4;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float* us = reinterpret_cast<float*>(smem4);
  float* vs = us + std::size_t(full_tile) * pitch;
  float* u_inv = vs + std::size_t(full_tile) * pitch;
  float* v_inv = u_inv + full_tile;
  float* u_held = v_inv + full_tile;  // 1: held (or no live view), 0: dropped
  float* v_held = u_held + full_tile;
  auto k_row = [&](std::int32_t pos) { return cache.k_row(kb.rc.layer, kb.it.seq, pos, kb.rc.head); };
  // Under cautious update a pair with a key the head dropped is not compared: the row
  // is the held keys alone (host::held_redundancy_scores).
  const bool cautious = !cache.live.empty();
  const auto mark_held = [&](float* held, std::int32_t pos0, std::int32_t count) {
    for (std::int32_t r = threadIdx.x; r < count; r += blockDim.x)
      held[r] = !cautious || cache.alive(kb.rc.layer, kb.it.seq, pos0 + r, kb.rc.head) ? 1.0f : 0.0f;
  };
  const auto both_held = [&](std::int32_t c, std::int32_t v) { return !cautious || (u_held[c] * v_held[v] != 0.0f); };
  load_rows(us, u_count, d, pitch, cache.type, [&](std::int32_t r) { return k_row(u_pos0 + r); });
  mark_held(u_held, u_pos0, u_count);
  __syncthreads();
  inverse_norms(us, u_inv, u_count, d, pitch, p.redundancy.eps);

  // Each warp owns full_tile / warps columns, pair_chunk at a time.
  constexpr int per_warp = full_tile / (row_threads / 32);
  constexpr int chunks = per_warp / pair_chunk;
  column_state st[chunks];
#pragma unroll
  for (int k = 0; k < chunks; ++k)
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) {
      st[k].rowsum[c] = 0.0f;
      st[k].newest[c] = -1;
      st[k].newest_c[c] = 0.0f;
    }
  for (std::int32_t v_pos0 = 0; v_pos0 < n; v_pos0 += full_tile) {
    const std::int32_t v_count = min(full_tile, n - v_pos0);
    __syncthreads();
    load_rows(vs, v_count, d, pitch, cache.type, [&](std::int32_t r) { return k_row(v_pos0 + r); });
    mark_held(v_held, v_pos0, v_count);
    __syncthreads();
    inverse_norms(vs, v_inv, v_count, d, pitch, p.redundancy.eps);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < chunks; ++k) {
      const std::int32_t u0 = warp * per_warp + k * pair_chunk;
      if (u0 < u_count)
        compare_columns(st[k], us + std::size_t(u0) * pitch, u_inv + u0, min(pair_chunk, u_count - u0), u_pos0 + u0,
                        vs, v_inv, v_count, v_pos0, d, pitch, p.redundancy.theta,
                        [&](std::int32_t c, std::int32_t v) { return both_held(u0 + c, v); });
    }
  }
#pragma unroll
  for (int k = 0; k < chunks; ++k) {
    const std::int32_t u0 = warp * per_warp + k * pair_chunk;
#pragma unroll
    for (int c = 0; c < pair_chunk; ++c) {
      reduce_column(st[k].rowsum[c], st[k].newest[c], st[k].newest_c[c]);
      if (lane == 0 && u0 + c < u_count) {
        const std::int64_t at = row * rs.max_tokens + u_pos0 + u0 + c;
        rowsum_out[at] = st[k].rowsum[c];
        newest_out[at] = st[k].newest[c];
        newest_c_out[at] = st[k].newest_c[c];
      }
    }
  }
}

// Full scope, second half: one block per row subtracts each u's dropped similarity
// from its newest neighbour's row sum (dropped_sums over `dropped_words`,
// [rows][max_tokens] words of the workspace). The newest neighbours come from
// `packed` (the tensor-core kernel's pack_newest: position + 1 above the similarity's
// bits), or else from newest and newest_c. Under cautious update n counts the keys the
// head holds, and a dropped key's red is 0 (the epilogue's softmax leaves it out).
template <class P>
__global__ void __launch_bounds__(row_threads) full_finish_kernel(P p, paged_kv_view cache, row_space rs,
                                                                  const float* rowsum, const std::int32_t* newest,
                                                                  const float* newest_c,
                                                                  const unsigned long long* packed,
                                                                  unsigned long long* dropped_words, float* red_out) {
  if (failed(rs)) return;
  const std::int64_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = candidate_end(p.scorer, T);
  const std::int64_t base = row * rs.max_tokens;
  const dropped_sums<true> dropped{dropped_words + base};
  dropped.clear(n);
  const bool cautious = !cache.live.empty();
  const auto held = [&](std::int32_t t) { return !cautious || cache.alive(rc.layer, it.seq, t, rc.head); };
  float held_keys = static_cast<float>(n);
  if (cautious) {
    __shared__ typename block_reduce::TempStorage reduce;
    __shared__ float broadcast;
    held_keys = 0.0f;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) held_keys += held(t) ? 1.0f : 0.0f;
    held_keys = block_sum(held_keys, reduce, broadcast);  // its barriers order the clears before the adds
  }
  __syncthreads();
  for (std::int32_t u = threadIdx.x; u < n; u += blockDim.x) {
    std::int32_t target;
    float c;
    if (packed) {
      const unsigned long long w = packed[base + u];
      target = static_cast<std::int32_t>(w >> 32) - 1;
      c = __uint_as_float(static_cast<unsigned>(w));
    } else {
      target = newest[base + u];
      c = newest_c[base + u];
    }
    if (target >= 0) dropped.add(target, c);
  }
  __syncthreads();
  const float inv_n = 1.0f / held_keys;
  for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x)
    red_out[base + t] = held(t) ? (rowsum[base + t] - dropped.of(t)) * inv_n / p.redundancy.tau : 0.0f;
}

}  // namespace cuda
KVP_NAMESPACE_END
