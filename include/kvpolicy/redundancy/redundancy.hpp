// R-KV sec. 3.3 redundancy of keys, full (all pairs) and lightning (Zipage C.7, within a block).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace redundancy {

enum class scope : std::uint8_t {
  full,   // all pairs of candidates, n = candidate count
  block,  // pairs within one cache block of b tokens, n = b
};

enum class combine_form : std::uint8_t {
  weighted,  // S <- lambda S - (1 - lambda) R   (R-KV eq. 7, Zipage code; default)
  subtract,  // S <- S - lambda R                (Zipage eq. 4)
};

// With C the cosine similarity of normalised keys k / (||k|| + eps) and r(u) the
// newest v != u with C(u, v) > theta:
//   red(t) = (1/n) sum_{u != t, r(u) != t} C(u, t),   R = softmax_t(red / tau).
// Among near-duplicates the newest keeps the lowest redundancy; a token with no
// similar neighbour drops nothing.
template <scope Scope>
struct key_redundancy {
  static constexpr redundancy::scope pairs = Scope;
  float theta = 0.5f;
  float tau = 1.0f;
  float lambda = 0.1f;
  float eps = 1e-8f;
  combine_form form = combine_form::weighted;

  KVP_HOST_DEVICE constexpr float combine(float s, float r) const noexcept {
    return form == combine_form::weighted ? lambda * s - (1.0f - lambda) * r : s - lambda * r;
  }
};

using full = key_redundancy<scope::full>;
using lightning = key_redundancy<scope::block>;

}  // namespace redundancy
KVP_NAMESPACE_END
