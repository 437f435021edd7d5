// Fill (SPEC.md "Layouts"; KV-Compress's MoveCache for shared tables): the kept tokens
// past the new length move into the evicted slots below it.
#pragma once

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace layout {

// With k tokens kept of a row, the evicted slots below k are filled, lowest slot
// first, by the kept tokens at k and after, newest first; kept tokens already below
// k stay where they are. It moves as many tokens as it evicted below k (compact moves
// every kept token after the first eviction), with their F and positions. Order is
// not kept: a later compression's pooling and lightning redundancy see the physical
// order, and cache.positions holds each token's original position (docs/pipeline.md,
// "Fill").
struct fill {
  static constexpr bool moves_tokens = true;
  static constexpr bool fills_holes = true;
};

}  // namespace layout
KVP_NAMESPACE_END
