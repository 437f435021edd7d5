// The engine's marker of blocks shared between requests (prefix caching).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Optional: which physical blocks other requests also read, as the engine tracks
// them. A block is shared when its refcount is above 1 or its bit is set (either
// array, or both; null: no marker). The executors also find sharing the marker does
// not show: a block that two sequences of the view both hold. A compression that
// would write a shared block is rejected before any byte is written (docs/views.md).
// The arrays live where the executor runs: host memory for the host executor,
// device memory for the CUDA executor.
struct block_sharing {
  const std::int32_t* refcounts = nullptr;  // [num_blocks]
  const std::uint32_t* bitmask = nullptr;   // [ceil(num_blocks / 32)]: block id's bit is id % 32 of word id / 32

  KVP_HOST_DEVICE constexpr bool marked() const noexcept { return refcounts != nullptr || bitmask != nullptr; }
  KVP_HOST_DEVICE constexpr bool shared(std::int32_t id) const noexcept {
    return (refcounts != nullptr && refcounts[id] > 1) ||
           (bitmask != nullptr && ((bitmask[id / 32] >> (id % 32)) & 1u) != 0);
  }
};

KVP_NAMESPACE_END
