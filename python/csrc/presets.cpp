#include "presets.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <kvpolicy/core/error.hpp>
#include <nanobind/stl/string.h>

#include "policy.hpp"

namespace nb = nanobind;

namespace kvpy {
namespace {

// One keyword of a preset: a Python value read from or written to one or more of
// the preset's fields. Knobs are applied in table order, whatever the order of the
// keywords, so a general one (`window`: scorer and protect) comes before a specific
// one (`protect_window`) and the specific one wins.
template <class P>
struct knob {
  const char* name;
  const char* doc;
  std::function<nb::object(const P&)> get;
  std::function<void(P&, nb::handle)> set;
};

std::int32_t to_int(nb::handle v, const char* name) {
  kvp::require(PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr()), name, "is {}; expected an int",
               nb::repr(v).c_str());
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  kvp::require(overflow == 0 && x >= INT32_MIN && x <= INT32_MAX, name, "is {}; out of the int32 range",
               nb::repr(v).c_str());
  return static_cast<std::int32_t>(x);
}
float to_float(nb::handle v, const char* name) {
  kvp::require((PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())) && !PyBool_Check(v.ptr()), name,
               "is {}; expected a float", nb::repr(v).c_str());
  return static_cast<float>(PyFloat_AsDouble(v.ptr()));
}
double to_double(nb::handle v, const char* name) {
  kvp::require((PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())) && !PyBool_Check(v.ptr()), name,
               "is {}; expected a float", nb::repr(v).c_str());
  return PyFloat_AsDouble(v.ptr());
}
bool to_bool(nb::handle v, const char* name) {
  kvp::require(PyBool_Check(v.ptr()), name, "is {}; expected True or False", nb::repr(v).c_str());
  return v.ptr() == Py_True;
}

// An enum field spelled as strings in Python.
template <class E>
struct spelling {
  const char* text;
  E value;
};
template <class E, std::size_t N>
E to_enum(nb::handle v, const char* name, const spelling<E> (&table)[N]) {
  std::string choices;
  for (const auto& s : table) choices += (choices.empty() ? "'" : ", '") + std::string(s.text) + "'";
  kvp::require(PyUnicode_Check(v.ptr()), name, "is {}; expected one of {}", nb::repr(v).c_str(), choices);
  const std::string text = nb::cast<std::string>(v);
  for (const auto& s : table)
    if (text == s.text) return s.value;
  kvp::require(false, name, "is '{}'; expected one of {}", text, choices);
  return table[0].value;
}
template <class E, std::size_t N>
nb::object from_enum(E e, const spelling<E> (&table)[N]) {
  for (const auto& s : table)
    if (s.value == e) return nb::str(s.text);
  return nb::none();
}

constexpr spelling<kvp::group_reduce> group_names[] = {{"max", kvp::group_reduce::max},
                                                       {"mean", kvp::group_reduce::mean},
                                                       {"sum", kvp::group_reduce::sum},
                                                       {"max_logits", kvp::group_reduce::max_logits}};
constexpr spelling<kvp::window_reduce> reduce_names[] = {{"mean", kvp::window_reduce::mean},
                                                         {"sum", kvp::window_reduce::sum}};
constexpr spelling<kvp::aggregate::global_mode> global_names[] = {{"max", kvp::aggregate::global_mode::max},
                                                                  {"sum", kvp::aggregate::global_mode::sum},
                                                                  {"mean", kvp::aggregate::global_mode::mean}};
constexpr spelling<kvp::aggregate::pool_mode> pool_names[] = {{"max", kvp::aggregate::pool_mode::max},
                                                              {"avg", kvp::aggregate::pool_mode::avg}};
constexpr spelling<kvp::select::block_budget> budget_names[] = {{"sequence", kvp::select::block_budget::sequence},
                                                                 {"layer", kvp::select::block_budget::layer}};
constexpr spelling<kvp::select::temperature_search> search_names[] = {
    {"bisection", kvp::select::temperature_search::bisection},
    {"first_order", kvp::select::temperature_search::first_order}};
constexpr spelling<kvp::select::calibration_scope> scope_names[] = {
    {"whole_row", kvp::select::calibration_scope::whole_row},
    {"unprotected_only", kvp::select::calibration_scope::unprotected_only}};
constexpr spelling<kvp::redundancy::combine_form> form_names[] = {
    {"weighted", kvp::redundancy::combine_form::weighted}, {"subtract", kvp::redundancy::combine_form::subtract}};

// Knob makers over a field reached by `at(p)`.
template <class P, class At>
knob<P> int_knob(const char* name, const char* doc, At at) {
  return {name, doc, [at](const P& p) { return nb::int_(at(const_cast<P&>(p))); },
          [at, name](P& p, nb::handle v) { at(p) = to_int(v, name); }};
}
// The float32 field as the shortest decimal that reads back as it (0.8, not
// 0.800000011920929): what repr() and params() show round-trips exactly.
nb::float_ shortest(float f) { return nb::float_(std::stod(kvp::detail::format("{}", f))); }

template <class P, class At>
knob<P> float_knob(const char* name, const char* doc, At at) {
  return {name, doc, [at](const P& p) { return shortest(at(const_cast<P&>(p))); },
          [at, name](P& p, nb::handle v) { at(p) = to_float(v, name); }};
}
// A knob whose value must pass `ok` (`why` says what it must be), refused on the spot.
template <class P, class At, class Ok>
knob<P> checked_float_knob(const char* name, const char* doc, At at, Ok ok, const char* why) {
  return {name, doc, [at](const P& p) { return shortest(at(const_cast<P&>(p))); },
          [at, ok, name, why](P& p, nb::handle v) {
            const float x = to_float(v, name);
            kvp::require(ok(x), name, "is {}; {}", x, why);
            at(p) = x;
          }};
}
template <class P, class At, class Ok>
knob<P> checked_int_knob(const char* name, const char* doc, At at, Ok ok, const char* why) {
  return {name, doc, [at](const P& p) { return nb::int_(at(const_cast<P&>(p))); },
          [at, ok, name, why](P& p, nb::handle v) {
            const std::int32_t x = to_int(v, name);
            kvp::require(ok(x), name, "is {}; {}", x, why);
            at(p) = x;
          }};
}
template <class P, class At>
knob<P> double_knob(const char* name, const char* doc, At at) {
  return {name, doc, [at](const P& p) { return nb::float_(at(const_cast<P&>(p))); },
          [at, name](P& p, nb::handle v) { at(p) = to_double(v, name); }};
}
template <class P, class At>
knob<P> bool_knob(const char* name, const char* doc, At at) {
  return {name, doc, [at](const P& p) { return nb::bool_(at(const_cast<P&>(p))); },
          [at, name](P& p, nb::handle v) { at(p) = to_bool(v, name); }};
}
template <class P, class E, std::size_t N, class At>
knob<P> enum_knob(const char* name, const char* doc, const spelling<E> (&table)[N], At at) {
  return {name, doc, [at, &table](const P& p) { return from_enum(at(const_cast<P&>(p)), table); },
          [at, name, &table](P& p, nb::handle v) { at(p) = to_enum(v, name, table); }};
}

// The window attention scorer and the protected tokens (every scored preset).
template <class P>
void scorer_knobs(std::vector<knob<P>>& k) {
  k.push_back({"window", "observation window: queries scored (scorer.window) and tokens protected (protect.window)",
               [](const P& p) { return nb::int_(p.scorer.window); },
               [](P& p, nb::handle v) { p.scorer.window = p.protect.window = to_int(v, "window"); }});
  k.push_back(int_knob<P>("protect_window", "the newest tokens always kept (protect.window)",
                          [](P& p) -> auto& { return p.protect.window; }));
  k.push_back(int_knob<P>("sinks", "the first tokens always kept (protect.sinks)",
                          [](P& p) -> auto& { return p.protect.sinks; }));
  k.push_back(enum_knob<P>("group", "reduction over a KV head's query heads (scorer.group)", group_names,
                           [](P& p) -> auto& { return p.scorer.group; }));
  k.push_back(enum_knob<P>("reduce", "reduction over the window's queries (scorer.reduce)", reduce_names,
                           [](P& p) -> auto& { return p.scorer.reduce; }));
  k.push_back(bool_knob<P>("causal", "mask keys after each window query (scorer.causal)",
                           [](P& p) -> auto& { return p.scorer.causal; }));
  k.push_back(bool_knob<P>("keys_before_window", "score only the keys before the window (scorer.keys_before_window)",
                           [](P& p) -> auto& { return p.scorer.keys_before_window; }));
}
template <class P, class At>
void global_score_knobs(std::vector<knob<P>>& k, At at) {
  k.push_back(enum_knob<P>("score_mode", "how F's history combines with the new score (global_score.mode)",
                           global_names, [at](P& p) -> auto& { return at(p).mode; }));
  k.push_back(float_knob<P>("alpha", "decay of F's history (global_score.alpha)",
                            [at](P& p) -> auto& { return at(p).alpha; }));
  k.push_back(bool_knob<P>("max_norm", "divide scores by their row maximum first (global_score.max_norm)",
                           [at](P& p) -> auto& { return at(p).max_norm; }));
}
template <class P, class At>
void pool_knobs(std::vector<knob<P>>& k, At at) {
  k.push_back(enum_knob<P>("pool", "pooling along the tokens (pool.mode)", pool_names,
                           [at](P& p) -> auto& { return at(p).mode; }));
  k.push_back(int_knob<P>("kernel", "pooling kernel, odd (pool.kernel)", [at](P& p) -> auto& { return at(p).kernel; }));
  k.push_back(bool_knob<P>("first_only", "pool only on a sequence's first compression (pool.first_only)",
                           [at](P& p) -> auto& { return at(p).first_only; }));
}
template <class P>
void redundancy_knobs(std::vector<knob<P>>& k) {
  k.push_back(float_knob<P>("theta", "cosine above which two keys are near-duplicates (redundancy.theta)",
                            [](P& p) -> auto& { return p.redundancy.theta; }));
  k.push_back(float_knob<P>("tau", "softmax temperature of the redundancy (redundancy.tau)",
                            [](P& p) -> auto& { return p.redundancy.tau; }));
  k.push_back(float_knob<P>("lambda_", "weight of the score against the redundancy (redundancy.lambda)",
                            [](P& p) -> auto& { return p.redundancy.lambda; }));
  k.push_back(float_knob<P>("eps", "added to key norms (redundancy.eps)", [](P& p) -> auto& { return p.redundancy.eps; }));
  k.push_back(enum_knob<P>("form", "'weighted': lambda S - (1 - lambda) R; 'subtract': S - lambda R (redundancy.form)",
                           form_names, [](P& p) -> auto& { return p.redundancy.form; }));
}

// Calibrated top-p (Hard-KV): without a calibration state, temperatures are solved at
// every compression. Values out of range are refused here, naming the keyword (the
// pair t_min < t_max, and lower <= upper, when the policy runs: pipeline.select.*).
template <class P>
void calibrated_knobs(std::vector<knob<P>>& k) {
  const auto positive = [](auto x) { return x > 0; };
  const auto not_negative = [](auto x) { return x >= 0; };
  k.push_back(checked_float_knob<P>("p", "the attention mass each head's kept set carries (select.p)",
                                    [](P& p) -> auto& { return p.select.p; },
                                    [](float x) { return x > 0.0f && x <= 1.0f; }, "a mass lies in (0, 1]"));
  k.push_back(checked_float_knob<P>("tolerance", "accepted |calibrated top-n_p mass - p| (select.tolerance)",
                                    [](P& p) -> auto& { return p.select.tolerance; }, positive, "must be positive"));
  k.push_back(checked_float_knob<P>("t_min", "lowest temperature searched (select.t_min)",
                                    [](P& p) -> auto& { return p.select.t_min; }, positive, "must be positive"));
  k.push_back(checked_float_knob<P>("t_max", "highest temperature searched (select.t_max; Hard-KV's bisection: 1)",
                                    [](P& p) -> auto& { return p.select.t_max; }, positive, "must be positive"));
  k.push_back(enum_knob<P>("search", "'bisection' (Hard-KV alg. 2) or 'first_order' (Adam, alg. 1) (select.search)",
                           search_names, [](P& p) -> auto& { return p.select.search; }));
  k.push_back(checked_int_knob<P>("iterations", "bisection steps at most (select.iterations)",
                                  [](P& p) -> auto& { return p.select.iterations; }, positive, "must be positive"));
  k.push_back(checked_int_knob<P>("steps", "first-order steps at most (select.steps)",
                                  [](P& p) -> auto& { return p.select.steps; }, positive, "must be positive"));
  k.push_back(checked_float_knob<P>("learning_rate", "first order's Adam rate (select.learning_rate)",
                                    [](P& p) -> auto& { return p.select.learning_rate; }, positive,
                                    "must be positive"));
  k.push_back(checked_float_knob<P>("t_start", "first order's starting temperature (select.t_start)",
                                    [](P& p) -> auto& { return p.select.t_start; }, positive, "must be positive"));
  k.push_back(checked_int_knob<P>("upper",
                                  "at most this many tokens per head, protected included; 0: no cap (select.upper)",
                                  [](P& p) -> auto& { return p.select.upper; }, not_negative,
                                  "must not be negative (0: no cap)"));
  k.push_back(checked_int_knob<P>("lower", "at least this many tokens per head; 0: off (select.lower)",
                                  [](P& p) -> auto& { return p.select.lower; }, not_negative,
                                  "must not be negative (0: off)"));
  k.push_back(bool_knob<P>("union_top_k",
                           "also keep the top (budget - protected) by score, over the row as the top-p set "
                           "(select.union_top_k; Hard-KV's code: on)",
                           [](P& p) -> auto& { return p.select.union_top_k; }));
  k.push_back(enum_knob<P>("scope",
                           "'whole_row' (the authors' rule: n_p and the calibrated softmax over every token, sinks "
                           "and window included) or 'unprotected_only' (the protected tokens out of both, the raw "
                           "mass renormalised) (select.scope)",
                           scope_names, [](P& p) -> auto& { return p.select.scope; }));
  k.push_back(bool_knob<P>("divide_by_row_max",
                           "divide the scores by the row's largest |s| before the softmax (select.divide_by_row_max; "
                           "Hard-KV's code: off)",
                           [](P& p) -> auto& { return p.select.divide_by_row_max; }));
}

template <class P>
std::vector<knob<P>> knobs_of() {
  using namespace kvp::presets;
  std::vector<knob<P>> k;
  if constexpr (std::is_same_v<P, kv_compress>) {
    // Over a per-head cache (kvpolicy.compress_per_head): the selector, the budget and
    // the metric (kvpolicy.per_head_metric).
    k.push_back(int_knob<P>("protected_window", "the last positions of a sequence never evicted (select.protected_window)",
                            [](P& p) -> auto& { return p.select.protected_window; }));
    k.push_back(int_knob<P>("sinks", "the first positions never evicted (select.sinks)",
                            [](P& p) -> auto& { return p.select.sinks; }));
    k.push_back(enum_knob<P>("budget",
                             "'sequence': one block count over all layers and KV heads of a sequence; 'layer': one "
                             "per layer (select.budget)",
                             budget_names, [](P& p) -> auto& { return p.select.budget; }));
    k.push_back(int_knob<P>("max_cache_tokens",
                            "tokens each (layer, KV head) keeps on average, in whole blocks; -1: no token budget",
                            [](P& p) -> auto& { return p.max_cache_tokens; }));
    k.push_back(double_knob<P>("compression_rate",
                               "fraction of the compressible positions kept, in (0, 1]; 1: no rate",
                               [](P& p) -> auto& { return p.compression_rate; }));
    k.push_back(int_knob<P>("metric_window", "the prefill's last queries the metric reads (metric.window)",
                            [](P& p) -> auto& { return p.metric.window; }));
    k.push_back(int_knob<P>("pool_kernel", "max-pool per query head, odd; 1: none (metric.pool_kernel)",
                            [](P& p) -> auto& { return p.metric.pool_kernel; }));
    k.push_back(int_knob<P>("excluded_distance",
                            "a query adds nothing to keys closer than this (metric.excluded_distance)",
                            [](P& p) -> auto& { return p.metric.excluded_distance; }));
  } else if constexpr (std::is_same_v<P, kara>) {
    // Kara scores a window bidirectionally and keeps its own pattern: no protect (both
    // 0, as pattern selectors need), no causal mask, no keys before a window.
    k.push_back(int_knob<P>("window", "|W|: the tokens of a window and the queries scored (scorer.window)",
                            [](P& p) -> auto& { return p.scorer.window; }));
    k.push_back(int_knob<P>("buffer", "|U|: the window's newest tokens, never evicted nor scored (scorer.buffer)",
                            [](P& p) -> auto& { return p.scorer.buffer; }));
    k.push_back(enum_knob<P>("group", "reduction over a KV head's query heads (scorer.group)", group_names,
                             [](P& p) -> auto& { return p.scorer.group; }));
    k.push_back(int_knob<P>("gamma", "longest chunk, both anchors included, >= 3 (select.gamma)",
                            [](P& p) -> auto& { return p.select.gamma; }));
    k.push_back(int_knob<P>("alpha", "tokens the chunks and the fill may add to the anchors (select.alpha)",
                            [](P& p) -> auto& { return p.select.alpha; }));
  } else if constexpr (std::is_same_v<P, streaming_llm>) {
    k.push_back({"sinks", "the first tokens kept (select.sinks and protect.sinks)",
                 [](const P& p) { return nb::int_(p.select.sinks); },
                 [](P& p, nb::handle v) { p.select.sinks = p.protect.sinks = to_int(v, "sinks"); }});
    k.push_back(int_knob<P>("window", "the newest tokens always kept (protect.window)",
                            [](P& p) -> auto& { return p.protect.window; }));
  } else {
    scorer_knobs(k);
    if constexpr (std::is_same_v<P, zipage>) {
      global_score_knobs(k, [](P& p) -> auto& { return p.aggregate.first; });
      pool_knobs(k, [](P& p) -> auto& { return p.aggregate.second; });
      redundancy_knobs(k);
    } else if constexpr (std::is_same_v<P, rkv>) {
      pool_knobs(k, [](P& p) -> auto& { return p.aggregate; });
      redundancy_knobs(k);
    } else if constexpr (std::is_same_v<P, gkv>) {
      global_score_knobs(k, [](P& p) -> auto& { return p.aggregate; });
      redundancy_knobs(k);
    } else if constexpr (std::is_same_v<P, snapkv>) {
      pool_knobs(k, [](P& p) -> auto& { return p.aggregate; });
    } else if constexpr (std::is_same_v<P, hard_kv>) {
      pool_knobs(k, [](P& p) -> auto& { return p.aggregate; });
      calibrated_knobs(k);
    } else if constexpr (std::is_same_v<P, hard_kv_rkv>) {
      pool_knobs(k, [](P& p) -> auto& { return p.aggregate; });
      redundancy_knobs(k);
      calibrated_knobs(k);
    }
    // h2o: accumulate has no parameter.
  }
  return k;
}

template <class P>
void bind_preset(nb::module_& m, const char* py_name, const char* doc) {
  static const std::vector<knob<P>> knobs = knobs_of<P>();
  std::string full_doc = std::string(doc) + "\n\nKeywords (each also a read-write attribute):\n";
  for (const auto& k : knobs) full_doc += std::string("  ") + k.name + ": " + k.doc + "\n";

  auto cls = nb::class_<P>(m, py_name, nb::is_final());
  cls.doc() = nb::str(full_doc.c_str());
  cls.def(
      "__init__",
      [py_name](P* self, nb::kwargs kwargs) {
        new (self) P();
        for (auto [key, value] : kwargs) {
          const std::string name = nb::cast<std::string>(key);
          bool known = false;
          for (const auto& k : knobs) known = known || name == k.name;
          if (!known) {
            std::string names;
            for (const auto& k : knobs) names += (names.empty() ? "" : ", ") + std::string(k.name);
            throw nb::type_error((std::string(py_name) + "() got an unexpected keyword argument '" + name +
                                  "'; its keywords are: " + names)
                                     .c_str());
          }
        }
        for (const auto& k : knobs)
          if (kwargs.contains(k.name)) k.set(*self, kwargs[k.name]);
      },
      "Defaults are the preset's published parameters; each keyword overrides one.");
  for (const auto& k : knobs) {
    cls.def_prop_rw(
        k.name, [&k](const P& p) { return k.get(p); }, [&k](P& p, nb::handle v) { k.set(p, v); }, k.doc);
  }
  cls.def_prop_ro_static("name", [](nb::handle) { return std::string(preset_name<P>()); },
                         "the preset's name in kvp::presets");
  if constexpr (std::is_same_v<P, kvp::presets::kara>) {
    cls.def_prop_ro_static("kara_budget", [](nb::handle) { return kvp::presets::kara::kara_budget; },
                           "KvLLM's budget per window: tokens kept of W \\ U (225: 257 of 768 with the buffer)");
  }
  cls.def(
      "params",
      [](const P& p) {
        nb::dict d;
        for (const auto& k : knobs) d[k.name] = k.get(p);
        return d;
      },
      "Every keyword's current value: type(p)(**p.params()) is an equal policy.");
  cls.def("__repr__", [py_name](const P& p) {
    std::string s = std::string(py_name) + "(";
    bool first = true;
    for (const auto& k : knobs) {
      s += (first ? "" : ", ") + std::string(k.name) + "=" + nb::cast<std::string>(nb::repr(k.get(p)));
      first = false;
    }
    return s + ")";
  });
  cls.def("__eq__", [](const P& a, nb::handle b) {
    if (!nb::isinstance<P>(b)) return false;
    const P& other = nb::cast<const P&>(b);
    for (const auto& k : knobs)
      if (!k.get(a).equal(k.get(other))) return false;
    return true;
  });
  cls.def("__copy__", [](const P& p) { return P(p); });
  cls.def("__deepcopy__", [](const P& p, nb::handle) { return P(p); });
}

}  // namespace

void register_presets(nb::module_& m) {
  bind_preset<kvp::presets::zipage>(
      m, "Zipage",
      "Zipage: window attention (group max, window mean, w 16) -> global score (max, alpha 0.8) -> max pool 5 on "
      "the first compression -> lightning redundancy (tau 0.4, lambda 0.2) -> top-k -> compact.");
  bind_preset<kvp::presets::rkv>(m, "RKV",
                                 "R-KV: window attention over the keys before the window (group max_logits, mean, w "
                                 "8) -> max pool 7 -> full redundancy (tau 1, lambda 0.1) -> top-k -> compact.");
  bind_preset<kvp::presets::gkv>(m, "GKV",
                                 "G-KV: window attention (group max, mean, w 16) -> global score (max, alpha 0.8, "
                                 "max-normalised) -> full redundancy (lambda 0.5) -> top-k -> compact.");
  bind_preset<kvp::presets::snapkv>(
      m, "SnapKV", "SnapKV: window attention (group mean, window sum, w 32) -> max pool 7 -> top-k -> compact.");
  bind_preset<kvp::presets::h2o>(
      m, "H2O", "H2O: window attention summed over the window (w 16) -> accumulated in F -> top-k -> compact.");
  bind_preset<kvp::presets::hard_kv>(
      m, "HardKV",
      "Hard-KV with SnapKV's scores: window attention (group max_logits, mean, w 8) -> max pool 7 -> calibrated "
      "top-p, the authors' rule (n_p and the calibrated softmax over the whole row, sinks and window included; the "
      "top (budget - protected) by score kept too; p 0.9, at most 2048 per head; temperatures solved at every call) "
      "-> compact, each KV head to its own count (kept_counts). Protects the last 32 tokens and 1 sink.");
  bind_preset<kvp::presets::hard_kv_rkv>(
      m, "HardKVRKV",
      "Hard-KV with R-KV's scores: R-KV's stages (keys before the window, max pool 7, full redundancy tau 1, lambda "
      "0.1) -> calibrated top-p as HardKV -> compact, each KV head to its own count.");
  bind_preset<kvp::presets::kara>(
      m, "Kara",
      "Kara, a window at a time: bidirectional attention among the |W| tokens of a window (every query of the "
      "window sees every key; group sum, |W| 768, buffer |U| 32) -> Token2Chunk (the top budget - alpha tokens of "
      "W \\ U, the interiors of the best chunks of at most gamma 8 between them, the best remaining tokens; alpha "
      "16) -> compaction of the window alone. Runs over [window_begins[i], T) of each item (compress's "
      "window_begins, a multiple of the block size); the budget counts the tokens kept of W \\ U (kara_budget 225 "
      "keeps 257 of 768); the query slot holds the window's |W| queries, oldest first. Masks and scores cover the "
      "window.");
  bind_preset<kvp::presets::kv_compress>(
      m, "KVCompress",
      "KV-Compress over a per-head block cache (kvpolicy.compress_per_head): each KV head of each layer holds its "
      "own blocks; a sequence frees a number of blocks over all its layers and KV heads (budget 'sequence') or per "
      "layer ('layer'), the cheapest by the metric each slot holds (squared attention, window 32, max pool 7 per "
      "query head, summed over the group), then MoveCache compacts each head. The last 64 positions are never "
      "evicted. The budget: max_cache_tokens or compression_rate (at most one; both off by default, so "
      "compress_per_head needs blocks_to_free then).");
  bind_preset<kvp::presets::streaming_llm>(
      m, "StreamingLLM", "StreamingLLM: no scores; keeps the first `sinks` tokens and the most recent ones -> compact.");
}

}  // namespace kvpy
