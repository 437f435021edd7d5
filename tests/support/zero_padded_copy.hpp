// A copy of a test_cache with every K, V and query row widened from d to d * 4^k
// elements by zeros, and the queries multiplied by 2^k. Plain C++.
//
// Why: the CUDA executor moves rows of a multiple of 16 bytes only (docs/cuda.md),
// and the hand cases of the unit tests use d = 1, 2, 3. On the copy a pipeline
// computes the same thing, exactly: every stage reads keys through dot products,
// norms or single elements, which the zeros leave as they are, and attention divides
// q . k by sqrt(head_dim): (2^k q) . k / sqrt(4^k d) = q . k / sqrt(d), where each
// scaling by a power of two is exact in floating point. So the host executor gives
// bit-identical scores, masks and (first d elements of the) bytes on the copy
// (tests/unit/test_zero_padding.cpp), and the CUDA executor's results on it can be
// compared with the host's on the original.
#pragma once

#include <cmath>
#include <concepts>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

namespace kvp_test {

// Scorers whose scores a zero-padded copy leaves unchanged: attention scorers (the
// queries' 2^k makes up for sqrt(head_dim)), no scorer, and the test scorers that read
// one element of the key or none. A key scorer that reads the row's size or every
// element is not known to: it is never run on a padded copy.
template <class S>
inline constexpr bool ignores_zero_padding = kvp::AttentionScorer<S> || std::same_as<S, kvp::none> ||
                                             std::same_as<S, table_scorer> || std::same_as<S, first_element_scorer>;

// `tc` with rows of d * 4^k elements (k = 0: a plain copy). Block table, lengths and F
// are copied as they are. Throws if a query does not scale exactly (it would overflow).
inline test_cache zero_padded_copy(const test_cache& tc, int k) {
  cache_config cfg = tc.config();
  const i32 d = tc.head_dim(), wide = d << (2 * k);
  cfg.head_dim = wide;
  cfg.randomize = false;  // all zero: the padding
  test_cache out(cfg);
  out.raw_table() = tc.raw_table();
  out.raw_indptr() = tc.raw_indptr();
  out.raw_lengths() = tc.raw_lengths();
  out.raw_f() = tc.raw_f();
  out.raw_positions() = tc.raw_positions();
  out.raw_live() = tc.raw_live();
  // Every physical row, owned by a sequence or not.
  for (i32 l = 0; l < tc.num_layers(); ++l)
    for (i32 p = 0; p < tc.num_blocks(); ++p)
      for (i32 slot = 0; slot < tc.block_size(); ++slot)
        for (i32 h = 0; h < tc.kv_heads(); ++h)
          for (kv_kind kind : {kv_kind::k, kv_kind::v})
            std::memcpy(out.row_ptr(kind, l, p, slot, h), tc.row_ptr(kind, l, p, slot, h), tc.row_size());
  std::vector<float> q(static_cast<std::size_t>(wide), 0.0f);
  for (i32 l = 0; l < tc.num_layers(); ++l)
    for (i32 slot = 0; slot < tc.slots(); ++slot)
      for (i32 j = 0; j < tc.window(); ++j)
        for (i32 qh = 0; qh < tc.q_heads(); ++qh) {
          const auto row = tc.query(l, slot, j, qh);
          for (i32 i = 0; i < d; ++i) q[i] = std::ldexp(row[i], k);
          out.set_query(l, slot, j, qh, q);
          if (out.query(l, slot, j, qh) != q)
            throw std::invalid_argument("zero_padded_copy: a query does not scale exactly");
        }
  return out;
}

}  // namespace kvp_test
