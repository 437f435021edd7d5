// Bounds and seeds of the property-based fuzz tests (tests/unit/test_fuzz_*.cpp).
// Each case draws everything from its own seed, so one failing case replays alone:
//
//   KVP_FUZZ_SEED=<seed> KVP_FUZZ_CASES=1 build/tests/kvpolicy_tests --source-file=*test_fuzz_paged*
//
// KVP_FUZZ_SEED   first case's seed (default 1; case i runs seed + i)
// KVP_FUZZ_CASES  cases per test (default: the test's own count, kept to seconds in CI
//                 and under the sanitizers)
// KVP_FUZZ_SECONDS stop starting new cases after this many seconds (default 20)
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvp_test {

struct fuzz_bounds {
  std::uint32_t seed = 1;
  long cases = 0;
  double seconds = 20.0;

  static fuzz_bounds from_env(long default_cases) {
    fuzz_bounds f;
    f.cases = default_cases;
    if (const char* s = std::getenv("KVP_FUZZ_SEED")) f.seed = static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
    if (const char* s = std::getenv("KVP_FUZZ_CASES")) f.cases = std::strtol(s, nullptr, 10);
    if (const char* s = std::getenv("KVP_FUZZ_SECONDS")) f.seconds = std::strtod(s, nullptr);
    return f;
  }

  // Runs case(seed) for each case's seed until the count or the time is spent; returns
  // the number run.
  template <class Case>
  long run(Case&& one) const {
    const auto t0 = std::chrono::steady_clock::now();
    long n = 0;
    for (; n < cases; ++n) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) break;
      one(seed + static_cast<std::uint32_t>(n));
    }
    return n;
  }
};

// The generator's draws, by name (every draw from one seeded engine).
struct fuzz_rng {
  explicit fuzz_rng(std::uint32_t seed) : engine(seed) {}
  std::mt19937 engine;

  int between(int lo, int hi) {  // [lo, hi]
    if (hi < lo) throw std::logic_error("fuzz_rng::between: empty range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return std::uniform_int_distribution<int>(lo, hi)(engine);
  }
  bool chance(double p) { return std::bernoulli_distribution(p)(engine); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(between(0, static_cast<int>(v.size()) - 1))];
  }
};

// How to replay one case, for a failure's message.
inline std::string replay_hint(std::uint32_t seed) {
  return "replay: KVP_FUZZ_SEED=" + std::to_string(seed) + " KVP_FUZZ_CASES=1";
}

}  // namespace kvp_test
