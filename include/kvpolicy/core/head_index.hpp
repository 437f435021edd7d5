// Which (layer, KV head) a row of scores belongs to.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Given to the hooks of per-head policies (a key scorer or a selector that treats
// heads differently): a row is one (sequence, layer, KV head) of the batch, and the
// layer is the cache's layer index, not an offset into the batch's layer range.
struct head_index {
  std::int32_t layer = 0;
  std::int32_t kv_head = 0;

  friend constexpr bool operator==(head_index, head_index) noexcept = default;
};

KVP_NAMESPACE_END
