// Key redundancy (R-KV sec. 3.3; Zipage C.5, C.7): SPEC.md "Redundancy". Hand cases
// with d = 2 keys, and the full / lightning forms against an independent reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "support/reference.hpp"
#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp_test::test_cache;
namespace red = kvp::redundancy;
namespace ref = kvp_test::ref;

namespace {

using keys2 = std::vector<std::pair<float, float>>;

test_cache with_keys(const keys2& k, int b = 4) {
  test_cache tc({.block_size = b, .head_dim = 2, .lengths = {static_cast<int>(k.size())}, .randomize = false});
  for (std::size_t t = 0; t < k.size(); ++t) tc.set_key(0, 0, static_cast<int>(t), 0, {k[t].first, k[t].second});
  return tc;
}

// R = softmax(red / tau), read back through the executor (kvp_test::redundancy_alone).
template <class R>
std::vector<float> redundancy_of(R r, test_cache& tc) {
  auto s = kvp_test::run(kvp_test::redundancy_alone(r), tc, {{.seq = 0, .budget = tc.length(0)}}).scores[0];
  for (float& x : s) x = -x;
  return s;
}

// `families` families of copies + 1 near-copies (a key of the cache and `copies`
// copies of it with noise of up to 0.05 per element) at distinct random positions in
// [start, start + span); `used` marks the positions taken.
void plant_families(test_cache& tc, std::mt19937& rng, std::vector<bool>& used, int start, int span, int families,
                    int copies = 5) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto fresh = [&] {
    int p = 0;
    do p = start + static_cast<int>(rng() % static_cast<unsigned>(span)); while (used[static_cast<std::size_t>(p)]);
    used[static_cast<std::size_t>(p)] = true;
    return p;
  };
  for (int family = 0; family < families; ++family) {
    const auto base = tc.key(0, 0, fresh(), 0);
    for (int copy = 0; copy < copies; ++copy) {
      auto k = base;
      for (float& x : k) x += 0.05f * u(rng);
      tc.set_key(0, 0, fresh(), 0, k);
    }
  }
}

std::vector<double> softmax_of(std::vector<double> red, double n, double tau) {
  for (double& x : red) x = x / n / tau;
  return ref::softmax(red);
}

void check_vec(const std::vector<float>& got, const std::vector<double>& want, double eps = 1e-5) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(eps));
  }
}

}  // namespace

TEST_CASE("redundancy: defaults") {
  const red::full f;
  CHECK(f.theta == 0.5f);
  CHECK(f.tau == 1.0f);
  CHECK(f.lambda == 0.1f);
  CHECK(f.eps == 1e-8f);
  CHECK(f.form == red::combine_form::weighted);
  CHECK(red::full::pairs == red::scope::full);
  CHECK(red::lightning::pairs == red::scope::block);
}

TEST_CASE("redundancy: three copies, the newest is the least redundant; a lone token drops nothing") {
  // k0 = k1 = k2 = (1, 0): C = 1 among them. k3 = (0.1, 1): C(3, i) = c = 0.1 / sqrt(1.01)
  // for i < 3, below theta, so token 3 has no similar neighbour and drops nothing.
  // r(0) = 2, r(1) = 2, r(2) = 1, r(3) = none:
  //   red(0) = C10 + C20 + C30           = 2 + c
  //   red(1) = C01 + C21 + C31 - C21     = 1 + c
  //   red(2) = C02 + C12 + C32 - C02 - C12 = c
  //   red(3) = C03 + C13 + C23           = 3c
  test_cache tc = with_keys({{1, 0}, {1, 0}, {1, 0}, {0.1f, 1}});
  const double c = 0.1 / std::sqrt(1.01);
  const auto r = redundancy_of(red::full{}, tc);
  check_vec(r, softmax_of({2 + c, 1 + c, c, 3 * c}, 4, 1.0));
  CHECK(r[2] < r[1]);
  CHECK(r[1] < r[0]);
  // R-KV's code would drop C(3, 0) for the lone token (r(3) = 0): not copied.
  const auto rkv_bug = softmax_of({2, 1 + c, c, 3 * c}, 4, 1.0);
  CHECK(std::abs(r[0] - rkv_bug[0]) > 1e-3);
}

TEST_CASE("redundancy: theta decides who is similar") {
  // k0 = (1, 0), k1 = (0.9, sqrt(1 - 0.81)), k2 = (0, 1): C01 = 0.9, C02 = 0, C12 = s = sqrt(0.19).
  const double s = std::sqrt(0.19);
  test_cache tc = with_keys({{1, 0}, {0.9f, static_cast<float>(s)}, {0, 1}});
  // theta 0.5: r(0) = 1, r(1) = 0, r(2) = none -> red = (0, s, s).
  check_vec(redundancy_of(red::full{.theta = 0.5f}, tc), softmax_of({0, s, s}, 3, 1.0));
  // theta 0.4: r(0) = 1, r(1) = 2, r(2) = 1 -> red(0) = C10 + C20, red(1) = C01 + C21 less
  // both (r(0) = r(2) = 1), red(2) = C02 + C12 less C12 (r(1) = 2): (0.9, 0, 0).
  check_vec(redundancy_of(red::full{.theta = 0.4f}, tc), softmax_of({0.9, 0, 0}, 3, 1.0));
  // theta 0.95: nobody similar -> red = (0.9, 0.9 + s, s).
  check_vec(redundancy_of(red::full{.theta = 0.95f}, tc), softmax_of({0.9, 0.9 + s, s}, 3, 1.0));
}

TEST_CASE("redundancy: tau is the softmax temperature") {
  const double s = std::sqrt(0.19);
  test_cache tc = with_keys({{1, 0}, {0.9f, static_cast<float>(s)}, {0, 1}});
  check_vec(redundancy_of(red::full{.theta = 0.95f, .tau = 0.4f}, tc), softmax_of({0.9, 0.9 + s, s}, 3, 0.4));
  check_vec(redundancy_of(red::full{.theta = 0.95f, .tau = 3.0f}, tc), softmax_of({0.9, 0.9 + s, s}, 3, 3.0));
}

TEST_CASE("redundancy: eps enters the normalisation k / (||k|| + eps)") {
  // k0 = k1 = (0.5, 0), k2 = (0, 0.5). eps = 1: normalised (1/3, 0), C01 = 1/9 < theta:
  // red = (1/9, 1/9, 0). eps 1e-8: C01 = 1, r(0) = 1, r(1) = 0: red = (0, 0, 0).
  test_cache tc = with_keys({{0.5f, 0}, {0.5f, 0}, {0, 0.5f}});
  check_vec(redundancy_of(red::full{.eps = 1.0f}, tc), softmax_of({1.0 / 9, 1.0 / 9, 0}, 3, 1.0));
  check_vec(redundancy_of(red::full{}, tc), {1.0 / 3, 1.0 / 3, 1.0 / 3});
}

TEST_CASE("redundancy: combine forms and lambda") {
  // S from a table scorer, R by hand (theta 0.95 case above).
  const double s = std::sqrt(0.19);
  const auto R = softmax_of({0.9, 0.9 + s, s}, 3, 1.0);
  const std::vector<float> S{1.0f, 2.0f, -0.5f};
  for (float lambda : {0.1f, 0.2f, 0.5f, 1.0f}) {
    for (auto form : {red::combine_form::weighted, red::combine_form::subtract}) {
      test_cache tc = with_keys({{1, 0}, {0.9f, static_cast<float>(s)}, {0, 1}});
      kvp::pipeline<kvp_test::table_scorer, none, red::full, none, none> p;
      p.scorer = {S.data()};
      p.redundancy = {.theta = 0.95f, .lambda = lambda, .form = form};
      p.protect = {.window = 0, .sinks = 0};
      const auto got = kvp_test::run(p, tc, {{.seq = 0, .budget = 3}}).scores[0];
      std::vector<double> want;
      for (int t = 0; t < 3; ++t)
        want.push_back(form == red::combine_form::weighted ? lambda * S[t] - (1 - lambda) * R[t]
                                                           : S[t] - lambda * R[t]);
      CAPTURE(lambda);
      check_vec(got, want);
    }
  }
  // The hook itself.
  const red::full w{.lambda = 0.2f};
  CHECK(w.combine(1.0f, 0.5f) == doctest::Approx(0.2 - 0.8 * 0.5));
  const red::lightning sub{.lambda = 0.2f, .form = red::combine_form::subtract};
  CHECK(sub.combine(1.0f, 0.5f) == doctest::Approx(1.0 - 0.2 * 0.5));
}

TEST_CASE("redundancy, lightning: pairs only within a block of b tokens, n = b") {
  // b = 3. Block 0: (1,0), (1,0), (0.1,1): r(0) = 1, r(1) = 0, r(2) = none ->
  //   red = (C20, C21, C02 + C12) = (c, c, 2c).
  // Block 1: three copies (1,0): r(3) = 5, r(4) = 5, r(5) = 4 -> red = (2, 1, 0).
  // Divided by n = b = 3, softmax over all six.
  const double c = 0.1 / std::sqrt(1.01);
  const keys2 k{{1, 0}, {1, 0}, {0.1f, 1}, {1, 0}, {1, 0}, {1, 0}};
  test_cache tc = with_keys(k, 3);
  const auto light = redundancy_of(red::lightning{}, tc);
  check_vec(light, softmax_of({c, c, 2 * c, 2, 1, 0}, 3, 1.0));
  // The full form compares across blocks (and divides by 6): different.
  const auto full = redundancy_of(red::full{}, tc);
  CHECK(std::abs(full[0] - light[0]) > 1e-3);
  // Changing a key of block 1 changes no raw redundancy of block 0: the ratios of
  // block 0's R (a softmax) stay the same.
  tc.set_key(0, 0, 4, 0, {0.0f, -1.0f});
  const auto light2 = redundancy_of(red::lightning{}, tc);
  CHECK(light2[0] / light2[2] == doctest::Approx(light[0] / light[2]).epsilon(1e-6));
  CHECK(light2[1] / light2[2] == doctest::Approx(light[1] / light[2]).epsilon(1e-6));
  // A partial last block still divides by b: T = 5, block 1 = tokens 3, 4 (copies):
  // r(3) = 4, r(4) = 3 -> red 0 for both.
  test_cache tc5 = with_keys({{1, 0}, {1, 0}, {0.1f, 1}, {1, 0}, {1, 0}}, 3);
  check_vec(redundancy_of(red::lightning{}, tc5), softmax_of({c, c, 2 * c, 0, 0}, 3, 1.0));
}

TEST_CASE("redundancy: the host row function equals the pipeline's") {
  const keys2 k{{1, 0}, {1, 0}, {1, 0}, {0.1f, 1}};
  test_cache tc = with_keys(k);
  const auto keys = tc.keys(0, 0, 0);
  const auto direct = kvp::host::redundancy_scores(red::full{}, keys, 4, 2, 4);
  const auto via = redundancy_of(red::full{}, tc);
  for (int t = 0; t < 4; ++t) CHECK(direct[t] == via[t]);
}

TEST_CASE("redundancy: full and lightning match the reference on random keys") {
  std::mt19937 rng(99);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int checked = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const int T = pick(1, 16), d = pick(1, 4), b = pick(1, 5);
    test_cache tc({.block_size = b, .head_dim = d, .type = kvp_test::all_dtypes[pick(0, 2)], .lengths = {T},
                   .layout = kvp_test::all_layouts[pick(0, kvp_test::layout_count - 1)], .seed = static_cast<std::uint32_t>(iter)});
    // Plant near-duplicates: copy an earlier key with a little noise.
    for (int t = 1; t < T; ++t)
      if (pick(0, 2) == 0) {
        auto k = tc.key(0, 0, pick(0, t - 1), 0);
        for (float& x : k) x += 0.05f * u(rng);
        tc.set_key(0, 0, t, 0, k);
      }
    const auto keys = tc.keys(0, 0, 0);
    ref::redundancy_params rp;
    rp.theta = 0.2 + 0.6 * (u(rng) + 1) / 2;
    rp.tau = 0.3 + (u(rng) + 1);
    rp.eps = pick(0, 3) == 0 ? 0.5 : 1e-8;
    const bool lightning = pick(0, 1) == 1;
    rp.block = lightning ? b : 0;
    if (ref::theta_margin(keys, T, d, rp) < 1e-4) continue;  // on the threshold: fp32 may decide otherwise
    const auto want = ref::redundancy(keys, T, d, rp);
    std::vector<float> got;
    if (lightning)
      got = redundancy_of(red::lightning{.theta = static_cast<float>(rp.theta), .tau = static_cast<float>(rp.tau),
                                         .eps = static_cast<float>(rp.eps)},
                          tc);
    else
      got = redundancy_of(red::full{.theta = static_cast<float>(rp.theta), .tau = static_cast<float>(rp.tau),
                                    .eps = static_cast<float>(rp.eps)},
                          tc);
    CAPTURE(tc.describe());
    CAPTURE(lightning);
    check_vec(got, want, 1e-4);
    ++checked;
  }
  CHECK(checked > 300);
}

TEST_CASE("redundancy: full, 128-dim bf16 keys over several tiles, families of near-duplicates") {
  // The shape of the device's tensor-core kernel (16-bit keys, d 128, rows of 128-key
  // tiles), which meets each pair once: a key's newest neighbour is found from the
  // key's own tile when it is in that tile or newer, from the neighbour's tile (a
  // column of its Gram tile) when it is in an older one. Eight families of six
  // near-copies each, at random positions: with tau 0.01 a family's members lead R
  // (each copy adds ~0.16 to red / tau), so one wrong neighbour moves R by some 2e-3
  // at T 300 and 5e-4 at T 640 (against the executors' 1e-5), whichever tile found it.
  for (const int T : {300, 640}) {
    std::mt19937 rng(7);
    test_cache tc({.block_size = 64, .head_dim = 128, .type = kvp::dtype::bf16, .lengths = {T},
                   .seed = static_cast<std::uint32_t>(T)});
    std::vector<bool> used(static_cast<std::size_t>(T), false);
    plant_families(tc, rng, used, 0, T, 8);
    const auto keys = tc.keys(0, 0, 0);
    ref::redundancy_params rp;
    rp.tau = 0.01;
    REQUIRE(ref::theta_margin(keys, T, 128, rp) > 1e-3);
    CAPTURE(T);
    check_vec(redundancy_of(red::full{.tau = 0.01f}, tc), ref::redundancy(keys, T, 128, rp), 1e-3);
  }
}

TEST_CASE("redundancy: lightning, 128-dim bf16 keys in blocks of 256, families of near-duplicates") {
  // The shape of the device's tensor-core kernel (16-bit keys, d 128, a block's four
  // 64-key tiles): a key's newest neighbour may lie in any tile of its block, older or
  // newer. Random keys never cross theta, so families of six near-copies are placed at
  // random positions inside each cache block (blocks of 256, 44 and 128 keys at T 300
  // and 640). One similarity C dropped from the wrong key moves red / tau by C / n / tau,
  // about 0.39 for a near-copy (C near 1, n 256, tau 0.01): R by about half, far past
  // the 1e-3 the check allows.
  for (const int T : {300, 640}) {
    std::mt19937 rng(11);
    test_cache tc({.block_size = 256, .head_dim = 128, .type = kvp::dtype::bf16, .lengths = {T},
                   .seed = static_cast<std::uint32_t>(T + 1)});
    std::vector<bool> used(static_cast<std::size_t>(T), false);
    for (int start = 0; start < T; start += 256) {
      const int span = std::min(256, T - start);
      plant_families(tc, rng, used, start, span, std::max(1, span / 48));
    }
    const auto keys = tc.keys(0, 0, 0);
    ref::redundancy_params rp;
    rp.tau = 0.01;
    rp.block = 256;
    REQUIRE(ref::theta_margin(keys, T, 128, rp) > 1e-3);
    CAPTURE(T);
    check_vec(redundancy_of(red::lightning{.tau = 0.01f}, tc), ref::redundancy(keys, T, 128, rp), 1e-3);
  }
}

TEST_CASE("redundancy: one family of 48 near-copies in a block, lightning and full") {
  // Every older member names the newest member as its newest neighbour, so 47 dropped
  // similarities meet in one key's sum (the executors add them in any order: the CUDA
  // kernels by atomics in fixed point), and the newest names the second newest. With
  // tau 0.05 one similarity missing from that sum, or dropped from the wrong key,
  // moves red / tau by about 1 / 256 / 0.05 = 0.08, R by some 8%: relative to R, far
  // past the 1e-3 the check allows (the newest's R is a few percent of a member's, so
  // a tolerance in absolute terms would not see it).
  const int T = 256;
  std::mt19937 rng(5);
  test_cache tc({.block_size = 256, .head_dim = 128, .type = kvp::dtype::bf16, .lengths = {T}, .seed = 3});
  std::vector<bool> used(static_cast<std::size_t>(T), false);
  plant_families(tc, rng, used, 0, T, 1, 47);
  const auto keys = tc.keys(0, 0, 0);
  ref::redundancy_params rp;
  rp.tau = 0.05;
  REQUIRE(ref::theta_margin(keys, T, 128, rp) > 1e-3);
  const auto check_relative = [](const std::vector<float>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-3).scale(0.0));
    }
  };
  check_relative(redundancy_of(red::full{.tau = 0.05f}, tc), ref::redundancy(keys, T, 128, rp));
  rp.block = 256;
  check_relative(redundancy_of(red::lightning{.tau = 0.05f}, tc), ref::redundancy(keys, T, 128, rp));
}
