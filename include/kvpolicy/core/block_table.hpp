// The engine's block table, dense or CSR, read without copying.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Dense: `indices[seq * row_stride + i]` (vLLM, nano-vllm: `[num_seqs, max_blocks]`).
// CSR: `indices[indptr[seq] + i]` with `indptr[num_seqs]` entries past the last (FlashInfer).
// Entries are physical block ids into the cache; the view never writes them.
// `first` shifts rows: logical block i of sequence seq is entry first[seq] + i of its
// row. Engines leave it null; the executors set it to run a window-only layout over
// the window of each sequence as if the window were the whole sequence.
struct block_table_view {
  const std::int32_t* indices = nullptr;
  const std::int32_t* indptr = nullptr;  // null: dense
  std::int64_t row_stride = 0;           // dense only: entries per row
  const std::int32_t* first = nullptr;   // optional [num_seqs]: where each row starts, in entries

  static constexpr block_table_view dense(const std::int32_t* table, std::int64_t max_blocks) noexcept {
    return {table, nullptr, max_blocks};
  }
  static constexpr block_table_view csr(const std::int32_t* indptr_, const std::int32_t* indices_) noexcept {
    return {indices_, indptr_, 0};
  }

  KVP_HOST_DEVICE constexpr bool is_csr() const noexcept { return indptr != nullptr; }

  // Physical block holding logical block i of sequence seq.
  KVP_HOST_DEVICE constexpr std::int32_t block(std::int32_t seq, std::int32_t i) const noexcept {
    return unshifted(seq, i + (first ? first[seq] : 0));
  }
  // Entry i of the row, ignoring `first`.
  KVP_HOST_DEVICE constexpr std::int32_t unshifted(std::int32_t seq, std::int64_t i) const noexcept {
    return is_csr() ? indices[indptr[seq] + i] : indices[seq * row_stride + i];
  }

  // How many logical blocks the table has room for in sequence seq.
  KVP_HOST_DEVICE constexpr std::int64_t capacity(std::int32_t seq) const noexcept {
    return (is_csr() ? std::int64_t{indptr[seq + 1]} - indptr[seq] : row_stride) - (first ? first[seq] : 0);
  }
};

KVP_NAMESPACE_END
