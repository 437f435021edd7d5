// Softmax statistics of window attention over one cache block's keys, computed where
// those keys already sit in shared memory (the lightning redundancy kernel), so that
// the score kernel reads every key once, for its probability pass, instead of twice.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/wgmma.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Statistics per cache block: two halves (alternate 32-key chunks) of round32(w G)
// query rows in chunk order (query_order), each (max, sum of 2^(z - max)) in log2
// units, (-inf, 0) where a query sees none of the half's keys.
KVP_HOST_DEVICE constexpr std::int64_t block_statistics_count(std::int32_t w, std::int32_t G) {
  return 2 * std::int64_t{round32(w * G)};
}

// The largest head dim whose statistics the lightning kernel computes: a lane holds
// its query rows' fragments in registers (d / 4 of them), and lightning's register
// cap is that of three blocks per SM. Built for a run-time head dim, the kernel
// holds fragments for this many dims and uses d / 16 of their k-steps.
inline constexpr std::int32_t statistics_max_head_dim = 128;

// A warp's 16 query rows m0 + lane / 4 (+ 8) of the `rows` in chunk order, as
// mma.sync's (and wgmma's register) A fragment: per 16 dims, 32-bit words lane % 4
// and 4 + lane % 4 of each row's 8; padding rows are zero. Room for D dims, of which
// the first `steps` k-steps of 16 are loaded. Loaded from global
// memory by each block of a row (they mostly come from DRAM again: the streamed
// keys push them out of L2 between a row's blocks), under the block's key copy.
template <int D>
struct query_fragments {
  std::uint32_t a[D / 16][4];
  bool real[2];
  std::int32_t pj[2];  // window positions

  __device__ query_fragments() {}
  template <AttentionScorer S>
  __device__ void load(const S& s, const query_window_view& q, std::int32_t layer, std::int32_t slot, std::int32_t head,
                       std::int32_t G, std::int32_t T, std::int32_t m0, std::int32_t rows, std::int32_t steps) {
    const std::int32_t lane = threadIdx.x % 32, w = s.window;
    const query_order order{true, G, __ffs(G) - 1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int32_t r = m0 + lane / 4 + h * 8, j = r < rows ? order.position(r) : w;
      real[h] = j < w;
      pj[h] = T - w + j;
      const auto* row = reinterpret_cast<const std::uint32_t*>(
          q.row(layer, slot, q.window - w + (real[h] ? j : 0), head * G + (real[h] ? order.head(r) : 0)));
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        if (kk >= steps) break;
        a[kk][h] = real[h] ? row[kk * 8 + lane % 4] : 0u;
        a[kk][h + 2] = real[h] ? row[kk * 8 + 4 + lane % 4] : 0u;
      }
    }
  }
};

// A lane's running (max of raw logits, sum of 2^(z scale - max scale)) for its two
// rows over its columns; the quad joins them once at the end (write), so a 32-key
// chunk costs a max and a rescale, with no shuffle and no branch.
struct lane_statistics {
  float run_m[2] = {-__builtin_huge_valf(), -__builtin_huge_valf()};
  float run_s[2] = {0.0f, 0.0f};
  float scale;

  // scale: 1 / sqrt(d) in log2 units, as the score kernel's.
  __device__ explicit lane_statistics(std::int32_t d)
      : scale(1.0f / sqrtf(static_cast<float>(d)) * 1.4426950408889634f) {}

  // Folds the 16 x 32 fragment tile acc of keys [t0, t0 + 32) (all visible when
  // plain; keys from `end` on are not candidates). Without branches per row: a row
  // that has seen no key yet takes 0 as its max, so its terms are 2^-inf = 0.
  template <AttentionScorer S, int D>
  __device__ void fold(const S& s, const float (&acc)[4][4], std::int32_t t0, bool plain, std::int32_t end,
                       const query_fragments<D>& qf) {
    if (plain)
      fold_masked<false>(s, acc, t0, end, qf);
    else
      fold_masked<true>(s, acc, t0, end, qf);
  }
  template <bool Masked, AttentionScorer S, int D>
  __device__ void fold_masked(const S& s, const float (&acc)[4][4], std::int32_t t0, std::int32_t end,
                              const query_fragments<D>& qf) {
    const std::int32_t lane = threadIdx.x % 32;
    const float ninf = -__builtin_huge_valf();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float z[8];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::int32_t t = t0 + nt * 8 + (lane % 4) * 2 + e;
          z[2 * nt + e] = !Masked || (qf.real[h] && t < end && s.visible(qf.pj[h], t)) ? acc[nt][h * 2 + e] : ninf;
        }
      float m = run_m[h];
#pragma unroll
      for (int k = 0; k < 8; ++k) m = fmaxf(m, z[k]);
      const bool none = m == ninf;
      const float ms = none ? 0.0f : m * scale;
      // The sum so far, rescaled to the new max: by exactly 1 when the max holds, by
      // 2^-inf = 0 while the sum is empty.
      float sum = run_s[h] * exp2_ftz(none ? ninf : (run_m[h] - m) * scale);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum += exp2_ftz(fmaf(z[k], scale, -ms));
      run_m[h] = m;
      run_s[h] = sum;
    }
  }
  // Joins the quad's lanes and writes the warp's 16 rows m0.. (those below `rows`).
  __device__ void write(float2* out, std::int32_t m0, std::int32_t rows) const {
    const std::int32_t lane = threadIdx.x % 32;
    const float ninf = -__builtin_huge_valf();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = run_m[h];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      float sum = m == ninf ? 0.0f : rescaled_sum({run_m[h] * scale, run_s[h]}, m * scale);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const std::int32_t r = m0 + lane / 4 + h * 8;
      if (lane % 4 == 0 && r < rows) out[r] = m == ninf ? float2{ninf, 0.0f} : float2{m * scale, sum};
    }
  }
};

// The softmax statistics of one cache block's keys [pos0, pos0 + count) (candidates,
// in shared memory) for its row's window queries, written to out[half][query row].
// Built while the keys are still in flight, it loads the queries the warp takes
// first, so that their latency hides under the keys'; run() then computes (the
// whole block calls it, the keys published to it). Requires reduces_in_fragments.
// On sm_90a (keys in core_matrices) a warpgroup takes 64 query rows (each warp its
// 16, their fragments in registers as wgmma's A) and one half of the keys, 32 at a
// time as B straight from shared memory; elsewhere a warp takes 16 query rows and
// one half, keys by ldmatrix for mma.sync (where the MMAs are most of the
// statistics' time).
// HeadDim: the head dim as a constant, or 0 for the run-time d, at most MaxHeadDim
// (the caller passes a null `out` otherwise).
template <dtype Elem, int HeadDim, AttentionScorer S, int MaxHeadDim = statistics_max_head_dim>
class block_statistics {
  static constexpr int D = HeadDim > 0 ? HeadDim : MaxHeadDim;  // fragment room

 public:
  __device__ block_statistics(const S& s, const query_window_view& q, std::int32_t layer, std::int32_t slot,
                              std::int32_t head, std::int32_t G, std::int32_t T, std::int32_t d, float2* out)
      : s_(s),
        q_(q),
        layer_(layer),
        slot_(slot),
        head_(head),
        G_(G),
        T_(T),
        rows_(round32(s.window * G)),
        d_(HeadDim > 0 ? HeadDim : d),
        out_(out) {
    if (out_) load(first_item());
  }

  template <class Layout>
  __device__ void run(const std::uint16_t* keys, Layout at, std::int32_t pos0, std::int32_t count) {
    if (!out_) return;
    // Chunks below plain_end skip the mask test (padding query rows are left out by the
    // score kernel's window reduce).
    const std::int32_t end = pos0 + count, plain_end = min(end, window_visible_end(s_, T_));
    for (std::int32_t item = first_item(); item < items(); item += item_step()) {
      if (item != first_item()) load(item);
      const std::int32_t half = item % 2;
      lane_statistics st(d_);
      for (std::int32_t c0 = half * 32; c0 < count; c0 += 64) {
#if KVP_CUDA_WGMMA
        float acc[4][4];  // the first MMA overwrites it
        const wgmma_descriptor db(keys + at(c0, 0), d_);
        if constexpr (HeadDim > 0) {
          issue<HeadDim / 16>(acc, db);
        } else {
          with_step_count<D / 16>(d_ / 16, [&]<int Steps>() { issue<Steps>(acc, db); });
        }
        wgmma_gram_wait(acc);
#else
        const std::int32_t lane = threadIdx.x % 32;
        float acc[4][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          if (kk >= d_ / 16) break;
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            std::uint32_t bf[4];
            ldmatrix_x4(bf, keys + at(c0 + np * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
            mma_16816<Elem>(acc[np * 2], qf_.a[kk], bf[0], bf[1]);
            mma_16816<Elem>(acc[np * 2 + 1], qf_.a[kk], bf[2], bf[3]);
          }
        }
#endif
        st.fold(s_, acc, pos0 + c0, pos0 + c0 + 32 <= plain_end, end, qf_);
      }
      st.write(out_ + half * rows_, first_row(item), rows_);
    }
  }

 private:
  // Items are (16 or 64 query rows, half of the keys); a warp (warpgroup) takes
  // items first_item(), + item_step(), ...
#if KVP_CUDA_WGMMA
  __device__ std::int32_t items() const { return (rows_ + 63) / 64 * 2; }
  __device__ static std::int32_t first_item() { return warp_uniform(static_cast<std::int32_t>(threadIdx.x) / 128); }
  __device__ static std::int32_t item_step() { return static_cast<std::int32_t>(blockDim.x) / 128; }
  __device__ static std::int32_t first_row(std::int32_t item) {
    return item / 2 * 64 + static_cast<std::int32_t>(threadIdx.x) / 32 % 4 * 16;
  }
#else
  __device__ std::int32_t items() const { return rows_ / 16 * 2; }
  __device__ static std::int32_t first_item() { return static_cast<std::int32_t>(threadIdx.x) / 32; }
  __device__ static std::int32_t item_step() { return static_cast<std::int32_t>(blockDim.x) / 32; }
  __device__ static std::int32_t first_row(std::int32_t item) { return item / 2 * 16; }
#endif
  __device__ void load(std::int32_t item) {
    qf_.load(s_, q_, layer_, slot_, head_, G_, T_, first_row(item), rows_, d_ / 16);
  }
#if KVP_CUDA_WGMMA
  // The MMAs of one 32-key chunk: Steps k-steps, A from the fragments, as one commit
  // group. Fence and commit are here, not around the caller's switch over step
  // counts, so that they stand next to the MMAs in every case (else ptxas adds a
  // fence of its own to each: C7519).
  template <int Steps>
  __device__ void issue(float (&acc)[4][4], const wgmma_descriptor& db) const {
    wgmma_fence();  // the fragments were written by ordinary loads
#pragma unroll
    for (int kk = 0; kk < Steps; ++kk) wgmma_64x32x16_rs<Elem>(acc, qf_.a[kk], db.at(kk), kk > 0);
    wgmma_commit();
  }
#endif

  const S& s_;
  const query_window_view& q_;
  std::int32_t layer_, slot_, head_, G_, T_, rows_, d_;
  float2* out_;
  query_fragments<D> qf_;
};

}  // namespace cuda
KVP_NAMESPACE_END
