// Where a batch item's kept tokens are written: its own block table, or, for a shared
// prefix, fresh target blocks in place of the shared ones.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/block_table.hpp"

KVP_NAMESPACE_BEGIN

// Logical block j of the item's table after the compression: targets[j] for its first
// `shared` blocks (prefix_targets), its own table's block j after them.
struct destination_table {
  block_table_view table;
  std::int32_t seq = 0;
  const std::int32_t* targets = nullptr;  // [shared]
  std::int32_t shared = 0;

  KVP_HOST_DEVICE static constexpr destination_table of(const block_table_view& table, std::int32_t seq,
                                                        const prefix_targets& t, std::int32_t item) noexcept {
    const std::int32_t n = t.count(item);
    return {table, seq, n > 0 ? t.blocks + t.indptr[item] : nullptr, n};
  }
  KVP_HOST_DEVICE constexpr std::int32_t block(std::int32_t j) const noexcept {
    return j < shared ? targets[j] : table.block(seq, j);
  }
};

KVP_NAMESPACE_END
