// The batch items as the bindings receive them: one int32 array [n, 5] whose rows are
// (seq, query_slot, budget, history_tokens, window_begin), the memory layout of kvp::batch_item, so
// host rows are the items and device rows are a device_batch's items as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <kvpolicy/core/batch.hpp>
#include <kvpolicy/core/error.hpp>

#include "tensor_args.hpp"

namespace kvpy {

static_assert(std::is_standard_layout_v<kvp::batch_item> && sizeof(kvp::batch_item) == 5 * sizeof(std::int32_t) &&
                  offsetof(kvp::batch_item, seq) == 0 && offsetof(kvp::batch_item, query_slot) == 4 &&
                  offsetof(kvp::batch_item, budget) == 8 && offsetof(kvp::batch_item, history_tokens) == 12 &&
                  offsetof(kvp::batch_item, window_begin) == 16,
              "kvp::batch_item is no longer (seq, query_slot, budget, history_tokens, window_begin) as int32: "
              "update the column order in src/kvpolicy/_compress.py");

inline constexpr std::size_t item_columns = 5;

// The rows of `items`, checked: int32 [n, 5], rows packed (any strides when empty).
inline const kvp::batch_item* item_rows(const array& items) {
  require_ndim(items, 2, "items", "[n, 5]: (seq, query_slot, budget, history_tokens, window_begin)");
  require_dtype(items, int32_type, "items", "int32");
  const bool packed = items.shape(0) == 0 || ((items.shape(0) == 1 || items.stride(0) == item_columns) &&
                                              items.stride(1) == 1);
  kvp::require(items.shape(1) == item_columns && packed, "items",
               "has shape {} and strides {}; expected a contiguous [n, 5]", shape_of(items), strides_of(items));
  return static_cast<const kvp::batch_item*>(items.data());
}

}  // namespace kvpy
