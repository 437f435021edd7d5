// The CUDA executor: runs any pipeline of the token-wise family on a stream, over
// the same views as the host executor, with the same keep masks and bytes.
//
// CUB's two-phase convention: call compress() with temp == nullptr to get the
// workspace size, allocate it, call again. No allocation, no host synchronisation:
// a whole compression can be captured in a CUDA graph. Malformed shapes throw
// kvp::error before any launch; malformed device data (lengths, block ids, batch
// items) is caught by the first kernel, which then stops every later kernel, and
// is reported in `device_result::status` (see check()).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/compact_kernel.cuh"
#include "kvpolicy/exec/cuda/epilogue_kernel.cuh"
#include "kvpolicy/exec/cuda/redundancy_kernel.cuh"
#include "kvpolicy/exec/cuda/score_kernel.cuh"
#include "kvpolicy/exec/cuda/score_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/lightning_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/full_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/validate_kernel.cuh"
#include "kvpolicy/exec/device_status.hpp"
#include "kvpolicy/exec/validate.hpp"
#include "kvpolicy/pipeline/pipeline.hpp"

KVP_NAMESPACE_BEGIN

// A compression batch whose items live in device memory.
struct device_batch {
  const batch_item* items = nullptr;  // device, [num_items]
  std::int32_t num_items = 0;
  std::int32_t max_tokens = 0;  // at least every batch sequence's length (checked on the device)
  std::int32_t layer_begin = 0;
  std::int32_t layer_count = 0;  // 0: all layers from layer_begin on
};

// Where the executor writes its results, all device memory.
struct device_result {
  std::int32_t* status = nullptr;           // [status_words]; 0 in status[0] means success
  std::int32_t* new_lengths = nullptr;      // [num_items]
  std::int32_t* released_counts = nullptr;  // [num_items]
  std::int32_t* released_blocks = nullptr;  // [num_items][max_blocks(batch, cache)]
  std::uint8_t* keep_masks = nullptr;       // optional [num_items][layers][h_kv][max_tokens]
  float* scores = nullptr;                  // optional, same shape: final scores after protect
};

// Optional copies of the results to pinned host memory, made on the same stream.
struct host_mirror {
  std::int32_t* status = nullptr;
  std::int32_t* new_lengths = nullptr;
  std::int32_t* released_counts = nullptr;
  std::int32_t* released_blocks = nullptr;
};

// Rows of the released-block list of each item.
inline std::int32_t max_blocks(const device_batch& batch, const paged_kv_view& cache) {
  return (batch.max_tokens + cache.block_size - 1) / cache.block_size;
}

// Throws the kvp::error a failed device validation stands for (status in host memory).
inline void check(const std::int32_t* host_status) { throw_if_error(host_status); }

struct cuda_executor {
  cudaStream_t stream = nullptr;
  host_mirror mirror{};
  // Optional: 5 events recorded before the first kernel and after the score,
  // redundancy, epilogue (aggregate + select) and layout stages; where the redundancy
  // stage computes the softmax statistics (redundancy_computes_statistics) it runs
  // first, so events 1 and 2 follow the redundancy and the score stage. Not while
  // capturing.
  // With them the stages run one after the other, without the programmatic
  // dependent launches and row hand-offs that otherwise let each start in the last
  // wave of the one before (run_stages), so that their times add up.
  cudaEvent_t* stage_marks = nullptr;
  // Q.K^T and K.K^T on tensor cores when the cache is f16/bf16 (and the queries of
  // the same type) and head_dim is a multiple of 16; false forces the fp32 FMA kernels.
  bool tensor_cores = true;
  // Lightning redundancy on tensor cores also computes the window attention's softmax
  // statistics from the keys it holds in shared memory, so that the score kernel
  // reads the keys once, not twice (where redundancy_computes_statistics says). The
  // results differ from those without it only by fp32 rounding.
  bool statistics_in_redundancy = true;
  // Optional overlap, given a second stream and two events (fork, join). The batch's
  // items are split into `overlap_groups` groups and pipelined: `stream` runs each
  // group's epilogue and compaction (bound by memory) while `overlap_stream` runs the
  // next group's score and redundancy stages (bound by arithmetic); the first group's
  // redundancy runs beside its score (unless it computes the score's statistics:
  // then it runs before it, on overlap_stream), so one kernel's last wave leaves no
  // SM idle that the other can use. Groups touch disjoint sequences and each group's
  // stages keep their order, so the results are the same; fork and join are events,
  // so a capture records every branch. stage_marks 1 to 3 are then recorded with 4.
  cudaStream_t overlap_stream = nullptr;
  cudaEvent_t* overlap_events = nullptr;  // [2]
  // The best count depends on the batch: on configuration A (16 items, H100) 1 group
  // measured 1.67 ms, 2 / 3 / 4 groups 1.70 / 1.75 / 1.70, and one stream, chained with
  // row hand-offs (run_stages), 1.63: there the overlap does not pay.
  std::int32_t overlap_groups = 1;  // at least 1 when overlap_stream is set
  // Keys u per block of full redundancy's tensor-core kernel, which streams the rest
  // of the row's keys from L2 past them: 0 (default) takes 256 where two such blocks
  // fit in an SM's shared memory (sm_90: 2 x 104 KB at d 128; half the L2 traffic of
  // 128, e2e/gkv/A 4.41 -> 3.80 ms on the H100) and the launch still gives each SM
  // two, else 128 (sm_80, consumer parts, few rows); 128 or 256 asks for that size.
  std::int32_t full_pairs_rows = 0;
  // Where a launch has too few rows to fill the GPU (one sequence of 8 layers: 64),
  // the score kernel's single pass splits each row's keys over several blocks and the
  // compaction each row's bytes into column slices (cuda::score_key_splits,
  // cuda::compact_slices); the results are the same. false: one block per row.
  bool split_rows = true;

  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L>
  cudaError_t compress(void* temp, std::size_t& temp_bytes, const pipeline<S, A, R, Sel, L>& p,
                       const paged_kv_view& cache, const query_window_view& queries, const score_view& scores,
                       const device_batch& batch, const device_result& out) const {
    using P = pipeline<S, A, R, Sel, L>;
    const P pv = p;
    validate_shapes(pv, cache, queries, scores, compression_batch{{}, batch.layer_begin, batch.layer_count}, false);
    const layer_range layers = resolve_layers(compression_batch{{}, batch.layer_begin, batch.layer_count}, cache);
    require(batch.num_items >= 0, "batch.num_items", "is {}; must not be negative", batch.num_items);
    require(batch.max_tokens > 0, "batch.max_tokens", "is {}; must be positive", batch.max_tokens);
    check_device_shapes(pv, cache, queries, batch, layers);
    if (overlap_stream) {
      require(overlap_events != nullptr, "overlap_events", "is a null pointer while overlap_stream is set");
      require(overlap_groups >= 1, "overlap_groups", "is {}; must be at least 1 when overlap_stream is set",
              overlap_groups);
      require(overlap_stream != stream, "overlap_stream", "is the executor's stream; the overlap needs a second one");
    }
    require(full_pairs_rows == 0 || full_pairs_rows == cuda::full_mma_columns(1) ||
                full_pairs_rows == cuda::full_mma_columns(2),
            "full_pairs_rows", "is {}; must be 0 (chosen per device), {} or {}", full_pairs_rows,
            cuda::full_mma_columns(1), cuda::full_mma_columns(2));

    const cuda::row_space rs{batch.items, batch.num_items, layers.begin, layers.end - layers.begin, cache.num_kv_heads,
                       batch.max_tokens, out.status};
    const bool stats = redundancy_computes_statistics(pv, cache, queries);
    const std::int64_t stats_per_row =
        stats ? std::int64_t{max_blocks(batch, cache)} *
                    cuda::block_statistics_count(scorer_window(pv.scorer), queries.num_q_heads / cache.num_kv_heads)
              : 0;
    const auto plan =
        plan_workspace<P>(rs, cache.head_dim, out, !rows_fit_in_shared_memory(batch.max_tokens), stats_per_row,
                          mma_keys(cache));
    if (temp == nullptr) {
      temp_bytes = plan.total;
      return cudaSuccess;
    }
    require(temp_bytes >= plan.total, "temp_bytes", "is {}; the batch needs {}", temp_bytes, plan.total);
    require(out.status && out.new_lengths && out.released_counts && out.released_blocks, "out",
            "needs status, new_lengths, released_counts and released_blocks (a null pointer was given)");
    require(batch.num_items == 0 || batch.items != nullptr, "batch.items", "is a null pointer");

    auto* ws = static_cast<std::byte*>(temp);
    const auto mark = [&](int i) {
      if (stage_marks) cudaEventRecord(stage_marks[i], stream);
    };

    cudaMemsetAsync(out.status, 0, status_words * sizeof(std::int32_t), stream);
    mark(0);
    if (batch.num_items > 0) {
      cuda::validate_kernel<<<batch.num_items, cuda::row_threads, 0, stream>>>(
          pv, cache, queries, rs, reinterpret_cast<std::int32_t*>(ws + plan.ready), workspace_plan::flag_sets);
      if (!overlap_stream) {
        run_stages(pv, cache, queries, scores, rs, 0, batch.num_items, ws, plan, out, {stream, stream, stream}, mark,
                   stage_marks == nullptr, stats);
      } else {
        // A pipeline: `stream` runs every group's epilogue and compaction, the overlap
        // stream the next group's score and redundancy meanwhile; group 0 splits its
        // score (here) and redundancy (there).
        const std::int32_t groups = std::min(overlap_groups, batch.num_items);
        cudaEventRecord(overlap_events[0], stream);
        cudaStreamWaitEvent(overlap_stream, overlap_events[0], 0);
        for (std::int32_t g = 0; g < groups; ++g) {
          const std::int32_t first = static_cast<std::int32_t>(std::int64_t{batch.num_items} * g / groups);
          const std::int32_t last = static_cast<std::int32_t>(std::int64_t{batch.num_items} * (g + 1) / groups);
          // Where redundancy computes the statistics, each group's redundancy and score
          // run on the overlap stream, one after the other.
          const stage_streams on{g == 0 && !stats ? stream : overlap_stream, overlap_stream, stream};
          run_stages(pv, cache, queries, scores, rs, first, last - first, ws, plan, out, on, [](int) {}, false, stats);
        }
        cudaEventRecord(overlap_events[1], overlap_stream);
        cudaStreamWaitEvent(stream, overlap_events[1], 0);
        mark(1), mark(2), mark(3);
      }
    } else {
      mark(1), mark(2), mark(3);
    }
    mark(4);
    if (mirror.status) {
      cudaMemcpyAsync(mirror.status, out.status, status_words * sizeof(std::int32_t), cudaMemcpyDeviceToHost, stream);
      const std::size_t items = static_cast<std::size_t>(batch.num_items) * sizeof(std::int32_t);
      if (mirror.new_lengths) cudaMemcpyAsync(mirror.new_lengths, out.new_lengths, items, cudaMemcpyDeviceToHost, stream);
      if (mirror.released_counts)
        cudaMemcpyAsync(mirror.released_counts, out.released_counts, items, cudaMemcpyDeviceToHost, stream);
      if (mirror.released_blocks)
        cudaMemcpyAsync(mirror.released_blocks, out.released_blocks, items * max_blocks(batch, cache),
                        cudaMemcpyDeviceToHost, stream);
    }
    return cudaGetLastError();
  }

  // Whether the lightning kernel computes the window attention's softmax statistics
  // (statistics_in_redundancy): an attention scorer whose reduces run in the
  // fragments, both stages on tensor cores, head dim at most 128 (the query fragments
  // live in registers; 256 where fewer than three lightning blocks fit per SM, whose
  // kernels have the registers), and cache blocks of
  // at least twice as many keys as the window has query rows (each lightning block
  // reads those queries; with fewer keys it would read more queries than keys).
  template <class P>
  bool redundancy_computes_statistics(const P& p, const paged_kv_view& cache, const query_window_view& queries) const {
    using S = typename P::scorer_type;
    using R = typename P::redundancy_type;
    if constexpr (AttentionScorer<S> && requires { requires R::pairs == redundancy::scope::block; }) {
      const std::int32_t G = queries.num_q_heads / cache.num_kv_heads;
      return statistics_in_redundancy && mma_scores(cache, queries) && cuda::reduces_in_fragments(p.scorer.group, G) &&
             cache.head_dim <= (lightning_blocks_per_sm(cache) < 3 ? cuda::large_statistics_max_head_dim
                                                                   : cuda::statistics_max_head_dim) &&
             2 * cuda::round32(p.scorer.window * G) <= cache.block_size;
    } else {
      return false;
    }
  }

 private:
  struct workspace_plan;

  // Streams of the stages of one run_stages call: the epilogue and layout run on
  // `tail`; a score or redundancy stage elsewhere (a stream already ordered after
  // validation) is joined to it through overlap_events[1] before the epilogue.
  struct stage_streams {
    cudaStream_t score, redundancy, tail;
  };

  // The stages for items [first, first + count) of the batch: their rows are a
  // contiguous range of every per-row buffer, their per-item results a range of the
  // per-item ones. `mark(i)` records stage mark i (or nothing). `programmatic`: the
  // stages may be chained by programmatic dependent launches (nothing between them).
  // `stats`: redundancy_computes_statistics (score and redundancy on one stream); the
  // redundancy stage then runs first, and stage mark 1 follows it, 2 the score stage.
  template <class P, class Mark>
  void run_stages(const P& pv, const paged_kv_view& cache, const query_window_view& queries, const score_view& scores,
                  cuda::row_space rs, std::int32_t first, std::int32_t count, std::byte* ws, const workspace_plan& plan,
                  const device_result& out, stage_streams on, Mark mark, bool programmatic, bool stats) const {
    using S = typename P::scorer_type;
    using A = typename P::aggregate_type;
    using R = typename P::redundancy_type;
    using L = typename P::layout_type;
    const std::int64_t row0 = std::int64_t{first} * rs.num_layers * rs.num_heads, at = row0 * rs.max_tokens;
    rs.items += first;
    rs.num_items = count;
    const auto rows = static_cast<unsigned>(rs.rows());
    const std::int32_t blocks_per_item = (rs.max_tokens + cache.block_size - 1) / cache.block_size;
    auto* score_buf = reinterpret_cast<float*>(ws + plan.scores) + at;
    auto* red_buf = reinterpret_cast<float*>(ws + plan.red) + at;
    std::uint8_t* keep = (out.keep_masks ? out.keep_masks : reinterpret_cast<std::uint8_t*>(ws + plan.keep)) + at;
    // On one stream without stage marks the stages are chained by programmatic
    // dependent launches: lightning redundancy first, then the score kernel, which may
    // start in its last wave (and waits for it before reading the softmax statistics
    // lightning computed, when it did), then the epilogue and the layout,
    // whose launches overlap the end of the kernel before, and whose blocks start on
    // their row as soon as that row is handed on (below), not when the whole kernel
    // before has finished (configuration A: 1.874 -> 1.820 ms end to end).
    constexpr bool lightning = requires { requires R::pairs == redundancy::scope::block; };
    const bool chained = programmatic && on.score == on.tail && on.redundancy == on.tail;
    const auto launch_on = [&](cudaStream_t stream_of_stage, bool after_kernel) {
      return [=](auto kernel, unsigned grid_y, std::size_t smem, auto... args) {
        launch(stream_of_stage, after_kernel, kernel, rows, grid_y, smem, args...);
      };
    };
    const auto launch_score = launch_on(on.score, chained && lightning), launch_red = launch_on(on.redundancy, false),
               launch_tail = launch_on(on.tail, chained);
    // Chained, rows are handed on one by one (cuda::publish_row): the epilogue takes a
    // row once its score block is done, when that block comes last before it (after
    // lightning, or with no redundancy stage), and the layout once its epilogue block is.
    auto* ready = reinterpret_cast<std::int32_t*>(ws + plan.ready);
    constexpr bool scores_last = !std::same_as<S, none> && (lightning || std::same_as<R, none>);
    auto* block_stats = stats ? reinterpret_cast<float2*>(ws + plan.stats) + row0 * plan.stats_per_row : nullptr;
    // Given the statistics, the score kernel splits rows over several blocks where they
    // are too few to fill the GPU; its rows are then handed on as a whole grid.
    const std::int32_t key_splits =
        split_rows && block_stats
            ? cuda::score_key_splits(rows, rs.max_tokens, cuda::score_blocks_per_sm * multiprocessors())
            : 1;
    std::int32_t* score_ready = chained && scores_last && key_splits == 1 ? ready + row0 : nullptr;
    std::int32_t* select_ready = chained ? ready + plan.rows + row0 : nullptr;
    // Lightning's kernel by how many of its blocks fit per SM: lightning_mma_kernel
    // (three), lightning_mma_pair_kernel (two), lightning_mma_wide_kernel (one).
    const int lightning_per_sm = lightning ? lightning_blocks_per_sm(cache) : 3;
    const bool wide = lightning_per_sm == 1;
    // Chained after lightning, the score kernel takes a row once that row's lightning
    // blocks (one per cache block) are done, not once the whole grid is, so that rows
    // are scored in lightning's last wave. Not after the wide kernel: score blocks
    // beside its last blocks slowed it, head_dim/zipage/256 3.53 -> 3.56 ms on the
    // H100 (3.118 -> 3.140 on an H200).
    std::int32_t* stats_ready = chained && block_stats && !wide ? ready + 2 * plan.rows + row0 : nullptr;
    // The score kernel's launch with key_splits blocks per row.
    const auto launch_score_split = [&](auto kernel, std::size_t smem, auto... args) {
      launch(on.score, chained && lightning, kernel, rows * static_cast<unsigned>(key_splits), 1, smem, args...);
    };

    const auto score_stage = [&] {
      if constexpr (AttentionScorer<S>) {
        const std::int32_t G = queries.num_q_heads / cache.num_kv_heads;
        if (mma_scores(cache, queries)) {
          const auto smem = cuda::attention_mma_smem_bytes(pv.scorer.window, G, cache.head_dim,
                                                           cuda::reduces_in_fragments(pv.scorer.group, G));
          // wgmma for constant head dims where the query rows fill warpgroup tiles (the
          // kernel is the mma.sync one on targets other than sm_90a).
          const bool wgmma = cuda::score_wgmma_fits(pv.scorer.group, pv.scorer.window, G);
          with_mma_types(cache, [&]<dtype Elem, int HeadDim>() {
            if constexpr (HeadDim > 0) {
              if (wgmma) {
                launch_score_split(cuda::attention_score_mma_kernel<S, Elem, HeadDim, true>, smem, pv.scorer, cache,
                                   queries, rs, score_buf, score_ready, static_cast<const float2*>(block_stats),
                                   key_splits, static_cast<const std::int32_t*>(stats_ready));
                return;
              }
            }
            launch_score_split(cuda::attention_score_mma_kernel<S, Elem, HeadDim>, smem, pv.scorer, cache, queries, rs,
                               score_buf, score_ready, static_cast<const float2*>(block_stats), key_splits,
                               static_cast<const std::int32_t*>(stats_ready));
          });
        } else {
          const auto smem = cuda::attention_smem_floats(pv.scorer.window, G, cache.head_dim) * sizeof(float);
          launch_score(cuda::attention_score_kernel<S>, 1, smem, pv.scorer, cache, queries, rs, score_buf, score_ready);
        }
      } else if constexpr (KeyScorer<S>) {
        launch_score(cuda::key_score_kernel<S>, 1, 0, pv.scorer, cache, rs, score_buf, score_ready);
      }
    };
    const auto redundancy_stage = [&] {
      if constexpr (!std::same_as<R, none>) {
        const std::int32_t d = cache.head_dim;
        if constexpr (R::pairs == redundancy::scope::block) {
          const auto blocks = static_cast<unsigned>(blocks_per_item);
          if (mma_keys(cache)) {
            const auto smem = cuda::lightning_mma_smem_bytes(cache.block_size, d);
            with_mma_types(cache, [&]<dtype Elem, int HeadDim>() {
              const auto launch_lightning = [&]<bool Statistics>() {
                launch_red(cuda::lightning_mma_kernel<P, Elem, HeadDim, Statistics>, blocks, smem, pv, cache, rs,
                           red_buf, queries, block_stats, stats_ready);
              };
              if constexpr (HeadDim == 0) {
                if (wide)
                  return launch_threads(on.redundancy, false, cuda::lightning_mma_wide_kernel<P, Elem>, rows, blocks,
                                        cuda::lightning_wide_threads, smem, pv, cache, rs, red_buf, queries,
                                        block_stats, stats_ready);
                if (lightning_per_sm == 2 && block_stats)
                  return launch_red(cuda::lightning_mma_pair_kernel<P, Elem>, blocks, smem, pv, cache, rs, red_buf,
                                    queries, block_stats, stats_ready);
                if (!block_stats) return launch_lightning.template operator()<false>();
              }
              launch_lightning.template operator()<true>();
            });
          } else {
            const auto smem = cuda::lightning_smem_floats(cache.block_size, d) * sizeof(float);
            launch_red(cuda::lightning_kernel<P>, blocks, smem, pv, cache, rs, red_buf);
          }
        } else {
          auto* rowsum = reinterpret_cast<float*>(ws + plan.rowsum) + at;
          // The newest neighbours: packed (tensor-core path) or newest and newest_c.
          unsigned long long* packed = nullptr;
          std::int32_t* newest = nullptr;
          float* newest_c = nullptr;
          // A block per (row, column tile) on a flat grid, a row's tiles adjacent.
          const auto launch_row_tiles = [&](auto kernel, std::int32_t tile, std::size_t smem, auto... args) {
            launch(on.redundancy, false, kernel, rows * static_cast<unsigned>(cuda::tiles_per_row(rs.max_tokens, tile)), 1,
                   smem, args...);
          };
          if (mma_keys(cache)) {
            const int groups = full_pairs_row_groups(d, rows, rs.max_tokens);
            const auto smem = cuda::full_mma_smem_bytes(d, groups);
            auto* inv = reinterpret_cast<float*>(ws + plan.inv) + at;
            const auto spans = cuda::tiles_per_row(rs.max_tokens, cuda::key_sum_span);
            auto* key_sums = reinterpret_cast<float*>(ws + plan.key_sums) + row0 * spans * d;
            packed = reinterpret_cast<unsigned long long*>(ws + plan.packed) + at;
            with_mma_types(cache, [&]<dtype Elem, int HeadDim>() {
              launch_red(cuda::key_norms_and_sums_kernel<P, Elem, HeadDim>, static_cast<unsigned>(spans),
                         cuda::key_norms_smem_bytes(d), pv, cache, rs, inv, key_sums, packed);
              const auto pairs = [&]<int G>() {
                launch_row_tiles(cuda::full_pairs_mma_kernel<P, Elem, HeadDim, G>, cuda::full_mma_columns(G), smem, pv,
                                 cache, rs, inv, key_sums, rowsum, packed);
              };
              if (groups == 2)
                pairs.template operator()<2>();
              else
                pairs.template operator()<1>();
            });
          } else {
            newest = reinterpret_cast<std::int32_t*>(ws + plan.newest) + at;
            newest_c = reinterpret_cast<float*>(ws + plan.newest_c) + at;
            launch_row_tiles(cuda::full_columns_kernel<P>, cuda::full_tile, cuda::full_smem_floats(d) * sizeof(float), pv,
                             cache, rs, rowsum, newest, newest_c);
          }
          auto* dropped = reinterpret_cast<unsigned long long*>(ws + plan.dropped) + at;
          launch_red(cuda::full_finish_kernel<P>, 1, 0, pv, cache, rs, static_cast<const float*>(rowsum),
                     static_cast<const std::int32_t*>(newest), static_cast<const float*>(newest_c),
                     static_cast<const unsigned long long*>(packed), dropped, red_buf);
        }
      }
    };
    if (stats || (chained && lightning)) {
      redundancy_stage();
      mark(1);
      score_stage();
    } else {
      score_stage();
      mark(1);
      redundancy_stage();
    }
    // At most one other stream: score and redundancy each run on it or on tail.
    const bool red_elsewhere = !std::same_as<R, none> && on.redundancy != on.tail;
    if (on.score != on.tail || red_elsewhere) {
      cudaEventRecord(overlap_events[1], on.score != on.tail ? on.score : on.redundancy);
      cudaStreamWaitEvent(on.tail, overlap_events[1], 0);
    }
    mark(2);
    const cuda::epilogue_out eo{keep,
                                out.scores ? out.scores + at : nullptr,
                                out.new_lengths + first,
                                out.released_counts + first,
                                out.released_blocks + std::int64_t{first} * blocks_per_item,
                                blocks_per_item};
    // The global-memory rows hold two regions of the launch's rows each.
    float* rows_global = plan.rows_global ? reinterpret_cast<float*>(ws + plan.rows_global) + 2 * at : nullptr;
    launch_tail(cuda::epilogue_kernel<P>, 1, rows_global ? 0 : cuda::epilogue_smem_floats(rs.max_tokens) * sizeof(float),
              pv, cache, scores, rs, score_buf, red_buf, rows_global, eo, static_cast<const std::int32_t*>(score_ready),
              select_ready);
    mark(3);
    if constexpr (moves_tokens<L>()) {
      // Few rows (a launch of one sequence) are split into column slices to fill the GPU.
      const std::int32_t slices =
          split_rows ? cuda::compact_slices(rows, cache.row_bytes(), compact_blocks_per_sm * multiprocessors()) : 1;
      const std::int64_t slice_bytes = cache.row_bytes() / slices;
      const std::int32_t chunk = cuda::compact_chunk(slice_bytes, compact_staging_limit());
      // F moves with its tokens only when the pipeline keeps scores in it.
      const score_view moved_f = uses_score_cache<A>() ? scores : score_view{};
      launch(on.tail, chained, cuda::compact_kernel<P>, rows * static_cast<unsigned>(slices), 1,
             cuda::compact_staging_bytes(chunk, slice_bytes), pv, cache, moved_f, rs, keep, chunk, slices,
             static_cast<const std::int32_t*>(select_ready));
    }
  }

  // Calls f.template operator()<Elem>() for the cache's 16-bit type.
  template <class F>
  static void with_mma_type(const paged_kv_view& cache, F&& f) {
    if (cache.type == dtype::bf16)
      f.template operator()<dtype::bf16>();
    else
      f.template operator()<dtype::f16>();
  }
  // Calls f.template operator()<Elem, HeadDim>() for the cache's 16-bit type and its
  // head dim: 64 and 128 as constants, any other as 0 (read at run time).
  template <class F>
  static void with_mma_types(const paged_kv_view& cache, F&& f) {
    with_mma_type(cache, [&]<dtype Elem>() {
      switch (cache.head_dim) {
        case 64: return f.template operator()<Elem, 64>();
        case 128: return f.template operator()<Elem, 128>();
        default: return f.template operator()<Elem, 0>();
      }
    });
  }

  bool mma_keys(const paged_kv_view& cache) const {
    return tensor_cores && cache.type != dtype::f32 && cuda::mma_head_dim(cache.head_dim);
  }
  bool mma_scores(const paged_kv_view& cache, const query_window_view& queries) const {
    return mma_keys(cache) && queries.type == cache.type;
  }

  // Shared memory the compaction stages its chunks' rows in (two chunks at a time):
  // 96 KB, where the device allows it beside the kernel's static arrays (12 KB),
  // keeps two blocks per SM on sm_90. Configuration A, H100: 0.866 ms with one
  // 64 KB stage, 0.828 with two 32 KB stages, 0.805 with two 48 KB stages.
  static constexpr std::size_t compact_smem_bytes = 96 * 1024;
  static constexpr int compact_blocks_per_sm = 2;
  static constexpr std::size_t compact_static_reserve = 16 * 1024;
  static std::size_t compact_staging_limit() {
    const auto limit = static_cast<std::size_t>(shared_memory_limit());
    const bool room = limit > compact_smem_bytes + compact_static_reserve;
    const bool unknown = limit <= compact_static_reserve;  // no device to ask: the launch fails anyway
    return room || unknown ? compact_smem_bytes : limit - compact_static_reserve;
  }

  struct workspace_plan {
    std::size_t scores = 0, red = 0, rowsum = 0, newest = 0, newest_c = 0, inv = 0, key_sums = 0, packed = 0, dropped = 0,
                keep = 0, rows_global = 0;
    std::size_t ready = 0;
    std::size_t stats = 0;  // [rows][stats_per_row] float2: softmax statistics per cache block
    std::int64_t stats_per_row = 0;
    std::size_t total = 0;
    std::int64_t rows = 0;  // of the whole batch
    // Row hand-off flags: [flag_sets][rows], score -> epilogue, epilogue -> layout, and
    // lightning -> score (a count of the row's finished cache blocks).
    static constexpr std::int32_t flag_sets = 3;
  };

  // Whether the epilogue holds a row of scores (and its pooling copy) in shared memory.
  static bool rows_fit_in_shared_memory(std::int32_t max_tokens) {
    return cuda::epilogue_smem_floats(max_tokens) * sizeof(float) <= static_cast<std::size_t>(shared_memory_limit());
  }

  template <class P>
  static workspace_plan plan_workspace(const cuda::row_space& rs, std::int32_t head_dim, const device_result& out,
                                       bool rows_global, std::int64_t stats_per_row, bool tensor_keys) {
    const std::size_t cells = static_cast<std::size_t>(rs.rows()) * static_cast<std::size_t>(rs.max_tokens);
    workspace_plan w;
    w.rows = rs.rows();
    auto take = [&](std::size_t bytes) {
      const std::size_t at = w.total;
      w.total += (bytes + 255) / 256 * 256;
      return at;
    };
    w.scores = take(cells * sizeof(float));
    w.ready = take(workspace_plan::flag_sets * static_cast<std::size_t>(rs.rows()) * sizeof(std::int32_t));
    if constexpr (!std::same_as<typename P::redundancy_type, none>) {
      w.red = take(cells * sizeof(float));
      if constexpr (P::redundancy_type::pairs == redundancy::scope::full) {
        w.rowsum = take(cells * sizeof(float));
        w.dropped = take(cells * sizeof(unsigned long long));  // full_finish_kernel's dropped_sums
        if (tensor_keys) {
          // Inverse norms, partial key sums ([rows][spans of key_sum_span keys][d]) and
          // packed newest neighbours.
          w.inv = take(cells * sizeof(float));
          w.key_sums = take(static_cast<std::size_t>(rs.rows()) *
                            cuda::tiles_per_row(rs.max_tokens, cuda::key_sum_span) *
                            static_cast<std::size_t>(head_dim) * sizeof(float));
          w.packed = take(cells * sizeof(unsigned long long));
        } else {
          w.newest = take(cells * sizeof(std::int32_t));  // full_columns_kernel's newest neighbours
          w.newest_c = take(cells * sizeof(float));
        }
      }
    }
    if (!out.keep_masks) w.keep = take(cells);
    if (rows_global) w.rows_global = take(2 * cells * sizeof(float));  // offset 0 is never a real buffer
    if (stats_per_row > 0) {
      w.stats_per_row = stats_per_row;
      w.stats = take(static_cast<std::size_t>(rs.rows() * stats_per_row) * sizeof(float2));
    }
    return w;
  }

  // Row groups of full_pairs_mma_kernel (full_pairs_rows / 128). By default two where
  // two blocks of them fit on an SM (with the shared memory each block reserves) and
  // the launch gives every SM two: with fewer blocks 128-key tiles finish sooner (8
  // rows of 2304 / 4608 tokens: 0.090 / 0.183 ms against 0.095 / 0.200 on the H100).
  int full_pairs_row_groups(std::int32_t d, std::int64_t rows, std::int32_t max_tokens) const {
    if (full_pairs_rows != 0) return full_pairs_rows / cuda::full_mma_columns(1);
    const std::size_t two = cuda::full_mma_smem_bytes(d, 2);
    const bool fits = two <= static_cast<std::size_t>(shared_memory_limit()) && blocks_per_sm(two) >= 2;
    const bool fills =
        rows * cuda::tiles_per_row(max_tokens, cuda::full_mma_columns(2)) >= 2 * std::int64_t{multiprocessors()};
    return fits && fills ? 2 : 1;
  }

  // How many blocks of lightning on tensor cores fit per SM, up to three (with the
  // shared memory each block reserves): one takes lightning_mma_wide_kernel (one block
  // of 256 threads would leave the SM 8 warps), two lightning_mma_pair_kernel where it
  // computes the statistics. Head dims built as constants (64, 128), and caches off
  // tensor cores, count as three.
  int lightning_blocks_per_sm(const paged_kv_view& cache) const {
    if (!mma_keys(cache) || cache.head_dim == 64 || cache.head_dim == 128) return 3;
    const std::size_t fit = blocks_per_sm(cuda::lightning_mma_smem_bytes(cache.block_size, cache.head_dim));
    return static_cast<int>(std::clamp<std::size_t>(fit, 1, 3));
  }

  // How many blocks of `smem` bytes of dynamic shared memory fit on one SM of the
  // current device, with the shared memory the runtime reserves per block.
  static std::size_t blocks_per_sm(std::size_t smem) {
    int device = 0, per_sm = 0, reserved = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
    return static_cast<std::size_t>(per_sm) / (smem + static_cast<std::size_t>(reserved));
  }

  static int multiprocessors() {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
  }
  static int shared_memory_limit() {
    int device = 0, limit = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return limit;
  }

  // What the kernels need beyond what the host executor needs: 16-byte rows, and
  // per-row working sets that fit in shared memory.
  template <class P>
  void check_device_shapes(const P& p, const paged_kv_view& cache, const query_window_view& queries,
                                  const device_batch& batch, const layer_range& layers) const {
    const std::int64_t row = cache.row_bytes();
    require(row % 16 == 0, "cache.head_dim", "is {}; the CUDA executor moves rows of a multiple of 16 bytes ({} here)",
            cache.head_dim, row);
    const auto aligned = [&](std::int64_t elems, dtype t) { return elems * size_of(t) % 16 == 0; };
    const kv_strides* strides[2] = {&cache.k_stride, &cache.v_stride};
    const layer_bases* bases[2] = {&cache.k, &cache.v};
    for (int kv = 0; kv < 2; ++kv) {
      const char* name = kv == 0 ? "k" : "v";
      const kv_strides& st = *strides[kv];
      require(aligned(st.block, cache.type) && aligned(st.token, cache.type) && aligned(st.head, cache.type),
              detail::path("cache.{}_stride", name),
              "is (block {}, token {}, head {}) elements; rows must start on 16-byte boundaries", st.block, st.token,
              st.head);
      const layer_bases& lb = *bases[kv];
      require(aligned(lb.offset, cache.type) && aligned(lb.layer_stride, cache.type), detail::path("cache.{}.offset", name),
              "is {} (layer stride {}) elements; rows must start on 16-byte boundaries", lb.offset, lb.layer_stride);
      require(lb.table || reinterpret_cast<std::uintptr_t>(lb.base) % 16 == 0, detail::path("cache.{}.base", name),
              "address {:#x} is not 16-byte aligned", reinterpret_cast<std::uintptr_t>(lb.base));
    }
    const std::size_t limit = static_cast<std::size_t>(shared_memory_limit());
    require(cuda::compact_chunk(row, compact_staging_limit()) >= 1, "cache.head_dim",
            "is {}; a row of {} bytes is too long for the compaction's staging buffer", cache.head_dim, row);
    // Per-row tiles go in gridDim.y, which stops at 65535.
    const std::int64_t tiles = std::max<std::int64_t>(max_blocks(batch, cache), batch.max_tokens / 64 + 1);
    require(tiles <= 65535, "batch.max_tokens", "is {}; rows of more than 65535 tiles ({}) exceed the launch grid",
            batch.max_tokens, tiles);
    if constexpr (AttentionScorer<typename P::scorer_type>) {
      const std::int32_t G = queries.num_q_heads / cache.num_kv_heads;
      const std::size_t need = mma_scores(cache, queries)
                                   ? cuda::attention_mma_smem_bytes(p.scorer.window, G, cache.head_dim,
                                                                    cuda::reduces_in_fragments(p.scorer.group, G))
                                   : cuda::attention_smem_floats(p.scorer.window, G, cache.head_dim) * sizeof(float);
      require(need <= limit,
              "pipeline.scorer.window", "is {}; {} queries of {} dims per KV head exceed {} bytes of shared memory",
              p.scorer.window, p.scorer.window * G, cache.head_dim, limit);
      require(aligned(queries.layer_stride, queries.type) && aligned(queries.slot_stride, queries.type) &&
                  aligned(queries.pos_stride, queries.type) && aligned(queries.head_stride, queries.type),
              "queries", "strides (layer {}, slot {}, pos {}, head {}) must keep rows on 16-byte boundaries",
              queries.layer_stride, queries.slot_stride, queries.pos_stride, queries.head_stride);
      require(reinterpret_cast<std::uintptr_t>(queries.base) % 16 == 0, "queries.base",
              "address {:#x} is not 16-byte aligned", reinterpret_cast<std::uintptr_t>(queries.base));
    }
    if constexpr (!std::same_as<typename P::redundancy_type, none>) {
      if constexpr (P::redundancy_type::pairs == redundancy::scope::full) {
        require(!mma_keys(cache) || std::max(cuda::full_mma_smem_bytes(cache.head_dim, 1),
                                             cuda::key_norms_smem_bytes(cache.head_dim)) <= limit,
                "cache.head_dim", "is {}; a tile of keys exceeds {} bytes of shared memory", cache.head_dim, limit);
        require(!mma_keys(cache) || full_pairs_rows != cuda::full_mma_columns(2) ||
                    cuda::full_mma_smem_bytes(cache.head_dim, 2) <= limit,
                "full_pairs_rows", "is {}; a tile of {} keys of {} dims exceeds {} bytes of shared memory",
                full_pairs_rows, full_pairs_rows, cache.head_dim, limit);
        // The column kernels' flat grid: rows x tiles blocks in gridDim.x.
        const std::int32_t smallest_tile = std::min(cuda::full_tile, cuda::full_mma_columns(1));
        const std::int64_t blocks = std::int64_t{batch.num_items} * (layers.end - layers.begin) * cache.num_kv_heads *
                                    cuda::tiles_per_row(batch.max_tokens, smallest_tile);
        require(blocks <= 2147483647, "batch.num_items",
                "is {}; full redundancy over rows of {} tokens would launch {} blocks, more than a grid holds",
                batch.num_items, batch.max_tokens, blocks);
      }
      if constexpr (P::redundancy_type::pairs == redundancy::scope::block) {
        const std::size_t need = mma_keys(cache) ? cuda::lightning_mma_smem_bytes(cache.block_size, cache.head_dim)
                                                 : cuda::lightning_smem_floats(cache.block_size, cache.head_dim) *
                                                       sizeof(float);
        require(need <= limit,
                "cache.block_size", "is {}; a block of {}-dim keys exceeds {} bytes of shared memory", cache.block_size,
                cache.head_dim, limit);
      }
    }
  }

  // Whether the image of `kernel` that the current device runs was built for sm_90 or
  // later. Asked of the runtime once per kernel and device: cudaFuncGetAttributes took
  // some 0.6 us of every launch's host time.
  template <class Kernel>
  static bool built_for_sm90(Kernel kernel) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    static std::mutex guard;
    static std::map<std::pair<const void*, int>, bool> known;
    const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
    {
      const std::lock_guard lock(guard);
      if (const auto it = known.find(key); it != known.end()) return it->second;
    }
    cudaFuncAttributes built{};
    const bool sm90 = cudaFuncGetAttributes(&built, kernel) == cudaSuccess && built.ptxVersion >= 90;
    const std::lock_guard lock(guard);
    known.emplace(key, sm90);
    return sm90;
  }

  // `programmatic`: a programmatic dependent launch (cuda::wait_for_prerequisites),
  // when the kernel was built for sm_90 or later, where it waits as it must.
  template <class Kernel, class... Args>
  static void launch(cudaStream_t on, bool programmatic, Kernel kernel, unsigned grid_x, unsigned grid_y,
                     std::size_t smem, Args... args) {
    launch_threads(on, programmatic, kernel, grid_x, grid_y, cuda::row_threads, smem, args...);
  }
  // The same with `threads` per block.
  template <class Kernel, class... Args>
  static void launch_threads(cudaStream_t on, bool programmatic, Kernel kernel, unsigned grid_x, unsigned grid_y,
                             unsigned threads, std::size_t smem, Args... args) {
    // Dynamic shared memory beyond 48 KB minus the kernel's static shared memory (CUB's
    // scans, say) needs the opt-in; any launch that asks for some opts in, so a
    // request just under 48 KB does not fail on top of static storage.
    if (smem > 0) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (programmatic && built_for_sm90(kernel)) {
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(grid_x, grid_y);
      config.blockDim = dim3(threads);
      config.dynamicSmemBytes = smem;
      config.stream = on;
      config.attrs = &attr;
      config.numAttrs = 1;
      cudaLaunchKernelEx(&config, kernel, args...);
    } else {
      kernel<<<dim3(grid_x, grid_y), threads, smem, on>>>(args...);
    }
  }
};

KVP_NAMESPACE_END
