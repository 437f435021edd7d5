// Tokens no policy may evict: the observation window and the attention sinks.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// The last `window` positions and the first `sinks` get +inf before selection.
struct protect {
  std::int32_t window = 16;
  std::int32_t sinks = 0;  // StreamingLLM uses 4

  KVP_HOST_DEVICE constexpr bool covers(std::int32_t t, std::int32_t T) const noexcept {
    return t < sinks || t >= T - window;
  }
};

KVP_NAMESPACE_END
