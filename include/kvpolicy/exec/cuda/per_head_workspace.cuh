// What the per-head executor's kernels share: the batch's rows and groups, and the
// workspace they hand each other (cuda_per_head_executor.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/per_head_item.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/select/head_adaptive_blocks.hpp"

KVP_NAMESPACE_BEGIN

namespace cuda {

// Rows are (item, layer, KV head), row = (item x layers + layer) x heads + head, as
// the results are laid out. A budget group is an item (block_budget::sequence) or an
// (item, layer) (block_budget::layer); its rows are adjacent.
struct per_head_space {
  const per_head_item* items = nullptr;  // device
  std::int32_t num_items = 0;
  std::int32_t num_layers = 0;
  std::int32_t num_heads = 0;
  std::int32_t* status = nullptr;  // device, status_words
  select::block_budget budget = select::block_budget::sequence;
  std::int32_t protected_window = 64;
  std::int32_t sinks = 0;

  KVP_HOST_DEVICE std::int32_t rows() const noexcept { return num_items * num_layers * num_heads; }
  KVP_HOST_DEVICE std::int32_t rows_per_group() const noexcept {
    return budget == select::block_budget::sequence ? num_layers * num_heads : num_heads;
  }
  KVP_HOST_DEVICE std::int32_t groups() const noexcept {
    return budget == select::block_budget::sequence ? num_items : num_items * num_layers;
  }
};

struct per_head_coord {
  std::int32_t item, layer, head;
};
KVP_HOST_DEVICE inline per_head_coord decode_per_head_row(const per_head_space& s, std::int32_t row) {
  const std::int32_t rest = row / s.num_heads;
  return {rest / s.num_layers, rest % s.num_layers, row % s.num_heads};
}

// Tokens one block of the histogram kernel reads of a row.
inline constexpr std::int32_t per_head_tile_tokens = 8 * row_threads;
// Tokens a thread of the schedule's first pass or of the evict kernel loads before it
// uses them: independent loads in flight (a table entry, then the metric it points
// to, is a chain of two).
inline constexpr std::int32_t per_head_loads_in_flight = 8;
// A row's cached key of a protected token: above every metric key (+inf's is 0xff800000).
inline constexpr std::uint32_t per_head_protected_key = 0xffffffffu;
// Passes of the group cut's radix select: 8 bits of the 32-bit metric key each.
inline constexpr std::int32_t per_head_passes = 4;

// A row's schedule state. `evictable`: tokens outside the protection (the histogram's
// first pass counts them); `less`: evictable tokens whose metric key lies below the
// group's prefix; `candidates`: its keys under the prefix of passes 1 and 2 (kept
// where they fit, per_head_workspace::candidates); `blocks`: blocks the row frees
// (first those cheaper than the cut); `ties`: its blocks costing exactly the cut.
struct per_head_row_state {
  std::int32_t evictable, less, candidates[2], blocks, ties, moves;  // moves: tokens MoveCache copies
};

// A budget group's radix select: its rows' possible blocks (`total`), the blocks it
// frees (`need`), each pass's digit and the key prefix found so far, and whether its
// rows' blocks are known without a cut (nothing or everything possible freed).
struct per_head_group_state {
  std::int64_t total;
  std::int64_t need;
  std::int32_t digit[per_head_passes];
  std::uint32_t prefix;
  std::int32_t settled;
};

struct per_head_workspace {
  std::int32_t* owner = nullptr;        // [pools][num_blocks]: the row claiming a block, -1 before
  std::int32_t* item_of_seq = nullptr;  // [num_seqs]: the item naming a sequence, -1 before
  std::uint32_t* hist = nullptr;        // [passes][rows][256]
  per_head_row_state* rows = nullptr;   // [rows]
  per_head_group_state* groups = nullptr;  // [groups]
  std::int64_t* cheaper = nullptr;      // [passes][groups][256]: F(j), blocks cheaper than digit j
  std::int32_t* pairs = nullptr;        // [rows][2][pitch]: each head's holes and movers (physical slots)
  // [rows][key_pitch]: each head's 32-bit metric keys in token order (protected ones
  // per_head_protected_key), written by the schedule's first pass and read by the
  // others and the evict kernel instead of the metric through the table. In the pairs'
  // memory: the evict kernel reads a head's keys before it writes the head's pairs.
  std::uint32_t* keys = nullptr;
  std::uint32_t* kept = nullptr;        // [rows][words]: each head's kept tokens, a bit each
  // [rows][words]: a row's keys under the prefix of pass 1 (or, where those did not
  // fit, of pass 2), which the later passes read instead of the row's keys. In the kept
  // bits' memory: the evict kernel writes those after the schedule.
  std::uint32_t* candidates = nullptr;
  std::int32_t pitch = 0;
  std::int32_t words = 0;
  std::int32_t tiles = 0;               // histogram blocks per row
  std::int32_t key_pitch = 0;           // 2 pitch: at least a head's capacity
};

// The workspace's parts, each 256-byte aligned, for a cache and a batch.
struct per_head_workspace_layout {
  std::size_t owner = 0, item_of_seq = 0, hist = 0, rows = 0, groups = 0, cheaper = 0, pairs = 0, kept = 0, total = 0;
  std::int32_t pools = 1, pitch = 0, words = 0, tiles = 0;
  std::int64_t hist_bytes = 0, row_bytes = 0, cheaper_bytes = 0;

  per_head_workspace_layout(const per_head_kv_view& c, const per_head_space& s) {
    const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
    pools = c.shared_pool ? 1 : c.num_layers;
    // A head moves at most half its tokens (survivors past the new length, one per hole below it).
    // Even, so that each row's keys (2 pitch words) start on a 16-byte boundary: a
    // warp's loads of 32 of them fill whole sectors.
    pitch = static_cast<std::int32_t>((capacity / 2 + 2) & ~std::int64_t{1});
    tiles = static_cast<std::int32_t>((capacity + per_head_tile_tokens - 1) / per_head_tile_tokens);
    const auto rows_n = static_cast<std::size_t>(s.rows());
    std::size_t at = 0;
    auto take = [&](std::size_t bytes) {
      const std::size_t here = at;
      at += (bytes + 255) / 256 * 256;
      return here;
    };
    owner = take(sizeof(std::int32_t) * static_cast<std::size_t>(pools) * static_cast<std::size_t>(c.num_blocks));
    item_of_seq = take(sizeof(std::int32_t) * static_cast<std::size_t>(c.num_seqs));
    hist_bytes = static_cast<std::int64_t>(sizeof(std::uint32_t) * per_head_passes * 256 * rows_n);
    hist = take(static_cast<std::size_t>(hist_bytes));
    row_bytes = static_cast<std::int64_t>(sizeof(per_head_row_state) * rows_n);
    rows = take(static_cast<std::size_t>(row_bytes));
    groups = take(sizeof(per_head_group_state) * static_cast<std::size_t>(s.groups()));
    cheaper_bytes = static_cast<std::int64_t>(sizeof(std::int64_t) * per_head_passes * 256) * s.groups();
    cheaper = take(static_cast<std::size_t>(cheaper_bytes));
    pairs = take(sizeof(std::int32_t) * 2 * static_cast<std::size_t>(pitch) * rows_n);
    words = static_cast<std::int32_t>((capacity + 31) / 32);
    kept = take(sizeof(std::uint32_t) * static_cast<std::size_t>(words) * rows_n);
    total = at;
  }

  per_head_workspace bind(void* temp) const {
    auto* base = static_cast<std::byte*>(temp);
    return {reinterpret_cast<std::int32_t*>(base + owner),
            reinterpret_cast<std::int32_t*>(base + item_of_seq),
            reinterpret_cast<std::uint32_t*>(base + hist),
            reinterpret_cast<per_head_row_state*>(base + rows),
            reinterpret_cast<per_head_group_state*>(base + groups),
            reinterpret_cast<std::int64_t*>(base + cheaper),
            reinterpret_cast<std::int32_t*>(base + pairs),
            reinterpret_cast<std::uint32_t*>(base + pairs),
            reinterpret_cast<std::uint32_t*>(base + kept),
            reinterpret_cast<std::uint32_t*>(base + kept),
            pitch,
            words,
            tiles,
            2 * pitch};
  }
};

// The row's protection, as head_adaptive_blocks::protects: the first `sinks` positions
// and the last `protected_window` of the sequence's `length` positions.
KVP_HOST_DEVICE inline bool per_head_protects(const per_head_space& s, std::int32_t position, std::int32_t length) {
  return position < s.sinks || position >= length - s.protected_window;
}

}  // namespace cuda
KVP_NAMESPACE_END
