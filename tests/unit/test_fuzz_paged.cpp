// Property-based fuzzing of the paged cache's validation (issue 47, item 7): random
// valid calls (layouts, dtypes, dense and CSR tables, lengths, items, layer ranges,
// shared prefixes with targets, the engine's sharing marks, live masks, Kara windows)
// over five pipelines, each then either run as it is or broken by one mutation.
//   - A broken call throws kvp::error naming the broken part (one of the fields the
//     mutation allows), and no byte of K, V, F, positions, live bytes, queries, table
//     or lengths changes.
//   - A valid call compresses; nothing outside its sequences' blocks (and targets) in
//     its layers is written, shared-prefix blocks and the tokens before a Kara window
//     are not written, the protected window and sinks are kept, each kept token's K
//     and V bytes and position arrive unchanged at its new slot, in order for the
//     order-keeping layouts, and the live bytes say which slots hold kept tokens.
// Bounds and replay: support/fuzz.hpp. In the CUDA build (kvpolicy_gpu_unit_tests)
// valid calls run on both executors through kvp_test::run, and broken ones are also
// given to the CUDA executor over a device copy: the same refusal, nothing written.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <type_traits>
#include <string>
#include <vector>

#include "support/fuzz.hpp"
#include "support/test_cache.hpp"

namespace {

using kvp::none;
using kvp_test::fuzz_rng;
using kvp_test::i32;
using kvp_test::i64;
using kvp_test::kv_kind;
using kvp_test::test_cache;

// ---- the pipelines ------------------------------------------------------------------

// Small windows, so that short random sequences take them.
enum class policy { zipage, fill, kara, cautious, streaming };
constexpr policy all_policies[] = {policy::zipage, policy::fill, policy::kara, policy::cautious, policy::streaming};
const char* policy_name(policy p) {
  switch (p) {
    case policy::zipage: return "zipage (attention, F, pool, lightning, top-k, compact)";
    case policy::fill: return "snapkv with layout::fill";
    case policy::kara: return "kara (bidirectional window, token2chunk, window_compact)";
    case policy::cautious: return "hard_kv with a live view (cautious update)";
    case policy::streaming: return "streaming_llm (no scorer)";
  }
  return "?";
}
constexpr i32 query_window = 8;  // the fixture's query slots: at least every scorer window below

using fill_pipeline =
    kvp::pipeline<kvp::scorer::window_attention, kvp::aggregate::pool, none, kvp::select::top_k, kvp::layout::fill>;
using kara_pipeline = kvp::pipeline<kvp::scorer::bidirectional_window, none, none, kvp::select::token2chunk,
                                    kvp::layout::window_compact>;

// Calls f with the policy's pipeline, its windows drawn from rng.
template <class F>
void with_pipeline(policy which, fuzz_rng& rng, F&& f) {
  const i32 w = rng.between(2, 4), sinks = rng.between(0, 1);
  switch (which) {
    case policy::zipage: {
      kvp::presets::zipage p;
      p.scorer.window = w;
      p.aggregate.second.kernel = 3;
      p.protect = {.window = w, .sinks = sinks};
      return f(p);
    }
    case policy::fill: {
      fill_pipeline p;
      p.scorer = {.window = w};
      p.aggregate = {.mode = kvp::aggregate::pool_mode::max, .kernel = 3};
      p.protect = {.window = w, .sinks = sinks};
      return f(p);
    }
    case policy::kara: {
      kara_pipeline p;
      p.scorer = {.window = rng.between(4, query_window), .buffer = rng.between(1, 2)};
      p.select = {.gamma = 3, .alpha = 2};
      p.protect = {.window = 0, .sinks = 0};
      return f(p);
    }
    case policy::cautious: {
      kvp::presets::hard_kv p;
      p.scorer.window = w;
      p.aggregate.kernel = 3;
      p.protect = {.window = w, .sinks = sinks};
      return f(p);
    }
    case policy::streaming: {
      kvp::presets::streaming_llm p;
      p.select.sinks = sinks;
      p.protect = {.window = w, .sinks = sinks};
      return f(p);
    }
  }
}

// ---- one call -----------------------------------------------------------------------

// The arrays of a call besides the fixture's: the engine's sharing marks and the
// shared prefixes' targets (empty: none).
struct side_arrays {
  std::vector<i32> refcounts;
  std::vector<std::uint32_t> bitmask;
  std::vector<i32> target_indptr, target_blocks;
};

// What an executor is handed; the fixture's views, or the device copy's.
template <class P>
struct call {
  P p;
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;
  std::vector<kvp::batch_item> items;
  i32 layer_begin = 0, layer_count = 0;
  kvp::prefix_targets targets{};
};

// A valid call: the fixture, the items and the side arrays.
struct paged_case {
  std::optional<test_cache> tc;
  std::vector<kvp::batch_item> items;
  i32 layer_begin = 0, layer_count = 0;
  side_arrays side;
  std::vector<i32> shared;  // per item: leading blocks it only reads (its targets' count)
  std::string text;         // what was drawn, for a failure's message
};

template <class P>
paged_case make_case(const P& p, policy which, fuzz_rng& rng) {
  paged_case c;
  const bool windowed = which == policy::kara, targets_ok = which != policy::fill && !windowed;
  kvp_test::cache_config cfg;
  cfg.layout = kvp_test::all_layouts[static_cast<std::size_t>(rng.between(0, kvp_test::layout_count - 1))];
  cfg.type = kvp_test::all_dtypes[static_cast<std::size_t>(rng.between(0, 2))];
  cfg.layers = rng.between(1, 3);
  cfg.block_size = std::vector<i32>{1, 2, 4, 8}[static_cast<std::size_t>(rng.between(0, 3))];
  cfg.kv_heads = rng.between(1, 2);
  cfg.q_heads = cfg.kv_heads * rng.between(1, 2);
  cfg.head_dim = rng.chance(0.5) ? 8 : 16;  // rows of 16 bytes or more: the CUDA executor's too
  cfg.csr = rng.chance(0.5);
  cfg.window = query_window;
  cfg.spare_blocks = rng.between(0, 4);
  cfg.capacity_blocks = rng.chance(0.3) ? rng.between(1, 12) : 0;
  cfg.live = which == policy::cautious;
  cfg.seed = static_cast<std::uint32_t>(rng.engine());
  const i32 S = rng.between(1, 4);
  const i32 min_len = std::max(p.protect.window + p.protect.sinks, kvp::scorer_window(p.scorer)) + 2;
  // Batch sequences (a random subset, in random order) and the others.
  std::vector<i32> order(static_cast<std::size_t>(S));
  for (i32 s = 0; s < S; ++s) order[s] = s;
  std::shuffle(order.begin(), order.end(), rng.engine);
  const i32 n = rng.between(1, S);
  std::vector<bool> in_batch(static_cast<std::size_t>(S), false);
  for (i32 i = 0; i < n; ++i) in_batch[order[i]] = true;
  cfg.lengths.clear();
  for (i32 s = 0; s < S; ++s)
    cfg.lengths.push_back(in_batch[s] ? rng.between(min_len, min_len + 30) : rng.between(0, 30));
  cfg.slots = S + rng.between(0, 1);
  c.tc.emplace(cfg);
  test_cache& tc = *c.tc;
  const i32 b = tc.block_size(), L = tc.num_layers();

  c.layer_begin = rng.between(0, L - 1);
  c.layer_count = rng.chance(0.5) ? 0 : rng.between(1, L - c.layer_begin);
  std::vector<i32> free_blocks;
  for (i32 id = 0; id < tc.num_blocks(); ++id)
    if (tc.owner(id).first < 0) free_blocks.push_back(id);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng.engine);
  std::set<i32> marked;  // blocks the engine marks shared
  for (i32 i = 0; i < n; ++i) {
    const i32 seq = order[i], T = tc.length(seq);
    kvp::batch_item it{.seq = seq, .query_slot = rng.between(0, tc.slots() - 1)};
    if (windowed) {
      const i32 room = (T - kvp::scorer_window(p.scorer)) / b;  // whole blocks before a window that still fits
      it.window_begin = rng.between(0, std::max(room, 0)) * b;
    }
    const i32 Tw = T - it.window_begin;
    const i32 must = kvp::protected_count(Tw, kvp::candidate_end(p.scorer, Tw), p.protect.sinks, p.protect.window);
    it.budget = which == policy::kara ? rng.between(1, Tw) : rng.between(std::max(must, 1), Tw);
    it.history_tokens = rng.chance(0.5) ? 0 : rng.between(0, Tw);
    // A shared prefix: its blocks marked by the engine, or held by a sequence outside
    // the batch too; kept tokens go to free target blocks.
    i32 shared = 0;
    const i32 blocks = (T + b - 1) / b;
    if (targets_ok && rng.chance(0.3) && !free_blocks.empty())
      shared = rng.between(1, std::min<i32>(blocks, static_cast<i32>(free_blocks.size())));
    c.shared.push_back(shared);
    for (i32 k = 0; k < shared; ++k) {
      marked.insert(tc.block(seq, k));
      c.side.target_blocks.push_back(free_blocks.back());
      free_blocks.pop_back();
    }
    c.items.push_back(it);
  }
  const bool any_targets = std::any_of(c.shared.begin(), c.shared.end(), [](i32 k) { return k > 0; });
  if (any_targets) {
    c.side.target_indptr.push_back(0);
    for (i32 k : c.shared) c.side.target_indptr.push_back(c.side.target_indptr.back() + k);
    // A sequence outside the batch with blocks reads an item's first shared block.
    for (i32 s = n; s < S; ++s) {
      const i32 other = order[s];
      if (tc.length(other) == 0) continue;
      for (std::size_t i = 0; i < c.items.size(); ++i)
        if (c.shared[i] > 0 && rng.chance(0.5)) {
          tc.raw_table()[tc.table_index(other, 0)] = tc.block(c.items[i].seq, 0);
          break;
        }
    }
  }
  // The engine's marks: the shared prefixes, and random blocks nobody in the batch writes.
  std::set<i32> written;
  for (std::size_t i = 0; i < c.items.size(); ++i)
    for (std::size_t k = static_cast<std::size_t>(c.shared[i]); k < tc.blocks(c.items[i].seq).size(); ++k)
      written.insert(tc.blocks(c.items[i].seq)[k]);
  for (i32 id = 0; id < tc.num_blocks(); ++id)
    if (!written.count(id) && rng.chance(0.2)) marked.insert(id);
  for (i32 t : c.side.target_blocks) marked.erase(t);
  const i32 mark_kind = marked.empty() && !any_targets ? rng.between(0, 2) : rng.between(1, 2);
  if (mark_kind == 1) {
    c.side.refcounts.assign(static_cast<std::size_t>(tc.num_blocks()), 1);
    for (i32 id : marked) c.side.refcounts[id] = rng.between(2, 3);
  } else if (mark_kind == 2) {
    c.side.bitmask.assign(static_cast<std::size_t>(tc.num_blocks() + 31) / 32, 0u);
    for (i32 id : marked) c.side.bitmask[id / 32] |= 1u << (id % 32);
  }
  // Cautious update: some tokens already dropped by some heads (never all of a row).
  if (which == policy::cautious)
    for (auto& x : tc.raw_live())
      if (x && rng.chance(0.15)) x = 0;

  c.text = std::string(tc.describe()) + " layers [" + std::to_string(c.layer_begin) + " +" +
           std::to_string(c.layer_count) + "] items";
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    const auto& it = c.items[i];
    c.text += " {seq " + std::to_string(it.seq) + " slot " + std::to_string(it.query_slot) + " budget " +
              std::to_string(it.budget) + " history " + std::to_string(it.history_tokens) + " window_begin " +
              std::to_string(it.window_begin) + " shared " + std::to_string(c.shared[i]) + "}";
  }
  c.text += mark_kind == 1 ? " refcounts" : mark_kind == 2 ? " bitmask" : "";
  return c;
}

template <class P>
call<P> host_call(const P& p, paged_case& c) {
  call<P> k{p, c.tc->view(), c.tc->queries(), c.tc->scores(), c.items, c.layer_begin, c.layer_count};
  k.cache.sharing = {c.side.refcounts.empty() ? nullptr : c.side.refcounts.data(),
                     c.side.bitmask.empty() ? nullptr : c.side.bitmask.data()};
  if (!c.side.target_indptr.empty()) k.targets = {c.side.target_indptr.data(), c.side.target_blocks.data()};
  return k;
}

// ---- mutations ------------------------------------------------------------------------

// One way to break a call: edits to the arrays (done at once), and `tweak`, applied to
// whichever call an executor gets (host or device views). `fields`: what the error may
// name. `host_only`: the device cannot be handed this (a host array of layer pointers).
template <class P>
struct mutation {
  std::string what;
  std::vector<std::string> fields;
  std::function<void(call<P>&)> tweak = [](call<P>&) {};
  bool host_only = false;
};

std::string entry(i32 seq, i32 i) { return "cache.table[seq " + std::to_string(seq) + "][" + std::to_string(i) + "]"; }
std::string item_field(std::size_t i, const char* name) { return "batch[" + std::to_string(i) + "]." + name; }

// A random mutation that applies to this case and pipeline (tries until one does).
template <class P>
mutation<P> mutate(const P& p, policy which, paged_case& c, fuzz_rng& rng) {
  test_cache& tc = *c.tc;
  const i32 S = tc.num_seqs(), b = tc.block_size(), NB = tc.num_blocks();
  const auto n = c.items.size();
  constexpr bool attention = kvp::AttentionScorer<typename P::scorer_type>;
  constexpr bool with_f = kvp::uses_score_cache<typename P::aggregate_type>();
  const bool windowed = which == policy::kara;
  const auto held = [&](i32 seq) { return (tc.length(seq) + b - 1) / b; };
  const auto item_of = [&](i32 seq) -> int {
    for (std::size_t i = 0; i < n; ++i)
      if (c.items[i].seq == seq) return static_cast<int>(i);
    return -1;
  };
  for (;;) {
    using M = mutation<P>;
    const std::size_t i = static_cast<std::size_t>(rng.between(0, static_cast<int>(n) - 1));
    kvp::batch_item& it = c.items[i];
    const i32 T = tc.length(it.seq), Tw = T - it.window_begin;
    const i32 seq = rng.between(0, S - 1);
    switch (rng.between(0, 33)) {
      case 0: {  // a block id out of range, or negative, in any sequence's used entries
        if (held(seq) == 0) continue;
        const i32 k = rng.between(0, held(seq) - 1);
        const i32 bad = rng.chance(0.5) ? NB + rng.between(0, 4) : -rng.between(1, 5);
        tc.raw_table()[tc.table_index(seq, k)] = bad;
        return M{"block id " + std::to_string(bad), {entry(seq, k)}};
      }
      case 1: {  // a batch sequence's block held twice: by itself, another batch sequence or one outside
        const i32 other = rng.between(0, S - 1);
        if (held(it.seq) == 0 || held(other) == 0) continue;
        const i32 k = rng.between(0, held(it.seq) - 1), j = rng.between(0, held(other) - 1);
        if (other == it.seq && k == j) continue;
        const i32 id = tc.raw_table()[tc.table_index(it.seq, k)];
        if (tc.raw_table()[tc.table_index(other, j)] == id) continue;
        // Both read-only (shared prefixes of two items, or the prefix before two windows) is allowed.
        const int oi = item_of(other);
        const auto read_only = [&](int item, i32 blk) {
          return item >= 0 && (blk < c.shared[item] || blk * b < c.items[item].window_begin);
        };
        if (read_only(static_cast<int>(i), k) && (oi < 0 || read_only(oi, j))) continue;
        tc.raw_table()[tc.table_index(other, j)] = id;
        // A target's first claim may come first for an item whose prefix is given away.
        return M{"block " + std::to_string(id) + " of seq " + std::to_string(it.seq) + " also at seq " +
                     std::to_string(other) + " entry " + std::to_string(j),
                 {entry(it.seq, k), entry(other, j)}};
      }
      case 2: {  // the engine marks a block a batch item writes as shared
        std::vector<i32> writable;
        for (i32 k = c.shared[i]; k < held(it.seq); ++k)
          if (k * b >= it.window_begin) writable.push_back(k);
        if (writable.empty()) continue;
        const i32 k = rng.pick(writable), id = tc.raw_table()[tc.table_index(it.seq, k)];
        if (!c.side.refcounts.empty()) c.side.refcounts[id] = 2;
        else if (!c.side.bitmask.empty()) c.side.bitmask[id / 32] |= 1u << (id % 32);
        else {
          c.side.refcounts.assign(static_cast<std::size_t>(NB), 0);
          c.side.refcounts[id] = 5;
        }
        return M{"block " + std::to_string(id) + " marked shared", {entry(it.seq, k)}};
      }
      case 3: {  // a length past the table's room, or negative
        const i64 cap = c.tc->config().csr ? tc.raw_indptr()[seq + 1] - tc.raw_indptr()[seq]
                                            : static_cast<i64>(tc.raw_table().size()) / S;
        const i32 bad = rng.chance(0.7) ? static_cast<i32>(cap * b) + rng.between(1, 2 * b) : -rng.between(1, 3);
        tc.raw_lengths()[seq] = bad;
        // A batch item's window_begin is checked against its length first.
        std::vector<std::string> f{"cache.lengths[" + std::to_string(seq) + "]"};
        if (windowed && item_of(seq) >= 0) f.push_back(item_field(static_cast<std::size_t>(item_of(seq)), "window_begin"));
        return M{"length " + std::to_string(bad), f};
      }
      case 4: return M{"budget past the length", {item_field(i, "budget")}, [i, Tw](call<P>& k) { k.items[i].budget = Tw + 1; }};
      case 5: return M{"budget not positive", {item_field(i, "budget")}, [i](call<P>& k) { k.items[i].budget = 0; }};
      case 6: {  // budget under the protected count
        if constexpr (kvp::BudgetSelector<typename P::select_type> &&
                      !kvp::ScoreDependentSelector<typename P::select_type>) {
          const i32 must = kvp::protected_count(Tw, kvp::candidate_end(p.scorer, Tw), p.protect.sinks, p.protect.window);
          if (must < 2) continue;
          return M{"budget under the protected " + std::to_string(must), {item_field(i, "budget")},
                   [i, must](call<P>& k) { k.items[i].budget = must - 1; }};
        }
        continue;
      }
      case 7: {
        const i32 h = rng.chance(0.5) ? -1 : Tw + 1;
        return M{"history " + std::to_string(h), {item_field(i, "history_tokens")},
                 [i, h](call<P>& k) { k.items[i].history_tokens = h; }};
      }
      case 8: {
        const i32 s = rng.chance(0.5) ? -1 : S + rng.between(0, 2);
        return M{"seq " + std::to_string(s), {item_field(i, "seq")}, [i, s](call<P>& k) { k.items[i].seq = s; }};
      }
      case 9: {  // the same sequence twice
        if (n < 2) continue;
        const std::size_t j = (i + 1) % n;
        std::vector<std::string> f{item_field(std::max(i, j), "seq")};
        if (windowed) f.push_back(item_field(std::max(i, j), "window_begin"));  // checked against the other's length first
        return M{"seq named twice", f,
                 [i, j](call<P>& k) { k.items[std::max(i, j)].seq = k.items[std::min(i, j)].seq; }};
      }
      case 10: {
        if (!attention) continue;
        const i32 s = rng.chance(0.5) ? -1 : tc.slots() + rng.between(0, 2);
        return M{"query slot " + std::to_string(s), {item_field(i, "query_slot")},
                 [i, s](call<P>& k) { k.items[i].query_slot = s; }};
      }
      case 11: {  // a window where the layout takes none, or a bad one where it does
        i32 wb = 0;
        if (!windowed) wb = b * rng.between(1, 3);
        else if (b > 1 && rng.chance(0.4)) wb = it.window_begin + rng.between(1, b - 1);
        else wb = rng.chance(0.5) ? -b : ((T + b - 1) / b) * b + b * rng.between(0, 1);
        return M{"window_begin " + std::to_string(wb), {item_field(i, "window_begin")},
                 [i, wb](call<P>& k) { k.items[i].window_begin = wb; }};
      }
      case 12: {  // the protect window past a sequence (the budget still fits)
        if (windowed) continue;
        // An item before it may first keep too few for the wider window: its budget is named.
        std::vector<std::string> f{"pipeline.protect.window"};
        for (std::size_t j = 0; j < n; ++j) f.push_back(item_field(j, "budget"));
        return M{"protect window past the sequence", f,
                 [T](call<P>& k) { k.p.protect.window = T + 1; }};
      }
      case 13: {
        const i32 l = rng.chance(0.5) ? -1 : tc.num_layers();
        return M{"layer_begin " + std::to_string(l), {"batch.layer_begin"}, [l](call<P>& k) { k.layer_begin = l; }};
      }
      case 14: return M{"layer_count", {"batch.layer_count"}, [L = tc.num_layers()](call<P>& k) {
                          k.layer_count = L - k.layer_begin + 1;
                        }};
      case 15: return M{"null lengths", {"cache.lengths"}, [](call<P>& k) { k.cache.lengths = nullptr; }};
      case 16: return M{"null table", {"cache.table.indices"}, [](call<P>& k) { k.cache.table.indices = nullptr; }};
      case 17: return M{"null K", {"cache.k"}, [](call<P>& k) { k.cache.k = {}; }};
      case 18: return M{"null V", {"cache.v"}, [](call<P>& k) { k.cache.v = {}; }};
      case 19: {
        if (!attention) continue;
        return M{"null queries", {"queries.base"}, [](call<P>& k) { k.queries.base = nullptr; }};
      }
      case 20: {
        if (!with_f) continue;
        return M{"null F", {"scores.base"}, [](call<P>& k) { k.scores = {}; }};
      }
      case 21: {  // K or V strides that break a row, a block or the rows' nesting
        const bool v = rng.chance(0.5);
        const std::string base = v ? "cache.v_stride" : "cache.k_stride";
        const i32 d = tc.head_dim(), pick = rng.between(0, 3);
        const i64 blk = i64{b} * tc.kv_heads() * d;
        return M{base + " broken", {base + (pick == 0 ? ".dim" : pick == 1 ? ".head" : pick == 2 ? ".token" : ".block"), base},
                 [v, pick, d, blk](call<P>& k) {
                   kvp::kv_strides& s = v ? k.cache.v_stride : k.cache.k_stride;
                   if (pick == 0) s.dim = 2;
                   else if (pick == 1) s.head = d - 1;
                   else if (pick == 2) s.token = d / 2;
                   else s.block = blk - 1;
                 }};
      }
      case 22: {  // token and head strides equal with two heads and two tokens: rows overlap
        if (tc.kv_heads() < 2 || b < 2) continue;
        return M{"overlapping rows", {"cache.k_stride"}, [d = tc.head_dim()](call<P>& k) {
                   k.cache.k_stride.token = d;
                   k.cache.k_stride.head = d;
                 }};
      }
      case 23: {  // a layer's base one byte off its element's alignment
        const bool v = rng.chance(0.5);
        const std::string f = std::string(v ? "cache.v" : "cache.k") + " layer " + std::to_string(c.layer_begin);
        const bool by_table = (v ? c.tc->view().v : c.tc->view().k).table != nullptr;
        return M{"misaligned", {f},
                 [v](call<P>& k) {
                   kvp::layer_bases& lb = v ? k.cache.v : k.cache.k;
                   if (lb.base) {
                     lb.base = static_cast<std::byte*>(lb.base) + 1;
                     return;
                   }
                   static thread_local std::vector<void*> layers;  // a host copy of the layer table
                   layers.assign(lb.table, lb.table + k.cache.num_layers);
                   auto& at = layers[static_cast<std::size_t>(k.layer_begin)];
                   at = static_cast<std::byte*>(at) + 1;
                   lb.table = layers.data();
                 },
                 /*host_only=*/by_table};
      }
      case 24: {  // the queries' shape against the cache and the scorer
        if (!attention) continue;
        switch (rng.between(0, 4)) {
          case 0: return M{"queries.head_dim", {"queries.head_dim"}, [](call<P>& k) { k.queries.head_dim += 1; }};
          case 1:
            return M{"queries.num_q_heads", {"queries.num_q_heads"},
                     [](call<P>& k) { k.queries.num_q_heads = k.cache.num_kv_heads == 1 ? 0 : k.cache.num_kv_heads + 1; }};
          case 2: return M{"queries.num_layers", {"queries.num_layers"}, [](call<P>& k) { k.queries.num_layers = 0; }};
          case 3:
            return M{"queries.window", {"queries.window"},
                     [w = kvp::scorer_window(p.scorer)](call<P>& k) { k.queries.window = w - 1; }};
          default: return M{"queries.num_slots", {"queries.num_slots"}, [](call<P>& k) { k.queries.num_slots = 0; }};
        }
      }
      case 25: {  // a cache shape field not positive
        const int f = rng.between(0, 5);
        const char* names[] = {"cache.num_layers", "cache.num_blocks", "cache.block_size",
                               "cache.num_kv_heads", "cache.head_dim", "cache.num_seqs"};
        return M{names[f], {names[f]}, [f, v = -rng.between(0, 1)](call<P>& k) {
                   i32* fields[] = {&k.cache.num_layers, &k.cache.num_blocks, &k.cache.block_size,
                                    &k.cache.num_kv_heads, &k.cache.head_dim, &k.cache.num_seqs};
                   *fields[f] = v;
                 }};
      }
      case 26: {  // fewer blocks than the table names: a used id past the new count
        i32 top = -1;
        for (i32 s = 0; s < S; ++s)
          for (i32 k = 0; k < held(s); ++k) top = std::max(top, tc.raw_table()[tc.table_index(s, k)]);
        if (top <= 0) continue;
        std::vector<std::string> f;
        for (i32 s = 0; s < S; ++s)
          for (i32 k = 0; k < held(s); ++k)
            if (tc.raw_table()[tc.table_index(s, k)] == top) f.push_back(entry(s, k));
        for (std::size_t t = 0; t < c.side.target_blocks.size(); ++t)  // free blocks may lie past it
          if (c.side.target_blocks[t] >= top) f.push_back("batch.targets.blocks[" + std::to_string(t) + "]");
        return M{"num_blocks " + std::to_string(top), f, [top](call<P>& k) { k.cache.num_blocks = top; }};
      }
      case 27: {  // an element type outside the enum
        const bool q = attention && rng.chance(0.5);
        return M{q ? "queries.type" : "cache.type", {q ? "queries.type" : "cache.type"},
                 [q](call<P>& k) { (q ? k.queries.type : k.cache.type) = static_cast<kvp::dtype>(3); }};
      }
      case 28: {  // a dense table's row stride, or a CSR row of negative size
        if (!tc.config().csr)
          return M{"row_stride", {"cache.table.row_stride"}, [](call<P>& k) { k.cache.table.row_stride = 0; }};
        if (held(seq) == 0 && tc.raw_indptr()[seq + 1] == tc.raw_indptr()[seq]) continue;
        tc.raw_indptr()[seq + 1] = tc.raw_indptr()[seq] - 1;
        std::vector<std::string> f{"cache.lengths[" + std::to_string(seq) + "]", "cache.table.indptr*"};
        if (seq + 1 < S) f.push_back("cache.lengths[" + std::to_string(seq + 1) + "]");
        if (windowed && item_of(seq) >= 0) f.push_back(item_field(static_cast<std::size_t>(item_of(seq)), "window_begin"));
        if (windowed && item_of(seq + 1) >= 0)
          f.push_back(item_field(static_cast<std::size_t>(item_of(seq + 1)), "window_begin"));
        f.push_back("cache.table[*");  // the next row starts one entry early: any entry may read wrong,
        f.push_back("batch.targets*");  // or a target
        return M{"CSR row " + std::to_string(seq) + " of negative size", f};
      }
      case 29: {  // the targets: out of range, repeated, held, marked, too many, bad indptr
        if (c.side.target_indptr.empty()) {
          if (which == policy::fill || windowed) {  // layouts that take no targets
            c.side.target_indptr.assign(n + 1, 0);
            c.side.target_blocks = {0};
            return M{"targets with a layout that takes none", {"batch.targets"}};
          }
          continue;
        }
        const i32 t = rng.between(0, static_cast<int>(c.side.target_blocks.size()) - 1);
        const std::string tf = "batch.targets.blocks[" + std::to_string(t) + "]";
        switch (rng.between(0, 3)) {
          case 0:
            c.side.target_blocks[t] = rng.chance(0.5) ? NB : -1;
            return M{"target out of range", {tf}};
          case 1: {  // a block some sequence holds
            std::vector<std::string> f{tf};
            const i32 s = rng.between(0, S - 1);
            if (held(s) == 0) continue;
            const i32 k = rng.between(0, held(s) - 1), id = tc.raw_table()[tc.table_index(s, k)];
            c.side.target_blocks[t] = id;
            // Several entries may hold it (a shared prefix); the first one found is named.
            for (i32 s2 = 0; s2 < S; ++s2)
              for (i32 k2 = 0; k2 < held(s2); ++k2)
                if (tc.raw_table()[tc.table_index(s2, k2)] == id) f.push_back(entry(s2, k2));
            return M{"target held by seq " + std::to_string(s), f};
          }
          case 2: {
            if (c.side.target_blocks.size() < 2) continue;
            const i32 u = (t + 1) % static_cast<i32>(c.side.target_blocks.size());
            c.side.target_blocks[u] = c.side.target_blocks[t];
            return M{"target repeated", {"batch.targets.blocks[" + std::to_string(std::max(t, u)) + "]"}};
          }
          default: {
            const i32 id = c.side.target_blocks[t];
            if (!c.side.refcounts.empty()) c.side.refcounts[id] = 2;
            else if (!c.side.bitmask.empty()) c.side.bitmask[id / 32] |= 1u << (id % 32);
            else continue;
            return M{"target marked shared", {tf}};
          }
        }
      }
      case 30: {  // more targets than an item's blocks
        if (c.side.target_indptr.empty()) continue;
        const i32 extra = held(it.seq) - c.shared[i] + 1;
        for (std::size_t j = i + 1; j < c.side.target_indptr.size(); ++j) c.side.target_indptr[j] += extra;
        for (i32 e = 0; e < extra; ++e)
          c.side.target_blocks.insert(c.side.target_blocks.begin() + c.side.target_indptr[i], NB + 100 + e);
        return M{"more targets than blocks",
                 {"batch.targets (item " + std::to_string(i) + ")", "batch.targets.blocks[" +
                                                                       std::to_string(c.side.target_indptr[i]) + "]"}};
      }
      case 31: {  // a live view with negative strides, or with stages that cannot keep it
        if (which == policy::cautious)
          return M{"live strides", {"cache.live"}, [](call<P>& k) { k.cache.live.token_stride = -1; }};
        if (which != policy::kara && which != policy::zipage) continue;  // window_compact; lightning redundancy
        return M{"live view with " + std::string(policy_name(which)), {"cache.live"},
                 [live = tc.raw_live().data(), NB, b, H = tc.kv_heads()](call<P>& k) {
                   k.cache.live = kvp::live_view::contiguous(live, NB, b, H);
                 }};
      }
      case 32: {  // pipeline parameters
        switch (rng.between(0, 1)) {
          case 0: return M{"negative protect window", {"pipeline.protect.window"}, [](call<P>& k) { k.p.protect.window = -1; }};
          default: return M{"negative sinks", {"pipeline.protect.sinks"}, [](call<P>& k) { k.p.protect.sinks = -1; }};
        }
      }
      case 33: {  // a null entry in a per-layer table of K or V
        return M{"null layer", {"cache.k.table[" + std::to_string(c.layer_begin) + "]", "cache.k"},
                 [](call<P>& k) {
                   if (!k.cache.k.table) {
                     k.cache.k = {};
                     return;
                   }
                   static thread_local std::vector<void*> layers;
                   layers.assign(k.cache.k.table, k.cache.k.table + k.cache.num_layers);
                   layers[static_cast<std::size_t>(k.layer_begin)] = nullptr;
                   k.cache.k.table = layers.data();
                 },
                 /*host_only=*/true};
      }
    }
  }
}

// ---- properties -------------------------------------------------------------------------

bool field_allowed(const std::string& field, const std::vector<std::string>& allowed, bool device) {
  for (const auto& a : allowed) {
    if (field == a || (a.back() == '*' && field.rfind(a.substr(0, a.size() - 1), 0) == 0)) return true;
    // The device's words name the same part less finely where threads race to report
    // (which entry of a repeated block, which target): the same table, the same targets.
    for (const char* part : {"cache.table[", "batch.targets"})
      if (device && field.rfind(part, 0) == 0 && a.rfind(part, 0) == 0) return true;
  }
  return false;
}

std::string listed(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : " | ") + s;
  return out;
}

template <class P>
void expect_refused(const call<P>& k, test_cache& tc, const side_arrays& side, const mutation<P>& m) {
  const auto before = tc.take_snapshot();
  const side_arrays side_before = side;
  std::string field;
  bool thrown = false;
  try {
    (void)kvp::host_executor{}.compress(k.p, k.cache, k.queries, k.scores,
                                        kvp_test::make_batch(k.items, k.layer_begin, k.layer_count, k.targets));
  } catch (const kvp::error& e) {
    thrown = true;
    field = e.field();
    CHECK_MESSAGE(field_allowed(field, m.fields, false), "named ", field, ", expected ", listed(m.fields), ": ", std::string(e.what()));
    CHECK_MESSAGE(std::string(e.what()).find(field) != std::string::npos, std::string(e.what()));
  }
  CHECK_MESSAGE(thrown, "accepted: ", m.what);
  const auto writes = tc.writes_outside(before, tc.no_region(), tc.no_region());
  CHECK_MESSAGE(writes.empty(), "a refused call wrote: ", listed(writes));
  CHECK(side.refcounts == side_before.refcounts);
  CHECK(side.bitmask == side_before.bitmask);
}

// Where a valid call may write: its items' blocks past their shared prefixes and before
// nothing of a window, and their targets, in the call's layers.
test_cache::region writable(const test_cache& tc, const paged_case& c, i32 l0, i32 l1) {
  test_cache::region r = tc.no_region();
  const i32 b = tc.block_size();
  auto mark = [&](i32 block) {
    for (i32 l = l0; l < l1; ++l)
      for (i32 s = 0; s < b; ++s) r.ok[(static_cast<std::size_t>(l) * r.blocks + block) * b + s] = 1;
  };
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    const auto& it = c.items[i];
    for (i32 k = std::max(c.shared[i], it.window_begin / b); k < (tc.length(it.seq) + b - 1) / b; ++k) mark(tc.block(it.seq, k));
  }
  for (i32 id : c.side.target_blocks) mark(id);
  return r;
}

template <class P>
void expect_valid(const P& p, paged_case& c) {
  test_cache& tc = *c.tc;
  const auto before = tc.take_snapshot();
  const call<P> k = host_call(p, c);
  const i32 L = tc.num_layers(), H = tc.kv_heads(), b = tc.block_size();
  const i32 l0 = c.layer_begin, l1 = c.layer_count == 0 ? L : l0 + c.layer_count;
  kvp::host_result r;
  try {
#ifdef KVP_TEST_CUDA_EXECUTOR
    // Both executors, which must agree (the fixture's views carry no sharing marks there).
    r = kvp_test::run(p, tc, c.items, c.layer_begin, c.layer_count, k.targets);
#else
    r = kvp::host_executor{.record_keep_masks = true}.compress(
        k.p, k.cache, k.queries, k.scores, kvp_test::make_batch(k.items, k.layer_begin, k.layer_count, k.targets));
#endif
  } catch (const kvp::error& e) {
    FAIL("a valid call was refused: ", std::string(e.what()));
  }
  const auto region = writable(tc, c, l0, l1);
  const auto writes = tc.writes_outside(before, region, region);
  CHECK_MESSAGE(writes.empty(), "wrote outside the batch: ", listed(writes));

  using L_t = typename P::layout_type;
  const bool keeps_order = !kvp::fills_holes<L_t>();
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    const auto& it = c.items[i];
    const i32 T = before.lengths[static_cast<std::size_t>(it.seq)], wb = it.window_begin, Tw = T - wb;
    const i32 new_length = r.new_lengths[i];
    REQUIRE(new_length >= wb);
    REQUIRE(new_length <= T);
    REQUIRE(static_cast<i32>(r.new_tables[i].size()) == (new_length + b - 1) / b);
    i32 longest = 0;
    for (i32 l = l0; l < l1; ++l)
      for (i32 h = 0; h < H; ++h) {
        const i32 row = (l - l0) * H + h;
        const std::uint8_t* keep = &r.keep_masks[i][static_cast<std::size_t>(row) * Tw];
        std::vector<i32> kept;  // positions of the kept tokens, oldest first
        for (i32 t = 0; t < Tw; ++t) {
          const bool alive = !tc.config().live ||
                             before.live[tc.position_index(l, tc.block_of_token(it.seq, wb + t), (wb + t) % b, h)] != 0;
          if (!alive) CHECK_MESSAGE(keep[t] == 0, "a dropped token was kept: layer ", l, " head ", h, " token ", wb + t);
          // The protected window and sinks, where the head holds them.
          if (alive && (t >= Tw - p.protect.window || t < p.protect.sinks))
            CHECK_MESSAGE(keep[t] == 1, "a protected token was evicted: layer ", l, " head ", h, " token ", wb + t);
          if (keep[t]) kept.push_back(wb + t);
        }
        const i32 count = static_cast<i32>(kept.size());
        CHECK(r.kept_counts[i][static_cast<std::size_t>(row)] == wb + count);
        longest = std::max(longest, count);
        // Each kept token at its new slot: its position, and its K and V bytes unchanged.
        std::set<i32> seen;
        for (i32 j = 0; j < count; ++j) {
          const i32 slot = wb + j, block = r.new_tables[i][static_cast<std::size_t>(slot / b)];
          const i32 pos = tc.raw_positions()[tc.position_index(l, block, slot % b, h)];
          if (keeps_order) CHECK_MESSAGE(pos == kept[j], "slot ", slot, " holds position ", pos, ", not ", kept[j]);
          const bool known = std::binary_search(kept.begin(), kept.end(), pos) && seen.insert(pos).second;
          CHECK_MESSAGE(known, "slot ", slot, " holds position ", pos, ", not one kept token");
          if (!known) continue;
          for (kv_kind kind : {kv_kind::k, kv_kind::v})
            CHECK_MESSAGE(tc.row_bytes(kind, l, block, slot % b, h) ==
                              tc.row_bytes(before, kind, l, tc.block_of_token(it.seq, pos), pos % b, h),
                          "token ", pos, " changed on its way to slot ", slot, " (layer ", l, " head ", h, ")");
          if (tc.config().live) CHECK(tc.raw_live()[tc.position_index(l, block, slot % b, h)] == 1);
        }
        if (tc.config().live)
          for (i32 slot = wb + count; slot < new_length; ++slot)
            CHECK(tc.raw_live()[tc.position_index(l, r.new_tables[i][static_cast<std::size_t>(slot / b)], slot % b, h)] == 0);
      }
    if (kvp::moves_tokens<L_t>()) CHECK(new_length == wb + longest);
  }
}

#ifdef KVP_TEST_CUDA_EXECUTOR
// The broken call on the CUDA executor, over a device copy: refused with the field named
// (on the host before any launch, or in the status words), and nothing written.
template <class P>
void expect_refused_on_device(const P& p, paged_case& c, const mutation<P>& m) {
  test_cache& tc = *c.tc;
  const kvp_test::device_copy dev(tc);
  const auto to_dev = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return thrust::device_vector<T>(v.begin(), v.end());
  };
  const auto refcounts = to_dev(c.side.refcounts);
  const auto bitmask = to_dev(c.side.bitmask);
  const auto indptr = to_dev(c.side.target_indptr);
  const auto blocks = to_dev(c.side.target_blocks.empty() ? std::vector<i32>{-1} : c.side.target_blocks);
  call<P> k{p, dev.cache(), dev.queries(), dev.scores(), c.items, c.layer_begin, c.layer_count};
  k.cache.sharing = {c.side.refcounts.empty() ? nullptr : thrust::raw_pointer_cast(refcounts.data()),
                     c.side.bitmask.empty() ? nullptr : thrust::raw_pointer_cast(bitmask.data())};
  if (!c.side.target_indptr.empty())
    k.targets = {thrust::raw_pointer_cast(indptr.data()), thrust::raw_pointer_cast(blocks.data())};
  m.tweak(k);
  i32 max_tokens = 1;
  for (i32 x : tc.raw_lengths()) max_tokens = std::max(max_tokens, x);
  const i32 b = tc.block_size();
  const thrust::device_vector<kvp::batch_item> items(k.items.begin(), k.items.end());
  const auto n = static_cast<i32>(k.items.size());
  const kvp::device_batch batch{thrust::raw_pointer_cast(items.data()), n, max_tokens, k.layer_begin, k.layer_count,
                                k.targets};
  std::string field;
  try {
    const i32 max_blocks = (max_tokens + b - 1) / b;  // the fixture's block size: the view's may be broken
    const std::size_t rows = static_cast<std::size_t>(n) * tc.num_layers() * tc.kv_heads();
    thrust::device_vector<i32> status(kvp::status_words, 0), lengths(n, -1), counts(n, -1),
        released(std::max<std::size_t>(std::size_t(n) * max_blocks, 1), -1), kept(std::max<std::size_t>(rows, 1), -1),
        nonfinite(n, -1), tables(std::max<std::size_t>(std::size_t(n) * max_blocks, 1), -1);
    const kvp::device_result out{thrust::raw_pointer_cast(status.data()),   thrust::raw_pointer_cast(lengths.data()),
                                 thrust::raw_pointer_cast(counts.data()),   thrust::raw_pointer_cast(released.data()),
                                 nullptr,                                   nullptr,
                                 thrust::raw_pointer_cast(kept.data()),     thrust::raw_pointer_cast(nonfinite.data()),
                                 thrust::raw_pointer_cast(tables.data())};
    const kvp::cuda_executor ex{};
    std::size_t bytes = 0;
    // The calls sit outside REQUIRE: doctest would take the kvp::error a refusal throws
    // (the size query validates too) as a failed assertion instead of letting it reach the catch.
    const cudaError_t sized = ex.compress(nullptr, bytes, k.p, k.cache, k.queries, k.scores, batch, out);
    REQUIRE(cudaSuccess == sized);
    thrust::device_vector<std::byte> temp(std::max<std::size_t>(bytes, 1));
    const cudaError_t ran =
        ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, k.p, k.cache, k.queries, k.scores, batch, out);
    REQUIRE(cudaSuccess == ran);
    REQUIRE(cudaSuccess == cudaDeviceSynchronize());
    const auto st = kvp_test::to_host(status);
    kvp::check(st.data());
  } catch (const kvp::error& e) {
    field = e.field();
  }
  INFO("CUDA executor");
  CHECK_MESSAGE(!field.empty(), "accepted on the device: ", m.what);
  if (!field.empty()) CHECK_MESSAGE(field_allowed(field, m.fields, true), "named ", field, ", expected ", listed(m.fields));
  const auto before = tc.take_snapshot();
  dev.copy_back(tc);
  const auto writes = tc.writes_outside(before, tc.no_region(), tc.no_region());
  CHECK_MESSAGE(writes.empty(), "a refused call wrote on the device: ", listed(writes));
}
#endif

template <class P>
void fuzz_case(const P& p, policy which, fuzz_rng& rng, bool broken) {
  paged_case c = make_case(p, which, rng);
  INFO(policy_name(which), ": ", c.text);
  if (!broken) return expect_valid(p, c);
  const mutation<P> m = mutate(p, which, c, rng);
  INFO("mutation: ", m.what);
  call<P> k = host_call(p, c);
  m.tweak(k);
  expect_refused(k, *c.tc, c.side, m);
#ifdef KVP_TEST_CUDA_EXECUTOR
  if (!m.host_only) expect_refused_on_device(p, c, m);
#endif
}

}  // namespace

TEST_CASE("fuzz, paged cache: every broken call is refused naming its field, every valid one compresses soundly") {
  const auto bounds = kvp_test::fuzz_bounds::from_env(600);
  const long ran = bounds.run([](std::uint32_t seed) {
    INFO(kvp_test::replay_hint(seed));
    fuzz_rng rng(seed);
    const policy which = all_policies[rng.between(0, 4)];
    const bool broken = rng.chance(0.75);
    with_pipeline(which, rng, [&](const auto& p) { fuzz_case(p, which, rng, broken); });
  });
  MESSAGE("paged fuzz: ", ran, " cases from seed ", bounds.seed);
  CHECK(ran > 0);
}

// ---- cases the fuzzing found, kept by name ---------------------------------------------

namespace {

// Kara over a 4-token-block cache: seq 0 of 20 tokens, seq 1 of 16.
kara_pipeline small_kara() {
  kara_pipeline p;
  p.scorer = {.window = 8, .buffer = 2};
  p.select = {.gamma = 3, .alpha = 1};
  p.protect = {.window = 0, .sinks = 0};
  return p;
}
test_cache kara_cache() {
  return test_cache({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 8, .lengths = {20, 16}, .q_heads = 2,
                     .window = query_window, .seed = 5});
}

// Throws the kvp::error naming `field`, and writes nothing.
template <class P>
void refuses(const P& p, test_cache& tc, const kvp::paged_kv_view& cache, const kvp::query_window_view& queries,
             const std::vector<kvp::batch_item>& items, const std::string& field) {
  const auto before = tc.take_snapshot();
  std::string named;
  try {
    (void)kvp::host_executor{}.compress(p, cache, queries, tc.scores(), kvp_test::make_batch(items));
  } catch (const kvp::error& e) {
    named = e.field();
  }
  CHECK(named == field);
  CHECK(tc.unchanged_since(before));
}

}  // namespace

TEST_CASE("fuzz regression: a block id before a Kara window is checked like every other") {
  // Seed 1 of the first run: entries before an item's window were never read by the
  // validation (it saw the rows shifted to the windows), so an id out of range there
  // went through and came back in new_tables.
  test_cache tc = kara_cache();
  tc.raw_table()[tc.table_index(0, 0)] = tc.num_blocks() + 3;
  refuses(small_kara(), tc, tc.view(), tc.queries(), {{.seq = 0, .query_slot = 0, .budget = 3, .window_begin = 8}},
          "cache.table[seq 0][0]");
  tc.raw_table()[tc.table_index(0, 0)] = -2;
  refuses(small_kara(), tc, tc.view(), tc.queries(), {{.seq = 0, .query_slot = 0, .budget = 3, .window_begin = 8}},
          "cache.table[seq 0][0]");
}

TEST_CASE("fuzz regression: one item may not write a block another item holds before its window") {
  // The window of seq 0 (from token 0) held seq 1's first block, which lies before seq
  // 1's window: the validation never saw that block, and seq 0's compaction overwrote it.
  test_cache tc = kara_cache();
  tc.raw_table()[tc.table_index(0, 2)] = tc.block(1, 0);
  refuses(small_kara(), tc, tc.view(), tc.queries(),
          {{.seq = 1, .query_slot = 1, .budget = 3, .window_begin = 8}, {.seq = 0, .query_slot = 0, .budget = 3}},
          "cache.table[seq 0][2]");
  // Two items that only read it (before both windows) are fine: neither writes it.
  test_cache ok = kara_cache();
  ok.raw_table()[ok.table_index(0, 0)] = ok.block(1, 0);
  const auto r = kvp::host_executor{}.compress(
      small_kara(), ok.view(), ok.queries(), ok.scores(),
      kvp_test::make_batch({{.seq = 1, .query_slot = 1, .budget = 3, .window_begin = 4},
                            {.seq = 0, .query_slot = 0, .budget = 3, .window_begin = 8}}));
  CHECK(r.new_tables[1][0] == ok.block(1, 0));
}

TEST_CASE("fuzz regression: an element type outside the enum is refused, not read at the wrong width") {
  // A dtype cast from an engine's integer (3 here) passed every check; size_of took it
  // for 2 bytes while load_as_float read 4, and the compression wrote rows it did not hold.
  test_cache tc = kara_cache();
  kvp::paged_kv_view cache = tc.view();
  cache.type = static_cast<kvp::dtype>(3);
  const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 3, .window_begin = 8}};
  refuses(small_kara(), tc, cache, tc.queries(), items, "cache.type");
  kvp::query_window_view queries = tc.queries();
  queries.type = static_cast<kvp::dtype>(7);
  refuses(small_kara(), tc, tc.view(), queries, items, "queries.type");
}

TEST_CASE("fuzz regression: a CSR row that starts before the table is refused, not read") {
  // Under AddressSanitizer: indptr[1] set to -1 made seq 1's row start before the
  // indices array, and the validation read entry -1 before seq 0's check saw the row.
  test_cache tc({.layers = 1, .block_size = 4, .kv_heads = 1, .head_dim = 8, .lengths = {8, 6}, .csr = true,
                 .window = query_window, .seed = 9});
  tc.raw_indptr()[1] = -1;
  kvp::presets::streaming_llm p;
  p.select.sinks = 0;
  p.protect = {.window = 2, .sinks = 0};
  refuses(p, tc, tc.view(), tc.queries(), {{.seq = 1, .budget = 3}}, "cache.table.indptr[1]");
}
