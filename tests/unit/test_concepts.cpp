// Policy concepts: every library policy satisfies its concept, and types that miss
// a hook, return the wrong type, or are not trivially copyable do not.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "kvpolicy/kvpolicy.hpp"
#include "support/test_policies.hpp"

namespace {

using kvp::none;
namespace agg = kvp::aggregate;

// ---- library policies --------------------------------------------------------
static_assert(kvp::Scorer<none>);
static_assert(kvp::AttentionScorer<kvp::scorer::window_attention>);
static_assert(kvp::AttentionScorer<kvp::scorer::squared_attention>);
static_assert(kvp::AttentionScorer<kvp::scorer::h2o>);
static_assert(kvp::Scorer<kvp::scorer::window_attention>);
static_assert(kvp::Scorer<kvp::scorer::squared_attention>);
static_assert(!kvp::KeyScorer<kvp::scorer::window_attention>);
static_assert(kvp::KeyScorer<kvp_test::table_scorer> && kvp::Scorer<kvp_test::table_scorer>);
static_assert(!kvp::AttentionScorer<kvp_test::table_scorer>);

static_assert(kvp::Aggregator<none>);
static_assert(kvp::TemporalAggregator<agg::global_score> && kvp::Aggregator<agg::global_score>);
static_assert(kvp::TemporalAggregator<agg::accumulate> && kvp::Aggregator<agg::accumulate>);
static_assert(kvp::SpatialAggregator<agg::pool> && kvp::Aggregator<agg::pool>);
static_assert(!kvp::SpatialAggregator<agg::global_score> && !kvp::TemporalAggregator<agg::pool>);
static_assert(kvp::Aggregator<agg::then<agg::global_score, agg::pool>>);
static_assert(kvp::Aggregator<agg::then<agg::accumulate, agg::pool>>);
static_assert(kvp::Aggregator<agg::then<agg::pool, agg::pool>>);
static_assert(!kvp::Aggregator<agg::then<agg::pool, int>>);
static_assert(!kvp::Aggregator<agg::then<agg::global_score, kvp::select::top_k>>);

static_assert(kvp::Redundancy<none>);
static_assert(kvp::Redundancy<kvp::redundancy::full>);
static_assert(kvp::Redundancy<kvp::redundancy::lightning>);

static_assert(kvp::Selector<none>);
static_assert(kvp::Selector<kvp::select::top_k>);
static_assert(kvp::Selector<kvp::select::sinks_recent>);

static_assert(kvp::Layout<none>);
static_assert(kvp::Layout<kvp::layout::compact>);

// Each library policy is a Policy (trivially copyable, default constructible) and
// satisfies only its own stage's concept.
static_assert(kvp::Policy<kvp::scorer::window_attention> && kvp::Policy<kvp::redundancy::full> &&
              kvp::Policy<kvp::select::top_k> && kvp::Policy<kvp::layout::compact> && kvp::Policy<agg::pool>);
static_assert(!kvp::Selector<kvp::layout::compact> && !kvp::Layout<kvp::select::top_k>);
static_assert(!kvp::Redundancy<agg::pool> && !kvp::Aggregator<kvp::redundancy::full>);
static_assert(!kvp::Scorer<kvp::select::top_k> && !kvp::Selector<kvp::scorer::window_attention>);

// Presets are pipelines of conforming stages.
template <class P>
constexpr bool conforming_pipeline = kvp::Scorer<typename P::scorer_type> && kvp::Aggregator<typename P::aggregate_type> &&
                                     kvp::Redundancy<typename P::redundancy_type> &&
                                     kvp::Selector<typename P::select_type> && kvp::Layout<typename P::layout_type>;
static_assert(conforming_pipeline<kvp::presets::zipage> && conforming_pipeline<kvp::presets::rkv> &&
              conforming_pipeline<kvp::presets::gkv> && conforming_pipeline<kvp::presets::snapkv> &&
              conforming_pipeline<kvp::presets::h2o> && conforming_pipeline<kvp::presets::streaming_llm>);
static_assert(kvp::uses_score_cache<agg::global_score>() && kvp::uses_score_cache<agg::accumulate>() &&
              kvp::uses_score_cache<agg::then<agg::global_score, agg::pool>>() && !kvp::uses_score_cache<agg::pool>() &&
              !kvp::uses_score_cache<none>());

// ---- wrong types -------------------------------------------------------------
static_assert(!kvp::Scorer<int> && !kvp::Aggregator<int> && !kvp::Redundancy<int> && !kvp::Selector<int> &&
              !kvp::Layout<int>);
static_assert(!kvp::Scorer<float*> && !kvp::Selector<void*>);

// A selector missing keep_count.
struct no_keep_count {
  float rank_key(float s, std::int32_t, std::int32_t) const { return s; }
};
static_assert(!kvp::Selector<no_keep_count>);

// rank_key returning double instead of float.
struct rank_key_double {
  double rank_key(float s, std::int32_t, std::int32_t) const { return s; }
  std::int32_t keep_count(std::int32_t, std::int32_t k) const { return k; }
};
static_assert(!kvp::Selector<rank_key_double>);

// A correct selector, for contrast, and the same with a std::string member.
struct good_selector {
  float rank_key(float s, std::int32_t, std::int32_t) const { return s; }
  std::int32_t keep_count(std::int32_t, std::int32_t k) const { return k; }
};
static_assert(kvp::Selector<good_selector>);
struct string_selector : good_selector {
  std::string name;
};
static_assert(!kvp::Selector<string_selector>);

// The three forms of a keep count: from the budget, from the budget and the head, from
// the row's scores (select/selector_row.hpp), and what each is classified as.
struct head_selector {
  float rank_key(float s, std::int32_t, std::int32_t) const { return s; }
  std::int32_t keep_count(std::int32_t, std::int32_t k, kvp::head_index h) const { return k + h.kv_head; }
};
static_assert(kvp::BudgetSelector<head_selector> && !kvp::ScoreDependentSelector<head_selector>);
static_assert(kvp::Selector<head_selector> && !kvp::uniform_counts<head_selector>);
static_assert(kvp::BudgetSelector<good_selector> && kvp::uniform_counts<good_selector>);
struct row_selector {
  float rank_key(float s, std::int32_t, std::int32_t) const { return s; }
  template <class Row>
  std::int32_t row_keep_count(const Row& row, std::int32_t) const {
    return row.size() / 2;
  }
};
static_assert(kvp::ScoreDependentSelector<row_selector> && !kvp::BudgetSelector<row_selector>);
static_assert(kvp::Selector<row_selector> && !kvp::uniform_counts<row_selector>);
// A row count of the wrong type, and one without a rank key.
struct row_selector_float {
  float rank_key(float s, std::int32_t, std::int32_t) const { return s; }
  template <class Row>
  float row_keep_count(const Row&, std::int32_t) const {
    return 1.0f;
  }
};
static_assert(!kvp::Selector<row_selector_float>);
struct row_selector_no_rank {
  template <class Row>
  std::int32_t row_keep_count(const Row&, std::int32_t) const {
    return 1;
  }
};
static_assert(!kvp::Selector<row_selector_no_rank> && !kvp::RankingSelector<row_selector_no_rank>);
// The head form of a key scorer, and a head index of the wrong type.
struct head_key_scorer {
  float key_score(kvp::row_ref, std::int32_t t, std::int32_t, kvp::head_index h) const {
    return static_cast<float>(t + h.layer);
  }
};
static_assert(kvp::KeyScorer<head_key_scorer> && kvp::Scorer<head_key_scorer>);
struct layer_int_key_scorer {
  float key_score(kvp::row_ref, std::int32_t, std::int32_t, std::int32_t, std::int32_t) const { return 0.0f; }
};
static_assert(!kvp::KeyScorer<layer_int_key_scorer>);

// Not default constructible.
struct no_default_selector : good_selector {
  explicit no_default_selector(int) {}
};
static_assert(!kvp::Selector<no_default_selector>);

// Non-trivially-copyable via a user copy constructor.
struct copy_ctor_layout {
  static constexpr bool moves_tokens = true;
  copy_ctor_layout() = default;
  copy_ctor_layout(const copy_ctor_layout&) {}
  std::int32_t destination(std::int32_t i) const { return i; }
};
static_assert(!kvp::Layout<copy_ctor_layout>);

struct layout_without_flag {
  std::int32_t destination(std::int32_t i) const { return i; }
};
static_assert(!kvp::Layout<layout_without_flag>);
struct layout_wrong_return {
  static constexpr bool moves_tokens = true;
  std::int64_t destination(std::int32_t i) const { return i; }
};
static_assert(!kvp::Layout<layout_wrong_return>);
// A hook that is not const cannot be called on `const L&`.
struct layout_non_const_hook {
  static constexpr bool moves_tokens = true;
  std::int32_t destination(std::int32_t i) { return i; }
};
static_assert(!kvp::Layout<layout_non_const_hook>);

// Attention scorers: remove one member at a time.
struct attn_ok {
  std::int32_t window = 4;
  kvp::group_reduce group = kvp::group_reduce::max;
  kvp::window_reduce reduce = kvp::window_reduce::mean;
  float transform(float p) const { return p; }
  bool visible(std::int32_t, std::int32_t) const { return true; }
  bool contributes(std::int32_t, std::int32_t) const { return true; }
  std::int32_t key_end(std::int32_t T) const { return T; }
};
static_assert(kvp::AttentionScorer<attn_ok> && kvp::Scorer<attn_ok>);
struct attn_no_window {
  kvp::group_reduce group = kvp::group_reduce::max;
  kvp::window_reduce reduce = kvp::window_reduce::mean;
  float transform(float p) const { return p; }
  bool visible(std::int32_t, std::int32_t) const { return true; }
  bool contributes(std::int32_t, std::int32_t) const { return true; }
  std::int32_t key_end(std::int32_t T) const { return T; }
};
static_assert(!kvp::AttentionScorer<attn_no_window> && !kvp::Scorer<attn_no_window>);
struct attn_visible_int : attn_ok {
  int visible(std::int32_t, std::int32_t) const { return 1; }
};
static_assert(!kvp::AttentionScorer<attn_visible_int>);
struct attn_transform_double : attn_ok {
  double transform(float p) const { return p; }
};
static_assert(!kvp::AttentionScorer<attn_transform_double>);
struct attn_no_key_end {
  std::int32_t window = 4;
  kvp::group_reduce group = kvp::group_reduce::max;
  kvp::window_reduce reduce = kvp::window_reduce::mean;
  float transform(float p) const { return p; }
  bool visible(std::int32_t, std::int32_t) const { return true; }
  bool contributes(std::int32_t, std::int32_t) const { return true; }
};
static_assert(!kvp::AttentionScorer<attn_no_key_end>);

// Key scorers.
struct key_score_double {
  double key_score(kvp::row_ref, std::int32_t, std::int32_t) const { return 0; }
};
static_assert(!kvp::KeyScorer<key_score_double> && !kvp::Scorer<key_score_double>);

// Temporal aggregators: combine and max_norm both required.
struct temporal_no_max_norm {
  float combine(float f, float s) const { return f + s; }
};
static_assert(!kvp::TemporalAggregator<temporal_no_max_norm> && !kvp::Aggregator<temporal_no_max_norm>);
struct temporal_ok : temporal_no_max_norm {
  bool max_norm = false;
};
static_assert(kvp::TemporalAggregator<temporal_ok> && kvp::Aggregator<temporal_ok>);
struct temporal_combine_int {
  bool max_norm = false;
  int combine(float, float) const { return 0; }
};
static_assert(!kvp::TemporalAggregator<temporal_combine_int>);

// Spatial aggregators.
struct spatial_no_finish {
  std::int32_t kernel = 3;
  bool first_only = false;
  float identity() const { return 0; }
  float reduce(float a, float x) const { return a + x; }
};
static_assert(!kvp::SpatialAggregator<spatial_no_finish> && !kvp::Aggregator<spatial_no_finish>);
struct spatial_ok : spatial_no_finish {
  float finish(float a, std::int32_t n) const { return a / static_cast<float>(n); }
};
static_assert(kvp::SpatialAggregator<spatial_ok> && kvp::Aggregator<agg::then<temporal_ok, spatial_ok>>);

// Redundancy: needs the static `pairs` and the parameters.
struct redundancy_no_pairs {
  float theta = 0.5f, tau = 1.0f, eps = 1e-8f;
  float combine(float s, float r) const { return s - r; }
};
static_assert(!kvp::Redundancy<redundancy_no_pairs>);
struct redundancy_ok : redundancy_no_pairs {
  static constexpr kvp::redundancy::scope pairs = kvp::redundancy::scope::full;
};
static_assert(kvp::Redundancy<redundancy_ok>);
struct redundancy_no_tau {
  static constexpr kvp::redundancy::scope pairs = kvp::redundancy::scope::full;
  float theta = 0.5f, eps = 1e-8f;
  float combine(float s, float r) const { return s - r; }
};
static_assert(!kvp::Redundancy<redundancy_no_tau>);
struct redundancy_with_vector : redundancy_ok {
  std::string tag;
};
static_assert(!kvp::Redundancy<redundancy_with_vector>);

// A pipeline only accepts conforming stages.
template <class S, class A, class R, class Sel, class L>
concept makes_pipeline = requires { typename kvp::pipeline<S, A, R, Sel, L>; };
static_assert(makes_pipeline<none, none, none, none, none>);
static_assert(makes_pipeline<attn_ok, agg::then<temporal_ok, spatial_ok>, redundancy_ok, good_selector, none>);
static_assert(!makes_pipeline<int, none, none, none, none>);
static_assert(!makes_pipeline<none, none, none, no_keep_count, none>);
static_assert(!makes_pipeline<none, none, none, none, copy_ctor_layout>);

}  // namespace

TEST_CASE("concepts: user-written policies compose and run on the host executor") {
  // A pipeline of the test's own conforming types runs; the static_asserts above are the test.
  kvp::pipeline<kvp_test::first_element_scorer, none, none, good_selector, kvp::layout::compact> p;
  p.protect = {.window = 0, .sinks = 0};
  CHECK(sizeof(p) > 0);
}
