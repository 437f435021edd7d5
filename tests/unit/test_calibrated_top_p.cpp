// Calibrated top-p (SPEC.md "Calibrated top-p"; Hard-KV 3.2, app. D) with the
// unprotected_only scope (the protected tokens out of both distributions, T relative
// to the row's largest |s| on [1e-3, 10]): the raw count n_p, the temperature search
// (bisection and first order), its outcomes at the bounds, the temperature kept per
// (slot, layer, head) and reused, the caps, the options, the checks; and the hard_kv
// presets through the executors (the CUDA build of this file runs each case on both
// executors and compares them, temperatures included). The default rule, the
// authors' (whole row), is test_calibrated_top_p_whole_row.cpp's.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::none;
using kvp::calibration_outcome;
using kvp::select::calibrated_top_p;
using kvp_test::table_scorer;
using kvp_test::test_cache;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

// The state an engine keeps: one temperature and outcome per (slot, layer, head).
struct state_arrays {
  std::vector<float> temperature;
  std::vector<calibration_outcome> outcome;
  kvp::calibration_state view;
  state_arrays(int slots, int layers, int heads)
      : temperature(static_cast<std::size_t>(slots) * layers * heads, 0.0f),
        outcome(temperature.size(), calibration_outcome::unsolved),
        view{temperature.data(), outcome.data(), slots, layers, heads} {}
};

// Independent reference, in double: the selectable tokens (finite scores) by
// descending score, ties to the more recent; n_p from the raw scores the same way.
struct reference_row {
  std::vector<double> s, raw;
  std::vector<int> t;  // positions of the selectable tokens
  reference_row(const std::vector<float>& score, const std::vector<float>& raw_in) {
    for (int i = 0; i < static_cast<int>(score.size()); ++i)
      if (std::isfinite(score[static_cast<std::size_t>(i)])) {
        s.push_back(score[static_cast<std::size_t>(i)]);
        raw.push_back(std::max(0.0f, raw_in[static_cast<std::size_t>(i)]));
        t.push_back(i);
      }
  }
  // Indices into s, best first by `key`.
  std::vector<std::size_t> order(const std::vector<double>& key) const {
    std::vector<std::size_t> o(key.size());
    std::iota(o.begin(), o.end(), std::size_t{0});
    std::sort(o.begin(), o.end(), [&](std::size_t a, std::size_t b) { return key[a] != key[b] ? key[a] > key[b] : t[a] > t[b]; });
    return o;
  }
  int fewest(const std::vector<double>& key, const std::vector<double>& w, double mass) const {
    double acc = 0.0;
    const auto o = order(key);
    for (std::size_t i = 0; i < o.size(); ++i)
      if ((acc += w[o[i]]) >= mass) return static_cast<int>(i) + 1;
    return static_cast<int>(o.size());
  }
  int n_p(double p) const { return fewest(raw, raw, p * std::accumulate(raw.begin(), raw.end(), 0.0)); }
  std::vector<double> tempered(double T) const {
    const double top = *std::max_element(s.begin(), s.end());
    double scale = 0.0;
    for (double x : s) scale = std::max(scale, std::fabs(x));
    if (scale == 0.0) scale = 1.0;
    std::vector<double> e(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) e[i] = std::exp((s[i] - top) / (scale * T));
    return e;
  }
  // Mass of the top n (by score) under softmax(s / (scale T)).
  double mass(int n, double T) const {
    const auto e = tempered(T);
    const auto o = order(s);
    double in = 0.0;
    for (int i = 0; i < n; ++i) in += e[o[static_cast<std::size_t>(i)]];
    return in / std::accumulate(e.begin(), e.end(), 0.0);
  }
  int calibrated_count(double p, double T) const {
    const auto e = tempered(T);
    return fewest(s, e, p * std::accumulate(e.begin(), e.end(), 0.0));
  }
};

// The unprotected_only rule as this file tests it: scores divided by the row's largest
// |s|, T on [1e-3, 10], no top-k union unless a case asks.
calibrated_top_p unprotected_rule(calibrated_top_p sel) {
  sel.scope = kvp::select::calibration_scope::unprotected_only;
  sel.divide_by_row_max = true;
  if (sel.t_max == calibrated_top_p{}.t_max) sel.t_max = 10.0f;
  return sel;
}

int keep_count(calibrated_top_p sel, const std::vector<float>& s, const std::vector<float>& raw, int must,
               int budget = 1, kvp::head_index head = {}, int slot = 0) {
  const kvp::host::selector_row row(s, raw, static_cast<std::int32_t>(s.size()), must, head, slot);
  return unprotected_rule(sel).row_keep_count(row, budget);
}

// A row of n tokens: raw attention falling off geometrically from a few heavy hitters,
// and final scores a smoothed copy of it (as a pool would make), with noise.
void random_row(std::uint32_t seed, int n, std::vector<float>& s, std::vector<float>& raw) {
  std::uint32_t x = seed * 2654435761u + 1u;
  auto uniform = [&] { return ((x = x * 1664525u + 1013904223u) >> 8) * (1.0f / 16777216.0f); };
  raw.assign(static_cast<std::size_t>(n), 0.0f);
  s.assign(static_cast<std::size_t>(n), 0.0f);
  for (int t = 0; t < n; ++t) raw[static_cast<std::size_t>(t)] = std::pow(uniform(), 6.0f) + 1e-4f;
  for (int t = 0; t < n; ++t) {
    float m = raw[static_cast<std::size_t>(t)];
    if (t > 0) m = std::max(m, raw[static_cast<std::size_t>(t - 1)]);
    if (t + 1 < n) m = std::max(m, raw[static_cast<std::size_t>(t + 1)]);
    s[static_cast<std::size_t>(t)] = m * (0.8f + 0.4f * uniform());
  }
}

}  // namespace

TEST_CASE("calibrated top-p: n_p, the temperature and the count on a row computed by hand") {
  // Raw {0.5, 0.25, 0.125, 0.125}: p 0.7 needs 2 (0.75). Scores equal the raw ones,
  // scaled by their max 0.5 to {1, 0.5, 0.25, 0.25}. The top-2 mass under
  // softmax(x / T) is (e^(1/T) + e^(0.5/T)) / (e^(1/T) + e^(0.5/T) + 2 e^(0.25/T)).
  const std::vector<float> s{0.5f, 0.25f, 0.125f, 0.125f}, raw = s;
  state_arrays st(1, 1, 1);
  calibrated_top_p sel{.p = 0.7f, .tolerance = 1e-3f, .upper = 0, .state = st.view};
  const int count = keep_count(sel, s, raw, 0);
  REQUIRE(st.outcome[0] == calibration_outcome::converged);
  const double T = st.temperature[0];
  const double a = std::exp(1.0 / T), b = std::exp(0.5 / T), c = std::exp(0.25 / T);
  CHECK(std::fabs((a + b) / (a + b + 2 * c) - 0.7) <= 1e-3 + 1e-6);
  // The count: the fewest tokens whose calibrated mass reaches 0.7.
  const reference_row ref(s, raw);
  CHECK(ref.n_p(0.7) == 2);
  CHECK(count == ref.calibrated_count(0.7, T));
  CHECK((count == 2 || count == 3));
}

TEST_CASE("calibrated top-p: the calibrated top-n_p mass is within tolerance on random rows, both searches") {
  for (const auto search : {kvp::select::temperature_search::bisection, kvp::select::temperature_search::first_order}) {
    int converged = 0;
    for (std::uint32_t seed = 1; seed <= 40; ++seed) {
      std::vector<float> s, raw;
      random_row(seed, 200 + 37 * static_cast<int>(seed), s, raw);
      state_arrays st(1, 1, 1);
      const calibrated_top_p sel{.p = 0.9f, .search = search, .upper = 0, .state = st.view};
      const int count = keep_count(sel, s, raw, 0);
      const reference_row ref(s, raw);
      const int n_p = ref.n_p(0.9);
      INFO("seed ", seed, " n_p ", n_p, " outcome ", static_cast<int>(st.outcome[0]), " T ", st.temperature[0]);
      if (st.outcome[0] == calibration_outcome::converged) {
        ++converged;
        CHECK(std::fabs(ref.mass(n_p, st.temperature[0]) - 0.9) <= 1e-2 + 1e-4);
      }
      // Whatever the outcome, the count is the calibrated top-p at the T it reports.
      CHECK(count == ref.calibrated_count(0.9, st.temperature[0]));
    }
    // Bisection always converges on these rows; Adam at lr 1e-2 from 0.5 may run out of steps.
    if (search == kvp::select::temperature_search::bisection) CHECK(converged == 40);
    else CHECK(converged > 0);
  }
}

TEST_CASE("calibrated top-p: monotone in T and in p") {
  // The search rests on the top-n mass falling as T rises; and at one temperature a
  // larger p keeps at least as many. (Re-solved for each p, counts need not be
  // monotone: the tolerance 1e-2 is as wide as the tail 1 - p when p nears 0.99.)
  std::vector<float> s, raw;
  random_row(7, 500, s, raw);
  const kvp::host::selector_row row(s, raw, 500, 0, {}, 0);
  using unprotected = kvp::select::calibration::unprotected_only;
  const calibrated_top_p sel = unprotected_rule({});
  const kvp::rank_cut cut = row.top(kvp::select::calibration::value_key<unprotected>{}, 60);
  const float top = row.max(kvp::select::calibration::value_key<unprotected>{}), unit = 1.0f / top;
  float last_mass = 2.0f;
  for (float T = 1e-3f; T <= 10.0f; T *= 1.5f) {
    const float m = sel.mass<unprotected>(row, cut, top, unit, T);
    CHECK(m <= last_mass);
    last_mass = m;
  }
  state_arrays st(1, 1, 1);
  st.outcome[0] = calibration_outcome::converged;
  st.temperature[0] = 0.15f;
  int last = 0;
  for (float p : {0.3f, 0.5f, 0.7f, 0.8f, 0.9f, 0.95f, 0.99f}) {
    const int count = keep_count(calibrated_top_p{.p = p, .upper = 0, .state = st.view}, s, raw, 0);
    CHECK(count >= last);
    CHECK(count == reference_row(s, raw).calibrated_count(p, 0.15));
    last = count;
  }
}

TEST_CASE("calibrated top-p: bounds that cannot be met are reported") {
  // Equal scores: every temperature gives the top n_p the mass n_p / N. Raw mass in one
  // token: n_p 1 of 8, mass 1/8 < 0.9 at every T: the lower bound, T = t_min.
  const std::vector<float> flat(8, 1.0f);
  std::vector<float> raw(8, 0.0f);
  raw[3] = 1.0f;
  state_arrays st(1, 1, 1);
  keep_count(calibrated_top_p{.state = st.view}, flat, raw, 0);
  CHECK(st.outcome[0] == calibration_outcome::lower_bound);
  CHECK(st.temperature[0] == 1e-3f);
  // Raw mass spread over all 8 (n_p 8): the top 8 always hold all the mass, 1 > 0.9 + tol
  // at every T: the upper bound.
  state_arrays st2(1, 1, 1);
  keep_count(calibrated_top_p{.state = st2.view}, flat, flat, 0);
  CHECK(st2.outcome[0] == calibration_outcome::upper_bound);
  CHECK(st2.temperature[0] == 10.0f);
  // No raw mass among the selectable tokens: nothing to calibrate, only the protected kept.
  state_arrays st3(1, 1, 1);
  const std::vector<float> zero(8, 0.0f);
  CHECK(keep_count(calibrated_top_p{.state = st3.view}, flat, zero, 2) == 2);
  CHECK(st3.outcome[0] == calibration_outcome::no_mass);
}

TEST_CASE("calibrated top-p: a solved temperature is reused, per slot, layer and head") {
  std::vector<float> s, raw;
  random_row(3, 300, s, raw);
  state_arrays st(2, 2, 3);
  const calibrated_top_p sel{.upper = 0, .state = st.view};
  const kvp::head_index head{1, 2};
  const int first = keep_count(sel, s, raw, 0, 1, head, 1);
  const std::int64_t at = st.view.index(1, head);
  REQUIRE(st.outcome[static_cast<std::size_t>(at)] == calibration_outcome::converged);
  for (std::size_t i = 0; i < st.outcome.size(); ++i)
    if (static_cast<std::int64_t>(i) != at) CHECK(st.outcome[i] == calibration_outcome::unsolved);
  CHECK(first == reference_row(s, raw).calibrated_count(0.9, st.temperature[static_cast<std::size_t>(at)]));
  // A later compression with other scores: no search, the stored T decides. Plant a T
  // to see it used.
  st.temperature[static_cast<std::size_t>(at)] = 0.05f;
  std::vector<float> s2, raw2;
  random_row(4, 280, s2, raw2);
  const int later = keep_count(sel, s2, raw2, 0, 1, head, 1);
  CHECK(st.temperature[static_cast<std::size_t>(at)] == 0.05f);
  CHECK(later == reference_row(s2, raw2).calibrated_count(0.9, 0.05f));
  // reuse off: solved again, and written.
  calibrated_top_p again = sel;
  again.reuse = false;
  keep_count(again, s2, raw2, 0, 1, head, 1);
  CHECK(st.temperature[static_cast<std::size_t>(at)] != 0.05f);
}

TEST_CASE("calibrated top-p: an entry that had no mass is searched once there is some") {
  // A head with no raw mass leaves `no_mass` and no temperature; its next compression,
  // with mass, searches instead of dividing by the missing temperature.
  std::vector<float> s, raw;
  random_row(5, 200, s, raw);
  state_arrays st(1, 1, 1);
  const calibrated_top_p sel{.upper = 0, .state = st.view};
  keep_count(sel, s, std::vector<float>(200, 0.0f), 0);
  REQUIRE(st.outcome[0] == calibration_outcome::no_mass);
  const int count = keep_count(sel, s, raw, 0);
  REQUIRE(st.outcome[0] == calibration_outcome::converged);
  CHECK(st.temperature[0] > 0.0f);
  CHECK(count == reference_row(s, raw).calibrated_count(0.9, st.temperature[0]));
}

TEST_CASE("calibrated top-p: at p 1 the count stays within the selectable tokens") {
  // NaN scores are never selectable; a mass of the whole row, summed in another order,
  // may fall short by rounding and run into them: the count stops at the selectable ones.
  std::vector<float> s, raw;
  random_row(9, 300, s, raw);
  for (int t = 0; t < 300; t += 7) s[static_cast<std::size_t>(t)] = std::numeric_limits<float>::quiet_NaN();
  int selectable = 0;
  for (float x : s) selectable += std::isfinite(x) ? 1 : 0;
  for (float p : {0.999f, 1.0f}) CHECK(keep_count(calibrated_top_p{.p = p, .upper = 0}, s, raw, 0) <= selectable);
}

TEST_CASE("calibrated top-p: protected tokens, caps, the top-k union") {
  std::vector<float> s, raw;
  random_row(11, 400, s, raw);
  // Protect the last 16 (+inf): they take no part in the distributions and are counted on top.
  std::vector<float> prot = s;
  for (int t = 384; t < 400; ++t) prot[static_cast<std::size_t>(t)] = inf;
  std::vector<float> raw_sel = raw;
  for (int t = 384; t < 400; ++t) raw_sel[static_cast<std::size_t>(t)] = 0.0f;  // as the reference sees them
  std::vector<float> s_sel(s.begin(), s.begin() + 384), r_sel(raw.begin(), raw.begin() + 384);
  state_arrays st(1, 1, 1);
  const int count = keep_count(calibrated_top_p{.upper = 0, .state = st.view}, prot, raw, 16);
  CHECK(count == 16 + reference_row(s_sel, r_sel).calibrated_count(0.9, st.temperature[0]));
  // Caps: at most upper (protected included), at least lower.
  CHECK(keep_count(calibrated_top_p{.upper = 20}, prot, raw, 16) == 20);
  CHECK(keep_count(calibrated_top_p{.upper = 0, .lower = 390}, prot, raw, 16) == 390);
  // Union with the top (budget - protected): the larger of the two counts.
  CHECK(keep_count(calibrated_top_p{.upper = 0, .union_top_k = true}, prot, raw, 16, 380) == 380);
  CHECK(keep_count(calibrated_top_p{.upper = 0, .union_top_k = true}, prot, raw, 16, 17) == count);
  CHECK(keep_count(calibrated_top_p{.upper = 0, .union_top_k = false}, prot, raw, 16, 380) == count);
}

TEST_CASE("calibrated top-p: bad parameters and state are refused, naming the field") {
  test_cache tc({.block_size = 4, .kv_heads = 2, .head_dim = 4, .lengths = {16}});
  auto refuses = [&](const calibrated_top_p& sel, const char* field) {
    kvp::presets::hard_kv p;
    p.select = sel;
    p.protect = {.window = 4, .sinks = 1};
    p.scorer.window = 4;
    CHECK_THROWS_WITH_AS(kvp_test::run_host(p, tc, {{.seq = 0, .budget = 8}}), doctest::Contains(field), kvp::error);
  };
  refuses({.p = 0.0f}, "pipeline.select.p");
  refuses({.p = 1.5f}, "pipeline.select.p");
  refuses({.tolerance = 0.0f}, "pipeline.select.tolerance");
  refuses({.t_min = 2.0f, .t_max = 1.0f}, "pipeline.select.t_min");
  refuses({.iterations = 0}, "pipeline.select.iterations");
  refuses({.upper = 10, .lower = 11}, "pipeline.select.lower");
  state_arrays wrong_heads(1, 1, 3);
  refuses({.state = wrong_heads.view}, "pipeline.select.state.num_kv_heads");
  state_arrays few_slots(1, 1, 2);
  few_slots.view.num_slots = 0;
  refuses({.state = few_slots.view}, "pipeline.select.state.num_slots");
}

TEST_CASE("hard_kv: per-head counts, the length is their largest, the temperatures solved once per head") {
  // Two layers of four KV heads with GQA 2, random keys and queries: the heads'
  // calibrated counts differ; each head compacts its own kept tokens, and the blocks past
  // the largest count go back.
  const kvp_test::cache_config cfg{.layers = 2, .block_size = 8, .kv_heads = 4, .head_dim = 16, .lengths = {96, 120},
                                   .q_heads = 8, .window = 8, .seed = 5};
  test_cache tc(cfg);
  state_arrays st(2, 2, 4);
  kvp::presets::hard_kv p;
  p.select.state = st.view;
  p.protect = {.window = 8, .sinks = 1};
  const auto res = kvp_test::run(p, tc, {{.seq = 0, .query_slot = 1, .budget = 16}, {.seq = 1, .query_slot = 0, .budget = 16}});
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& kept = res.kept_counts[i];
    CHECK(res.new_lengths[i] == *std::max_element(kept.begin(), kept.end()));
    for (int c : kept) CHECK(c >= 9);  // window 8 and one sink
    const int b = cfg.block_size, T = cfg.lengths[i];
    CHECK(static_cast<int>(res.released_blocks[i].size()) == (T + b - 1) / b - (res.new_lengths[i] + b - 1) / b);
  }
  std::vector<int> all(res.kept_counts[0]);
  all.insert(all.end(), res.kept_counts[1].begin(), res.kept_counts[1].end());
  CHECK(*std::min_element(all.begin(), all.end()) < *std::max_element(all.begin(), all.end()));
  for (const auto o : st.outcome) CHECK(o != calibration_outcome::unsolved);
  // Each head's kept tokens are the top of its final scores, as many as its count.
  for (std::size_t i = 0; i < 2; ++i)
    for (std::size_t row = 0; row < res.kept_counts[i].size(); ++row) {
      const int T = cfg.lengths[i];
      int kept = 0;
      for (int t = 0; t < T; ++t) kept += res.keep_masks[i][row * static_cast<std::size_t>(T) + static_cast<std::size_t>(t)];
      CHECK(kept == res.kept_counts[i][row]);
    }
}
