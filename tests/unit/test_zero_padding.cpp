// support/zero_padded_copy.hpp: a pipeline gives bit-identical results and bytes on a
// copy whose rows are zero-padded from d to d * 4^k (queries times 2^k). The CUDA build
// of the unit tests relies on it to run the hand cases (d = 1, 2, 3) on the CUDA
// executor, which moves rows of a multiple of 16 bytes only; checked here on the host.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "support/agreement.hpp"
#include "support/test_cache.hpp"
#include "support/test_policies.hpp"
#include "support/zero_padded_copy.hpp"

using kvp::none;
using kvp_test::test_cache;
namespace presets = kvp::presets;

namespace {

// A random cache with d in [1, 5], random dtypes (cache and queries) and layout, two
// sequences of 12 to 40 tokens, both compressed (one with history) on every layer.
struct padding_case {
  std::mt19937 rng;
  explicit padding_case(std::uint32_t seed) : rng(seed) {}
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

  test_cache cache(std::uint32_t seed) {
    const int H = pick(1, 2);
    return test_cache({.layers = 2,
                       .block_size = pick(2, 5),
                       .kv_heads = H,
                       .head_dim = pick(1, 5),
                       .type = kvp_test::all_dtypes[pick(0, 2)],
                       .lengths = {pick(12, 40), pick(12, 40)},
                       .csr = pick(0, 1) == 1,
                       .layout = kvp_test::all_layouts[pick(0, kvp_test::layout_count - 1)],
                       .q_heads = H * pick(1, 3),
                       .window = 4,
                       .q_type = kvp_test::all_dtypes[pick(0, 2)],
                       .seed = seed});
  }
  std::vector<kvp::batch_item> items(const test_cache& tc) {
    std::vector<kvp::batch_item> out;
    for (int s = 0; s < 2; ++s) {
      const int T = tc.length(s), budget = pick(8, T);
      out.push_back({.seq = s, .query_slot = s, .budget = budget, .history_tokens = s == 0 ? 0 : pick(0, T)});
    }
    return out;
  }
};

// p on `tc` and on its zero-padded copies (k = 0: a plain copy; 1; 2) must agree to the bit.
template <class P>
void check_padding_is_exact(const P& p, std::uint32_t seed) {
  padding_case r(seed);
  const test_cache tc = r.cache(seed);
  const auto items = r.items(tc);
  CAPTURE(tc.describe());
  for (int k = 0; k <= 2; ++k) {
    CAPTURE(k);
    test_cache original = kvp_test::zero_padded_copy(tc, 0), padded = kvp_test::zero_padded_copy(tc, k);
    CHECK(padded.head_dim() == tc.head_dim() << (2 * k));
    const std::vector<float> f_before = original.raw_f();
    const auto want = kvp_test::run_host(p, original, items);
    const auto got = kvp_test::run_host(p, padded, items);
    CHECK(kvp_test::check_same_results(want, got, original, items, 0.0f, kvp_test::rank_key_of(p)) == 0);
    kvp_test::check_same_cache(original, padded, f_before, 0.0f);
  }
}

template <class P>
P with_window(P p, int w) {
  p.scorer.window = w;
  p.protect.window = w;
  return p;
}

constexpr int cases = 40;

}  // namespace

TEST_CASE("zero padding is exact: presets with attention scorers, pooling, global score, redundancy") {
  for (std::uint32_t i = 0; i < cases; ++i) {
    check_padding_is_exact(with_window(presets::zipage{}, 4), 100 + i);
    check_padding_is_exact(with_window(presets::rkv{}, 4), 200 + i);
    check_padding_is_exact(with_window(presets::gkv{}, 4), 300 + i);
    check_padding_is_exact(with_window(presets::snapkv{}, 4), 400 + i);
    check_padding_is_exact(with_window(presets::h2o{}, 4), 500 + i);
  }
}

TEST_CASE("zero padding is exact: squared attention, sinks + recent, and the test scorers") {
  kvp::pipeline<kvp::scorer::squared_attention, kvp::aggregate::pool, none, kvp::select::top_k, kvp::layout::compact>
      squared;
  squared.scorer = {.window = 3, .excluded_distance = 1};
  squared.protect = {.window = 2, .sinks = 1};
  presets::streaming_llm streaming;
  streaming.protect.window = 4;
  kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::accumulate, kvp::redundancy::full, kvp::select::top_k,
                kvp::layout::compact>
      first_element;
  first_element.protect = {.window = 1, .sinks = 1};
  static_assert(kvp_test::ignores_zero_padding<kvp_test::first_element_scorer>);
  for (std::uint32_t i = 0; i < cases; ++i) {
    check_padding_is_exact(squared, 600 + i);
    check_padding_is_exact(streaming, 700 + i);
    check_padding_is_exact(first_element, 800 + i);
  }
}

TEST_CASE("zero padding: rows widen with zeros, queries double per k, the rest is copied") {
  test_cache tc({.block_size = 2, .head_dim = 1, .type = kvp::dtype::bf16, .lengths = {3}, .window = 1, .seed = 7});
  tc.set_key(0, 0, 2, 0, {0.75f});
  tc.set_query(0, 0, 0, 0, {-0.5f});
  tc.f(0, 0, 1, 0) = 3.0f;
  const test_cache padded = kvp_test::zero_padded_copy(tc, 2);  // d 1 -> 16
  CHECK(padded.key(0, 0, 2, 0) == std::vector<float>{0.75f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(padded.query(0, 0, 0, 0) == std::vector<float>{-2.0f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(padded.raw_f() == tc.raw_f());
  CHECK(padded.raw_table() == tc.raw_table());
  CHECK(padded.raw_lengths() == tc.raw_lengths());
  CHECK(padded.block(0, 1) == tc.block(0, 1));
}
