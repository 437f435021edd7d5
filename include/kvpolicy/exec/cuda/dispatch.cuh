// The CUDA executor's schedule: which kernels one compression launches, in which
// order, on which streams, with which hand-offs between them. Each stage's launch
// comes from its kind's plan (stage_kinds.cuh); this file only orders them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/stage_context.cuh"
#include "kvpolicy/exec/cuda/stage_epilogue.cuh"
#include "kvpolicy/exec/cuda/stage_kinds.cuh"
#include "kvpolicy/exec/cuda/validate_kernel.cuh"
#include "kvpolicy/exec/device_status.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What one compression (or one launch group of its rows) launches, stage by stage.
template <class P>
struct compress_plan {
  using score_stage = score_stage_t<typename P::scorer_type>;
  using redundancy_stage = redundancy_stage_t<typename P::redundancy_type>;
  using layout_stage = layout_stage_t<typename P::layout_type>;

  std::int64_t rows = 0;
  bool statistics = false;  // the redundancy stage computes the score's softmax statistics
  launch_plan validate, claim;
  typename score_stage::plan_type score;
  typename redundancy_stage::plan_type redundancy;
  epilogue_stage::plan_type epilogue;
  typename layout_stage::plan_type layout;
};

// A stage of several launches, one after the other.
inline std::string describe(const full_redundancy_stage::plan_type& f) {
  return kvp::detail::format("{}; {}; {}", describe(f.norms), describe(f.pairs), describe(f.finish));
}

// One line per stage: kernel, grid, threads, dynamic shared memory.
template <class P>
std::string describe(const compress_plan<P>& pl) {
  return kvp::detail::format(
      "rows {}{}\n  validate   {}\n  claim      {}\n  score      {}\n  redundancy {}\n  epilogue   {}\n  layout     {}",
      pl.rows, pl.statistics ? " (redundancy computes the softmax statistics)" : "", describe(pl.validate),
      describe(pl.claim), describe(pl.score), describe(pl.redundancy), describe(pl.epilogue),
      describe(pl.layout));
}

// Where each buffer of the workspace lies, for the whole batch.
template <class P>
struct workspace_layout {
  std::size_t scores = 0, red = 0, keep = 0, ready = 0, item_of_seq = 0, owner = 0, readers = 0, item_max = 0,
              item_rows_done = 0, stats = 0, f_stash = 0;
  bool own_keep = false, per_item_counts = false, stash_f = false;
  std::int64_t rows = 0;           // of the whole batch
  std::int64_t stats_per_row = 0;  // float2 per row
  typename compress_plan<P>::redundancy_stage::buffers redundancy;
  epilogue_stage::buffers epilogue;
  typename compress_plan<P>::layout_stage::buffers layout;
  std::size_t total = 0;
  // Row hand-off flags: score -> epilogue, epilogue -> layout, and lightning -> score (a
  // count of the row's finished cache blocks).
  static constexpr std::int32_t flag_sets = 3;
};

// The streams one group's stages run on: the epilogue and layout on `tail`; a score or
// redundancy stage elsewhere (a stream already ordered after validation) is joined to
// it through `join` before the epilogue.
struct stage_streams {
  cudaStream_t score, redundancy, tail;
  cudaEvent_t join;
};

// How the caller's streams take the stages (the cuda_executor fields of these names).
struct schedule {
  cudaStream_t stream = nullptr;
  cudaStream_t overlap_stream = nullptr;
  cudaEvent_t* overlap_events = nullptr;  // [2]: fork, join
  std::int32_t overlap_groups = 1;
  cudaEvent_t* stage_marks = nullptr;  // [5], or null
};

template <class P>
class dispatch {
 public:
  using plan_type = compress_plan<P>;
  using score_stage = typename plan_type::score_stage;
  using redundancy_stage = typename plan_type::redundancy_stage;
  using layout_stage = typename plan_type::layout_stage;
  using layout_type = workspace_layout<P>;

  // `whole`: for window-only layouts, the engine's view, whose rows the context's
  // (shifted to each item's window, window_view) are computed from at the start of run().
  explicit dispatch(const stage_context<P>& c, const paged_kv_view* whole = nullptr) : c_(c), whole_(whole) {}

  bool statistics() const {
    return std::same_as<score_stage, attention_score_stage> && redundancy_stage::computes_statistics(c_);
  }

  // The plan of `rows` rows: the whole batch (validation and workspace read it), or a
  // launch group of the overlap (its launches read it).
  plan_type plan(std::int64_t rows, std::int32_t num_items) const {
    plan_type pl;
    pl.rows = rows;
    pl.statistics = statistics();
    pl.validate.kernel = "validate_kernel";
    pl.validate.grid_x = static_cast<unsigned>(num_items + owner_reset_blocks(c_.cache.num_blocks));
    pl.claim.kernel = "claim_blocks_kernel";
    pl.claim.grid_x = static_cast<unsigned>(c_.cache.num_seqs);
    pl.score = score_stage::plan(c_, rows, pl.statistics);
    pl.redundancy = redundancy_stage::plan(c_, rows, pl.statistics);
    pl.epilogue = epilogue_stage::plan(c_, rows);
    pl.layout = layout_stage::plan(c_, rows, pl.statistics);
    return pl;
  }

  // What the kernels need beyond what the host executor needs, from the plan.
  void check(const plan_type& pl) const {
    const std::int64_t row = c_.cache.row_bytes();
    require(row % 16 == 0, "cache.head_dim", "is {}; the CUDA executor moves rows of a multiple of 16 bytes ({} here)",
            c_.cache.head_dim, row);
    const auto aligned = [&](std::int64_t elems) { return elems * size_of(c_.cache.type) % 16 == 0; };
    const kv_strides* strides[2] = {&c_.cache.k_stride, &c_.cache.v_stride};
    const layer_bases* bases[2] = {&c_.cache.k, &c_.cache.v};
    for (int kv = 0; kv < 2; ++kv) {
      const char* name = kv == 0 ? "k" : "v";
      const kv_strides& st = *strides[kv];
      require(aligned(st.block) && aligned(st.token) && aligned(st.head), kvp::detail::path("cache.{}_stride", name),
              "is (block {}, token {}, head {}) elements; rows must start on 16-byte boundaries", st.block, st.token,
              st.head);
      const layer_bases& lb = *bases[kv];
      require(aligned(lb.offset) && aligned(lb.layer_stride), kvp::detail::path("cache.{}.offset", name),
              "is {} (layer stride {}) elements; rows must start on 16-byte boundaries", lb.offset, lb.layer_stride);
      require(lb.table || reinterpret_cast<std::uintptr_t>(lb.base) % 16 == 0, kvp::detail::path("cache.{}.base", name),
              "address {:#x} is not 16-byte aligned", reinterpret_cast<std::uintptr_t>(lb.base));
    }
    // Per-row tiles go in gridDim.y, which stops at 65535.
    const std::int64_t tiles = std::max<std::int64_t>(c_.blocks_per_row(), c_.max_tokens / 64 + 1);
    require(tiles <= 65535, "batch.max_tokens", "is {}; rows of more than 65535 tiles ({}) exceed the launch grid",
            c_.max_tokens, tiles);
    score_stage::check(c_, pl.score);
    redundancy_stage::check(c_, pl.redundancy);
    layout_stage::check(c_, pl.layout);
  }

  // `targets`: the batch gives targets for shared prefixes, whose F the epilogue
  // leaves in the workspace for the compaction.
  layout_type layout(const plan_type& pl, std::int32_t num_items, bool keep_given, bool targets) const {
    const std::size_t cells = static_cast<std::size_t>(pl.rows) * static_cast<std::size_t>(c_.max_tokens);
    layout_type w;
    w.rows = pl.rows;
    workspace_builder ws;
    w.scores = ws.take(cells * sizeof(float));
    w.ready = ws.take(layout_type::flag_sets * static_cast<std::size_t>(pl.rows) * sizeof(std::int32_t));
    w.item_of_seq = ws.take(static_cast<std::size_t>(c_.cache.num_seqs) * sizeof(std::int32_t));
    w.owner = ws.take(static_cast<std::size_t>(c_.cache.num_blocks) * sizeof(std::int32_t));
    w.readers = ws.take(static_cast<std::size_t>(c_.cache.num_blocks) * sizeof(std::int32_t));
    w.stash_f = targets && uses_score_cache<typename P::aggregate_type>();
    if (w.stash_f) w.f_stash = ws.take(cells * sizeof(float));
    // Under cautious update a row keeps at most what its head holds: counts differ per row.
    w.per_item_counts = !uniform_counts<typename P::select_type> || !c_.cache.live.empty();
    if (w.per_item_counts) {
      w.item_max = ws.take(static_cast<std::size_t>(num_items) * sizeof(std::int32_t));
      w.item_rows_done = ws.take(static_cast<std::size_t>(num_items) * sizeof(std::int32_t));
    }
    if constexpr (!std::same_as<redundancy_stage, no_stage>) w.red = ws.take(cells * sizeof(float));
    w.redundancy = redundancy_stage::reserve(c_, pl.redundancy, ws, pl.rows);
    w.own_keep = !keep_given;
    if (w.own_keep) w.keep = ws.take(cells);
    w.epilogue = epilogue_stage::reserve(c_, pl.epilogue, ws, pl.rows);
    w.layout = layout_stage::reserve(c_, pl.layout, ws, pl.rows);
    if (pl.statistics) {
      w.stats_per_row = redundancy_stage::statistics_per_row(c_);
      w.stats = ws.take(static_cast<std::size_t>(pl.rows * w.stats_per_row) * sizeof(float2));
    }
    w.total = ws.total;
    return w;
  }

  // Validation: validate_kernel over the items (and the reset of the block owners),
  // then claim_blocks_kernel over the view's sequences.
  void validate(const plan_type& pl, const layout_type& w, std::byte* ws, const row_space& rs,
                const prefix_targets& targets, std::int32_t* nonfinite, cudaStream_t stream) const {
    validation_state v;
    v.ready = reinterpret_cast<std::int32_t*>(ws + w.ready);
    v.flag_sets = layout_type::flag_sets;
    v.item_of_seq = reinterpret_cast<std::int32_t*>(ws + w.item_of_seq);
    v.owner = reinterpret_cast<std::int32_t*>(ws + w.owner);
    v.readers = reinterpret_cast<std::int32_t*>(ws + w.readers);
    v.targets = targets;
    if (w.per_item_counts) {
      v.item_max = reinterpret_cast<std::int32_t*>(ws + w.item_max);
      v.item_rows_done = reinterpret_cast<std::int32_t*>(ws + w.item_rows_done);
    }
    v.nonfinite = nonfinite;
    launch(pl.validate, stream, false, validate_kernel<P>, c_.p, c_.cache, c_.queries, rs, v);
    launch(pl.claim, stream, false, claim_blocks_kernel<>, c_.cache, rs, v);
  }

  // Everything one compression launches, in order: the status cleared, validation,
  // then the stages, on one stream (chained by programmatic dependent launches unless
  // stage marks are recorded between them) or pipelined over item groups on two.
  template <class Out>
  void run(const plan_type& pl, const layout_type& w, std::byte* ws, const row_space& rs,
           const prefix_targets& targets, const Out& out, const schedule& sc) const {
    const auto mark = [&](int i) {
      if (sc.stage_marks) cudaEventRecord(sc.stage_marks[i], sc.stream);
    };
    cudaMemsetAsync(out.status, 0, status_words * sizeof(std::int32_t), sc.stream);
    mark(0);
    if (rs.num_items == 0) {
      mark(1), mark(2), mark(3), mark(4);
      return;
    }
    if (whole_) {
      // The shifted rows first: validation and every stage read the window's.
      auto* first = const_cast<std::int32_t*>(c_.cache.table.first);
      auto* lengths = const_cast<std::int32_t*>(c_.cache.lengths);
      const std::int32_t seqs = whole_->num_seqs;
      window_rows_reset_kernel<> <<<(seqs + row_threads - 1) / row_threads, row_threads, 0, sc.stream>>>(
          whole_->lengths, seqs, first, lengths);
      window_rows_kernel<> <<<(rs.num_items + row_threads - 1) / row_threads, row_threads, 0, sc.stream>>>(
          whole_->lengths, seqs, whole_->block_size, rs, first, lengths);
    }
    validate(pl, w, ws, rs, targets, out.nonfinite_counts, sc.stream);
    if (!sc.overlap_stream) {
      run_stages(pl, w, ws, rs, 0, rs.num_items, targets, out, {sc.stream, sc.stream, sc.stream, nullptr}, mark,
                 sc.stage_marks == nullptr);
    } else {
      // A pipeline: `stream` runs every group's epilogue and compaction, the overlap
      // stream the next group's score and redundancy meanwhile; group 0 splits its
      // score (on `stream`) and redundancy (there), unless redundancy computes the
      // score's statistics: then both run there, one after the other.
      const std::int32_t groups = std::min(sc.overlap_groups, rs.num_items);
      cudaEventRecord(sc.overlap_events[0], sc.stream);
      cudaStreamWaitEvent(sc.overlap_stream, sc.overlap_events[0], 0);
      const std::int64_t rows_per_item = std::int64_t{rs.num_layers} * rs.num_heads;
      for (std::int32_t g = 0; g < groups; ++g) {
        const auto first = static_cast<std::int32_t>(std::int64_t{rs.num_items} * g / groups);
        const auto last = static_cast<std::int32_t>(std::int64_t{rs.num_items} * (g + 1) / groups);
        const stage_streams on{g == 0 && !pl.statistics ? sc.stream : sc.overlap_stream, sc.overlap_stream, sc.stream,
                               sc.overlap_events[1]};
        run_stages(plan((last - first) * rows_per_item, last - first), w, ws, rs, first, last - first, targets, out,
                   on, [](int) {}, false);
      }
      cudaEventRecord(sc.overlap_events[1], sc.overlap_stream);
      cudaStreamWaitEvent(sc.stream, sc.overlap_events[1], 0);
      mark(1), mark(2), mark(3);
    }
    mark(4);
  }

  // The stages for items [first, first + count) of the batch, planned by `pl` (the
  // batch's plan, or this group's): their rows are a contiguous range of every
  // per-row buffer, their per-item results a range of the per-item ones. `mark(i)`
  // records stage mark i (or nothing). `programmatic`: the stages may be chained by
  // programmatic dependent launches (nothing recorded between them).
  template <class Out, class Mark>
  void run_stages(const plan_type& pl, const layout_type& w, std::byte* ws, row_space rs, std::int32_t first,
                  std::int32_t count, prefix_targets targets, const Out& out, stage_streams on, Mark mark,
                  bool programmatic) const {
    const std::int64_t pitch = c_.max_tokens, row0 = std::int64_t{first} * rs.num_layers * rs.num_heads;
    rs.items += first;
    rs.num_items = count;
    if (!targets.empty()) targets.indptr += first;  // the group's items
    float* f_stash = w.stash_f ? rows_of<float>(ws, w.f_stash, row0, pitch) : nullptr;
    auto* scores = rows_of<float>(ws, w.scores, row0, pitch);
    auto* red = std::same_as<redundancy_stage, no_stage> ? nullptr : rows_of<float>(ws, w.red, row0, pitch);
    std::uint8_t* keep = (w.own_keep ? reinterpret_cast<std::uint8_t*>(ws + w.keep) : out.keep_masks) + row0 * pitch;
    auto* ready = reinterpret_cast<std::int32_t*>(ws + w.ready);  // [flag_sets][batch rows]
    // On one stream without stage marks the stages are chained by programmatic
    // dependent launches: lightning redundancy first, then the score kernel, which may
    // start in its last wave (and waits for it before reading the softmax statistics
    // lightning computed, when it did), then the epilogue and the layout, whose
    // launches overlap the end of the kernel before, and whose blocks start on their
    // row as soon as that row is handed on, not when the whole kernel before has
    // finished.
    constexpr bool lightning = std::same_as<redundancy_stage, block_redundancy_stage>;
    const bool chained = programmatic && on.score == on.tail && on.redundancy == on.tail;
    // Chained, rows are handed on one by one (publish_row): the epilogue takes a row
    // once its score block is done, when that block comes last before it (after
    // lightning, or with no redundancy stage), and the layout once its epilogue block is.
    constexpr bool scores_last = !std::same_as<score_stage, no_stage> &&
                                 (lightning || std::same_as<redundancy_stage, no_stage>);
    float2* block_stats = pl.statistics ? rows_of<float2>(ws, w.stats, row0, w.stats_per_row) : nullptr;
    std::int32_t key_splits = 1;
    if constexpr (std::same_as<score_stage, attention_score_stage>) key_splits = pl.score.key_splits;
    std::int32_t* score_ready = chained && scores_last && key_splits == 1 ? ready + row0 : nullptr;
    std::int32_t* select_ready = chained ? ready + w.rows + row0 : nullptr;
    // Chained after lightning, the score kernel takes a row once that row's lightning
    // blocks are done, where the lightning variant allows it.
    std::int32_t* stats_ready = chained && block_stats && redundancy_stage::hands_rows_on(pl.redundancy)
                                    ? ready + 2 * w.rows + row0
                                    : nullptr;

    const auto score = [&] {
      score_stage::launch(c_, pl.score,
                          score_launch{on.score, chained && lightning, rs, scores, score_ready, block_stats, stats_ready});
    };
    const auto redundancy = [&] {
      redundancy_stage::launch(c_, pl.redundancy, w.redundancy,
                               redundancy_launch{on.redundancy, rs, row0, red, block_stats, stats_ready, ws});
    };
    if (pl.statistics || (chained && lightning)) {
      redundancy();
      mark(1);
      score();
    } else {
      score();
      mark(1);
      redundancy();
    }
    // At most one other stream: score and redundancy each run on it or on tail.
    const bool red_elsewhere = !std::same_as<redundancy_stage, no_stage> && on.redundancy != on.tail;
    if (on.score != on.tail || red_elsewhere) {
      cudaEventRecord(on.join, on.score != on.tail ? on.score : on.redundancy);
      cudaStreamWaitEvent(on.tail, on.join, 0);
    }
    mark(2);
    const std::int32_t max_blocks = c_.blocks_per_row();
    epilogue_out eo;
    eo.keep = keep;
    eo.scores = out.scores ? out.scores + row0 * pitch : nullptr;
    eo.kept_counts = out.kept_counts ? out.kept_counts + row0 : nullptr;
    eo.nonfinite = out.nonfinite_counts ? out.nonfinite_counts + first : nullptr;
    eo.new_lengths = out.new_lengths + first;
    eo.released_counts = out.released_counts + first;
    eo.released_blocks = out.released_blocks + std::int64_t{first} * max_blocks;
    eo.max_blocks = max_blocks;
    if (w.per_item_counts) {
      eo.item_max = reinterpret_cast<std::int32_t*>(ws + w.item_max) + first;
      eo.item_rows_done = reinterpret_cast<std::int32_t*>(ws + w.item_rows_done) + first;
    }
    eo.targets = targets;
    eo.f_stash = f_stash;
    eo.new_tables = out.new_tables ? out.new_tables + std::int64_t{first} * max_blocks : nullptr;
    epilogue_stage::launch(c_, pl.epilogue, w.epilogue,
                           epilogue_launch{on.tail, chained, rs, row0, scores, red, eo,
                                           static_cast<const std::int32_t*>(score_ready), select_ready, ws});
    mark(3);
    if constexpr (!std::same_as<layout_stage, no_stage>) {
      layout_stage::launch(c_, pl.layout, w.layout,
                           layout_launch{on.tail, chained, rs, keep, static_cast<const std::int32_t*>(select_ready),
                                         targets, f_stash},
                           ws, row0);
    }
  }

 private:
  const stage_context<P>& c_;
  const paged_kv_view* whole_ = nullptr;
};

// Bytes at the front of the workspace that hold the shifted rows of a window-only
// layout: first[num_seqs] and lengths[num_seqs].
inline std::size_t window_rows_bytes(std::int32_t num_seqs) {
  return 2 * ((static_cast<std::size_t>(num_seqs) * sizeof(std::int32_t) + 255) / 256 * 256);
}

// The engine's view with every row read through the window arrays at `temp` (null
// while sizing the workspace: then the view is the engine's, for planning only).
inline paged_kv_view window_view(const paged_kv_view& cache, void* temp) {
  paged_kv_view v = cache;
  if (temp == nullptr) return v;
  auto* first = static_cast<std::int32_t*>(temp);
  v.table.first = first;
  v.lengths = reinterpret_cast<std::int32_t*>(static_cast<std::byte*>(temp) + window_rows_bytes(cache.num_seqs) / 2);
  return v;
}

}  // namespace cuda
KVP_NAMESPACE_END
