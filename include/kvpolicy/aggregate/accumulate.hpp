// KV-Compress eq. 20 / H2O: the running sum of every score a token ever received.
#pragma once

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace aggregate {

// S <- F + S, F <- S: global score with alpha 1 in sum mode.
struct accumulate {
  static constexpr bool max_norm = false;

  KVP_HOST_DEVICE constexpr float combine(float history, float s) const noexcept { return history + s; }
};

}  // namespace aggregate
KVP_NAMESPACE_END
