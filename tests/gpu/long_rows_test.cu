// Redundancy on rows longer than any shared-memory bound: 60,000 tokens, past the
// 58 K at which full redundancy's finish once ran out of shared memory (max_tokens * 4
// bytes on the H100). The host executor's reference is O(T^2 d) there, too slow to
// compare against, so the keys are built for an exact answer computed in O(T^2 / 32):
// each key lives in one of 32 disjoint 4-dim subspaces (its family) and is one of 40
// patterns of {-1, 0, 1}^4 (one or three entries set) times 0.5, 1 or 2. Keys of two
// families are orthogonal (C exactly 0 on any hardware); within a family C takes the
// values 0, +-1/3, +-1/sqrt(3), +-2/3 and +-1, none within 0.07 of theta (0.5), so the
// newest similar neighbour r(u) is never a near-tie.
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <doctest/doctest.h>

// run_cuda, from the CUDA build of the unit tests (which defines kvp_test::run there).
#define KVP_TEST_CUDA_EXECUTOR
#include "support/reference.hpp"
#include "support/run_on_both_executors.cuh"

namespace {

namespace red = kvp::redundancy;

constexpr int family_dims = 4;
constexpr int families = 128 / family_dims;

struct planted_key {
  int family = 0;
  std::array<double, family_dims> x{};  // the key's entries in its family's subspace
};

std::vector<std::array<double, family_dims>> patterns() {
  std::vector<std::array<double, family_dims>> out;
  for (int a = 0; a < family_dims; ++a)
    for (const double s : {-1.0, 1.0}) {
      std::array<double, family_dims> e{};
      e[a] = s;
      out.push_back(e);
    }
  for (int zero = 0; zero < family_dims; ++zero)
    for (int signs = 0; signs < 8; ++signs) {
      std::array<double, family_dims> v{};
      for (int i = 0, bit = 0; i < family_dims; ++i)
        if (i != zero) v[i] = (signs >> bit++) & 1 ? -1.0 : 1.0;
      out.push_back(v);
    }
  return out;
}

// Random planted keys for tokens [0, T) of head 0, layer 0, sequence 0 of `tc`.
std::vector<planted_key> plant(kvp_test::test_cache& tc, int T, std::uint32_t seed) {
  const auto set = patterns();
  std::mt19937 rng(seed);
  const double scales[] = {0.5, 1.0, 2.0};
  std::vector<planted_key> keys(static_cast<std::size_t>(T));
  std::vector<float> row(128);
  for (int t = 0; t < T; ++t) {
    auto& k = keys[static_cast<std::size_t>(t)];
    k.family = static_cast<int>(rng() % families);
    const double s = scales[rng() % 3];
    const auto& v = set[rng() % set.size()];
    std::fill(row.begin(), row.end(), 0.0f);
    for (int i = 0; i < family_dims; ++i) {
      k.x[i] = s * v[i];
      row[static_cast<std::size_t>(k.family * family_dims + i)] = static_cast<float>(k.x[i]);  // exact in bf16
    }
    tc.set_key(0, 0, t, 0, row);
  }
  return keys;
}

// R = softmax(red / tau) (SPEC.md "Redundancy") from the families alone: pairs of two
// families add C = 0 and are never similar. block 0: full (n = T); else lightning
// (pairs within blocks of `block`, n = block).
std::vector<double> expected_redundancy(const std::vector<planted_key>& keys, int block, double tau) {
  const double theta = 0.5, eps = 1e-8;
  const int T = static_cast<int>(keys.size());
  const double n = block == 0 ? T : block;
  std::vector<std::vector<int>> members(families);
  for (int t = 0; t < T; ++t) members[static_cast<std::size_t>(keys[static_cast<std::size_t>(t)].family)].push_back(t);
  std::vector<double> norm(static_cast<std::size_t>(T));
  for (int t = 0; t < T; ++t) {
    double s = 0.0;
    for (const double x : keys[static_cast<std::size_t>(t)].x) s += x * x;
    norm[static_cast<std::size_t>(t)] = std::sqrt(s) + eps;
  }
  const auto cosine = [&](int u, int v) {
    const auto &a = keys[static_cast<std::size_t>(u)].x, &b = keys[static_cast<std::size_t>(v)].x;
    double dot = 0.0;
    for (int i = 0; i < family_dims; ++i) dot += a[i] * b[i];
    return dot / (norm[static_cast<std::size_t>(u)] * norm[static_cast<std::size_t>(v)]);
  };
  const auto paired = [&](int u, int v) { return u != v && (block == 0 || u / block == v / block); };

  std::vector<double> sum(static_cast<std::size_t>(T), 0.0);
  for (const auto& m : members)
    for (std::size_t i = 0; i < m.size(); ++i) {
      const int u = m[i];
      int newest = -1;  // r(u): members are in increasing position, so scan from the end
      for (std::size_t j = m.size(); j-- > 0;)
        if (paired(u, m[j]) && cosine(u, m[j]) > theta) {
          newest = m[j];
          break;
        }
      for (const int t : m)
        if (paired(u, t) && t != newest) sum[static_cast<std::size_t>(t)] += cosine(u, t);
    }
  for (double& x : sum) x = x / n / tau;
  return kvp_test::ref::softmax(sum);
}

// R from the CUDA executor alone (kvp_test::redundancy_alone: the final score is -R).
template <class R>
std::vector<float> device_redundancy(R r, kvp_test::test_cache& tc, const kvp::cuda_executor& ex = {}) {
  auto s = kvp_test::run_cuda(kvp_test::redundancy_alone(r), tc, {{.seq = 0, .budget = tc.length(0)}}, 0, 0, {}, ex)
               .scores[0];
  for (float& x : s) x = -x;
  return s;
}

// Relative to R: a key's R spans orders of magnitude here, and one similarity dropped
// from the wrong key moves red / tau by C / n / tau, at least 1/sqrt(3) / 60 = 0.0096
// for full (n 60,000, tau 0.001) and 0.23 for lightning (n 256, tau 0.01): R by as
// much relative to itself, past the 1e-3 allowed.
void check_relative(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  int wrong = 0, first_wrong = -1;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= 1e-3 * want[i])) {
      if (wrong++ == 0) first_wrong = static_cast<int>(i);
    }
  const auto at = static_cast<std::size_t>(first_wrong >= 0 ? first_wrong : 0);
  INFO(wrong, " tokens differ; the first, ", first_wrong, ": device ", got[at], ", expected ", want[at]);
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("redundancy of planted keys: the closed form equals the reference on a short row") {
  // The closed form above against tests/support/reference.hpp's O(T^2 d) definition.
  const int T = 700;
  kvp_test::test_cache tc({.block_size = 256, .head_dim = 128, .type = kvp::dtype::bf16, .lengths = {T},
                           .randomize = false});
  const auto keys = plant(tc, T, 5);
  const auto all = tc.keys(0, 0, 0);
  for (const int block : {0, 256}) {
    kvp_test::ref::redundancy_params rp;
    rp.tau = 0.01;
    rp.block = block;
    REQUIRE(kvp_test::ref::theta_margin(all, T, 128, rp) > 0.07);
    const auto want = kvp_test::ref::redundancy(all, T, 128, rp);
    const auto got = expected_redundancy(keys, block, 0.01);
    CAPTURE(block);
    for (std::size_t t = 0; t < want.size(); ++t) CHECK(got[t] == doctest::Approx(want[t]).epsilon(1e-9));
  }
}

TEST_CASE("redundancy on a row of 60000 tokens: full and lightning against a closed form") {
  const int T = 60000;
  kvp_test::test_cache tc({.block_size = 256, .head_dim = 128, .type = kvp::dtype::bf16, .lengths = {T},
                           .randomize = false});
  const auto keys = plant(tc, T, 17);
  SUBCASE("full") {
    // tau 0.001: a family's 1,900 members give red / tau a spread of several units.
    // Both tile sizes of the tensor-core kernel (full_pairs_rows).
    const auto want = expected_redundancy(keys, 0, 0.001);
    for (const int rows : {128, 256}) {
      CAPTURE(rows);
      check_relative(device_redundancy(red::full{.tau = 0.001f}, tc, {.full_pairs_rows = rows}), want);
    }
  }
  SUBCASE("lightning") {
    check_relative(device_redundancy(red::lightning{.tau = 0.01f}, tc), expected_redundancy(keys, 256, 0.01));
  }
}
