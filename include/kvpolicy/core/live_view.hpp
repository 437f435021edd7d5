// Cautious update (Hard-KV): which cached tokens each (layer, KV head) still holds.
// One byte per cached (layer, block, slot, KV head), beside K, V, F and positions.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/slot_view.hpp"

KVP_NAMESPACE_BEGIN

// Optional (paged_kv_view::live). A head-adaptive selector keeps a count per (layer,
// KV head) in a table the heads share, so after a compaction a head holds its kept
// tokens in slots [0, count) and leftovers in [count, new length): tokens it dropped.
// With this view set, every compression treats a token whose byte is 0 as gone from
// that head (a dropped token stays dropped: the new mask is the old one AND the new
// selection): attention scorers leave it out of their softmax, it enters aggregation
// with score 0, it is never kept, and protect does not count it. The layout (one that
// compacts whole rows: compact, fill) writes the bytes of each row (1 in [0, count),
// 0 in [count, T)). The engine writes 1 for every layer and head of each token it
// appends, and its attention reads only live tokens (docs/integration.md). Nonzero is
// live. Where the executor runs (host or device memory).
using live_view = slot_view<std::uint8_t>;  // contiguous: `[L, num_blocks, b, h_kv]`, as F

KVP_NAMESPACE_END
