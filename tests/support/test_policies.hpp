// Small policies for tests: scores set by hand, to exercise the later stages alone.
#pragma once

#include <cstdint>

#include "kvpolicy/kvpolicy.hpp"

namespace kvp_test {

// A KeyScorer whose score of token t is values[t] (host memory, at least T entries).
// Trivially copyable and default constructible like any policy.
struct table_scorer {
  const float* values = nullptr;

  float key_score(kvp::row_ref, std::int32_t t, std::int32_t) const noexcept { return values[t]; }
};
static_assert(kvp::KeyScorer<table_scorer>);

// A KeyScorer reading the score from the key itself: element 0 of k_t.
struct first_element_scorer {
  float key_score(kvp::row_ref k, std::int32_t, std::int32_t) const noexcept { return k[0]; }
};
static_assert(kvp::KeyScorer<first_element_scorer>);

}  // namespace kvp_test
