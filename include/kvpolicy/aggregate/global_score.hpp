// G-KV / Zipage alg. 2 global score: a decayed memory of past scores, kept in F.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace aggregate {

enum class global_mode : std::uint8_t {
  max,   // S <- max(alpha F, S)            (default)
  sum,   // S <- alpha F + S                (H2O-like)
  mean,  // S <- alpha F + (1 - alpha) S
};

// For a token with history (t < history_tokens) S <- combine(F, S); then F <- S for
// every candidate. A sequence never compressed just stores F <- S.
struct global_score {
  global_mode mode = global_mode::max;
  float alpha = 0.8f;
  // G-KV: divide S by its per-(seq, layer, head) max before combining.
  bool max_norm = false;

  KVP_HOST_DEVICE constexpr float combine(float history, float s) const noexcept {
    switch (mode) {
      case global_mode::sum: return alpha * history + s;
      case global_mode::mean: return alpha * history + (1.0f - alpha) * s;
      default: {
        const float a = alpha * history;
        return a > s ? a : s;
      }
    }
  }
};

}  // namespace aggregate
KVP_NAMESPACE_END
