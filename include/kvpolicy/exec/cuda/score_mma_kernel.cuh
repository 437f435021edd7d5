// Window attention on tensor cores for f16/bf16 caches: the Q.K^T tiles of
// attention_score_kernel computed with mma.sync (fp32 accumulators), key tiles
// double-buffered with cp.async, the softmax and the reductions in fp32 as before.
// Two passes over the keys: softmax statistics with the queries as MMA rows (a
// row's keys sit in one quad), then probabilities, where scorers whose group
// reduce runs in registers take the keys as rows (a lane's columns are whole GQA
// groups, so the group reduce and most of the window reduce need no shuffle).
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/exec/cuda/wgmma.cuh"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {


// Softmax statistics are (max, sum of 2^(z - max)) in log2 units; a set of logits
// whose max is -inf is empty. rescaled_sum: a set's sum relative to a max m >= its own.
// (Flushing factors below 2^-126 to zero changes a sum, which is at least 1, by
// less than its rounding.)
__device__ inline float rescaled_sum(float2 st, float m) {
  return st.x == -__builtin_huge_valf() ? 0.0f : st.y * exp2_ftz(st.x - m);
}
// Running statistics `run` joined by a nonempty set of max m and sum `sum`.
__device__ inline float2 merge_nonempty(float2 run, float m, float sum) {
  const float m_new = fmaxf(run.x, m);
  return {m_new, rescaled_sum(run, m_new) + sum * exp2_ftz(m - m_new)};
}

// Keys per tile of the tensor-core scorer.
inline constexpr int mma_key_tile = 64;

KVP_HOST_DEVICE constexpr std::int32_t round16(std::int32_t x) { return (x + 15) / 16 * 16; }
KVP_HOST_DEVICE constexpr std::int32_t round32(std::int32_t x) { return (x + 31) / 32 * 32; }
KVP_HOST_DEVICE constexpr std::int32_t round64(std::int32_t x) { return (x + 63) / 64 * 64; }
// Four threads per statistics row; the loop bound keeps every quad whole.
KVP_HOST_DEVICE constexpr std::int32_t round_up4(std::int32_t rows) { return (rows * 4 + 255) / 256 * 256; }

// Row pitch of the logit tile, in floats: 72 = 8 mod 32 banks, so the fragment
// stores of a half-warp (8 rows x 4 column pairs) and a warp's reads of 32
// consecutive keys are both free of bank conflicts.
inline constexpr int logit_pitch = mma_key_tile + 8;
// Threads that split the window of one key in the score phase.
inline constexpr int window_splits = row_threads / mma_key_tile;

// Window partials per key of a tile: one per window split, or, when the reduces run
// in the fragments, one per 32-query chunk in each of two buffers (a tile's
// partials are summed after the next tile's barrier).
KVP_HOST_DEVICE constexpr std::int32_t window_partials(std::int32_t w, std::int32_t G) {
  return 2 * round32(w * G) / 32 > window_splits ? 2 * round32(w * G) / 32 : window_splits;
}

// Whether the group and window reduces run in registers: for G a power of two up to
// 8 a lane's 8 query columns of the probability pass hold whole GQA groups
// (query_order). max_logits and other G take the tile's logits through shared memory.
KVP_HOST_DEVICE constexpr bool reduces_in_fragments(group_reduce group, std::int32_t G) {
  return group != group_reduce::max_logits && G <= 8 && (G & (G - 1)) == 0;
}

// Shared memory, in bytes: queries [round16(w G)][d + 8] and two key tiles
// [64][d + 8] of 16-bit elements (the 8-element pad puts the 8 rows of an ldmatrix
// on distinct banks), the tile's logits [round16(w G)][72] unless the reduces run
// in the fragments, per query the softmax statistics (max, sum) and the running
// ones of its two 32-key halves, and the window partials. Without the logit tile,
// a scorer of w 16, G 4, d 128 takes 55 KB: four blocks per SM.
KVP_HOST_DEVICE constexpr std::size_t attention_mma_smem_bytes(std::int32_t w, std::int32_t G, std::int32_t d,
                                                               bool in_fragments) {
  const std::size_t rows = static_cast<std::size_t>(in_fragments ? round32(w * G) : round16(w * G));
  const std::size_t pitch = std::size_t(d) + 8;
  return (rows + 2 * mma_key_tile) * pitch * 2 + (in_fragments ? 0 : rows * logit_pitch * 4) + 3 * rows * 8 +
         std::size_t(window_partials(w, G)) * mma_key_tile * 4;
}

// Keys below the result are visible to every one of the window's queries (the
// scorer's optional visible_end hint, the window ending at T); 0 without the hint,
// where no key is known to be.
template <AttentionScorer S>
__device__ inline std::int32_t window_visible_end(const S& s, std::int32_t T) {
  std::int32_t end = 0;
  if constexpr (requires { { s.visible_end(0) } -> std::same_as<std::int32_t>; }) {
    end = s.visible_end(T - s.window);
    for (std::int32_t j = 1; j < s.window; ++j) end = min(end, s.visible_end(T - s.window + j));
  }
  return end;
}

// Where the query of each shared-memory row sits: window position and head in its
// GQA group. In the natural order row r is head r % G of position r / G. With the
// reduces in the fragments, rows go in 32-row chunks ordered for the probability
// pass, whose MMA has the keys as rows and a chunk's queries as columns: a lane
// holds columns (lane % 4) * 2 + e of 4 fragment tiles nt, and its 8 slots
// s = 2 nt + e are heads s % G of the 8 / G positions chunk * 32 / G +
// (lane % 4) * 8 / G + s / G, so the group and most of the window reduce stay
// in the thread. G is a power of two in both orders that use a shift.
struct query_order {
  bool by_chunks;
  std::int32_t G, g_shift;  // g_shift: log2 G, or -1 when G is not a power of two

  __device__ std::int32_t position(std::int32_t r) const {
    if (!by_chunks) return g_shift >= 0 ? r >> g_shift : r / G;
    const std::int32_t c = r & 31;
    return ((r >> 5) << 5 >> g_shift) + (((c >> 1) & 3) << 3 >> g_shift) + (slot(c) >> g_shift);
  }
  __device__ std::int32_t head(std::int32_t r) const {
    if (!by_chunks) return g_shift >= 0 ? r & (G - 1) : r % G;
    return slot(r & 31) & (G - 1);
  }
  // The slot of chunk column c: 2 * fragment tile + element.
  __device__ static std::int32_t slot(std::int32_t c) { return (c >> 3) * 2 + (c & 1); }
  // The chunk row of a lane's slot s (lane_col = lane % 4).
  __device__ static std::int32_t row_of_slot(std::int32_t s, std::int32_t lane_col) {
    return (s >> 1) * 8 + lane_col * 2 + (s & 1);
  }
};

// The probability pass with the keys as MMA rows: one warp's 16 keys x 32 queries
// (one chunk). Per key the lane turns its 8 logits into probabilities, reduces them
// over each GQA group and its 8 / G window positions, and the quad adds its four
// lanes' sums: the chunk's window sum for the key, in every lane of the quad.
// The lane's positions are pj0 + pl, pl < 8 / G.
template <int G, AttentionScorer S>
__device__ inline float chunk_window_sum(const S& s, const float (&pr)[8], std::int32_t pj0, std::int32_t w_end,
                                         std::int32_t t) {
  float win = 0.0f;
#pragma unroll
  for (int pl = 0; pl < 8 / G; ++pl) {
    float gv = pr[pl * G];
#pragma unroll
    for (int g = 1; g < G; ++g) gv = s.group == group_reduce::max ? fmaxf(gv, pr[pl * G + g]) : gv + pr[pl * G + g];
    if (s.group == group_reduce::mean) gv *= 1.0f / static_cast<float>(G);  // exact: G is a power of two
    // Padding positions (past the window) and non-contributing pairs add nothing.
    if (pj0 + pl < w_end && s.contributes(pj0 + pl, t)) win += gv;
  }
  win += __shfl_xor_sync(0xffffffffu, win, 1);
  win += __shfl_xor_sync(0xffffffffu, win, 2);
  return win;
}

// Blocks per row of attention_score_mma_kernel's single pass (block statistics
// given): splits_to_fill, with at least score_tuning::min_tiles_per_split 64-key tiles
// per block (a block loads its row's queries, a share of its tiles' bytes). A batch
// that fills the GPU takes one; a launch of one sequence several.
KVP_HOST_DEVICE constexpr std::int32_t score_key_splits(std::int64_t rows, std::int32_t max_tokens,
                                                        std::int64_t slots) {
  return splits_to_fill(rows, slots, tiles_per_row(max_tokens, mma_key_tile) / score_tuning::min_tiles_per_split);
}

// Whether the score kernel's MMAs run on wgmma: the reduces in the fragments (so
// every pass takes 64-row warpgroup tiles: queries by 64 in the statistics pass, keys
// by 64 against 32-query chunks in the probability pass), whole 64-row tiles of
// queries, and at least two of them: with one (w G = 64: one 64 x 32 tile per
// warpgroup, key tile and pass) mma.sync was faster, with two wgmma
// (bench/results/README.md, "Tuning constants").
KVP_HOST_DEVICE constexpr bool score_wgmma_fits(group_reduce group, std::int32_t w, std::int32_t G) {
  return reduces_in_fragments(group, G) && round32(w * G) % 64 == 0 && round32(w * G) >= 128;
}

// HeadDim: the head dim as a constant (the executor builds 64 and 128 so), or 0 to
// read it at run time. A constant unrolls the MMA loops whole, so ldmatrix loads run
// ahead of the MMAs that wait on them.
// Wgmma: the MMAs on wgmma, queries and keys in core matrices (sm_90a; the executor
// sets it where score_wgmma_fits; elsewhere the kernel is the mma.sync one).
// block_stats: the softmax statistics of each cache block of the row, written by the
// kernel before (lightning_mma_kernel's stats_out), joined here in place of the
// first pass over the keys; null to make that pass (when given, the reduces must run
// in the fragments). key_splits: blocks per row, each scoring an equal share of its
// 64-key tiles (score_key_splits; blocks of a row adjacent), which only the single
// pass over the keys allows; 1 without block_stats. stats_ready (with block_stats):
// lightning's per-row count of finished cache blocks (publish_row_part), so that a
// block waits for its row's lightning blocks rather than for the whole grid; null
// to wait for the grid.
template <AttentionScorer S, dtype Elem, int HeadDim = 0, bool Wgmma = false, bool Cautious = false>
__global__ void __launch_bounds__(row_threads, score_tuning::blocks_per_sm)
    attention_score_mma_kernel(S s, paged_kv_view cache, query_window_view q, row_space rs, float* scores,
                               std::int32_t* ready_out, const float2* block_stats, std::int32_t key_splits,
                               const std::int32_t* stats_ready) {
  extern __shared__ uint4 smem16[];
  // Launched after lightning redundancy, this kernel may start in its last wave; it
  // waits for it (or for its row of it: stats_ready) before it reads the blocks'
  // statistics (block_stats) and in any case before it finishes (or, with
  // stats_ready, its last block does, so that the grid still ends after lightning),
  // so that the epilogue, which waits for this kernel (or, given ready_out, for this
  // block), sees both.
  if (stats_ready && !block_stats) __trap();  // the executor's choice
  const prerequisites_at_exit after_redundancy{stats_ready == nullptr};
  allow_dependents();
  if (failed(rs)) return;
  const std::uint32_t row = blockIdx.x / static_cast<std::uint32_t>(key_splits);
  const auto split = static_cast<std::int32_t>(blockIdx.x % static_cast<std::uint32_t>(key_splits));
  const row_coord rc = decode_row(rs, row);
  const batch_item it = rs.items[rc.item];
  const std::int32_t T = cache.lengths[it.seq], n = s.key_end(T);
  // This block's keys [key_begin, key_end): whole tiles but for the row's last.
  const std::int32_t tiles = (n + mma_key_tile - 1) / mma_key_tile;
  const std::int32_t key_begin = split * tiles / key_splits * mma_key_tile,
                     key_end = min(n, (split + 1) * tiles / key_splits * mma_key_tile);
  const std::int32_t d = HeadDim > 0 ? HeadDim : cache.head_dim, w = s.window, G = q.num_q_heads / cache.num_kv_heads;
  const std::int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const bool by_logits = s.group == group_reduce::max_logits;
  // Group and window reduces in registers: the probability pass runs with the keys
  // as MMA rows on query rows in chunk order (query_order).
  const bool in_fragments = reduces_in_fragments(s.group, G);
  const std::int32_t QW = w * G, rows = in_fragments ? round32(QW) : round16(QW), pitch = d + 8, zp = logit_pitch;
  // A query row's window position, by shifts when G is a power of two: a division
  // by a run-time G is some 25 instructions, twice per fragment tile.
  const query_order order{in_fragments, G, (G & (G - 1)) == 0 ? __ffs(G) - 1 : -1};
  const float ninf = -__builtin_huge_valf();
  const float scale = 1.0f / sqrtf(static_cast<float>(d)) * 1.4426950408889634f;
  constexpr bool use_wgmma = Wgmma && KVP_CUDA_WGMMA;
  using Layout = std::conditional_t<use_wgmma, core_matrices, padded_rows>;
  const Layout at = [&] {
    if constexpr (use_wgmma)
      return core_matrices{d};
    else
      return padded_rows{pitch};
  }();
  if (use_wgmma && !score_wgmma_fits(s.group, w, G)) __trap();  // the executor's choice
  if (key_splits > 1 && !block_stats) __trap();                  // likewise

  auto* qs = reinterpret_cast<std::uint16_t*>(smem16);
  // Two key tiles; buffer i starts at kbase + i * tile_elems (no array: a run-time
  // index into one would put it in local memory).
  std::uint16_t* kbase = qs + at(rows, 0);
  const std::size_t tile_elems = at(mma_key_tile, 0);
  auto* zs = reinterpret_cast<float*>(kbase + 2 * tile_elems);
  // Logits are kept in log2 units (z * log2 e) so that exp is one exp2.
  auto* stat = reinterpret_cast<float2*>(zs + (in_fragments ? 0 : std::size_t(rows) * zp));
  // [rows][2]: running (max, sum) of each query over the keys of one 32-key half of
  // every tile; the quad leader of the warp that owns (query, half) alone updates it.
  float2* half_stat = stat + rows;
  auto* part = reinterpret_cast<float*>(half_stat + 2 * rows);  // [window_partials][64]

  for (std::int32_t e = threadIdx.x; e < rows * (d / 8); e += blockDim.x) {
    const std::int32_t r = e / (d / 8), v = e % (d / 8), j = order.position(r);
    uint4 val{0, 0, 0, 0};
    if (j < w)
      val = reinterpret_cast<const uint4*>(q.row(rc.layer, it.query_slot, q.window - w + j, rc.head * G + order.head(r)))[v];
    *reinterpret_cast<uint4*>(qs + at(r, v)) = val;
  }
  if constexpr (use_wgmma) fence_async_shared();  // the queries, before wgmma reads them
  for (std::int32_t i = threadIdx.x; i < rows; i += blockDim.x) {
    stat[i] = {ninf, 0.0f};
    half_stat[2 * i] = half_stat[2 * i + 1] = {ninf, 0.0f};
  }
  // Keys below plain_end are candidates visible to every window query, and no row is
  // padding (or padding rows are left out later, in chunk order): tiles under it
  // skip the mask test (the scorer's optional visible_end).
  const std::int32_t plain_end = !Cautious && (QW == rows || in_fragments) ? min(n, window_visible_end(s, T)) : 0;
  if (block_stats) {
    // The blocks' statistics, joined in block order (blocks past the candidates wrote
    // none), once the kernel that wrote them has finished (or those blocks have).
    const std::int32_t b = cache.block_size, blocks = (n + b - 1) / b;
    if (stats_ready)
      await_row_parts(stats_ready, row, blocks);
    else
      wait_for_prerequisites();
    const std::int64_t per_block = 2 * std::int64_t{rows};
    const float2* row_stats = block_stats + std::int64_t{row} * ((rs.max_tokens + b - 1) / b) * per_block;
    for (std::int32_t i = threadIdx.x; i < rows; i += blockDim.x) {
      float2 st{ninf, 0.0f};
      for (std::int32_t blk = 0; blk < blocks; ++blk)
        for (std::int32_t h = 0; h < 2; ++h) {
          const float2 part_stat = row_stats[blk * per_block + h * rows + i];
          if (part_stat.x != ninf) st = merge_nonempty(st, part_stat.x, part_stat.y);
        }
      half_stat[2 * i] = st;  // this thread set both halves to empty above
    }
  }
  const key_tile_loader loader(cache, rc.layer, it.seq, rc.head, at);
  // The key tile at `pos` (whole tiles of a constant head dim by the loader's
  // test-free path).
  const auto load_tile = [&](std::uint16_t* to, std::int32_t pos) {
    loader.template copy_tile<mma_key_tile, HeadDim>(cache, to, n - pos, pos);
  };
  for (int pass = block_stats ? 1 : 0; pass < 2; ++pass) {
    __syncthreads();
    if (pass == 1)
      for (std::int32_t i = threadIdx.x; i < (in_fragments ? rows : QW); i += blockDim.x) {
        float2 st = stat[i];
        if (!by_logits) {
          // The row's statistics from those of its two halves.
          const float2 a = half_stat[2 * i], b = half_stat[2 * i + 1];
          const float m = fmaxf(a.x, b.x);
          st = {m, rescaled_sum(a, m) + rescaled_sum(b, m)};
        }
        // (max, 1 / sum); a row that sees no key gets (0, 0), so its terms are 0, not NaN.
        stat[i] = st.x == ninf ? float2{0.0f, 0.0f} : float2{st.x, 1.0f / st.y};
      }
    if (key_begin < key_end) {  // else no tile waits for the copy, and the next pass would copy again
      load_tile(kbase, key_begin);
      cp_async_commit();
    }
    // A key's score from the window partials of every query chunk (chunk order),
    // left in part's buffer `b` by the probability pass over the tile at `tile`.
    const auto finish_scores = [&](std::int32_t tile, int b) {
      const std::int32_t t = tile + static_cast<std::int32_t>(threadIdx.x);
      if (threadIdx.x < static_cast<unsigned>(mma_key_tile) && t < n) {
        float total = 0.0f;
        for (std::int32_t c = 0; c < rows / 32; ++c) total += part[(b * (rows / 32) + c) * mma_key_tile + threadIdx.x];
        scores[row * std::int64_t{rs.max_tokens} + t] =
            s.reduce == window_reduce::mean ? total * (1.0f / static_cast<float>(w)) : total;
      }
    };
    int buf = 0;
    for (std::int32_t tile = key_begin; tile < key_end; tile += mma_key_tile, buf ^= 1) {
      // One barrier per tile: it publishes this tile and tells every warp is done
      // with the other buffer, which the next tile's copy then overwrites; with the
      // reduces in the fragments it also completes the previous tile's window partials.
      cp_async_wait<0>();
      if constexpr (use_wgmma) fence_async_shared();
      __syncthreads();
      if (pass == 1 && in_fragments && tile > key_begin) finish_scores(tile - mma_key_tile, buf ^ 1);
      const std::int32_t next = tile + mma_key_tile;
      if (next < key_end) {
        load_tile(kbase + (buf ^ 1) * tile_elems, next);
        cp_async_commit();
      }

      const std::uint16_t* kb = kbase + buf * tile_elems;
      // Cautious update (the Cautious instance only): keys the head dropped are masked
      // like keys no query sees; one bit per key of the tile, the same in every lane.
      std::uint64_t tile_held = ~0ull;
      if constexpr (Cautious) {
        const auto bit = [&](std::int32_t t) { return t < n && cache.alive(rc.layer, it.seq, t, rc.head); };
        tile_held = __ballot_sync(0xffffffffu, bit(tile + lane)) |
                    std::uint64_t{__ballot_sync(0xffffffffu, bit(tile + 32 + lane))} << 32;
      }
      const auto held = [&](std::int32_t t) { return !Cautious || ((tile_held >> (t - tile)) & 1u) != 0; };
      // Probabilities with the keys as rows: warps take (16 keys x 32 queries) pieces.
      // (This MMA loop is the logits loop below with A and B swapped; one helper for
      // both was slower, from its register allocation: bench/results/README.md.)
      for (std::int32_t piece = warp; pass == 1 && in_fragments && piece < (rows / 32) * 4; piece += warps) {
        const std::int32_t key0 = (piece % 4) * 16, chunk = piece / 4, q0 = chunk * 32;
        float* chunk_part = part + (buf * (rows / 32) + chunk) * mma_key_tile;
        float acc[4][4];
        if constexpr (use_wgmma) {
          // The warpgroup's 64 keys x its chunk (piece = warp + 8 k: key0 = 16 (warp % 4)).
          wgmma_gram<Elem, 32>(acc, kb, qs + at(q0, 0), d);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
          for (std::int32_t k0 = 0; k0 < d; k0 += 16) {
            std::uint32_t a[4];
            ldmatrix_x4(a, kb + std::size_t(key0 + lane % 16) * pitch + k0 + (lane / 16) * 8);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              std::uint32_t b[4];
              ldmatrix_x4(b, qs + std::size_t(q0 + np * 16 + lane % 8 + (lane / 16) * 8) * pitch + k0 + ((lane / 8) % 2) * 8);
              mma_16816<Elem>(acc[np * 2], a, b[0], b[1]);
              mma_16816<Elem>(acc[np * 2 + 1], a, b[2], b[3]);
            }
          }
        }
        // The lane's 8 query columns: their statistics and window positions (slot sl
        // is position (q0 + (lane % 4) * 8 + sl) / G; the first two terms are
        // multiples of 8, so of G).
        float2 st[8];
        const std::int32_t pj0 = T - w + ((q0 + (lane % 4) * 8) >> order.g_shift);
#pragma unroll
        for (int sl = 0; sl < 8; ++sl) st[sl] = stat[q0 + query_order::row_of_slot(sl, lane % 4)];
        // One body per G and mask state: the mask tested per element, or G per key
        // row, took a third of the body's instructions in branches.
        const auto probabilities = [&]<int Gc, bool Masked>() {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const std::int32_t t = tile + key0 + lane / 4 + h * 8;
            float pr[8];
#pragma unroll
            for (int sl = 0; sl < 8; ++sl) {
              float z = acc[sl / 2][h * 2 + sl % 2];
              if constexpr (Masked) z = t < n && s.visible(pj0 + sl / Gc, t) && held(t) ? z : ninf;
              pr[sl] = s.transform(exp2_ftz(fmaf(z, scale, -st[sl].x)) * st[sl].y);
            }
            const float win = chunk_window_sum<Gc>(s, pr, pj0, T, t);
            if (lane % 4 == 0) chunk_part[key0 + lane / 4 + h * 8] = win;
          }
        };
        const bool plain = tile + mma_key_tile <= plain_end;
        const auto masked_or_not = [&]<int Gc>() {
          if (plain)
            probabilities.template operator()<Gc, false>();
          else
            probabilities.template operator()<Gc, true>();
        };
        switch (G) {
          case 1: masked_or_not.template operator()<1>(); break;
          case 2: masked_or_not.template operator()<2>(); break;
          case 4: masked_or_not.template operator()<4>(); break;
          default: masked_or_not.template operator()<8>(); break;
        }
      }
      // Logits of the tile: warps take (16 queries x 32 keys) pieces.
      for (std::int32_t piece = warp; !(pass == 1 && in_fragments) && piece < (rows / 16) * 2; piece += warps) {
        // On wgmma a warpgroup takes 64 queries x 32 keys (piece = warp + 8 k: the
        // k-th 64 queries, 16 of them per warp, and the warpgroup's half of the keys).
        const std::int32_t m0 = use_wgmma ? (piece / 8) * 64 + (piece % 4) * 16 : (piece / 2) * 16;
        const std::int32_t n0 = use_wgmma ? (piece / 4) % 2 * 32 : (piece % 2) * 32;
        float acc[4][4];
        if constexpr (use_wgmma) {
          wgmma_gram<Elem, 32>(acc, qs + at((piece / 8) * 64, 0), kb + at(n0, 0), d);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
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
        }
        // The thread's two query rows and their window positions, once per piece.
        // Masked keys are -inf; scale * log2(e) is applied inside one FFMA with the
        // row's max subtracted (max commutes with the positive scale).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::int32_t qi = m0 + lane / 4 + h * 8;
          float z[8];
          if (tile + mma_key_tile <= plain_end) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) z[2 * nt] = acc[nt][h * 2], z[2 * nt + 1] = acc[nt][h * 2 + 1];
          } else {
            const std::int32_t j = order.position(qi), pj = T - w + j;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              const std::int32_t t = tile + n0 + nt * 8 + (lane % 4) * 2;
              z[2 * nt] = j < w && t < n && s.visible(pj, t) && held(t) ? acc[nt][h * 2] : ninf;
              z[2 * nt + 1] = j < w && t + 1 < n && s.visible(pj, t + 1) && held(t + 1) ? acc[nt][h * 2 + 1] : ninf;
            }
          }
          if (by_logits) {
            // Statistics per window position come after the group max, from shared memory.
            float* zrow = zs + std::size_t(qi) * zp + n0 + (lane % 4) * 2;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
              *reinterpret_cast<float2*>(zrow + nt * 8) = {z[2 * nt] * scale, z[2 * nt + 1] * scale};
          } else if (pass == 0) {
            // Statistics straight from the fragments: the quad holds the row's 32 keys.
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
            if (lane % 4 == 0 && m != ninf) {
              float2& run = half_stat[2 * qi + n0 / 32];
              run = merge_nonempty(run, ms, e);
            }
          } else {
            // Probabilities through shared memory, where the reduces read them.
            const float2 st = qi < QW ? stat[qi] : float2{0.0f, 0.0f};
            float* prow = zs + std::size_t(qi) * zp + n0 + (lane % 4) * 2;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
              *reinterpret_cast<float2*>(prow + nt * 8) = {s.transform(exp2_ftz(fmaf(z[2 * nt], scale, -st.x)) * st.y),
                                                           s.transform(exp2_ftz(fmaf(z[2 * nt + 1], scale, -st.x)) * st.y)};
          }
        }
      }
      // Statistics in the fragments are complete, and window partials are summed
      // after it: the next tile's barrier suffices.
      if (!by_logits && (pass == 0 || in_fragments)) continue;
      __syncthreads();

      if (pass == 0) {
        // Statistics per window position, of the group's max logit: four adjacent
        // threads take 16 keys each of one row, then fold in the quad.
        const std::int32_t stat_rows = w;
        for (std::int32_t idx = threadIdx.x; idx < round_up4(stat_rows) ; idx += blockDim.x) {
          const std::int32_t i = idx / 4, k0 = (idx % 4) * 16;
          float z[16];
#pragma unroll
          for (int k = 0; k < 16; ++k) z[k] = ninf;
          if (i < stat_rows) {
            for (std::int32_t g = 0; g < G; ++g) {
              const float* zr = zs + std::size_t(i * G + g) * zp + k0;
#pragma unroll
              for (int k = 0; k < 16; ++k) z[k] = fmaxf(z[k], zr[k]);
            }
          }
          float m = ninf;
#pragma unroll
          for (int k = 0; k < 16; ++k) m = fmaxf(m, z[k]);
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          float e = 0.0f;
          if (m != ninf) {
#pragma unroll
            for (int k = 0; k < 16; ++k) e += z[k] == ninf ? 0.0f : exp2f(z[k] - m);
          }
          e += __shfl_xor_sync(0xffffffffu, e, 1);
          e += __shfl_xor_sync(0xffffffffu, e, 2);
          // Only the quad's first thread touches the running statistics of row i.
          if (idx % 4 == 0 && i < stat_rows && m != ninf) {
            stat[i] = merge_nonempty(stat[i], m, e);
          }
        }
      } else {
        // Scores: window_splits threads per key split the window (a warp covers 32
        // consecutive keys of one split), then add in a fixed order.
        const std::int32_t key = threadIdx.x % mma_key_tile, sub = threadIdx.x / mma_key_tile, t = tile + key;
        const bool valid = t < n;
        float acc = 0.0f;
        for (std::int32_t j = sub; valid && j < w; j += window_splits) {
          const std::int32_t pj = T - w + j;
          if (!s.contributes(pj, t)) continue;
          if (by_logits) {
            float zz = ninf;
            for (std::int32_t g = 0; g < G; ++g) zz = fmaxf(zz, zs[std::size_t(j * G + g) * zp + key]);
            const float2 st = stat[j];
            acc += s.transform(zz == ninf ? 0.0f : exp2f(zz - st.x) * st.y);
          } else {
            float gacc = s.group == group_reduce::max ? ninf : 0.0f;
            for (std::int32_t g = 0; g < G; ++g) {
              const float p = zs[std::size_t(j * G + g) * zp + key];
              gacc = s.group == group_reduce::max ? fmaxf(gacc, p) : gacc + p;
            }
            acc += s.group == group_reduce::mean ? gacc / static_cast<float>(G) : gacc;
          }
        }
        part[sub * mma_key_tile + key] = acc;
        __syncthreads();
        if (sub == 0 && valid) {
          float total = part[key];
          for (int k = 1; k < window_splits; ++k) total += part[k * mma_key_tile + key];
          scores[row * std::int64_t{rs.max_tokens} + t] =
              s.reduce == window_reduce::mean ? total * (1.0f / static_cast<float>(w)) : total;
        }
      }
    }
    // The last tile's window partials (buf has moved past its buffer).
    if (pass == 1 && in_fragments && key_begin < key_end) {
      __syncthreads();
      finish_scores((key_end - 1) / mma_key_tile * mma_key_tile, buf ^ 1);
    }
  }
  publish_scores(ready_out, row, stats_ready != nullptr);
}

}  // namespace cuda
KVP_NAMESPACE_END
