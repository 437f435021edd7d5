// Stage kind: redundancy over all pairs of a row's candidates (redundancy::scope::full,
// R-KV). On tensor cores for 16-bit caches: inverse norms and partial key sums
// (key_norms_and_sums_kernel), the upper triangle of the Gram matrix streamed in tiles
// (full_pairs_mma_kernel); else in fp32 (full_columns_kernel); then the newest
// neighbours' dropped similarities (full_finish_kernel). O(T) workspace per row.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/full_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/redundancy_kernel.cuh"
#include "kvpolicy/exec/cuda/stage_block_redundancy.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct full_redundancy_stage {
  struct plan_type {
    bool mma = false;
    int row_groups = 1;   // full_pairs_mma_kernel's 128-key row groups per block (1 or 2)
    launch_plan norms;    // key_norms_and_sums_kernel (tensor cores only)
    launch_plan pairs;    // full_pairs_mma_kernel or full_columns_kernel
    launch_plan finish;   // full_finish_kernel
  };
  // Workspace offsets, per row of the whole batch.
  struct buffers {
    std::size_t rowsum = 0, dropped = 0, inv = 0, key_sums = 0, packed = 0, newest = 0, newest_c = 0;
    std::int64_t spans = 0;  // partial key sums per row
  };

  template <class P>
  static bool computes_statistics(const stage_context<P>&) { return false; }
  template <class P>
  static std::int64_t statistics_per_row(const stage_context<P>&) { return 0; }
  static bool hands_rows_on(const plan_type&) { return false; }

  // Row groups per block: 2 where two blocks of them fit on an SM and the launch still
  // gives every SM two; a launch of few rows finishes sooner with smaller tiles.
  // cuda_executor::full_pairs_rows overrides it.
  template <class P>
  static int row_groups(const stage_context<P>& c, std::int64_t rows) {
    if (c.opt.full_pairs_rows != 0) return c.opt.full_pairs_rows / full_mma_columns(1);
    const std::size_t two = full_mma_smem_bytes(c.cache.head_dim, 2);
    const bool fits = two <= c.dev.smem_per_block && c.dev.blocks_per_sm(two) >= 2;
    const bool fills = rows * tiles_per_row(c.max_tokens, full_mma_columns(2)) >= 2 * std::int64_t{c.dev.multiprocessors};
    return fits && fills ? 2 : 1;
  }

  template <class P>
  static plan_type plan(const stage_context<P>& c, std::int64_t rows, bool) {
    plan_type pl;
    const std::int32_t d = c.cache.head_dim;
    pl.mma = c.mma_keys();
    // A block per (row, tile of keys) on a flat grid, a row's tiles adjacent.
    const auto row_tiles = [&](std::int32_t tile) {
      return static_cast<unsigned>(rows * tiles_per_row(c.max_tokens, tile));
    };
    if (pl.mma) {
      pl.row_groups = row_groups(c, rows);
      pl.norms.kernel = "key_norms_and_sums_kernel";
      pl.norms.grid_x = static_cast<unsigned>(rows);
      pl.norms.grid_y = static_cast<unsigned>(tiles_per_row(c.max_tokens, key_sum_span));
      pl.norms.smem = key_norms_smem_bytes(d);
      pl.pairs.kernel = pl.row_groups == 2 ? "full_pairs_mma_kernel<2 row groups>" : "full_pairs_mma_kernel";
      pl.pairs.grid_x = row_tiles(full_mma_columns(pl.row_groups));
      pl.pairs.smem = full_mma_smem_bytes(d, pl.row_groups);
    } else {
      pl.pairs.kernel = "full_columns_kernel";
      pl.pairs.grid_x = row_tiles(full_tile);
      pl.pairs.smem = full_smem_floats(d) * sizeof(float);
    }
    pl.finish.kernel = "full_finish_kernel";
    pl.finish.grid_x = static_cast<unsigned>(rows);
    return pl;
  }

  template <class P>
  static void check(const stage_context<P>& c, const plan_type& pl) {
    const std::size_t limit = c.dev.smem_per_block;
    if (pl.row_groups == 2 && c.opt.full_pairs_rows != 0)
      require(pl.pairs.smem <= limit, "full_pairs_rows", "is {}; a tile of {} keys of {} dims exceeds {} bytes of shared memory",
              c.opt.full_pairs_rows, c.opt.full_pairs_rows, c.cache.head_dim, limit);
    require(std::max(pl.pairs.smem, pl.norms.smem) <= limit, "cache.head_dim",
            "is {}; a tile of keys exceeds {} bytes of shared memory", c.cache.head_dim, limit);
    // The flat grid of (row, tile) blocks in gridDim.x.
    const std::int32_t smallest_tile = std::min(full_tile, full_mma_columns(1));
    const std::int64_t rows = pl.finish.grid_x;
    const std::int64_t blocks = rows * tiles_per_row(c.max_tokens, smallest_tile);
    require(blocks <= 2147483647, "batch.num_items",
            "is too large: full redundancy over {} rows of {} tokens would launch {} blocks, more than a grid holds", rows,
            c.max_tokens, blocks);
  }

  template <class P>
  static buffers reserve(const stage_context<P>& c, const plan_type& pl, workspace_builder& ws, std::int64_t rows) {
    const std::size_t cells = static_cast<std::size_t>(rows) * static_cast<std::size_t>(c.max_tokens);
    buffers b;
    b.rowsum = ws.take(cells * sizeof(float));
    b.dropped = ws.take(cells * sizeof(unsigned long long));  // full_finish_kernel's dropped_sums
    if (pl.mma) {
      b.spans = tiles_per_row(c.max_tokens, key_sum_span);
      b.inv = ws.take(cells * sizeof(float));
      b.key_sums = ws.take(static_cast<std::size_t>(rows * b.spans) * static_cast<std::size_t>(c.cache.head_dim) *
                           sizeof(float));
      b.packed = ws.take(cells * sizeof(unsigned long long));
    } else {
      b.newest = ws.take(cells * sizeof(std::int32_t));
      b.newest_c = ws.take(cells * sizeof(float));
    }
    return b;
  }

  template <class P>
  static void launch(const stage_context<P>& c, const plan_type& pl, const buffers& b, const redundancy_launch& a) {
    const std::int64_t pitch = c.max_tokens, row0 = a.row0;
    auto* rowsum = rows_of<float>(a.workspace, b.rowsum, row0, pitch);
    unsigned long long* packed = nullptr;
    std::int32_t* newest = nullptr;
    float* newest_c = nullptr;
    if (pl.mma) {
      auto* inv = rows_of<float>(a.workspace, b.inv, row0, pitch);
      auto* key_sums = rows_of<float>(a.workspace, b.key_sums, row0, b.spans * c.cache.head_dim);
      packed = rows_of<unsigned long long>(a.workspace, b.packed, row0, pitch);
      with_mma_types(c.cache, [&]<dtype Elem, int HeadDim>() {
        cuda::launch(pl.norms, a.stream, false, key_norms_and_sums_kernel<P, Elem, HeadDim>, c.p, c.cache, a.rs, inv,
                     key_sums, packed);
        const auto pairs = [&]<int G>() {
          cuda::launch(pl.pairs, a.stream, false, full_pairs_mma_kernel<P, Elem, HeadDim, G>, c.p, c.cache, a.rs,
                       static_cast<const float*>(inv), static_cast<const float*>(key_sums), rowsum, packed);
        };
        if (pl.row_groups == 2)
          pairs.template operator()<2>();
        else
          pairs.template operator()<1>();
      });
    } else {
      newest = rows_of<std::int32_t>(a.workspace, b.newest, row0, pitch);
      newest_c = rows_of<float>(a.workspace, b.newest_c, row0, pitch);
      cuda::launch(pl.pairs, a.stream, false, full_columns_kernel<P>, c.p, c.cache, a.rs, rowsum, newest, newest_c);
    }
    auto* dropped = rows_of<unsigned long long>(a.workspace, b.dropped, row0, pitch);
    cuda::launch(pl.finish, a.stream, false, full_finish_kernel<P>, c.p, c.cache, a.rs, static_cast<const float*>(rowsum),
                 static_cast<const std::int32_t*>(newest), static_cast<const float*>(newest_c),
                 static_cast<const unsigned long long*>(packed), dropped, a.red);
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
