// The batch items as the bindings receive them: one int32 array [n, 4] whose rows are
// (seq, query_slot, budget, history_tokens), the memory layout of kvp::batch_item, so
// host rows are the items and device rows are a device_batch's items as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <kvpolicy/core/batch.hpp>

namespace kvpy {

static_assert(std::is_standard_layout_v<kvp::batch_item> && sizeof(kvp::batch_item) == 4 * sizeof(std::int32_t) &&
                  offsetof(kvp::batch_item, seq) == 0 && offsetof(kvp::batch_item, query_slot) == 4 &&
                  offsetof(kvp::batch_item, budget) == 8 && offsetof(kvp::batch_item, history_tokens) == 12,
              "kvp::batch_item is no longer (seq, query_slot, budget, history_tokens) as int32: update the "
              "column order in src/kvpolicy/compress.py");

inline constexpr std::size_t item_columns = 4;

}  // namespace kvpy
