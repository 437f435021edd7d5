// Calibrated top-p's default rule, the authors' (SPEC.md "Calibrated top-p"; Hard-KV
// 3.2, app. D, and HARDInfer's code): n_p from the raw attention of the whole row,
// sinks and window included and not renormalised; the calibrated softmax over the
// whole row, T bisected on [1e-3, 1] with the scores as they are; the kept set is the
// calibrated top-p set, union the top (budget - protected) by score, union the sinks
// and the window; caps L_upper / L_lower. Hand-sized cases of each step, then an
// independent reference of the rule (double precision, written from the paper and
// their code, none of the library's code) against the selector on thousands of random
// rows of several kinds, and against both executors through a whole pipeline (the
// CUDA build of this file runs those cases on both and compares them).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "support/test_cache.hpp"
#include "support/test_policies.hpp"

using kvp::calibration_outcome;
using kvp::select::calibrated_top_p;
using kvp::select::calibration_scope;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

// ---- The independent reference ----

// A row as the authors' code sees it: every token's raw attention and score, and which
// tokens are protected (sinks, window).
struct authors_row {
  std::vector<double> raw, value;
  std::vector<bool> protect;
};

struct authors_result {
  int count = 0;
  double T = 0.0;
  std::vector<std::uint8_t> keep;
};

// Positions by descending key, ties to the more recent (the library's documented order).
std::vector<int> by_descending(const std::vector<double>& key) {
  std::vector<int> o(key.size());
  std::iota(o.begin(), o.end(), 0);
  std::sort(o.begin(), o.end(), [&](int a, int b) { return key[a] != key[b] ? key[a] > key[b] : a > b; });
  return o;
}

// The fewest tokens, taken in `order`, whose weights reach `mass`.
int fewest(const std::vector<int>& order, const std::vector<double>& w, double mass) {
  double acc = 0.0;
  for (std::size_t i = 0; i < order.size(); ++i)
    if ((acc += w[order[i]]) >= mass) return static_cast<int>(i) + 1;
  return static_cast<int>(order.size());
}

struct authors_options {
  double p = 0.9, tolerance = 1e-2;
  int budget = 0, upper = 2048, lower = 0;
  bool union_top_k = true;
};

authors_result authors_rule(const authors_row& r, const authors_options& o) {
  const int N = static_cast<int>(r.raw.size());
  int must = 0;
  for (bool b : r.protect) must += b;
  // n_p: top-p of the raw attention over the whole row (its own total: not renormalised
  // over any part of it).
  const double raw_total = std::accumulate(r.raw.begin(), r.raw.end(), 0.0);
  const int n_p = fewest(by_descending(r.raw), r.raw, o.p * raw_total);
  // The calibrated distribution softmax(v / T) over the whole row.
  const std::vector<int> order = by_descending(r.value);
  const double top = r.value[order[0]];
  auto tempered = [&](double T) {
    std::vector<double> e(N);
    for (int t = 0; t < N; ++t) e[t] = std::exp((r.value[t] - top) / T);
    return e;
  };
  auto mass = [&](double T) {
    const auto e = tempered(T);
    double in = 0.0;
    for (int i = 0; i < n_p; ++i) in += e[order[i]];
    return in / std::accumulate(e.begin(), e.end(), 0.0);
  };
  // Their bisection (search.py, binary_search_T): T on [1e-3, 1], each midpoint's mass
  // checked, until one lies within the tolerance or the interval is spent.
  double lo = 1e-3, hi = 1.0, mid = 0.5 * (lo + hi), m = mass(mid);
  for (int i = 0; i < 200 && lo < hi && std::fabs(m - o.p) > o.tolerance; ++i) {
    (m > o.p ? lo : hi) = mid;
    mid = 0.5 * (lo + hi);
    m = mass(mid);
  }
  authors_result res;
  res.T = mid;
  const auto e = tempered(mid);
  int kept_by_score = fewest(order, e, o.p * std::accumulate(e.begin(), e.end(), 0.0));
  // Their union: the top (budget - window - sinks) of the calibrated distribution,
  // over the whole row as the top-p set.
  if (o.union_top_k) kept_by_score = std::max(kept_by_score, std::min(o.budget - must, N));
  res.keep.assign(N, 0);
  for (int t = 0; t < N; ++t) res.keep[t] = r.protect[t];
  for (int i = 0; i < kept_by_score; ++i) res.keep[order[i]] = 1;
  int count = 0;
  for (auto k : res.keep) count += k;
  // Caps: the protected tokens first, then the unprotected by score (what the executor keeps).
  int target = count;
  if (o.upper > 0) target = std::min(target, o.upper);
  if (o.lower > 0) target = std::max(target, o.lower);
  target = std::clamp(target, must, N);
  res.keep.assign(N, 0);
  int kept = 0;
  for (int t = 0; t < N; ++t)
    if (r.protect[t]) res.keep[t] = 1, ++kept;
  for (int i = 0; i < N && kept < target; ++i)
    if (!r.protect[order[i]]) res.keep[order[i]] = 1, ++kept;
  res.count = target;
  return res;
}

// ---- The library's selector on the same row (host executor's pieces) ----

struct library_result {
  int count = 0;
  float T = 0.0f;
  calibration_outcome outcome = calibration_outcome::unsolved;
  std::vector<std::uint8_t> keep;
};

library_result library_rule(calibrated_top_p sel, const authors_row& r, int budget) {
  const int N = static_cast<int>(r.raw.size());
  std::vector<float> s(N), raw(N), before(N);
  int must = 0;
  for (int t = 0; t < N; ++t) {
    raw[t] = static_cast<float>(r.raw[t]);
    before[t] = static_cast<float>(r.value[t]);
    s[t] = r.protect[t] ? inf : before[t];
    must += r.protect[t];
  }
  float temperature = 0.0f;
  calibration_outcome outcome = calibration_outcome::unsolved;
  sel.state = {&temperature, &outcome, 1, 1, 1};
  library_result res;
  res.count = kvp::host::keep_count(sel, s, raw, before, N, must, budget, kvp::head_index{}, 0, N);
  res.keep = kvp::host::select_top(sel, s, res.count);
  res.T = temperature;
  res.outcome = outcome;
  return res;
}

// ---- Random rows ----

struct rng {
  std::uint64_t x;
  double uniform() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
  }
  int below(int n) { return static_cast<int>(uniform() * n); }
  double normal() {
    const double u = std::max(uniform(), 1e-300), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

enum class kind { peaked, flat, protected_mass, logits };
const char* name(kind k) {
  switch (k) {
    case kind::peaked: return "peaked";
    case kind::flat: return "flat";
    case kind::protected_mass: return "mass on protected";
    case kind::logits: return "softmax of gaussian logits";
  }
  return "?";
}

// Raw attention of one kind (sums to 1 over the row), then the policy's scores as
// hard_kv makes them: max pool 7 of the raw (clipped windows); every other row also
// times noise in [0.8, 1.2], as a redundancy term would reorder them.
authors_row random_row(rng& g, kind k, int N, int sinks, int window) {
  authors_row r;
  r.raw.resize(N);
  r.protect.assign(N, false);
  for (int t = 0; t < N; ++t) r.protect[t] = t < sinks || t >= N - window;
  switch (k) {
    case kind::peaked:
      for (auto& x : r.raw) x = std::pow(g.uniform(), 8.0) + 1e-6;
      break;
    case kind::flat:
      for (auto& x : r.raw) x = 1.0 + 0.2 * g.uniform();
      break;
    case kind::protected_mass: {
      for (auto& x : r.raw) x = std::pow(g.uniform(), 4.0) + 1e-6;
      double rest = 0.0, prot = 0.0;
      for (int t = 0; t < N; ++t) (r.protect[t] ? prot : rest) += r.raw[t];
      const double share = 0.5 + 0.45 * g.uniform();  // of the mass on the protected tokens
      for (int t = 0; t < N; ++t) r.raw[t] *= r.protect[t] ? share / prot : (1.0 - share) / rest;
      break;
    }
    case kind::logits: {
      const double scale = 0.5 + 3.5 * g.uniform();
      for (auto& x : r.raw) x = std::exp(scale * g.normal());
      break;
    }
  }
  const double total = std::accumulate(r.raw.begin(), r.raw.end(), 0.0);
  for (auto& x : r.raw) x = static_cast<float>(x / total);  // as the library receives them: fp32
  const bool noisy = g.uniform() < 0.5;
  r.value.resize(N);
  for (int t = 0; t < N; ++t) {
    double m = 0.0;
    for (int u = std::max(0, t - 3); u <= std::min(N - 1, t + 3); ++u) m = std::max(m, r.raw[u]);
    r.value[t] = static_cast<float>(noisy ? m * (0.8 + 0.4 * g.uniform()) : m);
  }
  return r;
}

}  // namespace

TEST_CASE("whole row: n_p counts the protected tokens' raw attention, not renormalised") {
  // 8 tokens, one sink (t 0) and a window of 2 (t 6, 7) holding 0.8 of the raw mass.
  // Whole row, p 0.7: 0.3 (t 6) + 0.3 (t 0) + 0.2 (t 7) = 0.8: n_p 3, all protected.
  // The calibrated distribution over the whole row gives the top 3 mass 0.7 (within
  // tolerance), so the calibrated top-p set is those 3 (or one more at the margin): the
  // row keeps its protected 3, perhaps 4. Over the unprotected tokens only (0.04 each,
  // renormalised) n_p would be 4 of them: 7 kept.
  const authors_row r{{0.30, 0.04, 0.04, 0.04, 0.04, 0.04, 0.30, 0.20},
                      {0.30, 0.04, 0.04, 0.04, 0.04, 0.04, 0.30, 0.20},
                      {true, false, false, false, false, false, true, true}};
  const calibrated_top_p sel{.p = 0.7f, .tolerance = 1e-3f, .upper = 0, .union_top_k = false};
  const library_result got = library_rule(sel, r, 8);
  REQUIRE(got.outcome == calibration_outcome::converged);
  const double T = got.T, a = std::exp(0.30 / T), b = std::exp(0.20 / T), c = std::exp(0.04 / T);
  const double top3 = (2 * a + b) / (2 * a + b + 5 * c);
  CHECK(std::fabs(top3 - 0.7) <= 1e-3 + 1e-6);
  // The calibrated top-p count at T: 3 when the top 3 reach 0.7, else 4.
  CHECK(got.count == (top3 >= 0.7 ? 3 : 4));
  // The variant: the unprotected tokens alone, their raw mass renormalised.
  calibrated_top_p variant = sel;
  variant.scope = calibration_scope::unprotected_only;
  const library_result other = library_rule(variant, r, 8);
  CHECK(other.count >= 3 + 4);
}

TEST_CASE("whole row: the top-k union over the whole row, sinks and window counted once") {
  // As above at p 0.5: n_p 2 (t 6 and t 0), the calibrated top-p set within {t 6, t 0,
  // t 7}. The union's top (budget - 3) by score is over the whole row too: budget 5 adds
  // the top 2, t 6 and t 0, both protected: nothing. Budget 8 adds the top 5: the three
  // protected and the two most recent of the 0.04s, t 5 and t 4.
  const authors_row r{{0.30, 0.04, 0.04, 0.04, 0.04, 0.04, 0.30, 0.20},
                      {0.30, 0.04, 0.04, 0.04, 0.04, 0.04, 0.30, 0.20},
                      {true, false, false, false, false, false, true, true}};
  const calibrated_top_p sel{.p = 0.5f, .upper = 0};
  CHECK(library_rule(sel, r, 5).count == 3);
  const library_result wide = library_rule(sel, r, 8);
  CHECK(wide.count == 5);
  CHECK(wide.keep == std::vector<std::uint8_t>{1, 0, 0, 0, 1, 1, 1, 1});
  calibrated_top_p no_union = sel;
  no_union.union_top_k = false;
  CHECK(library_rule(no_union, r, 8).count == 3);
  // Caps: at most upper (protected included), at least lower, the rest by score.
  calibrated_top_p capped = sel;
  capped.upper = 4;
  const library_result four = library_rule(capped, r, 8);
  CHECK(four.count == 4);
  CHECK(four.keep == std::vector<std::uint8_t>{1, 0, 0, 0, 0, 1, 1, 1});
  calibrated_top_p raised = no_union;
  raised.lower = 6;
  CHECK(library_rule(raised, r, 8).count == 6);
}

TEST_CASE("whole row: tokens without a score and dropped tokens take no part") {
  // The last two tokens are past the candidates (no score: -inf before protect, raw 0):
  // they are kept, but neither distribution sees them. A dropped token (-inf everywhere)
  // neither. The rest: raw {0.5, 0.3, 0.2} over t 0..2, scores equal.
  const std::vector<float> s{0.5f, 0.3f, 0.2f, -inf, inf, inf}, raw{0.5f, 0.3f, 0.2f, 0.0f, 0.0f, 0.0f},
      before{0.5f, 0.3f, 0.2f, -inf, -inf, -inf};
  float temperature = 0.0f;
  calibration_outcome outcome = calibration_outcome::unsolved;
  const calibrated_top_p sel{.p = 0.5f, .tolerance = 1e-3f, .upper = 0, .union_top_k = false,
                             .state = {&temperature, &outcome, 1, 1, 1}};
  const int count = kvp::host::keep_count(sel, s, raw, before, 4, 2, 1, kvp::head_index{}, 0, 5);
  REQUIRE(outcome == calibration_outcome::converged);
  // n_p 1 (0.5 reaches 0.5): T makes softmax over {0.5, 0.3, 0.2} put 0.5 on t 0; the
  // count is 2 protected + 1 or 2.
  const double T = temperature, a = std::exp(0.5 / T), b = std::exp(0.3 / T), c = std::exp(0.2 / T);
  CHECK(std::fabs(a / (a + b + c) - 0.5) <= 1e-3 + 1e-6);
  CHECK(count == 2 + (a / (a + b + c) >= 0.5 ? 1 : 2));
}

TEST_CASE("whole row: agrees with an independent reference of the authors' rule on random rows") {
  // Counts per head agree in at least 99% of the rows of each kind; where they agree the
  // kept masks are the same. Both with the top-k union (the default) and without.
  for (const bool with_union : {true, false}) {
    for (const kind k : {kind::peaked, kind::flat, kind::protected_mass, kind::logits}) {
      rng g{0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(k) * 1000 + with_union)};
      const int rows = 1000;
      int same_count = 0, mask_differs = 0, converged = 0;
      std::string first_difference;
      for (int i = 0; i < rows; ++i) {
        const int N = 64 + g.below(540);
        constexpr int sink_choices[] = {0, 1, 4}, window_choices[] = {8, 32};
        const int sinks = sink_choices[g.below(3)], window = window_choices[g.below(2)];
        const authors_row r = random_row(g, k, N, sinks, window);
        const int must = sinks + window;
        const int budget = must + 1 + g.below(N - must);
        const double p = g.uniform() < 0.7 ? 0.9 : 0.6;
        authors_options o{.p = p, .budget = budget, .upper = g.uniform() < 0.2 ? must + 20 : 2048,
                          .union_top_k = with_union};
        calibrated_top_p sel{.p = static_cast<float>(p), .upper = o.upper, .union_top_k = with_union};
        const authors_result want = authors_rule(r, o);
        const library_result got = library_rule(sel, r, budget);
        converged += got.outcome == calibration_outcome::converged;
        if (want.count == got.count) {
          ++same_count;
          mask_differs += want.keep != got.keep;
        } else if (first_difference.empty()) {
          first_difference = "row " + std::to_string(i) + ": N " + std::to_string(N) + ", reference " +
                             std::to_string(want.count) + " (T " + std::to_string(want.T) + "), library " +
                             std::to_string(got.count) + " (T " + std::to_string(got.T) + ")";
        }
      }
      const std::string what = std::string(name(k)) + (with_union ? ", top-k union" : ", no union");
      MESSAGE(what, ": counts agree in ", same_count, " of ", rows,
           " rows; searches converged ", converged, "; first difference: ", first_difference);
      CHECK(same_count >= rows * 99 / 100);
      CHECK(mask_differs == 0);
    }
  }
}

TEST_CASE("whole row: hard_kv's scores through the executors agree with the reference") {
  // A whole pipeline, the rows' raw scores read from the keys (element 0), max pool 7,
  // protect (window 8, one sink), calibrated top-p by default: per-head counts and masks
  // against the reference on the pooled scores. The CUDA build runs it on both executors.
  using pipeline = kvp::pipeline<kvp_test::first_element_scorer, kvp::aggregate::pool, kvp::none, calibrated_top_p,
                                 kvp::layout::compact>;
  int rows = 0, same_count = 0, mask_differs = 0;
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    const kvp_test::cache_config cfg{.layers = 2, .block_size = 8, .kv_heads = 4, .head_dim = 4,
                                     .lengths = {150, 233, 97}, .seed = seed};
    kvp_test::test_cache tc(cfg);
    rng g{seed * 7919ull};
    std::vector<std::vector<authors_row>> want_rows(cfg.lengths.size());
    for (int seq = 0; seq < static_cast<int>(cfg.lengths.size()); ++seq)
      for (int l = 0; l < cfg.layers; ++l)
        for (int h = 0; h < cfg.kv_heads; ++h) {
          const int N = cfg.lengths[seq];
          const kind k = static_cast<kind>(g.below(4));
          authors_row r = random_row(g, k, N, 1, 8);
          // The pipeline pools itself: its scores are the max pool of the raw ones.
          for (int t = 0; t < N; ++t) {
            double m = 0.0;
            for (int u = std::max(0, t - 3); u <= std::min(N - 1, t + 3); ++u) m = std::max(m, r.raw[u]);
            r.value[t] = m;
          }
          std::vector<float> raw(r.raw.begin(), r.raw.end());
          kvp_test::set_first_elements(tc, l, seq, h, raw);
          want_rows[seq].push_back(r);
        }
    pipeline p;
    p.aggregate = {.mode = kvp::aggregate::pool_mode::max, .kernel = 7};
    p.protect = {.window = 8, .sinks = 1};
    p.select = {.p = seed % 2 ? 0.9f : 0.7f, .upper = 2048};
    std::vector<kvp::batch_item> items;
    for (int seq = 0; seq < static_cast<int>(cfg.lengths.size()); ++seq)
      items.push_back({.seq = seq, .budget = 9 + static_cast<int>(g.below(40))});
    const auto res = kvp_test::run(p, tc, items);
    for (std::size_t i = 0; i < items.size(); ++i) {
      const int N = cfg.lengths[i];
      for (std::size_t row = 0; row < want_rows[i].size(); ++row) {
        const authors_result want = authors_rule(
            want_rows[i][row], {.p = p.select.p, .budget = items[i].budget, .upper = 2048, .union_top_k = true});
        ++rows;
        if (want.count != res.kept_counts[i][row]) continue;
        ++same_count;
        const auto at = res.keep_masks[i].begin() + static_cast<std::ptrdiff_t>(row * N);
        mask_differs += !std::equal(want.keep.begin(), want.keep.end(), at);
      }
    }
  }
  MESSAGE("executors: counts agree in ", same_count, " of ", rows, " rows");
  CHECK(same_count >= rows * 99 / 100);
  CHECK(mask_differs == 0);
}

TEST_CASE("whole row: each departure from the authors' numbers changes the counts") {
  // Why the defaults are theirs: the unprotected-only rule (with its scaling and range),
  // the division by the row's largest |s| alone, and t_max 10 alone each stop the search
  // at other temperatures (or calibrate another distribution), so the counts differ from
  // the reference's in many rows.
  struct departure {
    const char* what;
    calibrated_top_p sel;
  };
  calibrated_top_p unprotected{.t_max = 10.0f, .union_top_k = false};
  unprotected.scope = calibration_scope::unprotected_only;
  unprotected.divide_by_row_max = true;
  calibrated_top_p scaled{.union_top_k = false};
  scaled.divide_by_row_max = true;
  const departure departures[] = {{"unprotected only", unprotected},
                                  {"divided by the row's largest |s|", scaled},
                                  {"t_max 10", {.t_max = 10.0f, .union_top_k = false}}};
  for (const departure& d : departures) {
    rng g{12345};
    int rows = 0, same_count = 0;
    for (const kind k : {kind::peaked, kind::flat, kind::protected_mass, kind::logits})
      for (int i = 0; i < 250; ++i, ++rows) {
        const int N = 64 + g.below(540);
        const authors_row r = random_row(g, k, N, 1, 32);
        calibrated_top_p sel = d.sel;
        same_count += authors_rule(r, {.budget = N, .union_top_k = false}).count == library_rule(sel, r, N).count;
      }
    MESSAGE(std::string(d.what), ": counts agree with the authors' rule in ", same_count, " of ", rows, " rows");
    CHECK(same_count < rows * 9 / 10);
  }
}
