// Window attention and lightning redundancy from one read of the keys (sm_90): a
// thread-block cluster per (item, layer, KV head) row, one block per cache block of
// the row. Each block loads its cache block's keys into shared memory once and
// keeps them there for all three uses: the softmax statistics of its keys, the
// lightning redundancy (all pairs of the block, lightning_block), and, once the
// cluster has joined every block's statistics through distributed shared memory,
// the probabilities and their group and window reduces. The two-kernel path reads
// the keys three times (twice for the scores, once for lightning).
//
// Built for scorers whose reduces run in the fragments (reduces_in_fragments) and
// head dims 64 and 128; the executor takes it when a row's blocks fit one cluster.
#pragma once

#include <cstdint>

#include <cooperative_groups.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/lightning_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The most blocks a cluster may hold on sm_90 (16 needs the non-portable opt-in).
inline constexpr int max_cluster_blocks = 16;

// Bytes of a cache block's keys in either lightning layout (lightning_mma_smem_bytes
// without its scratch).
KVP_HOST_DEVICE constexpr std::size_t block_key_bytes(std::int32_t block, std::int32_t d) {
  const std::size_t padded = static_cast<std::size_t>(round16(block)) * (std::size_t(d) + 8) * 2;
  const std::size_t core = static_cast<std::size_t>(round64(block)) * std::size_t(d) * 2;
  return padded > core ? padded : core;
}

// Shared memory, in bytes: the block's keys, lightning's scratch, the queries
// [round32(w G)][d + 8] (chunk order), per query the running statistics of its two
// 32-key halves, this block's statistics (read by the cluster) and the row's, and
// the window partials [round32(w G) / 32][round64(b)]. Configuration A (b 256,
// d 128, w 16, G 4): 89 KB, two blocks per SM.
KVP_HOST_DEVICE constexpr std::size_t score_lightning_smem_bytes(std::int32_t w, std::int32_t G, std::int32_t d,
                                                                 std::int32_t block) {
  const std::size_t rows = static_cast<std::size_t>(round32(w * G));
  return block_key_bytes(block, d) + lightning_scratch_floats(block) * 4 + rows * (std::size_t(d) + 8) * 2 +
         4 * rows * 8 + rows / 32 * static_cast<std::size_t>(round64(block)) * 4;
}

// Cluster barrier halves: arrive publishes this thread's earlier writes (release),
// wait returns once every thread of the cluster has arrived and makes theirs
// visible (acquire). Work between the two overlaps the barrier.
__device__ inline void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ inline void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// Launched with cluster dims (1, gridDim.y): blockIdx.y is the cache block of row
// blockIdx.x and its rank in the cluster. Writes the row's scores (as
// attention_score_mma_kernel) and redundancy (as lightning_mma_kernel); given
// ready_out, the cluster's first block publishes the row once every block's are written.
template <class P, dtype Elem, int HeadDim>
__global__ void __launch_bounds__(row_threads, 2)
    score_lightning_kernel(P p, paged_kv_view cache, query_window_view q, row_space rs, float* scores, float* red_out,
                           std::int32_t* ready_out) {
  static_assert(HeadDim == 64 || HeadDim == 128, "built for the head dims the MMA loops unroll whole");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = typename P::scorer_type;
  namespace cg = cooperative_groups;
  extern __shared__ uint4 smem16[];
  allow_dependents();  // the epilogue waits for rows, not for this grid
  // Uniform over the grid (validation ran before this launch), so no block of a
  // cluster leaves while the others wait at its barriers.
  if (failed(rs)) return;
  const S& s = p.scorer;
  const std::uint32_t row = blockIdx.x;
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T);
  const std::int32_t b = cache.block_size, pos0 = static_cast<std::int32_t>(blockIdx.y) * b;
  // Keys of this block that are candidates; blocks past the row's end hold none but
  // still take part in the cluster's barriers.
  const std::int32_t count = max(0, min(b, n - pos0)), end = pos0 + count;
  constexpr std::int32_t d = HeadDim;
  const std::int32_t w = s.window, G = q.num_q_heads / cache.num_kv_heads, rows = round32(w * G), pitch = d + 8;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const query_order order{true, G, __ffs(G) - 1};  // G is a power of two (reduces_in_fragments)
  const float ninf = -__builtin_huge_valf();
  const float scale = 1.0f / sqrtf(static_cast<float>(d)) * 1.4426950408889634f;
  const lightning_layout at = make_lightning_layout(d);
  const std::int32_t key_stride = round64(b);  // of the window partials

  auto* keys = reinterpret_cast<std::uint16_t*>(smem16);
  auto* scratch = reinterpret_cast<float*>(reinterpret_cast<std::byte*>(smem16) + block_key_bytes(b, d));
  auto* qs = reinterpret_cast<std::uint16_t*>(scratch + lightning_scratch_floats(b));
  auto* half_stat = reinterpret_cast<float2*>(qs + std::size_t(rows) * pitch);  // [rows][2]
  float2* block_stat = half_stat + 2 * rows;  // this block's (max, sum) per query, read by the cluster
  float2* stat = block_stat + rows;           // the row's (max, 1 / sum) per query
  auto* part = reinterpret_cast<float*>(stat + rows);  // [rows / 32][key_stride]

#if KVP_CUDA_WGMMA
  const std::int32_t key_rows = round64(count);
#else
  const std::int32_t key_rows = round16(count);
#endif
  if (count > 0) key_tile_loader(cache, rc.layer, it.seq, rc.head, at).copy(cache, keys, key_rows, count, pos0);
  cp_async_commit();
  for (std::int32_t e = threadIdx.x; e < rows * (d / 8); e += blockDim.x) {
    const std::int32_t r = e / (d / 8), v = e % (d / 8), j = order.position(r);
    uint4 val{0, 0, 0, 0};
    if (j < w)
      val = reinterpret_cast<const uint4*>(q.row(rc.layer, it.query_slot, q.window - w + j, rc.head * G + order.head(r)))[v];
    *reinterpret_cast<uint4*>(qs + std::size_t(r) * pitch + v * 8) = val;
  }
  // Keys below plain_end are this block's and visible to every window query: tiles
  // under it skip the mask test (padding query rows are left out by the window
  // reduce). Keys past `end` are the zero rows of a 64-key tile past a smaller block.
  std::int32_t plain_end = 0;
  if constexpr (requires { { s.visible_end(0) } -> std::same_as<std::int32_t>; }) {
    plain_end = end;
    for (std::int32_t j = 0; j < w; ++j) plain_end = min(plain_end, s.visible_end(T - w + j));
  }
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();

  // Statistics of this block's keys, with the queries as MMA rows: a warp takes 16
  // queries x one 32-key half of every 64-key tile, its query fragments loaded once;
  // a quad holds a query's keys, so max and sum need two shuffles each.
  for (std::int32_t piece = warp; piece < (rows / 16) * 2; piece += warps) {
    const std::int32_t m0 = (piece / 2) * 16, n0 = (piece % 2) * 32;
    std::uint32_t a[d / 16][4];
#pragma unroll
    for (int kk = 0; kk < d / 16; ++kk) ldmatrix_x4(a[kk], qs + std::size_t(m0 + lane % 16) * pitch + kk * 16 + (lane / 16) * 8);
    std::int32_t pj[2];
    bool real[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int32_t j = order.position(m0 + lane / 4 + h * 8);
      real[h] = j < w;
      pj[h] = T - w + j;
    }
    float2 run[2] = {{ninf, 0.0f}, {ninf, 0.0f}};
    for (std::int32_t tile = 0; tile < count; tile += mma_key_tile) {
      float acc[4][4] = {};
#pragma unroll
      for (int kk = 0; kk < d / 16; ++kk)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          std::uint32_t bf[4];
          ldmatrix_x4(bf, keys + at(tile + n0 + np * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
          mma_16816<Elem>(acc[np * 2], a[kk], bf[0], bf[1]);
          mma_16816<Elem>(acc[np * 2 + 1], a[kk], bf[2], bf[3]);
        }
      const bool plain = pos0 + tile + mma_key_tile <= plain_end;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float z[8];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const std::int32_t t = pos0 + tile + n0 + nt * 8 + (lane % 4) * 2 + e;
            z[2 * nt + e] = plain || (real[h] && t < end && s.visible(pj[h], t)) ? acc[nt][h * 2 + e] : ninf;
          }
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
      half_stat[2 * (m0 + lane / 4) + piece % 2] = run[0];
      half_stat[2 * (m0 + lane / 4 + 8) + piece % 2] = run[1];
    }
  }
  __syncthreads();
  for (std::int32_t i = threadIdx.x; i < rows; i += blockDim.x) {
    const float2 x = half_stat[2 * i], y = half_stat[2 * i + 1];
    const float m = fmaxf(x.x, y.x);
    block_stat[i] = m == ninf ? float2{ninf, 0.0f} : float2{m, rescaled_sum(x, m) + rescaled_sum(y, m)};
  }
  // The cluster's barrier runs while this block computes its redundancy.
  cluster_arrive();
  if (count > 0)
    lightning_block<decltype(p.redundancy), Elem>(p.redundancy, keys, scratch, count, pos0, b, d,
                                                  red_out + std::int64_t{row} * rs.max_tokens + pos0);
  cluster_wait();

  // The row's statistics: every block's, joined in block order (the same in each block).
  const cg::cluster_group cluster = cg::this_cluster();
  for (std::int32_t i = threadIdx.x; i < rows; i += blockDim.x) {
    float2 st{ninf, 0.0f};
    for (unsigned r = 0; r < gridDim.y; ++r) {
      const float2 other = *cluster.map_shared_rank(block_stat + i, r);
      if (other.x != ninf) st = merge_nonempty(st, other.x, other.y);
    }
    // (max, 1 / sum); a query that sees no key gets (0, 0), so its terms are 0, not NaN.
    stat[i] = st.x == ninf ? float2{0.0f, 0.0f} : float2{st.x, 1.0f / st.y};
  }
  __syncthreads();

  // Probabilities with the keys as MMA rows (as attention_score_mma_kernel's second
  // pass): a warp takes 16 keys x one 32-query chunk; lanes reduce over the group
  // and their window positions in registers, quads add their four lanes.
  const std::int32_t chunks = rows / 32, per_tile = chunks * 4;
  for (std::int32_t piece = warp; piece < (count + mma_key_tile - 1) / mma_key_tile * per_tile; piece += warps) {
    const std::int32_t tile = piece / per_tile * mma_key_tile, key0 = piece % 4 * 16, chunk = piece % per_tile / 4;
    const std::int32_t q0 = chunk * 32;
    float acc[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < d / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, keys + at(tile + key0 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        std::uint32_t bf[4];
        ldmatrix_x4(bf, qs + std::size_t(q0 + np * 16 + lane % 8 + (lane / 16) * 8) * pitch + kk * 16 + ((lane / 8) % 2) * 8);
        mma_16816<Elem>(acc[np * 2], a, bf[0], bf[1]);
        mma_16816<Elem>(acc[np * 2 + 1], a, bf[2], bf[3]);
      }
    }
    float2 st[8];
    std::int32_t pj[8];
    const std::int32_t pj0 = T - w + ((q0 + (lane % 4) * 8) >> order.g_shift);
#pragma unroll
    for (int sl = 0; sl < 8; ++sl) {
      st[sl] = stat[q0 + query_order::row_of_slot(sl, lane % 4)];
      pj[sl] = pj0 + (sl >> order.g_shift);
    }
    const bool plain = pos0 + tile + mma_key_tile <= plain_end;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int32_t local = tile + key0 + lane / 4 + h * 8, t = pos0 + local;
      float pr[8];
#pragma unroll
      for (int sl = 0; sl < 8; ++sl) {
        float z = acc[sl / 2][h * 2 + sl % 2];
        if (!plain) z = t < end && s.visible(pj[sl], t) ? z : ninf;
        pr[sl] = s.transform(exp2_ftz(fmaf(z, scale, -st[sl].x)) * st[sl].y);
      }
      float win = 0.0f;
      switch (G) {
        case 1: win = chunk_window_sum<1>(s, pr, pj, T, t); break;
        case 2: win = chunk_window_sum<2>(s, pr, pj, T, t); break;
        case 4: win = chunk_window_sum<4>(s, pr, pj, T, t); break;
        default: win = chunk_window_sum<8>(s, pr, pj, T, t); break;
      }
      if (lane % 4 == 0) part[chunk * key_stride + local] = win;
    }
  }
  __syncthreads();
  for (std::int32_t t = threadIdx.x; t < count; t += blockDim.x) {
    float total = 0.0f;
    for (std::int32_t c = 0; c < chunks; ++c) total += part[c * key_stride + t];
    scores[std::int64_t{row} * rs.max_tokens + pos0 + t] =
        s.reduce == window_reduce::mean ? total * (1.0f / static_cast<float>(w)) : total;
  }
  // No block leaves while another may still read its statistics; and once every
  // block's scores and redundancy are written (fenced at GPU scope, then the
  // cluster's release / acquire), the first block hands the row on.
  __threadfence();
  cluster_arrive();
  cluster_wait();
  if (ready_out && blockIdx.y == 0) publish_row(ready_out, row);
#else
  (void)p, (void)cache, (void)q, (void)rs, (void)scores, (void)red_out, (void)ready_out;
  __trap();  // the executor launches it on sm_90 and later only
#endif
}

}  // namespace cuda
KVP_NAMESPACE_END
