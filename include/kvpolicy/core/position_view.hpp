// Each cached token's original position: one int32 per cached (layer, block, slot,
// KV head), beside K, V and F, moved with its token by every layout.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/slot_view.hpp"

KVP_NAMESPACE_BEGIN

// Optional (paged_kv_view::positions). After a compression a sequence's cache is
// shorter than the sequence: token i of a head's kept prefix was generated at
// position at(l, block, slot, h), which an engine needs for the RoPE of the next
// tokens and for attention masks (docs/integration.md), and which order-free layouts
// need to keep order. The executors never write it but to move it; the engine writes
// each new token's position when it appends the token. Indexed by physical block, as
// F is (score_view.hpp); where the executor runs (host or device memory).
using position_view = slot_view<std::int32_t>;

KVP_NAMESPACE_END
