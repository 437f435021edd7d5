// Stage kind: attention scorers (AttentionScorer). Window attention over the paged
// keys: on tensor cores (attention_score_mma_kernel, wgmma where its tiles fit) for
// 16-bit caches, else in fp32 (attention_score_kernel).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/score_kernel.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Where a score stage's launch writes and what it waits for.
struct score_launch {
  cudaStream_t stream;
  bool programmatic;              // a programmatic dependent launch (after lightning)
  row_space rs;                   // the launch group's rows
  float* scores;                  // [rows][max_tokens]
  std::int32_t* ready_out;        // null, or the flags that hand each row on
  const float2* block_stats;      // null, or lightning's softmax statistics of the row's blocks
  const std::int32_t* stats_ready;  // null, or lightning's per-row count of finished blocks
};

// Query rows are read 16 bytes at a time (the kernels' loads and fragments).
inline void check_query_rows(const query_window_view& q) {
  const auto aligned = [&](std::int64_t elems) { return elems * size_of(q.type) % 16 == 0; };
  require(aligned(q.layer_stride) && aligned(q.slot_stride) && aligned(q.pos_stride) && aligned(q.head_stride),
          "queries", "strides (layer {}, slot {}, pos {}, head {}) must keep rows on 16-byte boundaries", q.layer_stride,
          q.slot_stride, q.pos_stride, q.head_stride);
  require(reinterpret_cast<std::uintptr_t>(q.base) % 16 == 0, "queries.base", "address {:#x} is not 16-byte aligned",
          reinterpret_cast<std::uintptr_t>(q.base));
}

struct attention_score_stage {
  struct plan_type : launch_plan {
    bool mma = false;               // on tensor cores
    bool wgmma = false;             // the wgmma variant (head dims 64 and 128, whole warpgroup tiles)
    bool cautious = false;          // the instance that reads the live view
    std::int32_t key_splits = 1;    // blocks per row
  };

  // `statistics`: the redundancy stage computes the softmax statistics, so the kernel
  // makes one pass over the keys, and may split a row over several blocks.
  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows, bool statistics) {
    plan_type pl;
    const std::int32_t G = c.group_size(), w = c.p.scorer.window, d = c.cache.head_dim;
    pl.mma = c.mma_scores();
    if (pl.mma) {
      pl.smem = attention_mma_smem_bytes(w, G, d, reduces_in_fragments(c.p.scorer.group, G));
      // Cautious update (a live view) runs its own instance: mma.sync, run-time head dim.
      pl.cautious = !c.cache.live.empty();
      pl.wgmma = !pl.cautious && c.constant_head_dim() && score_wgmma_fits(c.p.scorer.group, w, G);
      pl.key_splits = c.opt.split_rows && statistics
                          ? score_key_splits(rows, c.max_tokens,
                                             std::int64_t{score_tuning::blocks_per_sm} * c.dev.multiprocessors)
                          : 1;
      pl.kernel = pl.wgmma      ? "attention_score_mma_kernel<wgmma>"
                  : pl.cautious ? "attention_score_mma_kernel<cautious>"
                                : "attention_score_mma_kernel";
    } else {
      pl.smem = attention_smem_floats(w, G, d) * sizeof(float);
      pl.kernel = "attention_score_kernel";
    }
    pl.grid_x = static_cast<unsigned>(rows * pl.key_splits);
    return pl;
  }

  template <class P>
  static void check(const stage_context<P>& c, const plan_type& pl) {
    const query_window_view& q = c.queries;
    require(pl.smem <= c.dev.smem_per_block, "pipeline.scorer.window",
            "is {}; {} queries of {} dims per KV head exceed {} bytes of shared memory", c.p.scorer.window,
            c.p.scorer.window * c.group_size(), c.cache.head_dim, c.dev.smem_per_block);
    check_query_rows(q);
  }

  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const score_launch& a) {
    using S = typename P::scorer_type;
    if (!pl.mma) {
      cuda::launch(pl, a.stream, a.programmatic, attention_score_kernel<S>, c.p.scorer, c.cache, c.queries, a.rs,
                   a.scores, a.ready_out);
      return;
    }
    with_mma_types(c.cache, [&]<dtype Elem, int HeadDim>() {
      const auto go = [&](auto kernel) {
        cuda::launch(pl, a.stream, a.programmatic, kernel, c.p.scorer, c.cache, c.queries, a.rs, a.scores, a.ready_out,
                     a.block_stats, pl.key_splits, a.stats_ready);
      };
      if (pl.cautious) return go(attention_score_mma_kernel<S, Elem, 0, false, true>);
      if constexpr (HeadDim > 0) {
        if (pl.wgmma) return go(attention_score_mma_kernel<S, Elem, HeadDim, true>);
      }
      go(attention_score_mma_kernel<S, Elem, HeadDim>);
    });
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
