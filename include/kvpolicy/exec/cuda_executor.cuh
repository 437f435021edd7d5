// The CUDA executor: runs any pipeline on a stream, over the same views as the host
// executor, with the same keep masks and bytes.
//
// CUB's two-phase convention: call compress() with temp == nullptr to get the
// workspace size, allocate it, call again. No allocation, no host synchronisation:
// a whole compression can be captured in a CUDA graph. Malformed shapes throw
// kvp::error before any launch; malformed device data (lengths, block ids, batch
// items, shared blocks) is caught by the first kernels, which then stop every later
// kernel, and is reported in `device_result::status` (see check()).
//
// This file is the facade: the public types and compress(). The schedule is
// exec/cuda/dispatch.cuh, what each stage launches its kind's plan
// (exec/cuda/stage_kinds.cuh), every device-dependent constant exec/cuda/tuning.cuh.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/dispatch.cuh"
#include "kvpolicy/exec/cuda/full_mma_kernel.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
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
  prefix_targets targets{};      // optional: fresh blocks for shared prefixes (device memory)
};

// Where the executor writes its results, all device memory.
struct device_result {
  std::int32_t* status = nullptr;           // [status_words]; 0 in status[0] means success
  std::int32_t* new_lengths = nullptr;      // [num_items]: the largest kept count of the item's layers and heads
  std::int32_t* released_counts = nullptr;  // [num_items]
  std::int32_t* released_blocks = nullptr;  // [num_items][max_blocks(batch, cache)]
  std::uint8_t* keep_masks = nullptr;       // optional [num_items][layers][h_kv][max_tokens]
  float* scores = nullptr;                  // optional, same shape: final scores after protect
  std::int32_t* kept_counts = nullptr;      // optional [num_items][layers][h_kv]: tokens each head keeps
  std::int32_t* nonfinite_counts = nullptr;  // optional [num_items]: NaN or infinite candidate scores
  // Optional [num_items][max_blocks(batch, cache)]: each item's block table after the
  // compression, its first ceil(new_length / b) entries (targets of a shared prefix first).
  std::int32_t* new_tables = nullptr;
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
  // capturing. With them the stages run one after the other, without the
  // programmatic dependent launches and row hand-offs that otherwise let each start
  // in the last wave of the one before, so that their times add up.
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
  // next group's score and redundancy stages (bound by arithmetic). Groups touch
  // disjoint sequences and each group's stages keep their order, so the results are
  // the same; fork and join are events, so a capture records every branch. stage_marks
  // 1 to 3 are then recorded with 4. Whether it pays depends on the batch
  // (bench/results/README.md measures it); one chained stream is the default.
  cudaStream_t overlap_stream = nullptr;
  cudaEvent_t* overlap_events = nullptr;  // [2]
  std::int32_t overlap_groups = 1;        // at least 1 when overlap_stream is set
  // Keys u per block of full redundancy's tensor-core kernel: 0 (default) chooses per
  // device and batch (256 where two such blocks fit on an SM and the launch still
  // gives every SM two, else 128); 128 or 256 asks for that size.
  std::int32_t full_pairs_rows = 0;
  // Where a launch has too few rows to fill the GPU (one sequence of 8 layers: 64),
  // the score kernel's single pass splits each row's keys over several blocks and the
  // compaction each row's bytes into column slices; the results are the same. false:
  // one block per row.
  bool split_rows = true;

  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L>
  cudaError_t compress(void* temp, std::size_t& temp_bytes, const pipeline<S, A, R, Sel, L>& p,
                       const paged_kv_view& cache, const query_window_view& queries, const score_view& scores,
                       const device_batch& batch, const device_result& out) const {
    using P = pipeline<S, A, R, Sel, L>;
    const P pv = p;
    const layer_range layers = check_call(pv, cache, queries, scores, batch);
    const cuda::device_limits dev = cuda::device_limits::current();
    const cuda::executor_options opt = options();
    // A window-only layout runs every stage over the items' windows: the view's rows
    // shifted through arrays at the front of the workspace (cuda::window_view).
    constexpr bool windowed = window_only<L>();
    const std::size_t window_bytes = windowed ? cuda::window_rows_bytes(cache.num_seqs) : 0;
    const paged_kv_view view = windowed ? cuda::window_view(cache, temp) : cache;
    const cuda::stage_context<P> c{pv, view, queries, scores, dev, opt, batch.max_tokens};
    const cuda::dispatch<P> d(c, windowed ? &cache : nullptr);
    const cuda::row_space rs{batch.items, batch.num_items, layers.begin, layers.end - layers.begin,
                             cache.num_kv_heads,  batch.max_tokens, out.status};
    const auto plan = d.plan(rs.rows(), batch.num_items);
    d.check(plan);
    const auto ws = d.layout(plan, batch.num_items, out.keep_masks != nullptr, !batch.targets.empty());
    if (temp == nullptr) {
      temp_bytes = window_bytes + ws.total;
      return cudaSuccess;
    }
    require(temp_bytes >= window_bytes + ws.total, "temp_bytes", "is {}; the batch needs {}", temp_bytes,
            window_bytes + ws.total);
    require(out.status && out.new_lengths && out.released_counts && out.released_blocks, "out",
            "needs status, new_lengths, released_counts and released_blocks (a null pointer was given)");
    require(batch.num_items == 0 || batch.items != nullptr, "batch.items", "is a null pointer");

    d.run(plan, ws, static_cast<std::byte*>(temp) + window_bytes, rs, batch.targets, out,
          cuda::schedule{stream, overlap_stream, overlap_events, overlap_groups, stage_marks});
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

  // What compress() would launch for this call, stage by stage (host only: nothing is
  // launched); cuda::describe(plan) prints it.
  template <Scorer S, Aggregator A, Redundancy R, Selector Sel, Layout L>
  cuda::compress_plan<pipeline<S, A, R, Sel, L>> plan(const pipeline<S, A, R, Sel, L>& p, const paged_kv_view& cache,
                                                      const query_window_view& queries, const score_view& scores,
                                                      const device_batch& batch) const {
    using P = pipeline<S, A, R, Sel, L>;
    const layer_range layers = check_call(p, cache, queries, scores, batch);
    const cuda::device_limits dev = cuda::device_limits::current();
    const cuda::executor_options opt = options();
    const cuda::stage_context<P> c{p, cache, queries, scores, dev, opt, batch.max_tokens};
    return cuda::dispatch<P>(c).plan(std::int64_t{batch.num_items} * (layers.end - layers.begin) * cache.num_kv_heads,
                                     batch.num_items);
  }

  // Whether the lightning kernel computes the window attention's softmax statistics
  // for this pipeline and cache (statistics_in_redundancy; block_redundancy_stage
  // says when it can).
  template <class P>
  bool redundancy_computes_statistics(const P& p, const paged_kv_view& cache, const query_window_view& queries) const {
    const cuda::device_limits dev = cuda::device_limits::current();
    const cuda::executor_options opt = options();
    const score_view none_f{};
    const cuda::stage_context<P> c{p, cache, queries, none_f, dev, opt, cache.block_size};
    return cuda::dispatch<P>(c).statistics();
  }

 private:
  cuda::executor_options options() const {
    return {tensor_cores, statistics_in_redundancy, full_pairs_rows, split_rows};
  }

  // The host-side checks of a call: shapes, the batch's bounds, the options.
  template <class P>
  layer_range check_call(const P& p, const paged_kv_view& cache, const query_window_view& queries,
                         const score_view& scores, const device_batch& batch) const {
    const compression_batch layers_only{{}, batch.layer_begin, batch.layer_count};
    validate_shapes(p, cache, queries, scores, layers_only, false);
    const layer_range layers = resolve_layers(layers_only, cache);
    require(batch.num_items >= 0, "batch.num_items", "is {}; must not be negative", batch.num_items);
    require(batch.max_tokens > 0, "batch.max_tokens", "is {}; must be positive", batch.max_tokens);
    require(batch.targets.empty() || moves_tokens<typename P::layout_type>(), "batch.targets",
            "are given, but the layout moves no token: a shared prefix would keep its shared blocks");
    require(batch.targets.empty() || batch.targets.blocks != nullptr, "batch.targets.blocks",
            "is a null pointer while batch.targets.indptr is set");
    require(batch.targets.empty() || !fills_holes<typename P::layout_type>(), "batch.targets",
            "are given, but the fill layout moves tokens within the sequence's own blocks; compress a shared prefix "
            "with layout::compact");
    require(batch.targets.empty() || !window_only<typename P::layout_type>(), "batch.targets",
            "are given, but a window-only layout writes no block before the window: no shared prefix needs targets");
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
    return layers;
  }
};

KVP_NAMESPACE_END
