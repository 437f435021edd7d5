// Small policies for tests: scores set by hand, to exercise the later stages alone.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "support/test_cache.hpp"

namespace kvp_test {

// A keep mask of T tokens with the listed positions kept: what hand cases expect.
using mask = std::vector<std::uint8_t>;
inline mask mask_of(int T, std::initializer_list<int> kept) {
  mask m(static_cast<std::size_t>(T), 0);
  for (int t : kept) m[static_cast<std::size_t>(t)] = 1;
  return m;
}

// A KeyScorer whose score of token t is values[t] (at least T entries, in the memory of
// the executor that runs it: the CUDA build of the unit tests hands the CUDA executor a
// device copy, support/run_on_both_executors.cuh). Trivially copyable and default
// constructible like any policy.
struct table_scorer {
  const float* values = nullptr;

  KVP_HOST_DEVICE float key_score(kvp::row_ref, std::int32_t t, std::int32_t) const noexcept { return values[t]; }
};
static_assert(kvp::KeyScorer<table_scorer>);

// A KeyScorer reading the score from the key itself: element 0 of k_t.
struct first_element_scorer {
  KVP_HOST_DEVICE float key_score(kvp::row_ref k, std::int32_t, std::int32_t) const noexcept { return k[0]; }
};
static_assert(kvp::KeyScorer<first_element_scorer>);

// first_element_scorer's scores of the row (l, seq, h): element 0 of each key set to s[t].
inline void set_first_elements(test_cache& tc, int l, int seq, int h, const std::vector<float>& s) {
  for (int t = 0; t < static_cast<int>(s.size()); ++t) {
    auto k = tc.key(l, seq, t, h);
    k[0] = s[t];
    tc.set_key(l, seq, t, h, k);
  }
}

// A pipeline whose final score is exactly -R for redundancy r (no scorer, so S = 0;
// lambda 0 in the weighted form; nothing protected): R read back through an executor.
template <class R>
kvp::pipeline<kvp::none, kvp::none, R, kvp::none, kvp::none> redundancy_alone(R r) {
  kvp::pipeline<kvp::none, kvp::none, R, kvp::none, kvp::none> p;
  r.lambda = 0.0f;
  r.form = kvp::redundancy::combine_form::weighted;
  p.redundancy = r;
  p.protect = {.window = 0, .sinks = 0};
  return p;
}

}  // namespace kvp_test
