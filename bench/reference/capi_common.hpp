// What both kvp_capi libraries share: the views a kvp_capi_shape (or a
// kvp_capi_per_head_shape) describes, the result words inside the caller's workspace,
// and the error guard.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"  // first: error.hpp sets FMT_USE_CONSTEXPR before fmt is seen
#include "kvpolicy/exec/device_status.hpp"

#include "kvp_capi.h"

namespace kvp_capi {

static_assert(KVP_CAPI_STATUS_WORDS == kvp::status_words,
              "kvp_capi.h's KVP_CAPI_STATUS_WORDS must be the words the libraries copy (kvp::status_words)");
static_assert(sizeof(kvp::batch_item) == 5 * sizeof(std::int32_t) && alignof(kvp::batch_item) == alignof(std::int32_t),
              "kvp::batch_item is the 5 int32 columns kvp_capi.h names");
static_assert(static_cast<int>(kvp::dtype::f16) == 0 && static_cast<int>(kvp::dtype::bf16) == 1 &&
              static_cast<int>(kvp::dtype::f32) == 2, "dtype codes are kvp::dtype's values");

inline thread_local std::string last_error;

inline std::size_t round_up(std::size_t x) { return (x + 255) / 256 * 256; }

// Columns of the caller's items (kvp_capi.h): KARA's carry window_begin, the others'
// stop at history_tokens, as before window_begin existed.
inline int item_columns(const kvp_capi_shape& s) { return s.policy == KVP_CAPI_KARA ? 5 : 4; }

// The caller's items as kvp::batch_item (host memory), window_begin 0 where not given.
inline std::vector<kvp::batch_item> host_items(const kvp_capi_shape& s, const std::int32_t* items) {
  std::vector<kvp::batch_item> out(static_cast<std::size_t>(s.num_items));
  const int cols = item_columns(s);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::int32_t* r = items + i * cols;
    out[i] = {r[0], r[1], r[2], r[3], cols > 4 ? r[4] : 0};
  }
  return out;
}

// The result arrays, at the start of the caller's workspace; the executor's own
// workspace (CUDA) follows at `executor`.
struct ws_layout {
  std::size_t status = 0, new_lengths = 0, released_counts = 0, released_blocks = 0;
  std::size_t items = 0;  // the items widened to kvp::batch_item (CUDA, 4-column policies)
  std::size_t executor = 0;
};

inline ws_layout layout_of(const kvp_capi_shape& s) {
  const std::size_t blocks = s.block_size > 0 ? std::size_t((s.max_tokens + s.block_size - 1) / s.block_size) : 0;
  ws_layout w;
  std::size_t at = 0;
  w.status = at;
  at += round_up(kvp::status_words * sizeof(std::int32_t));
  w.new_lengths = at;
  at += round_up(std::size_t(s.num_items) * sizeof(std::int32_t));
  w.released_counts = at;
  at += round_up(std::size_t(s.num_items) * sizeof(std::int32_t));
  w.released_blocks = at;
  at += round_up(std::size_t(s.num_items) * blocks * sizeof(std::int32_t));
  w.items = at;
  at += round_up(std::size_t(s.num_items) * sizeof(kvp::batch_item));
  w.executor = at;
  return w;
}

template <class T>
T* at(void* ws, std::size_t offset) {
  return reinterpret_cast<T*>(static_cast<std::byte*>(ws) + offset);
}
template <class T>
const T* at(const void* ws, std::size_t offset) {
  return reinterpret_cast<const T*>(static_cast<const std::byte*>(ws) + offset);
}

struct views {
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;
};

inline views make_views(const kvp_capi_shape& s, void* kv, const void* q, float* f, const std::int32_t* table,
                        const std::int32_t* lengths) {
  kvp::require(s.dtype >= 0 && s.dtype <= 2, "shape.dtype", "is {}; 0 f16, 1 bf16, 2 f32", s.dtype);
  kvp::require(s.num_items >= 0, "shape.num_items", "is {}; must not be negative", s.num_items);
  const auto type = static_cast<kvp::dtype>(s.dtype);
  const kvp::cache_shape cs{s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, type};
  const kvp::sequence_table seqs{kvp::block_table_view::dense(table, s.max_blocks_per_seq), lengths, s.num_seqs};
  views v;
  v.cache = kvp::layouts::nano_vllm(kv, cs, seqs);
  v.queries = kvp::query_window_view::contiguous(q, s.num_layers, s.query_slots, s.query_window, s.num_q_heads,
                                                 s.head_dim, type);
  v.scores = kvp::score_view::contiguous(f, s.num_blocks, s.block_size, s.num_kv_heads);
  return v;
}

// ---- The per-head entry points (kvp_capi_per_head_shape; kvp_capi.h) ----

// Columns of a per-head item: (seq, blocks_to_free, logical_length), then one count per
// layer with a per-layer budget.
inline int per_head_item_columns(const kvp_capi_per_head_shape& s) {
  return s.per_layer_budget ? 3 + s.num_layers : 3;
}

inline kvp::select::head_adaptive_blocks per_head_selector(const kvp_capi_per_head_shape& s) {
  kvp::require(s.per_layer_budget == 0 || s.per_layer_budget == 1, "shape.per_layer_budget",
               "is {}; 0 one count per sequence, 1 one count per layer", s.per_layer_budget);
  kvp::select::head_adaptive_blocks sel;
  sel.protected_window = s.protected_window;
  sel.sinks = s.sinks;
  sel.budget = s.per_layer_budget ? kvp::select::block_budget::layer : kvp::select::block_budget::sequence;
  return sel;
}

// KV-Compress's unified cache: K and V `[num_blocks, b, d]`, one pool for every layer;
// metric and positions `[num_blocks, b]`; tables and lengths dense, layer first.
inline kvp::per_head_kv_view make_per_head_view(const kvp_capi_per_head_shape& s, void* k, void* v, float* metric,
                                                std::int32_t* positions, const std::int32_t* tables,
                                                const std::int32_t* lengths) {
  kvp::require(s.dtype >= 0 && s.dtype <= 2, "shape.dtype", "is {}; 0 f16, 1 bf16, 2 f32", s.dtype);
  kvp::require(s.num_items >= 0, "shape.num_items", "is {}; must not be negative", s.num_items);
  kvp::per_head_kv_view c;
  c.num_layers = s.num_layers;
  c.num_blocks = s.num_blocks;
  c.block_size = s.block_size;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.num_seqs = s.num_seqs;
  c.max_blocks = s.max_blocks;
  c.type = static_cast<kvp::dtype>(s.dtype);
  c.shared_pool = true;
  c.k = kvp::layer_bases{k, 0, nullptr, 0};
  c.v = kvp::layer_bases{v, 0, nullptr, 0};
  c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(s.block_size, s.head_dim);
  c.table = kvp::per_head_array::dense(tables, s.num_seqs, s.num_kv_heads, s.max_blocks);
  c.lengths = kvp::per_head_array::dense(lengths, s.num_seqs, s.num_kv_heads, 1);
  if (positions) c.positions = kvp::per_slot_positions::shared(positions, s.block_size);
  if (metric) c.metric = kvp::per_slot_metric::shared(metric, s.block_size);
  return c;
}

// The caller's items (host memory) as kvp::per_head_item; per_layer points into `items`.
inline std::vector<kvp::per_head_item> host_per_head_items(const kvp_capi_per_head_shape& s,
                                                           const std::int64_t* items) {
  kvp::require(items != nullptr || s.num_items == 0, "items", "is a null pointer");
  const int cols = per_head_item_columns(s);
  std::vector<kvp::per_head_item> out(static_cast<std::size_t>(s.num_items));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::int64_t* r = items + i * static_cast<std::size_t>(cols);
    kvp::require(r[0] >= INT32_MIN && r[0] <= INT32_MAX, kvp::detail::path("items[{}][0] (seq)", i),
                 "is {}; must fit int32", r[0]);
    kvp::require(r[2] >= INT32_MIN && r[2] <= INT32_MAX, kvp::detail::path("items[{}][2] (logical_length)", i),
                 "is {}; must fit int32", r[2]);
    out[i].seq = static_cast<std::int32_t>(r[0]);
    out[i].blocks_to_free = r[1];
    out[i].per_layer = s.per_layer_budget ? r + 3 : nullptr;
    out[i].logical_length = static_cast<std::int32_t>(r[2]);
  }
  return out;
}

inline void require_per_head_out(const kvp_capi_per_head_out* out) {
  kvp::require(out != nullptr, "out", "is a null pointer");
  kvp::require(out->status && out->new_lengths && out->freed_counts && out->freed_blocks, "out",
               "needs status, new_lengths, freed_counts and freed_blocks (a null pointer was given)");
}

// The CUDA library's workspace: the converted items, then the executor's workspace.
struct per_head_ws_layout {
  std::size_t items = 0, executor = 0;
};
inline per_head_ws_layout per_head_layout_of(const kvp_capi_per_head_shape& s) {
  per_head_ws_layout w;
  w.items = 0;
  w.executor = round_up(std::size_t(s.num_items > 0 ? s.num_items : 0) * sizeof(kvp::per_head_item));
  return w;
}

// Calls fn(preset) with the policy the shape names.
template <class Fn>
auto with_policy(const kvp_capi_shape& s, Fn&& fn) {
  kvp::require(s.policy >= KVP_CAPI_ZIPAGE && s.policy <= KVP_CAPI_KARA, "shape.policy",
               "is {}; 0 zipage, 1 snapkv, 2 hard_kv, 3 kara", s.policy);
  if (s.policy == KVP_CAPI_SNAPKV) return fn(kvp::presets::snapkv{});
  if (s.policy == KVP_CAPI_HARD_KV) return fn(kvp::presets::hard_kv{});
  if (s.policy == KVP_CAPI_KARA) return fn(kvp::presets::kara{});
  return fn(kvp::presets::zipage{});
}

// hard_kv's calibration options as kvp_capi.h spells them.
inline kvp_capi_calibration calibration_defaults() {
  const kvp::select::calibrated_top_p d = kvp::presets::hard_kv{}.select;
  return {d.p,          d.tolerance, d.t_min,         d.t_max,
          static_cast<std::int32_t>(d.search), d.iterations, d.steps, d.learning_rate,
          d.t_start,    d.upper,     d.lower,         d.union_top_k ? 1 : 0,
          static_cast<std::int32_t>(d.scope),  d.divide_by_row_max ? 1 : 0};
}

// The selector the options name; the enums and flags checked here (the selector's
// validate checks the rest, naming pipeline.select.<field>).
inline kvp::select::calibrated_top_p calibrated_of(const kvp_capi_calibration& c) {
  kvp::require(c.search == 0 || c.search == 1, "calibration.search", "is {}; 0 bisection, 1 first order", c.search);
  kvp::require(c.scope == 0 || c.scope == 1, "calibration.scope", "is {}; 0 whole row, 1 unprotected only", c.scope);
  kvp::require(c.union_top_k == 0 || c.union_top_k == 1, "calibration.union_top_k", "is {}; 0 or 1", c.union_top_k);
  kvp::require(c.divide_by_row_max == 0 || c.divide_by_row_max == 1, "calibration.divide_by_row_max",
               "is {}; 0 or 1", c.divide_by_row_max);
  kvp::select::calibrated_top_p sel = kvp::presets::hard_kv{}.select;
  sel.p = c.p;
  sel.tolerance = c.tolerance;
  sel.t_min = c.t_min;
  sel.t_max = c.t_max;
  sel.search = static_cast<kvp::select::temperature_search>(c.search);
  sel.iterations = c.iterations;
  sel.steps = c.steps;
  sel.learning_rate = c.learning_rate;
  sel.t_start = c.t_start;
  sel.upper = c.upper;
  sel.lower = c.lower;
  sel.union_top_k = c.union_top_k != 0;
  sel.scope = static_cast<kvp::select::calibration_scope>(c.scope);
  sel.divide_by_row_max = c.divide_by_row_max != 0;
  return sel;
}

// with_policy, hard_kv's selector set from `calibration` where one is given.
template <class Fn>
auto with_policy(const kvp_capi_shape& s, const kvp_capi_calibration* calibration, Fn&& fn) {
  if (calibration == nullptr) return with_policy(s, fn);
  kvp::require(s.policy == KVP_CAPI_HARD_KV, "calibration", "is given with shape.policy {}; only KVP_CAPI_HARD_KV (2) reads it",
               s.policy);
  kvp::presets::hard_kv p;
  p.select = calibrated_of(*calibration);
  return fn(p);
}

// Runs fn (returning 0 or an error code) and turns exceptions into codes + last_error.
template <class Fn>
int guarded(Fn&& fn) {
  try {
    const int rc = fn();
    if (rc == KVP_CAPI_OK) last_error.clear();
    return rc;
  } catch (const kvp::error& e) {
    last_error = e.what();
    return KVP_CAPI_EINVAL;
  } catch (const std::exception& e) {
    last_error = e.what();
    return KVP_CAPI_EOTHER;
  } catch (...) {
    last_error = "unknown exception";
    return KVP_CAPI_EOTHER;
  }
}

// A stand-in for pointers when only sizes are asked: the shape checks test them for
// null and alignment but never read through them.
inline void* dummy() { return reinterpret_cast<void*>(std::uintptr_t{1} << 12); }

}  // namespace kvp_capi
