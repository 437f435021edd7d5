// The global score cache F: one fp32 per cached (layer, block, slot, KV head).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/slot_view.hpp"

KVP_NAMESPACE_BEGIN

// Zipage C.3's `F in R^{L x N_total x b x h_kv}`, indexed by physical block so a
// token's score sits beside its K and V and moves with them.
using score_view = slot_view<float>;

KVP_NAMESPACE_END
