// What a decode-attention call reads and writes, for the host reference and the CUDA
// kernels alike: one new query token per sequence, attending one layer of a cache
// whose KV heads may hold different tokens (docs/cuda.md, "Decode attention").
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"

KVP_NAMESPACE_BEGIN

// The new tokens' query rows, or the output rows: `[items, heads, d]` under element
// strides (the dim stride is 1). Queries and output have the cache's dtype.
struct decode_rows {
  void* base = nullptr;
  std::int32_t num_heads = 0;  // h_q
  std::int32_t head_dim = 0;
  dtype type = dtype::bf16;
  std::int64_t item_stride = 0, head_stride = 0;

  // Contiguous `[items, h_q, d]`.
  static constexpr decode_rows contiguous(void* base, std::int32_t h_q, std::int32_t d, dtype t) noexcept {
    return {base, h_q, d, t, std::int64_t{h_q} * d, d};
  }

  KVP_HOST_DEVICE std::byte* row(std::int32_t item, std::int32_t head) const noexcept {
    return static_cast<std::byte*>(base) + (item * item_stride + head * head_stride) * size_of(type);
  }
};

// What the call adds, beside the output, for every token a KV head attended: the
// attention's own probabilities of the group's G query heads, after the softmax over
// the head's tokens (so with the scale the call is given).
enum class decode_metric : std::uint8_t {
  none,
  // KV-Compress's decode-time update (scorer::squared_attention_metric::decode): the
  // sum over the group of each probability squared, into the per-head cache's metric.
  squared,
  // H2O's accumulation: the sum over the group of the probabilities, into F (a
  // score_view, paged caches) or the per-head cache's metric.
  probability,
};

struct decode_epilogue {
  decode_metric kind = decode_metric::none;
  // A query at position p adds nothing to tokens at positions t with p - t < v (they
  // still take part in its softmax): scorer::squared_attention_metric's excluded
  // distance. Positions come from the cache's positions view where it has one (else a
  // token's index in its head, or in its sequence for paged caches); the query's from
  // decode_batch::query_positions (else that of the last token the head attends).
  std::int32_t excluded_distance = 0;
  // Paged caches: where the sums go (F, `[L, num_blocks, b, h_kv]`). Per-head caches
  // use cache.metric and ignore this.
  score_view scores{};

  KVP_HOST_DEVICE constexpr bool writes() const noexcept { return kind != decode_metric::none; }
};

// The sequences that decode, one query token each, in the layer the call attends.
// Pointers are device memory for the CUDA call, host memory for the reference.
struct decode_batch {
  const std::int32_t* seqs = nullptr;  // [num_items]: item i's sequence (null: item i is sequence i)
  std::int32_t num_items = 0;
  std::int32_t layer = 0;
  // An upper bound of every attended head's length (CUDA only: sizes the grid and the
  // workspace without reading the lengths on the host; 0: the table's capacity). A
  // head longer than this is an error.
  std::int32_t max_tokens = 0;
  const std::int32_t* query_positions = nullptr;  // [num_items], optional (excluded distance)
  std::int32_t* status = nullptr;                 // CUDA: [status_words], device memory
};

// Which tokens each KV head of a shared-table (paged) cache attends, besides the live
// view the cache may carry (cautious update: tokens whose byte is 0 are skipped).
// `counts` (optional, `[layer, seq, kv_head]`): a head-adaptive selector's per-head
// counts (Hard-KV after a compaction), each head attending its kept tokens [0, count);
// `tail_from` (optional, `[num_seqs]`): where the tokens appended since that compaction
// begin (its new length), which every head attends, [tail_from, length). So head h
// attends t < count || t >= tail_from (docs/integration.md, "Per-head counts in
// attention"); count <= tail_from <= length. Without counts every head attends
// [0, length).
struct decode_head_counts {
  per_head_array counts{};
  const std::int32_t* tail_from = nullptr;
  KVP_HOST_DEVICE constexpr bool given() const noexcept { return counts.base != nullptr || counts.layers != nullptr; }
};

// The tokens one head attends, as a span of T logical indices j: token j < count is
// token j of the sequence, the rest token j + gap (the tail after a compaction).
struct decode_row_span {
  std::int32_t length = 0;  // T: tokens attended (before the live view)
  std::int32_t count = 0;
  std::int32_t gap = 0;
  KVP_HOST_DEVICE constexpr std::int32_t token(std::int32_t j) const noexcept { return j < count ? j : j + gap; }
};

KVP_NAMESPACE_END
