// Calibrated top-p (Hard-KV 3.2, app. D; SPEC.md "Calibrated top-p"): each KV head
// keeps as many tokens as its own attention needs. The raw attention's top-p mass
// fixes a count n_p; a temperature T turns the policy's final scores s into
// softmax(s / T) whose top-n_p mass is p; the row keeps the top-p set of that
// calibrated distribution, so later compressions, which reuse T, keep per head what
// the head's current scores need.
//
// By default the rule is the authors' (their code, HARDInfer): n_p from the raw
// attention of the whole row, sinks and window included and not renormalised; the
// calibrated softmax over the whole row too; the kept set is the calibrated top-p set
// union the top (budget - protected) by score, union the sinks and the window (those of
// the two sets that are protected are counted once). `calibration_scope::
// unprotected_only` is the variant that leaves the protected tokens out of both
// distributions (the raw mass renormalised over the rest).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/select/calibration_state.hpp"
#include "kvpolicy/select/rank_order.hpp"
#include "kvpolicy/select/selector_row.hpp"

KVP_NAMESPACE_BEGIN
namespace select {

enum class temperature_search : std::uint8_t {
  bisection,    // on [t_min, t_max], at most `iterations` halvings (Hard-KV alg. 2)
  first_order,  // Adam on T from t_start, at most `steps` (Hard-KV alg. 1)
};

// Which tokens form the raw distribution (n_p) and the calibrated one.
enum class calibration_scope : std::uint8_t {
  whole_row,         // every scored token, the protected ones with their own scores (Hard-KV's code)
  unprotected_only,  // the tokens protect leaves to the selector; the raw mass renormalised over them
};

namespace calibration {

KVP_HOST_DEVICE inline bool finite(float x) { return x - x == 0.0f; }
// A token the selector decides on: a finite final score. Protect's +inf (window, sinks,
// tokens past the candidates), padding's and dropped tokens' -inf and NaN are not.
KVP_HOST_DEVICE inline bool selectable(const row_token& x) { return finite(x.score); }

// The members of both distributions, and the score the calibrated one is made of.
// whole_row: every token with a finite score before protect (not the tokens past the
// candidates, which have none, nor dropped ones); unprotected_only: the selectable ones.
struct whole_row {
  KVP_HOST_DEVICE static bool member(const row_token& x) { return finite(x.before_protect); }
  KVP_HOST_DEVICE static float value(const row_token& x) { return x.before_protect; }
};
struct unprotected_only {
  KVP_HOST_DEVICE static bool member(const row_token& x) { return selectable(x); }
  KVP_HOST_DEVICE static float value(const row_token& x) { return x.score; }
};

template <class V>
struct raw_key {
  KVP_HOST_DEVICE float operator()(const row_token& x) const { return V::member(x) ? x.raw : -__builtin_huge_valf(); }
};
template <class V>
struct raw_weight {
  KVP_HOST_DEVICE float operator()(const row_token& x) const { return V::member(x) && x.raw > 0.0f ? x.raw : 0.0f; }
};
template <class V>
struct member_count {
  KVP_HOST_DEVICE float operator()(const row_token& x) const { return V::member(x) ? 1.0f : 0.0f; }
};
template <class V>
struct value_key {
  KVP_HOST_DEVICE float operator()(const row_token& x) const { return V::member(x) ? V::value(x) : -__builtin_huge_valf(); }
};
template <class V>
struct abs_value {
  KVP_HOST_DEVICE float operator()(const row_token& x) const { return V::member(x) ? fabsf(V::value(x)) : 0.0f; }
};
// exp((v - max) / (scale * T)) over the members; with `only_cut`, over the cut's members
// only; with `moment`, times the exponent (for the gradient of the mass).
template <class V>
struct tempered {
  float max, inv;  // inv = 1 / (scale * T)
  rank_cut cut{};
  bool only_cut = false, moment = false;
  KVP_HOST_DEVICE float operator()(const row_token& x) const {
    if (!V::member(x) || (only_cut && !cut.admits(V::value(x), x.t))) return 0.0f;
    const float z = (V::value(x) - max) * inv;
    return moment ? z * expf(z) : expf(z);
  }
};
// The selectable members of a cut by value: what a whole-row kept set adds to the
// protected tokens.
template <class V>
struct selectable_in {
  rank_cut cut;
  KVP_HOST_DEVICE float operator()(const row_token& x) const {
    return selectable(x) && V::member(x) && cut.admits(V::value(x), x.t) ? 1.0f : 0.0f;
  }
};

// A solved entry, written once per row.
struct store {
  float* temperature;
  calibration_outcome* outcome;
  float T;
  calibration_outcome value;
  KVP_HOST_DEVICE void operator()() const {
    if (temperature != nullptr) *temperature = T;
    *outcome = value;
  }
};

}  // namespace calibration

struct calibrated_top_p {
  float p = 0.9f;             // the mass each head's kept set carries
  float tolerance = 1e-2f;    // |calibrated top-n_p mass - p| accepted
  float t_min = 1e-3f;        // the temperature's range: Hard-KV's bisection searches [1e-3, 1]
  float t_max = 1.0f;         // (its first-order search clamps to [1e-3, 10]: set t_max 10 for that)
  temperature_search search = temperature_search::bisection;
  std::int32_t iterations = 30;  // bisection's bound (Hard-KV's code has none; 30 halvings of [1e-3, 1] reach 1e-9)
  std::int32_t steps = 50;       // first_order's bound, Adam with ...
  float learning_rate = 1e-2f;   // ... this rate ...
  float t_start = 0.5f;          // ... from this T
  std::int32_t upper = 2048;     // L_upper: at most this many per head, protected included (0: no cap)
  std::int32_t lower = 0;        // L_lower: at least this many (0: off); Hard-KV's option 1152
  bool union_top_k = true;       // also keep the top (budget - protected) by score (Hard-KV's code always does)
  calibration_scope scope = calibration_scope::whole_row;
  // Divide the scores by the row's largest |s| before the softmax, so that T is
  // relative to the row's own scale (Hard-KV's code does not: T divides the scores as
  // they are; off, the bisection visits the temperatures theirs does).
  bool divide_by_row_max = false;
  // Temperatures kept between compressions. Empty: solved at every compression.
  // Otherwise an entry is solved when its outcome is `unsolved` (and always when
  // `reuse` is false), then read back at later compressions.
  calibration_state state{};
  bool reuse = true;

  // A row's tokens carry their score before protect too (row_token::before_protect).
  static constexpr bool sees_protected_scores = true;

  KVP_HOST_DEVICE constexpr float rank_key(float score, std::int32_t, std::int32_t) const noexcept { return score; }

  template <class Row>
  KVP_HOST_DEVICE std::int32_t row_keep_count(const Row& row, std::int32_t budget) const {
    return scope == calibration_scope::whole_row ? count<calibration::whole_row>(row, budget)
                                                 : count<calibration::unprotected_only>(row, budget);
  }

  // The row's count with the members and scores of V (calibration::whole_row or
  // unprotected_only): the protected tokens, plus the selectable ones of the kept set.
  template <class V, class Row>
  KVP_HOST_DEVICE std::int32_t count(const Row& row, std::int32_t budget) const {
    namespace c = calibration;
    const std::int32_t must = row.protected_count();
    std::int32_t m = 0;  // the calibrated top-p set's size, among the members
    const float raw_total = row.sum(c::raw_weight<V>{});
    if (raw_total > 0.0f) {
      const std::int32_t n_p = row.fewest_reaching(c::raw_key<V>{}, c::raw_weight<V>{}, p * raw_total);
      const float top = row.max(c::value_key<V>{});
      float unit = 1.0f;
      if (divide_by_row_max) {
        const float scale = row.max(c::abs_value<V>{});
        unit = scale > 0.0f ? 1.0f / scale : 1.0f;
      }
      const bool stored = !state.empty() && reuse;
      const std::int64_t at = state.empty() ? 0 : state.index(row.slot(), row.head());
      float T = 0.0f;
      // An entry without a temperature (unsolved, or no mass when it was searched) is searched.
      const calibration_outcome was = state.empty() ? calibration_outcome::unsolved : state.outcome[at];
      if (stored && was != calibration_outcome::unsolved && was != calibration_outcome::no_mass) {
        T = state.temperature[at];
      } else {
        const rank_cut cut = row.top(c::value_key<V>{}, n_p);
        calibration_outcome outcome = calibration_outcome::not_converged;
        T = solve<V>(row, cut, top, unit, outcome);
        // Every thread of a device row has read the entry above: the search's
        // collective operations lie between that read and this write.
        if (!state.empty()) row.once(c::store{state.temperature + at, state.outcome + at, T, outcome});
      }
      const c::tempered<V> e{top, unit / T};
      m = row.fewest_reaching(c::value_key<V>{}, e, p * row.sum(e));
    } else if (!state.empty()) {
      const std::int64_t at = state.index(row.slot(), row.head());
      if (!reuse || state.outcome[at] == calibration_outcome::unsolved)
        row.once(c::store{nullptr, state.outcome + at, 0.0f, calibration_outcome::no_mass});
    }
    // A mass within rounding of the whole (p near 1) can run past the members, into
    // tokens that are never kept.
    const auto members = static_cast<std::int32_t>(row.sum(c::member_count<V>{}));
    m = m < members ? m : members;
    const std::int32_t k = budget - must;  // Hard-KV's top-k: budget less window and sinks
    std::int32_t selected = m;
    if constexpr (std::is_same_v<V, c::whole_row>) {
      // The union's top k by score, over the whole row as the top-p set: protected
      // tokens in either are kept anyway, so what the row adds is the selectable
      // members of the larger of the two (both are tops of the same order).
      if (union_top_k && k > m) m = k < members ? k : members;
      selected = m > 0 ? static_cast<std::int32_t>(row.sum(c::selectable_in<V>{row.top(c::value_key<V>{}, m)})) : 0;
    } else if (union_top_k && k > selected) {
      selected = k;
    }
    std::int32_t total = must + selected;
    if (upper > 0 && total > upper) total = upper;
    if (lower > 0 && total < lower) total = lower;
    return total;  // the executor keeps at least the protected tokens and at most the row
  }

  // The top-n_p mass of softmax(v / T) as a function of T, at T (v: V's scores).
  template <class V, class Row>
  KVP_HOST_DEVICE float mass(const Row& row, const rank_cut& cut, float top, float unit, float T) const {
    const calibration::tempered<V> all{top, unit / T}, in_cut{top, unit / T, cut, true};
    return row.sum(in_cut) / row.sum(all);
  }

  template <class V, class Row>
  KVP_HOST_DEVICE float solve(const Row& row, const rank_cut& cut, float top, float unit,
                              calibration_outcome& outcome) const {
    if (search == temperature_search::bisection) {
      // The mass falls as T rises (a flatter distribution); check the bounds first,
      // so that a target out of reach says so. The midpoints are Hard-KV's: the
      // first within tolerance ends the search.
      if (mass<V>(row, cut, top, unit, t_max) > p + tolerance) return outcome = calibration_outcome::upper_bound, t_max;
      if (mass<V>(row, cut, top, unit, t_min) < p - tolerance) return outcome = calibration_outcome::lower_bound, t_min;
      float lo = t_min, hi = t_max, mid = 0.5f * (lo + hi);
      for (std::int32_t i = 0; i < iterations; ++i) {
        mid = 0.5f * (lo + hi);
        const float m = mass<V>(row, cut, top, unit, mid);
        if (fabsf(m - p) <= tolerance) return outcome = calibration_outcome::converged, mid;
        (m > p ? lo : hi) = mid;
      }
      outcome = calibration_outcome::not_converged;
      return mid;
    }
    // Adam on (mass - p)^2. dM/dT = -(E_cut[z] - M E[z]) / T with z = (v - max) * unit / T.
    float T = t_start < t_min ? t_min : (t_start > t_max ? t_max : t_start), m1 = 0.0f, m2 = 0.0f;
    float b1 = 1.0f, b2 = 1.0f;
    for (std::int32_t i = 0; i < steps; ++i) {
      const float inv = unit / T;
      const calibration::tempered<V> all{top, inv}, in_cut{top, inv, cut, true};
      const float Z = row.sum(all), M = row.sum(in_cut) / Z;
      if (fabsf(M - p) <= tolerance) return outcome = calibration_outcome::converged, T;
      const calibration::tempered<V> z_all{top, inv, {}, false, true}, z_cut{top, inv, cut, true, true};
      const float dM = -(row.sum(z_cut) / Z - M * row.sum(z_all) / Z) / T;
      const float g = 2.0f * (M - p) * dM;
      m1 = 0.9f * m1 + 0.1f * g;
      m2 = 0.999f * m2 + 0.001f * g * g;
      b1 *= 0.9f;
      b2 *= 0.999f;
      T -= learning_rate * (m1 / (1.0f - b1)) / (sqrtf(m2 / (1.0f - b2)) + 1e-8f);
      T = T < t_min ? t_min : (T > t_max ? t_max : T);
    }
    outcome = T <= t_min   ? calibration_outcome::lower_bound
              : T >= t_max ? calibration_outcome::upper_bound
                           : calibration_outcome::not_converged;
    return T;
  }

  // Checked by the executors before anything is written (kvp::error names the field).
  void validate(const paged_kv_view& cache, const query_window_view& queries) const {
    require(p > 0.0f && p <= 1.0f, "pipeline.select.p", "is {}; a mass lies in (0, 1]", p);
    require(tolerance > 0.0f, "pipeline.select.tolerance", "is {}; must be positive", tolerance);
    require(t_min > 0.0f && t_min < t_max, "pipeline.select.t_min", "is {}; must be positive and below t_max {}", t_min,
            t_max);
    require(search == temperature_search::bisection || search == temperature_search::first_order,
            "pipeline.select.search", "is {}; 0 bisection, 1 first_order", static_cast<int>(search));
    require(scope == calibration_scope::whole_row || scope == calibration_scope::unprotected_only,
            "pipeline.select.scope", "is {}; 0 whole_row, 1 unprotected_only", static_cast<int>(scope));
    require(iterations > 0, "pipeline.select.iterations", "is {}; must be positive", iterations);
    require(steps > 0, "pipeline.select.steps", "is {}; must be positive", steps);
    require(learning_rate > 0.0f, "pipeline.select.learning_rate", "is {}; must be positive", learning_rate);
    require(upper >= 0, "pipeline.select.upper", "is {}; must not be negative (0: no cap)", upper);
    require(lower >= 0 && (upper == 0 || lower <= upper), "pipeline.select.lower",
            "is {}; must lie in [0, upper {}]", lower, upper);
    if (state.empty()) return;
    require(state.outcome != nullptr, "pipeline.select.state.outcome", "is a null pointer beside a temperature array");
    require(state.num_layers >= cache.num_layers, "pipeline.select.state.num_layers",
            "is {}; the cache has {} layers", state.num_layers, cache.num_layers);
    require(state.num_kv_heads == cache.num_kv_heads, "pipeline.select.state.num_kv_heads",
            "is {}; the cache has {} KV heads", state.num_kv_heads, cache.num_kv_heads);
    // Items name their slot by query_slot, which the executors check against the
    // query window view: the state must hold every slot that view holds.
    require(queries.num_slots > 0 && state.num_slots >= queries.num_slots, "pipeline.select.state.num_slots",
            "is {}; the query window view has {} slots (a slot is the item's query_slot)", state.num_slots,
            queries.num_slots);
  }
};

}  // namespace select
KVP_NAMESPACE_END
