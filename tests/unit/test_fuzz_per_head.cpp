// Property-based fuzzing of the per-head cache's validation (issue 47, item 7): random
// valid per-head views (one pool or one per layer, dtypes, block sizes, lengths per
// (layer, seq, head), positions and metric beside K and V) and batches of
// host::compress_per_head (KV-Compress's schedule and MoveCache), each then run as it
// is or broken by one mutation.
//   - A broken call throws kvp::error naming the broken part, and no byte of K, V,
//     positions, metric, table or lengths changes.
//   - A valid call keeps every head's length or shortens it, writes no block the
//     batch's sequences do not hold, and leaves in each head's first new-length slots
//     distinct positions of tokens it held, with their K and V bytes unchanged.
// Bounds and replay: support/fuzz.hpp. In the CUDA build (kvpolicy_gpu_unit_tests) each
// call also goes to cuda_per_head_executor over a device copy: a valid one must agree
// with the host (lengths, freed blocks, every byte), a broken one be refused alike.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "support/fuzz.hpp"

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;
using kvp_test::fuzz_rng;

// An owning per-head cache: K and V `[pools, NB, b, d]` apart, positions and metric
// `[pools, NB, b]`, table `[L, S, H, max_blocks]` and lengths `[L, S, H]` dense.
struct ph_case {
  i32 L = 1, S = 1, H = 1, b = 1, d = 4, NB = 0, max_blocks = 1;
  kvp::dtype type = kvp::dtype::f32;
  bool shared = true;
  std::vector<std::byte> k, v;
  std::vector<i32> table, lengths, positions;
  std::vector<float> metric;
  std::vector<kvp::per_head_item> items;
  kvp::select::head_adaptive_blocks selector{.protected_window = 2, .sinks = 0};
  std::vector<std::vector<i64>> per_layer;  // per item, block_budget::layer: a count per layer
  std::string text;

  i32 pools() const { return shared ? 1 : L; }
  std::size_t row(i32 l, i32 s, i32 h) const { return (static_cast<std::size_t>(l) * S + s) * H + h; }
  i32& entry(i32 l, i32 s, i32 h, i32 i) { return table[row(l, s, h) * max_blocks + i]; }
  i32 blocks_of(i32 l, i32 s, i32 h) const { return (lengths[row(l, s, h)] + b - 1) / b; }
  std::size_t slot(i32 l, i32 block, i32 t) const {
    return (static_cast<std::size_t>(shared ? 0 : l) * NB + block) * b + t;
  }
  std::size_t row_bytes() const { return static_cast<std::size_t>(d) * kvp::size_of(type); }

  kvp::per_head_kv_view view() {
    return view_over(k.data(), v.data(), table.data(), lengths.data(), positions.data(), metric.data());
  }
  // The same view over copies of the arrays held elsewhere (device memory).
  kvp::per_head_kv_view view_over(std::byte* k_, std::byte* v_, const i32* table_, const i32* lengths_, i32* positions_,
                                  float* metric_) const {
    kvp::per_head_kv_view c;
    c.num_layers = L, c.num_blocks = NB, c.block_size = b, c.num_kv_heads = H, c.head_dim = d, c.num_seqs = S;
    c.max_blocks = max_blocks, c.type = type, c.shared_pool = shared;
    const i64 pool = i64{NB} * b * d;
    c.k = {k_, shared ? 0 : pool, nullptr, 0};
    c.v = {v_, shared ? 0 : pool, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(b, d);
    c.table = kvp::per_head_array::dense(table_, S, H, max_blocks);
    c.lengths = kvp::per_head_array::dense(lengths_, S, H);
    c.positions = shared ? kvp::per_slot_positions::shared(positions_, b) : kvp::per_slot_positions::per_layer(positions_, NB, b);
    c.metric = shared ? kvp::per_slot_metric::shared(metric_, b) : kvp::per_slot_metric::per_layer(metric_, NB, b);
    return c;
  }
};

ph_case make_case(fuzz_rng& rng) {
  ph_case c;
  c.L = rng.between(1, 3), c.S = rng.between(1, 3), c.H = rng.between(1, 2);
  c.b = std::vector<i32>{1, 2, 4}[static_cast<std::size_t>(rng.between(0, 2))];
  c.d = rng.chance(0.5) ? 4 : 8;
  c.type = std::vector<kvp::dtype>{kvp::dtype::f16, kvp::dtype::bf16, kvp::dtype::f32}[static_cast<std::size_t>(rng.between(0, 2))];
  c.shared = rng.chance(0.5);
  c.lengths.resize(static_cast<std::size_t>(c.L) * c.S * c.H);
  for (i32& T : c.lengths) T = rng.between(0, 14);
  i32 longest = 0, per_pool = 0;
  for (i32 l = 0; l < c.L; ++l) {
    i32 in_layer = 0;
    for (i32 s = 0; s < c.S; ++s)
      for (i32 h = 0; h < c.H; ++h) {
        longest = std::max(longest, c.blocks_of(l, s, h));
        in_layer += c.blocks_of(l, s, h);
      }
    per_pool = c.shared ? per_pool + in_layer : std::max(per_pool, in_layer);
  }
  c.max_blocks = longest + rng.between(1, 2);
  c.NB = per_pool + rng.between(1, 3);
  c.table.assign(static_cast<std::size_t>(c.L) * c.S * c.H * c.max_blocks, -1);
  std::vector<i32> ids(static_cast<std::size_t>(c.NB));
  std::size_t next = ids.size();
  for (i32 l = 0; l < c.L; ++l) {
    if (l == 0 || !c.shared) {  // a fresh shuffled pool
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng.engine);
      next = 0;
    }
    for (i32 s = 0; s < c.S; ++s)
      for (i32 h = 0; h < c.H; ++h)
        for (i32 i = 0; i < c.blocks_of(l, s, h); ++i) c.entry(l, s, h, i) = ids[next++];
  }
  const std::size_t slots = static_cast<std::size_t>(c.pools()) * c.NB * c.b;
  c.k.resize(slots * c.row_bytes());
  c.v.resize(slots * c.row_bytes());
  for (auto& x : c.k) x = static_cast<std::byte>(rng.between(0, 255));
  for (auto& x : c.v) x = static_cast<std::byte>(rng.between(0, 255));
  c.positions.assign(slots, -1);
  c.metric.resize(slots);
  for (float& m : c.metric) m = static_cast<float>(rng.between(0, 1000)) / 1000.0f;
  for (i32 l = 0; l < c.L; ++l)
    for (i32 s = 0; s < c.S; ++s)
      for (i32 h = 0; h < c.H; ++h)
        for (i32 t = 0; t < c.lengths[c.row(l, s, h)]; ++t) c.positions[c.slot(l, c.entry(l, s, h, t / c.b), t % c.b)] = t;
  // Items: a random subset of the sequences, each freeing up to half its blocks.
  std::vector<i32> order(static_cast<std::size_t>(c.S));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng.engine);
  const i32 n = rng.between(1, c.S);
  if (rng.chance(0.3)) c.selector.budget = kvp::select::block_budget::layer;
  c.per_layer.resize(static_cast<std::size_t>(n));
  for (i32 i = 0; i < n; ++i) {
    const i32 s = order[i];
    i32 held = 0, positions = 0;
    for (i32 l = 0; l < c.L; ++l) {
      i32 in_layer = 0;
      for (i32 h = 0; h < c.H; ++h) {
        in_layer += c.blocks_of(l, s, h);
        positions = std::max(positions, c.lengths[c.row(l, s, h)]);
      }
      c.per_layer[i].push_back(rng.between(0, in_layer / 2));
      held += in_layer;
    }
    c.items.push_back({.seq = s, .blocks_to_free = rng.between(0, held / 2), .logical_length = positions});
    if (c.selector.budget == kvp::select::block_budget::layer) c.items.back().per_layer = c.per_layer[i].data();
  }
  c.text = "L " + std::to_string(c.L) + " S " + std::to_string(c.S) + " H " + std::to_string(c.H) + " b " +
           std::to_string(c.b) + " d " + std::to_string(c.d) + " " + std::string(kvp::name_of(c.type)) +
           (c.shared ? " shared pool" : " per-layer pools") + " NB " + std::to_string(c.NB) + " lengths [";
  for (i32 T : c.lengths) c.text += std::to_string(T) + " ";
  c.text += std::string("] budget per ") +
            (c.selector.budget == kvp::select::block_budget::layer ? "layer" : "sequence") + " items";
  for (const auto& it : c.items)
    c.text += " {seq " + std::to_string(it.seq) + " free " + std::to_string(it.blocks_to_free) + "}";
  return c;
}

struct ph_mutation {
  std::string what;
  std::vector<std::string> fields;
  std::function<void(kvp::per_head_kv_view&, std::vector<kvp::per_head_item>&)> tweak =
      [](kvp::per_head_kv_view&, std::vector<kvp::per_head_item>&) {};
  bool host_only = false;  // the device cannot be handed this (a host array of layer pointers)
};

std::string head_entry(i32 l, i32 s, i32 h, i32 i) {
  return "cache.table[layer " + std::to_string(l) + "][seq " + std::to_string(s) + "][head " + std::to_string(h) +
         "][" + std::to_string(i) + "]";
}

ph_mutation mutate(ph_case& c, fuzz_rng& rng) {
  using M = ph_mutation;
  using V = kvp::per_head_kv_view;
  using I = std::vector<kvp::per_head_item>;
  for (;;) {
    const i32 l = rng.between(0, c.L - 1), s = rng.between(0, c.S - 1), h = rng.between(0, c.H - 1);
    const std::size_t i = static_cast<std::size_t>(rng.between(0, static_cast<int>(c.items.size()) - 1));
    switch (rng.between(0, 16)) {
      case 0: {  // an id out of range or negative
        if (c.blocks_of(l, s, h) == 0) continue;
        const i32 k = rng.between(0, c.blocks_of(l, s, h) - 1);
        c.entry(l, s, h, k) = rng.chance(0.5) ? c.NB + rng.between(0, 3) : -rng.between(1, 4);
        return M{"id out of range", {head_entry(l, s, h, k)}};
      }
      case 1: {  // an id held twice in one pool
        const i32 l2 = c.shared ? rng.between(0, c.L - 1) : l, s2 = rng.between(0, c.S - 1), h2 = rng.between(0, c.H - 1);
        if (c.blocks_of(l, s, h) == 0 || c.blocks_of(l2, s2, h2) == 0) continue;
        const i32 k = rng.between(0, c.blocks_of(l, s, h) - 1), k2 = rng.between(0, c.blocks_of(l2, s2, h2) - 1);
        if (l == l2 && s == s2 && h == h2 && k == k2) continue;
        c.entry(l2, s2, h2, k2) = c.entry(l, s, h, k);
        return M{"id held twice", {head_entry(l, s, h, k), head_entry(l2, s2, h2, k2)}};
      }
      case 2: {  // a length past the row's room, or negative
        const i32 bad = rng.chance(0.5) ? c.max_blocks * c.b + rng.between(1, 3) : -rng.between(1, 3);
        c.lengths[c.row(l, s, h)] = bad;
        return M{"length " + std::to_string(bad), {"cache.lengths[layer " + std::to_string(l) + "][seq " +
                                                   std::to_string(s) + "][head " + std::to_string(h) + "]"}};
      }
      case 3: {
        const int f = rng.between(0, 6);
        const char* names[] = {"cache.num_layers", "cache.num_blocks", "cache.block_size", "cache.num_kv_heads",
                               "cache.head_dim",   "cache.num_seqs",   "cache.max_blocks"};
        return M{names[f], {names[f]}, [f, v = -rng.between(0, 1)](V& k, I&) {
                   i32* fields[] = {&k.num_layers, &k.num_blocks, &k.block_size, &k.num_kv_heads,
                                    &k.head_dim,   &k.num_seqs,   &k.max_blocks};
                   *fields[f] = v;
                 }};
      }
      case 4: {
        const bool v = rng.chance(0.5);
        const std::string base = v ? "cache.v_stride" : "cache.k_stride";
        const int pick = rng.between(0, 2);
        return M{base, {base + (pick == 0 ? ".dim" : pick == 1 ? ".token" : ".block")}, [v, pick](V& k, I&) {
                   kvp::per_head_kv_strides& st = v ? k.v_stride : k.k_stride;
                   if (pick == 0) st.dim = 0;
                   else if (pick == 1) st.token = k.head_dim - 1;
                   else st.block = st.token * (k.block_size - 1) + k.head_dim - 1;
                 }};
      }
      case 5: {
        switch (rng.between(0, 3)) {
          case 0: return M{"null table", {"cache.table"}, [](V& k, I&) { k.table = {}; }};
          case 1: return M{"null lengths", {"cache.lengths"}, [](V& k, I&) { k.lengths = {}; }};
          case 2: return M{"null K", {"cache.k"}, [](V& k, I&) { k.k = {}; }};
          default: return M{"null V", {"cache.v"}, [](V& k, I&) { k.v = {}; }};
        }
      }
      case 6: return M{"null metric", {"cache.metric"}, [](V& k, I&) { k.metric = {}; }};
      case 7:
        return M{"metric block stride", {"cache.metric.block_stride"},
                 [](V& k, I&) { k.metric.block_stride = k.block_size - 1; }};
      case 8: {  // a shared pool's side arrays with a layer stride, or per-layer pools that overlap
        if (c.shared)
          return M{"positions layer stride", {"cache.positions.layer_stride"},
                   [](V& k, I&) { k.positions.layer_stride = k.positions.block_stride; }};
        if (c.L < 2) continue;
        return M{"overlapping layer pools", {"cache.k layer 1", "cache.k.layer 1"},
                 [](V& k, I&) {  // one element short of a layer's pool
                   k.k.layer_stride = (i64{k.num_blocks} - 1) * k.k_stride.block +
                                      (i64{k.block_size} - 1) * k.k_stride.token + k.head_dim - 1;
                 }};
      }
      case 9: return M{"type", {"cache.type"}, [](V& k, I&) { k.type = static_cast<kvp::dtype>(5); }};
      case 10: {
        const i32 bad = rng.chance(0.5) ? -1 : c.S + rng.between(0, 2);
        return M{"seq " + std::to_string(bad), {"batch[" + std::to_string(i) + "].seq"},
                 [i, bad](V&, I& items) { items[i].seq = bad; }};
      }
      case 11: {
        if (c.items.size() < 2) continue;
        const std::size_t j = (i + 1) % c.items.size();
        return M{"seq twice", {"batch[" + std::to_string(std::max(i, j)) + "].seq"},
                 [i, j](V&, I& items) { items[std::max(i, j)].seq = items[std::min(i, j)].seq; }};
      }
      case 12:
        if (c.selector.budget != kvp::select::block_budget::sequence) continue;  // the count is not read
        return M{"negative blocks_to_free", {"batch[" + std::to_string(i) + "].blocks_to_free"},
                 [i](V&, I& items) { items[i].blocks_to_free = -1 - items[i].blocks_to_free; }};
      case 13:
        return M{"no logical length with positions", {"batch[" + std::to_string(i) + "].logical_length"},
                 [i](V&, I& items) { items[i].logical_length = -1; }};
      case 16: {  // a per-layer budget without its counts, or with a negative one
        if (c.selector.budget != kvp::select::block_budget::layer) continue;
        if (rng.chance(0.5))
          return M{"no per-layer counts", {"batch[" + std::to_string(i) + "].per_layer"},
                   [i](V&, I& items) { items[i].per_layer = nullptr; }};
        c.per_layer[i][static_cast<std::size_t>(l)] = -1;
        return M{"negative per-layer count", {"batch[" + std::to_string(i) + "].per_layer[" + std::to_string(l) + "]"}};
      }
      case 14: {  // a position past the item's count
        const auto& it = c.items[i];
        if (c.lengths[c.row(l, it.seq, h)] == 0) continue;
        const i32 t = rng.between(0, c.lengths[c.row(l, it.seq, h)] - 1);
        c.positions[c.slot(l, c.entry(l, it.seq, h, t / c.b), t % c.b)] = it.logical_length + rng.between(0, 3);
        return M{"position past the count",
                 {"cache.positions (batch[" + std::to_string(i) + "], layer " + std::to_string(l) + ", head " +
                  std::to_string(h) + ", token " + std::to_string(t) + ")"}};
      }
      default: {  // a layer pointer table with a null layer (per-layer tables)
        return M{"null table layer", {"cache.table.layers[" + std::to_string(l) + "]"}, [l](V& k, I&) {
                   static thread_local std::vector<const i32*> layers;
                   layers.clear();
                   for (i32 x = 0; x < k.num_layers; ++x) layers.push_back(k.table.base + x * k.table.layer_stride);
                   layers[static_cast<std::size_t>(l)] = nullptr;
                   k.table = {nullptr, layers.data(), 0, k.table.seq_stride, k.table.head_stride};
                 },
                 /*host_only=*/true};
      }
    }
  }
}

// Whether the error names an allowed field. The device's words name a repeated block
// by whichever of its entries a thread reached second: any entry of the table.
bool field_allowed(const std::string& field, const std::vector<std::string>& allowed, bool device) {
  for (const auto& a : allowed)
    if (field == a || (device && field.rfind("cache.table[", 0) == 0 && a.rfind("cache.table[", 0) == 0)) return true;
  return false;
}

#ifdef KVP_TEST_CUDA_EXECUTOR
// The case's arrays on the device, the view over them, and what the executor wrote.
struct ph_device {
  explicit ph_device(const ph_case& c)
      : k(c.k.begin(), c.k.end()), v(c.v.begin(), c.v.end()), table(c.table.begin(), c.table.end()),
        lengths(c.lengths.begin(), c.lengths.end()), positions(c.positions.begin(), c.positions.end()),
        metric(c.metric.begin(), c.metric.end()) {
    for (const auto& counts : c.per_layer) per_layer.emplace_back(counts.begin(), counts.end());
  }
  thrust::device_vector<std::byte> k, v;
  thrust::device_vector<i32> table, lengths, positions;
  thrust::device_vector<float> metric;
  std::vector<thrust::device_vector<i64>> per_layer;
  std::vector<i32> new_lengths, freed_counts, freed_blocks;  // [rows], [rows], [rows][max_blocks]

  kvp::per_head_kv_view view(const ph_case& c) {
    return c.view_over(raw(k), raw(v), raw(table), raw(lengths), raw(positions), raw(metric));
  }
  // Runs the CUDA executor; the field of its refusal, or empty.
  std::string run(const ph_case& c, const kvp::select::head_adaptive_blocks& sel, const kvp::per_head_kv_view& view,
                  std::vector<kvp::per_head_item> items) {
    for (std::size_t i = 0; i < items.size(); ++i)  // per_layer: the device copy of item i's counts
      if (items[i].per_layer) items[i].per_layer = raw(per_layer[i]);
    const thrust::device_vector<kvp::per_head_item> d_items(items.begin(), items.end());
    const std::size_t rows = std::max<std::size_t>(items.size() * c.L * c.H, 1);
    thrust::device_vector<i32> status(kvp::status_words, 0), lens(rows, -1), counts(rows, -1),
        blocks(rows * static_cast<std::size_t>(c.max_blocks), -1);
    const kvp::device_per_head_batch batch{thrust::raw_pointer_cast(d_items.data()), static_cast<i32>(items.size())};
    const kvp::device_per_head_result out{raw(status), raw(lens), raw(counts), raw(blocks)};
    try {
      const kvp::cuda_per_head_executor ex{};
      std::size_t bytes = 0;
      // The calls sit outside REQUIRE: doctest would take the kvp::error a refusal throws
      // (the size query validates too) as a failed assertion instead of letting it reach the catch.
      const cudaError_t sized = ex.compress(nullptr, bytes, sel, view, batch, out);
      REQUIRE(cudaSuccess == sized);
      thrust::device_vector<std::byte> temp(std::max<std::size_t>(bytes, 1));
      const cudaError_t ran = ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, sel, view, batch, out);
      REQUIRE(cudaSuccess == ran);
      REQUIRE(cudaSuccess == cudaDeviceSynchronize());
      kvp::check(kvp_test::to_host(status).data());
    } catch (const kvp::error& e) {
      return e.field();
    }
    new_lengths = kvp_test::to_host(lens);
    freed_counts = kvp_test::to_host(counts);
    freed_blocks = kvp_test::to_host(blocks);
    return {};
  }
  void copy_back(ph_case& c) const {
    thrust::copy(k.begin(), k.end(), c.k.begin());
    thrust::copy(v.begin(), v.end(), c.v.begin());
    thrust::copy(positions.begin(), positions.end(), c.positions.begin());
    thrust::copy(metric.begin(), metric.end(), c.metric.begin());
  }

 private:
  template <class T>
  static T* raw(thrust::device_vector<T>& x) {
    return thrust::raw_pointer_cast(x.data());
  }
};
#endif

void expect_refused(ph_case& c, const ph_mutation& m) {
  kvp::per_head_kv_view view = c.view();
  std::vector<kvp::per_head_item> items = c.items;
  m.tweak(view, items);
  const ph_case before = c;
  std::string field;
  try {
    (void)kvp::host::compress_per_head(c.selector, view, items);
  } catch (const kvp::error& e) {
    field = e.field();
    INFO(std::string(e.what()));
    CHECK_MESSAGE(field_allowed(field, m.fields, false), "named ", field);
  }
  CHECK_MESSAGE(!field.empty(), "accepted: ", m.what);
  CHECK((c.k == before.k && c.v == before.v && c.positions == before.positions && c.table == before.table &&
         c.lengths == before.lengths));
  CHECK(std::memcmp(c.metric.data(), before.metric.data(), c.metric.size() * sizeof(float)) == 0);
#ifdef KVP_TEST_CUDA_EXECUTOR
  if (m.host_only) return;
  INFO("CUDA per-head executor");
  ph_device dev(c);
  kvp::per_head_kv_view dview = dev.view(c);
  std::vector<kvp::per_head_item> ditems = c.items;
  m.tweak(dview, ditems);
  const std::string named = dev.run(c, c.selector, dview, ditems);
  CHECK_MESSAGE(!named.empty(), "accepted on the device: ", m.what);
  if (!named.empty()) CHECK_MESSAGE(field_allowed(named, m.fields, true), "named ", named);
  ph_case after = c;
  dev.copy_back(after);
  CHECK((after.k == c.k && after.v == c.v && after.positions == c.positions));
  CHECK(std::memcmp(after.metric.data(), c.metric.data(), c.metric.size() * sizeof(float)) == 0);
#endif
}

void expect_valid(ph_case& c) {
  const ph_case before = c;
#ifdef KVP_TEST_CUDA_EXECUTOR
  ph_device dev(c);  // the cache as the host executor finds it
#endif
  kvp::per_head_result r;
  try {
    r = kvp::host::compress_per_head(c.selector, c.view(), c.items);
  } catch (const kvp::error& e) {
    FAIL("a valid call was refused: ", std::string(e.what()));
  }
  CHECK(c.table == before.table);
  CHECK(c.lengths == before.lengths);
#ifdef KVP_TEST_CUDA_EXECUTOR
  {  // The device agrees: lengths, freed blocks, every byte.
    INFO("CUDA per-head executor");
    const std::string named = dev.run(c, c.selector, dev.view(c), c.items);
    REQUIRE_MESSAGE(named.empty(), "the device refused a valid call: ", named);
    for (std::size_t i = 0; i < c.items.size(); ++i)
      for (std::size_t row = 0; row < static_cast<std::size_t>(c.L * c.H); ++row) {
        const std::size_t at = i * static_cast<std::size_t>(c.L * c.H) + row;
        CHECK(dev.new_lengths[at] == r.new_lengths[i][row]);
        REQUIRE(dev.freed_counts[at] == static_cast<i32>(r.freed_blocks[i][row].size()));
        for (i32 j = 0; j < dev.freed_counts[at]; ++j)
          CHECK(dev.freed_blocks[at * static_cast<std::size_t>(c.max_blocks) + j] == r.freed_blocks[i][row][j]);
      }
    ph_case on_device = before;
    dev.copy_back(on_device);
    CHECK((on_device.k == c.k && on_device.v == c.v && on_device.positions == c.positions));
    CHECK(std::memcmp(on_device.metric.data(), c.metric.data(), c.metric.size() * sizeof(float)) == 0);
  }
#endif
  // Blocks (pool, id) the batch holds: the only ones written.
  std::set<std::pair<i32, i32>> writable;
  for (const auto& it : c.items)
    for (i32 l = 0; l < c.L; ++l)
      for (i32 h = 0; h < c.H; ++h)
        for (i32 k = 0; k < c.blocks_of(l, it.seq, h); ++k) writable.insert({c.shared ? 0 : l, c.entry(l, it.seq, h, k)});
  const std::size_t rb = c.row_bytes();
  for (i32 p = 0; p < c.pools(); ++p)
    for (i32 id = 0; id < c.NB; ++id) {
      if (writable.count({p, id})) continue;
      for (i32 t = 0; t < c.b; ++t) {
        const std::size_t at = (static_cast<std::size_t>(p) * c.NB + id) * c.b + t;
        CHECK_MESSAGE(std::memcmp(&c.k[at * rb], &before.k[at * rb], rb) == 0, "K of block ", id, " written");
        CHECK_MESSAGE(std::memcmp(&c.v[at * rb], &before.v[at * rb], rb) == 0, "V of block ", id, " written");
        CHECK(c.positions[at] == before.positions[at]);
      }
    }
  for (std::size_t i = 0; i < c.items.size(); ++i) {
    const i32 s = c.items[i].seq;
    for (i32 l = 0; l < c.L; ++l)
      for (i32 h = 0; h < c.H; ++h) {
        const i32 T = c.lengths[c.row(l, s, h)], now = r.new_lengths[i][static_cast<std::size_t>(l) * c.H + h];
        CHECK(now >= 0);
        CHECK(now <= T);
        std::set<i32> seen;
        for (i32 t = 0; t < now; ++t) {
          const std::size_t at = c.slot(l, c.entry(l, s, h, t / c.b), t % c.b);
          const i32 pos = c.positions[at];
          const bool ok = pos >= 0 && pos < T && seen.insert(pos).second;
          CHECK_MESSAGE(ok, "slot ", t, " holds position ", pos);
          if (!ok) continue;
          const std::size_t from = before.slot(l, before.table[before.row(l, s, h) * c.max_blocks + pos / c.b], pos % c.b);
          CHECK_MESSAGE(std::memcmp(&c.k[at * rb], &before.k[from * rb], rb) == 0, "K of token ", pos, " changed");
          CHECK_MESSAGE(std::memcmp(&c.v[at * rb], &before.v[from * rb], rb) == 0, "V of token ", pos, " changed");
        }
      }
  }
}

}  // namespace

TEST_CASE("fuzz, per-head cache: every broken call is refused naming its field, every valid one compresses soundly") {
  const auto bounds = kvp_test::fuzz_bounds::from_env(600);
  const long ran = bounds.run([](std::uint32_t seed) {
    INFO(kvp_test::replay_hint(seed));
    fuzz_rng rng(seed);
    ph_case c = make_case(rng);
    INFO(c.text);
    if (rng.chance(0.25)) return expect_valid(c);
    const ph_mutation m = mutate(c, rng);
    INFO("mutation: ", m.what);
    expect_refused(c, m);
  });
  MESSAGE("per-head fuzz: ", ran, " cases from seed ", bounds.seed);
  CHECK(ran > 0);
}

// ---- cases the fuzzing found, kept by name ---------------------------------------------

TEST_CASE("fuzz regression: per-head errors name the batch item and the cache's field; an unknown type is refused") {
  fuzz_rng rng(7);
  ph_case c = make_case(rng);
  INFO(c.text);
  // A dtype outside the enum (5) passed validate_per_head and MoveCache moved rows of
  // the wrong width.
  expect_refused(c, {"type", {"cache.type"}, [](kvp::per_head_kv_view& k, auto&) { k.type = static_cast<kvp::dtype>(5); }});
  // A negative count was named "blocks_to_free[0]" (the schedule's group), not the item.
  expect_refused(c, {"negative count", {"batch[0].blocks_to_free"}, [](auto&, auto& items) { items[0].blocks_to_free = -3; }});
  // A position past the item's count was named "rows[r].positions[t]", a path into
  // no argument; now the slot of the cache, as the device names it.
  const i32 s = c.items[0].seq;
  for (i32 l = 0; l < c.L; ++l)
    for (i32 h = 0; h < c.H; ++h)
      if (c.lengths[c.row(l, s, h)] > 0) {
        ph_case broken = c;
        broken.positions[broken.slot(l, broken.entry(l, s, h, 0), 0)] = c.items[0].logical_length;
        expect_refused(broken, {"position past the count",
                                {"cache.positions (batch[0], layer " + std::to_string(l) + ", head " + std::to_string(h) +
                                 ", token 0)"}});
        return;
      }
  FAIL("seed 7 drew no held token for item 0");
}
