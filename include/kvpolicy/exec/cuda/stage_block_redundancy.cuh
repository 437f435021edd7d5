// Stage kind: redundancy within each cache block (redundancy::scope::block, Zipage's
// lightning). On tensor cores for 16-bit caches (lightning_mma_kernel, whose register
// budget its tuning policy sets; it may also compute the attention scorer's softmax
// statistics), else in fp32 (lightning_kernel). One block per (row, cache block).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/block_statistics.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/lightning_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/redundancy_kernel.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Where a redundancy stage's launch writes. The workspace buffers of the full scope
// are its own (full_redundancy_stage::buffers).
struct redundancy_launch {
  cudaStream_t stream;
  row_space rs;
  std::int64_t row0;           // the launch group's first row in the batch
  float* red;                  // [rows][max_tokens]: red(t) / n / tau
  float2* block_stats;         // null, or where the softmax statistics go (lightning)
  std::int32_t* stats_ready;   // null, or the per-row counts of finished blocks (lightning)
  std::byte* workspace;        // the caller's workspace, for the stage's own buffers
};

struct block_redundancy_stage {
  enum class variant : std::uint8_t { fp32, three, three_without_statistics, pair, wide };
  struct plan_type : launch_plan {
    variant kind = variant::fp32;
  };
  struct buffers {};

  // How many lightning blocks on tensor cores fit per SM, 1 to 3 (shared memory).
  // Head dims built as constants (64, 128), and caches off tensor cores, count as three.
  template <class P>
  static int blocks_per_sm(const stage_context<P>& c) {
    if (!c.mma_keys() || c.constant_head_dim()) return 3;
    const std::size_t fit = c.dev.blocks_per_sm(lightning_mma_smem_bytes(c.cache.block_size, c.cache.head_dim));
    return static_cast<int>(std::clamp<std::size_t>(fit, 1, 3));
  }

  // Whether the lightning kernel also computes the attention scorer's softmax
  // statistics (cuda_executor::statistics_in_redundancy), so that the score kernel
  // reads the keys once: an attention scorer whose reduces run in the fragments, both
  // stages on tensor cores, a head dim whose query fragments fit the kernel's
  // registers (the tuning policy's bound), and cache blocks of at least twice as many
  // keys as the window has query rows (each lightning block reads those queries).
  template <class P>
  static bool computes_statistics(const stage_context<P>& c) {
    if constexpr (AttentionScorer<typename P::scorer_type>) {
      const std::int32_t G = c.group_size();
      const std::int32_t max_d = blocks_per_sm(c) < 3 ? lightning_pair::statistics_max_head_dim
                                                      : lightning_three::statistics_max_head_dim;
      return c.opt.statistics_in_redundancy && c.mma_scores() && reduces_in_fragments(c.p.scorer.group, G) &&
             c.cache.head_dim <= max_d && 2 * round32(c.p.scorer.window * G) <= c.cache.block_size;
    } else {
      return false;
    }
  }
  // Softmax statistics (float2) per row, where computes_statistics.
  template <class P>
  static std::int64_t statistics_per_row(const stage_context<P>& c) {
    return std::int64_t{c.blocks_per_row()} * block_statistics_count(scorer_window(c.p.scorer), c.group_size());
  }

  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows, bool statistics) {
    plan_type pl;
    pl.grid_x = static_cast<unsigned>(rows);
    pl.grid_y = static_cast<unsigned>(c.blocks_per_row());
    if (!c.mma_keys()) {
      pl.kind = variant::fp32;
      pl.kernel = "lightning_kernel";
      pl.smem = lightning_smem_floats(c.cache.block_size, c.cache.head_dim) * sizeof(float);
      return pl;
    }
    pl.smem = lightning_mma_smem_bytes(c.cache.block_size, c.cache.head_dim);
    const int per_sm = blocks_per_sm(c);
    if (c.constant_head_dim()) {
      pl.kind = variant::three;
    } else if (per_sm == 1) {
      pl.kind = variant::wide;
    } else if (per_sm == 2 && statistics) {
      pl.kind = variant::pair;
    } else {
      pl.kind = statistics ? variant::three : variant::three_without_statistics;
    }
    pl.threads = pl.kind == variant::wide ? lightning_wide::threads : lightning_three::threads;
    switch (pl.kind) {
      case variant::wide: pl.kernel = "lightning_mma_kernel<wide>"; break;
      case variant::pair: pl.kernel = "lightning_mma_kernel<pair>"; break;
      case variant::three_without_statistics: pl.kernel = "lightning_mma_kernel<three, no statistics>"; break;
      default: pl.kernel = "lightning_mma_kernel<three>"; break;
    }
    return pl;
  }
  // Whether the score kernel may take a row once that row's lightning blocks are done
  // (not once the whole grid is): not after the wide kernel, where score blocks beside
  // its last blocks slowed it (bench/results/README.md, "Tuning constants").
  static bool hands_rows_on(const plan_type& pl) { return pl.kind != variant::wide; }

  template <class P>
  static void check(const stage_context<P>& c, const plan_type& pl) {
    require(pl.smem <= c.dev.smem_per_block, "cache.block_size", "is {}; a block of {}-dim keys exceeds {} bytes of shared memory",
            c.cache.block_size, c.cache.head_dim, c.dev.smem_per_block);
  }
  template <class P>
  static buffers reserve(const stage_context<P>&, const plan_type&, workspace_builder&, std::int64_t) {
    return {};
  }

  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const buffers&, const redundancy_launch& a) {
    if (pl.kind == variant::fp32) {
      cuda::launch(pl, a.stream, false, lightning_kernel<P>, c.p, c.cache, a.rs, a.red);
      return;
    }
    with_mma_types(c.cache, [&]<dtype Elem, int HeadDim>() {
      const auto go = [&](auto kernel) {
        cuda::launch(pl, a.stream, false, kernel, c.p, c.cache, a.rs, a.red, c.queries, a.block_stats, a.stats_ready);
      };
      if constexpr (HeadDim == 0) {
        if (pl.kind == variant::wide) return go(lightning_mma_kernel<P, Elem, 0, true, lightning_wide>);
        if (pl.kind == variant::pair) return go(lightning_mma_kernel<P, Elem, 0, true, lightning_pair>);
        if (pl.kind == variant::three_without_statistics)
          return go(lightning_mma_kernel<P, Elem, 0, false, lightning_three>);
      }
      go(lightning_mma_kernel<P, Elem, HeadDim, true, lightning_three>);
    });
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
