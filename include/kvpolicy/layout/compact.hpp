// Zipage alg. 4: kept tokens move, in order, to the front of the sequence's blocks.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace layout {

// The i-th kept token (in position order) moves to logical position i, with its F;
// the new length is the kept count and blocks past it are released to the engine.
// Because destination <= source, the move is safe in place, front to back.
struct compact {
  static constexpr bool moves_tokens = true;

  KVP_HOST_DEVICE constexpr std::int32_t destination(std::int32_t kept_index) const noexcept { return kept_index; }
};

}  // namespace layout
KVP_NAMESPACE_END
