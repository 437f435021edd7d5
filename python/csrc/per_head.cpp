#include "per_head.hpp"
#include "per_head_tensors.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <kvpolicy/core/error.hpp>
#include <kvpolicy/core/query_window_view.hpp>
#include <kvpolicy/exec/host/per_head_compress.hpp>
#include <kvpolicy/exec/validate_per_head.hpp>
#include <kvpolicy/pipeline/kv_compress_preset.hpp>
#include <nanobind/stl/string.h>

#include "numpy_out.hpp"
#include "python_communicator.hpp"
#include "tensor_args.hpp"

#ifdef KVPOLICY_PYTHON_WITH_CUDA
#include "device_compress.hpp"
#include "device_per_head.hpp"
#endif

namespace nb = nanobind;
using kvp::require;

namespace kvpy {
namespace {

using kv_compress = kvp::presets::kv_compress;

template <class A>
bool same_shape(const A& a, const mut_array& b, std::size_t axes) {
  if (a.ndim() != axes) return false;
  for (std::size_t i = 0; i < axes; ++i)
    if (a.shape(i) != b.shape(i)) return false;
  return true;
}

std::string shape_text(const mut_array& a, std::size_t axes) {  // a's first `axes` axes
  std::string s = "(";
  for (std::size_t i = 0; i < axes; ++i) s += kvp::detail::format(i ? ", {}" : "{}", a.shape(i));
  return s + (axes == 1 ? ",)" : ")");
}

std::int32_t to_i32(std::size_t n, const char* field, const char* what) {
  require(n <= INT32_MAX, field, "has {} {}; at most {}", n, what, INT32_MAX);
  return static_cast<std::int32_t>(n);
}

}  // namespace

per_head_tensors read_per_head(nb::handle k_arg, nb::handle v_arg, nb::handle metric_arg, nb::handle tables_arg,
                               nb::handle lengths_arg, nb::handle positions_arg, bool metric_required) {
  per_head_tensors t;
  mut_array k = writable(k_arg, "k"), v = writable(v_arg, "v");
  require(k.ndim() == 3 || k.ndim() == 4, "k",
          "has shape {}; expected [num_blocks, block_size, head_dim] (one pool for every layer) or [layers, "
          "num_blocks, block_size, head_dim] (a pool per layer)",
          shape_of(k));
  const kvp::dtype type = cache_dtype(k, "k");
  t.at = place_of(k, "k");
  require(same_shape(v, k, k.ndim()), "v", "has shape {}; k has {}", shape_of(v), shape_of(k));
  require(v.dtype() == k.dtype(), "v", "has element type {}; k has {}", dtype_name(v), dtype_name(k));
  require(place_of(v, "v") == t.at, "v", "lives on {}; k lives on {}", describe(place_of(v, "v")), describe(t.at));
  const bool shared = k.ndim() == 3;
  const std::size_t o = shared ? 0 : 1;  // the block axis
  require(k.shape(o + 2) <= 1 || k.stride(o + 2) == 1, "k",
          "has strides {}; a row's head_dim elements must be adjacent (last stride 1)", strides_of(k));
  require(v.shape(o + 2) <= 1 || v.stride(o + 2) == 1, "v",
          "has strides {}; a row's head_dim elements must be adjacent (last stride 1)", strides_of(v));

  array tables = readable(tables_arg, "tables");
  require_ndim(tables, 4, "tables", "[layers, seqs, kv_heads, max_blocks]");
  require_dtype(tables, int32_type, "tables", "int32");
  require_place(place_of(tables, "tables"), t.at, "tables");
  require(tables.shape(3) <= 1 || tables.stride(3) == 1, "tables",
          "has strides {}; a row's block ids must be adjacent (last stride 1)", strides_of(tables));
  require(shared || k.shape(0) == tables.shape(0), "k", "has {} layers (shape {}); tables has {}", k.shape(0),
          shape_of(k), tables.shape(0));
  array lengths = readable(lengths_arg, "lengths");
  require_ndim(lengths, 3, "lengths", "[layers, seqs, kv_heads]");
  require_dtype(lengths, int32_type, "lengths", "int32");
  require_place(place_of(lengths, "lengths"), t.at, "lengths");
  require(lengths.shape(0) == tables.shape(0) && lengths.shape(1) == tables.shape(1) &&
              lengths.shape(2) == tables.shape(2),
          "lengths", "has shape {}; tables has {}: expected (layers, seqs, kv_heads) = ({}, {}, {})",
          shape_of(lengths), shape_of(tables), tables.shape(0), tables.shape(1), tables.shape(2));

  require(!metric_required || !metric_arg.is_none(), "metric", "is None; the call writes each slot's metric");

  kvp::per_head_kv_view& c = t.view;
  c.num_layers = to_i32(tables.shape(0), "tables", "layers");
  c.num_blocks = to_i32(k.shape(o), "k", "blocks");
  c.block_size = to_i32(k.shape(o + 1), "k", "tokens a block");
  c.num_kv_heads = to_i32(tables.shape(2), "tables", "KV heads");
  c.head_dim = to_i32(k.shape(o + 2), "k", "head_dim elements");
  c.num_seqs = to_i32(tables.shape(1), "tables", "sequences");
  c.max_blocks = to_i32(tables.shape(3), "tables", "blocks a row");
  c.type = type;
  c.shared_pool = shared;
  c.k = {k.data(), shared ? 0 : k.stride(0), nullptr, 0};
  c.v = {v.data(), shared ? 0 : v.stride(0), nullptr, 0};
  c.k_stride = {k.stride(o), k.stride(o + 1), k.shape(o + 2) <= 1 ? 1 : k.stride(o + 2)};
  c.v_stride = {v.stride(o), v.stride(o + 1), v.shape(o + 2) <= 1 ? 1 : v.stride(o + 2)};
  c.table = {static_cast<const std::int32_t*>(tables.data()), nullptr, tables.stride(0), tables.stride(1),
             tables.stride(2)};
  c.lengths = {static_cast<const std::int32_t*>(lengths.data()), nullptr, lengths.stride(0), lengths.stride(1),
               lengths.stride(2)};
  if (!metric_arg.is_none()) {
    mut_array metric = writable(metric_arg, "metric");
    require_dtype(metric, float32_type, "metric", "float32");
    require(same_shape(metric, k, k.ndim() - 1), "metric", "has shape {}; expected {} (k's shape without head_dim)",
            shape_of(metric), shape_text(k, k.ndim() - 1));
    require_place(place_of(metric, "metric"), t.at, "metric");
    c.metric = {static_cast<float*>(metric.data()), shared ? 0 : metric.stride(0), metric.stride(o),
                metric.stride(o + 1)};
    t.written.push_back(std::move(metric));
  }
  if (!positions_arg.is_none()) {
    mut_array positions = writable(positions_arg, "positions");
    require_dtype(positions, int32_type, "positions", "int32");
    require(same_shape(positions, k, k.ndim() - 1), "positions",
            "has shape {}; expected {} (k's shape without head_dim)", shape_of(positions), shape_text(k, k.ndim() - 1));
    require_place(place_of(positions, "positions"), t.at, "positions");
    c.positions = {static_cast<std::int32_t*>(positions.data()), shared ? 0 : positions.stride(0), positions.stride(o),
                   positions.stride(o + 1)};
    t.written.push_back(std::move(positions));
  }
  t.written.push_back(std::move(k));
  t.written.push_back(std::move(v));
  t.read.push_back(std::move(tables));
  t.read.push_back(std::move(lengths));
  return t;
}

namespace {

// The items as kvpolicy.compress_per_head passes them: int64 [n, 3] rows (seq,
// blocks_to_free, logical_length), or [n, 3 + layers] with a per-layer budget (the
// layers' counts after them), packed.
const std::int64_t* item_rows(const array& items, const kv_compress& p, std::int32_t layers, std::int32_t& columns) {
  require_ndim(items, 2, "items", "[n, 3 + layers]: (seq, blocks_to_free, logical_length, per-layer counts)");
  require_dtype(items, nb::dtype<std::int64_t>(), "items", "int64");
  columns = p.select.budget == kvp::select::block_budget::layer ? 3 + layers : 3;
  const bool packed = items.shape(0) == 0 || ((items.shape(0) == 1 || items.stride(0) == columns) &&
                                              (items.shape(1) <= 1 || items.stride(1) == 1));
  require(items.shape(1) == static_cast<std::size_t>(columns) && packed, "items",
          "has shape {} and strides {}; expected a contiguous [n, {}]", shape_of(items), strides_of(items), columns);
  return static_cast<const std::int64_t*>(items.data());
}

nb::dict host_compress_per_head(const kv_compress& p, nb::handle k, nb::handle v, nb::handle metric,
                                nb::handle tables, nb::handle lengths, nb::handle positions, nb::handle items_arg,
                                nb::handle communicator, std::int32_t first_head, std::int32_t total_heads) {
  per_head_tensors t = read_per_head(k, v, metric, tables, lengths, positions);
  require(!t.at.device, "k", "lives on CUDA device {}; host_compress_per_head runs on host memory", t.at.id);
  const kvp::per_head_kv_view& c = t.view;
  const array items = readable(items_arg, "items");
  require(!place_of(items, "items").device, "items", "lives on CUDA memory; the host path reads host memory");
  std::int32_t cols = 0;
  const std::int64_t* rows = item_rows(items, p, c.num_layers, cols);
  const std::size_t n = items.shape(0);
  std::vector<kvp::per_head_item> batch(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t* r = rows + i * static_cast<std::size_t>(cols);
    require(r[0] >= INT32_MIN && r[0] <= INT32_MAX, kvp::detail::path("batch[{}].seq", i), "is {}; out of int32",
            r[0]);
    require(r[2] >= INT32_MIN && r[2] <= INT32_MAX, kvp::detail::path("batch[{}].logical_length", i),
            "is {}; out of int32", r[2]);
    batch[i] = {.seq = static_cast<std::int32_t>(r[0]),
                .blocks_to_free = r[1],
                .per_layer = cols > 3 ? r + 3 : nullptr,
                .logical_length = static_cast<std::int32_t>(r[2])};
  }
  kvp::per_head_result r;
  {
    nb::gil_scoped_release quiet;  // touches no Python object
    if (communicator.is_none())
      r = kvp::host::compress_per_head(p.select, c, batch);
    else
      r = kvp::host::compress_per_head(p.select, c, batch, {.first = first_head, .total = total_heads},
                                       python_communicator{communicator});
  }
  const std::size_t L = static_cast<std::size_t>(c.num_layers), H = static_cast<std::size_t>(c.num_kv_heads);
  const std::size_t rows_per_item = L * H, width = static_cast<std::size_t>(c.max_blocks);
  std::vector<std::int32_t> new_lengths(n * rows_per_item), counts(n * rows_per_item), evicted(n * rows_per_item),
      moved(n * rows_per_item), freed_blocks(n * rows_per_item * width, -1);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t row = 0; row < rows_per_item; ++row) {
      const std::size_t at = i * rows_per_item + row;
      new_lengths[at] = r.new_lengths[i][row];
      evicted[at] = r.evicted[i][row];
      moved[at] = r.moved[i][row];
      const auto& ids = r.freed_blocks[i][row];
      counts[at] = static_cast<std::int32_t>(ids.size());
      std::copy(ids.begin(), ids.end(), freed_blocks.begin() + at * width);
    }
  nb::dict out;
  out["new_lengths"] = to_numpy(std::move(new_lengths), {n, L, H});
  out["freed_counts"] = to_numpy(std::move(counts), {n, L, H});
  out["freed_blocks"] = to_numpy(std::move(freed_blocks), {n, L, H, width});
  out["evicted"] = to_numpy(std::move(evicted), {n, L, H});
  out["moved"] = to_numpy(std::move(moved), {n, L, H});
  out["freed"] = to_numpy(std::move(r.freed), {n});
  out["nonfinite_metrics"] = to_numpy(std::move(r.nonfinite), {n});
  return out;
}

// The queries [layers, slots, window, h_q, d] as the metric reads them (any dtype of
// the cache's three, any strides with rows adjacent).
kvp::query_window_view read_queries(nb::handle q_arg, const kvp::per_head_kv_view& c, const place& at, array& keep) {
  keep = readable(q_arg, "queries");
  const array& q = keep;
  require_ndim(q, 5, "queries", "[layers, slots, window, h_q, d]");
  const kvp::dtype type = cache_dtype(q, "queries");
  require_place(place_of(q, "queries"), at, "queries");
  require(q.shape(0) >= static_cast<std::size_t>(c.num_layers), "queries", "has shape {}; the cache has {} layers",
          shape_of(q), c.num_layers);
  require(q.shape(4) == static_cast<std::size_t>(c.head_dim), "queries", "has shape {}; k's head_dim is {}",
          shape_of(q), c.head_dim);
  require(q.shape(3) >= static_cast<std::size_t>(c.num_kv_heads) && q.shape(3) % c.num_kv_heads == 0, "queries",
          "has {} query heads (shape {}); must be a multiple of the {} KV heads", q.shape(3), shape_of(q),
          c.num_kv_heads);
  require(q.shape(4) <= 1 || q.stride(4) == 1, "queries",
          "has strides {}; a row's head_dim elements must be adjacent (last stride 1)", strides_of(q));
  kvp::query_window_view v;
  v.base = q.data();
  v.num_layers = to_i32(q.shape(0), "queries", "layers");
  v.num_slots = to_i32(q.shape(1), "queries", "slots");
  v.window = to_i32(q.shape(2), "queries", "positions a slot");
  v.num_q_heads = to_i32(q.shape(3), "queries", "query heads");
  v.head_dim = c.head_dim;
  v.type = type;
  v.layer_stride = q.stride(0);
  v.slot_stride = q.stride(1);
  v.pos_stride = q.stride(2);
  v.head_stride = q.stride(3);
  return v;
}

// int32 values of an item column (host), one per item.
std::vector<std::int32_t> item_column(nb::handle h, const char* field, std::size_t n) {
  const array a = readable(h, field);
  require_vector(a, field);
  require_dtype(a, int32_type, field, "int32");
  require(!place_of(a, field).device, field, "lives on CUDA memory; the items are host values");
  require(a.shape(0) == n, field, "has {} entries; seqs has {}", a.shape(0), n);
  const auto* p = static_cast<const std::int32_t*>(a.data());
  return {p, p + n};
}

// KV-Compress's metric on the host, row by row (scorer::squared_attention_metric):
// prefill overwrites every slot of each item's heads from the last `window` queries
// of its slot; decode adds the slot's newest query (its last entry).
void host_per_head_metric(const kv_compress& p, nb::handle queries_arg, nb::handle k, nb::handle metric,
                          nb::handle tables, nb::handle lengths, nb::handle positions, nb::handle seqs_arg,
                          nb::handle slots_arg, nb::handle qpos_arg, bool prefill) {
  per_head_tensors t = read_per_head(k, k, metric, tables, lengths, positions);
  require(!t.at.device, "k", "lives on CUDA device {}; the host metric runs on host memory", t.at.id);
  const kvp::per_head_kv_view& c = t.view;
  array q_keep;
  const kvp::query_window_view q = read_queries(queries_arg, c, t.at, q_keep);
  const array seqs_a = readable(seqs_arg, "seqs");
  require_vector(seqs_a, "seqs");
  const std::size_t n = seqs_a.shape(0);
  const std::vector<std::int32_t> seqs = item_column(seqs_arg, "seqs", n),
                                  slots = item_column(slots_arg, "query_slots", n),
                                  qpos = item_column(qpos_arg, "query_positions", n);
  kvp::validate_per_head(c);
  const std::int32_t window = prefill ? p.metric.window : 1;
  require(q.window >= window, "queries",
          "holds {} queries a slot; the metric reads the last {}: pass at least that many, or set the policy's "
          "metric_window (kvpolicy.KVCompress(metric_window={}))",
          q.window, window, q.window);
  for (std::size_t i = 0; i < n; ++i) {
    require(seqs[i] >= 0 && seqs[i] < c.num_seqs, kvp::detail::path("seqs[{}]", i), "is {}; the cache has {} sequences",
            seqs[i], c.num_seqs);
    require(slots[i] >= 0 && slots[i] < q.num_slots, kvp::detail::path("query_slots[{}]", i),
            "is {}; queries has {} slots", slots[i], q.num_slots);
  }
  nb::gil_scoped_release quiet;
  const std::int32_t G = q.num_q_heads / c.num_kv_heads, d = c.head_dim, b = c.block_size;
  for (std::size_t i = 0; i < n; ++i)
    for (std::int32_t l = 0; l < c.num_layers; ++l)
      for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
        const std::int32_t T = c.length(l, seqs[i], h);
        const std::int32_t rows = prefill ? std::min(window, T) : 1;
        std::vector<float> keys(static_cast<std::size_t>(T) * d), qs(static_cast<std::size_t>(rows) * G * d),
            m(static_cast<std::size_t>(T));
        std::vector<std::int32_t> pos;
        for (std::int32_t s = 0; s < T; ++s) {
          const std::byte* row = c.k_row(l, seqs[i], h, s);
          for (std::int32_t e = 0; e < d; ++e)
            keys[static_cast<std::size_t>(s) * d + e] = kvp::load_as_float(row, c.type, e);
          m[static_cast<std::size_t>(s)] = c.metric.at(l, c.physical_block(l, seqs[i], h, s), s % b);
          if (!c.positions.empty()) pos.push_back(c.positions.at(l, c.physical_block(l, seqs[i], h, s), s % b));
        }
        for (std::int32_t j = 0; j < rows; ++j)
          for (std::int32_t g = 0; g < G; ++g) {
            const std::byte* row = q.row(l, slots[i], q.window - rows + j, h * G + g);
            for (std::int32_t e = 0; e < d; ++e)
              qs[(static_cast<std::size_t>(j) * G + g) * d + e] = kvp::load_as_float(row, q.type, e);
          }
        if (prefill) p.metric.prefill(qs, keys, G, d, m);
        else p.metric.decode(qs, keys, G, d, m, qpos[i], pos);
        for (std::int32_t s = 0; s < T; ++s)
          c.metric.at(l, c.physical_block(l, seqs[i], h, s), s % b) = m[static_cast<std::size_t>(s)];
      }
}

// The policy's budget turned into blocks to free, read off host lengths
// [layers, seqs, h_kv]: one count per item (sequence budget) or per item and layer.
nb::ndarray<nb::numpy, std::int64_t> blocks_to_free(const kv_compress& p, nb::handle lengths_arg,
                                                    std::int32_t block_size, nb::handle seqs_arg,
                                                    nb::handle logical_arg) {
  const array lengths = readable(lengths_arg, "lengths");
  require_ndim(lengths, 3, "lengths", "[layers, seqs, kv_heads]");
  require_dtype(lengths, int32_type, "lengths", "int32");
  require(!place_of(lengths, "lengths").device, "lengths", "lives on CUDA memory; the budget reads host lengths");
  const array seqs = readable(seqs_arg, "seqs"), logical = readable(logical_arg, "logical_lengths");
  require_vector(seqs, "seqs");
  require_dtype(seqs, nb::dtype<std::int64_t>(), "seqs", "int64");
  require_vector(logical, "logical_lengths");
  require_dtype(logical, nb::dtype<std::int64_t>(), "logical_lengths", "int64");
  require(logical.shape(0) == seqs.shape(0), "logical_lengths", "has {} entries; seqs has {}", logical.shape(0),
          seqs.shape(0));
  kvp::per_head_kv_view c;
  c.num_layers = to_i32(lengths.shape(0), "lengths", "layers");
  c.num_seqs = to_i32(lengths.shape(1), "lengths", "sequences");
  c.num_kv_heads = to_i32(lengths.shape(2), "lengths", "KV heads");
  c.block_size = block_size;
  c.lengths = {static_cast<const std::int32_t*>(lengths.data()), nullptr, lengths.stride(0), lengths.stride(1),
               lengths.stride(2)};
  const bool per_layer = p.select.budget == kvp::select::block_budget::layer;
  const std::size_t n = seqs.shape(0), groups = per_layer ? static_cast<std::size_t>(c.num_layers) : 1;
  std::vector<std::int64_t> out(n * groups);
  const auto* s = static_cast<const std::int64_t*>(seqs.data());
  const auto* g = static_cast<const std::int64_t*>(logical.data());
  for (std::size_t i = 0; i < n; ++i) {
    require(s[i] >= 0 && s[i] < c.num_seqs, kvp::detail::path("seqs[{}]", i), "is {}; lengths has {} sequences", s[i],
            c.num_seqs);
    require(g[i] >= -1 && g[i] <= INT32_MAX, kvp::detail::path("logical_lengths[{}]", i),
            "is {}; expected -1 (the longest head) or a position count", g[i]);
    p.blocks_to_free(c, static_cast<std::int32_t>(s[i]), static_cast<std::int32_t>(g[i]),
                     std::span<std::int64_t>(out.data() + i * groups, groups));
  }
  return to_numpy(std::move(out), {n, groups});
}

#ifdef KVPOLICY_PYTHON_WITH_CUDA

void* as_stream(std::uintptr_t s) { return reinterpret_cast<void*>(s); }

struct device_args {
  per_head_tensors tensors;
  per_head_call call;
  array items_keep;
};

void describe(device_args& a, const kv_compress& p, nb::handle k, nb::handle v, nb::handle metric, nb::handle tables,
              nb::handle lengths, nb::handle positions, nb::handle items_arg, std::uintptr_t stream) {
  a.tensors = read_per_head(k, v, metric, tables, lengths, positions);
  require(a.tensors.at.device, "k", "lives on the host; the device path runs on CUDA memory");
  per_head_call& call = a.call;
  call.view = a.tensors.view;
  call.select = p.select;
  call.device_id = a.tensors.at.id;
  call.stream = as_stream(stream);
  a.items_keep = readable(items_arg, "items");
  std::int32_t cols = 0;
  const std::int64_t* rows = item_rows(a.items_keep, p, call.view.num_layers, cols);
  call.columns = cols;
  call.num_items = to_i32(a.items_keep.shape(0), "items", "rows");
  const place at = place_of(a.items_keep, "items");
  if (at.device) {
    require_place(at, a.tensors.at, "items");
    call.device_items = rows;
  } else {
    call.host_items = rows;  // read on the host while launching (kernel arguments)
  }
}

template <class T>
T* output(const nb::dict& out, const char* name, nb::dlpack::dtype type, const char* type_name,
          std::vector<std::size_t> shape, const place& at, std::vector<mut_array>& keep) {
  const std::string field = std::string("out.") + name;
  require(out.contains(name) && !out[name].is_none(), field, "is missing");
  mut_array a = writable(out[name], field);
  require_dtype(a, type, field, type_name);
  require_place(place_of(a, field), at, field);
  bool packed = a.ndim() == shape.size();
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); packed && i-- > 0;) {
    packed = a.shape(i) == shape[i] && (shape[i] <= 1 || a.stride(i) == expect);
    expect *= static_cast<std::int64_t>(shape[i]);
  }
  require(packed, field, "has shape {} and strides {}; expected a contiguous array of {} axes", shape_of(a),
          strides_of(a), shape.size());
  T* p = static_cast<T*>(a.data());
  keep.push_back(std::move(a));
  return p;
}

std::size_t ws_bytes_binding(const kv_compress& p, nb::handle k, nb::handle v, nb::handle metric,
                                   nb::handle tables, nb::handle lengths, nb::handle positions, nb::handle items) {
  device_args a;
  describe(a, p, k, v, metric, tables, lengths, positions, items, 0);
  return device_per_head_workspace_bytes(a.call);
}

void compress_binding(const kv_compress& p, nb::handle k, nb::handle v, nb::handle metric, nb::handle tables,
                     nb::handle lengths, nb::handle positions, nb::handle items, const nb::dict& out,
                     nb::handle workspace, std::uintptr_t stream, bool check) {
  device_args a;
  describe(a, p, k, v, metric, tables, lengths, positions, items, stream);
  const kvp::per_head_kv_view& c = a.call.view;
  const std::size_t n = static_cast<std::size_t>(a.call.num_items), L = static_cast<std::size_t>(c.num_layers),
                    H = static_cast<std::size_t>(c.num_kv_heads), mb = static_cast<std::size_t>(c.max_blocks);
  const place& at = a.tensors.at;
  std::vector<mut_array> keep;
  per_head_outputs o;
  o.status = output<std::int32_t>(out, "status", int32_type, "int32", {8}, at, keep);
  o.new_lengths = output<std::int32_t>(out, "new_lengths", int32_type, "int32", {n, L, H}, at, keep);
  o.freed_counts = output<std::int32_t>(out, "freed_counts", int32_type, "int32", {n, L, H}, at, keep);
  o.freed_blocks = output<std::int32_t>(out, "freed_blocks", int32_type, "int32", {n, L, H, mb}, at, keep);
  o.evicted = output<std::int32_t>(out, "evicted", int32_type, "int32", {n, L, H}, at, keep);
  o.moved = output<std::int32_t>(out, "moved", int32_type, "int32", {n, L, H}, at, keep);
  o.freed = output<std::int64_t>(out, "freed", nb::dtype<std::int64_t>(), "int64", {n}, at, keep);
  o.nonfinite = output<std::int64_t>(out, "nonfinite_metrics", nb::dtype<std::int64_t>(), "int64", {n}, at, keep);
  mut_array ws = writable(workspace, "workspace");
  require_place(place_of(ws, "workspace"), at, "workspace");
  require(ws.ndim() == 1 && (ws.shape(0) <= 1 || ws.stride(0) == 1), "workspace",
          "has shape {} and strides {}; expected a contiguous 1-D array", shape_of(ws), strides_of(ws));
  device_compress_per_head(a.call, o, ws.data(), ws.nbytes());
  if (check) {
    const device_scope on(at.id);
    check_status(o.status, a.call.stream);  // kvpolicy.compress_per_head refuses check under capture
  }
}

std::size_t metric_ws_binding(const kv_compress& p, nb::handle queries, nb::handle k, nb::handle metric,
                              nb::handle tables, nb::handle lengths, nb::handle positions, std::int32_t num_items,
                              bool prefill) {
  per_head_tensors t = read_per_head(k, k, metric, tables, lengths, positions);
  require(t.at.device, "k", "lives on the host; the device path runs on CUDA memory");
  array q_keep;
  per_head_metric_call call;
  call.view = t.view;
  call.metric = p.metric;
  call.queries = read_queries(queries, t.view, t.at, q_keep);
  call.num_items = num_items;
  call.prefill = prefill;
  call.device_id = t.at.id;
  return device_per_head_metric_workspace_bytes(call);
}

void metric_binding(const kv_compress& p, nb::handle queries, nb::handle k, nb::handle metric, nb::handle tables,
                    nb::handle lengths, nb::handle positions, nb::handle seqs_arg, nb::handle slots_arg,
                    nb::handle qpos_arg, bool prefill, nb::handle status_arg, nb::handle workspace,
                    std::uintptr_t stream, bool check) {
  per_head_tensors t = read_per_head(k, k, metric, tables, lengths, positions);
  require(t.at.device, "k", "lives on the host; the device path runs on CUDA memory");
  array q_keep;
  per_head_metric_call call;
  call.view = t.view;
  call.metric = p.metric;
  call.queries = read_queries(queries, t.view, t.at, q_keep);
  const array seqs_a = readable(seqs_arg, "seqs");
  require_vector(seqs_a, "seqs");
  const std::size_t n = seqs_a.shape(0);
  const std::vector<std::int32_t> seqs = item_column(seqs_arg, "seqs", n),
                                  slots = item_column(slots_arg, "query_slots", n),
                                  qpos = item_column(qpos_arg, "query_positions", n);
  call.seqs = seqs.data();
  call.slots = slots.data();
  call.query_positions = qpos.data();
  call.num_items = to_i32(n, "seqs", "items");
  call.prefill = prefill;
  call.device_id = t.at.id;
  call.stream = as_stream(stream);
  mut_array status = writable(status_arg, "status");
  require_vector(status, "status");
  require_dtype(status, int32_type, "status", "int32");
  require(status.shape(0) == 8, "status", "has {} words; expected 8", status.shape(0));
  require_place(place_of(status, "status"), t.at, "status");
  mut_array ws = writable(workspace, "workspace");
  require_place(place_of(ws, "workspace"), t.at, "workspace");
  require(ws.ndim() == 1 && (ws.shape(0) <= 1 || ws.stride(0) == 1), "workspace",
          "has shape {} and strides {}; expected a contiguous 1-D array", shape_of(ws), strides_of(ws));
  auto* words = static_cast<std::int32_t*>(status.data());
  device_per_head_metric(call, words, ws.data(), ws.nbytes());
  if (check) {
    const device_scope on(t.at.id);
    check_status(words, call.stream);
  }
}

#endif

}  // namespace

void register_per_head(nb::module_& m) {
  m.def("host_compress_per_head", &host_compress_per_head, nb::arg("policy"), nb::arg("k"), nb::arg("v"),
        nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(), nb::arg("items"),
        nb::arg("communicator").none(), nb::arg("first_head"), nb::arg("total_heads"),
        "kvp::host::compress_per_head over host arrays (kvpolicy.compress_per_head is the API).");
  m.def("kv_compress_blocks_to_free", &blocks_to_free, nb::arg("policy"), nb::arg("lengths"), nb::arg("block_size"),
        nb::arg("seqs"), nb::arg("logical_lengths"),
        "kvp::presets::kv_compress::blocks_to_free for each item, from host lengths (kvpolicy.blocks_to_free).");
  m.def("host_per_head_metric", &host_per_head_metric, nb::arg("policy"), nb::arg("queries"), nb::arg("k"),
        nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(), nb::arg("seqs"),
        nb::arg("query_slots"), nb::arg("query_positions"), nb::arg("prefill"),
        "scorer::squared_attention_metric per row over host arrays (kvpolicy.per_head_metric is the API).");
#ifdef KVPOLICY_PYTHON_WITH_CUDA
  m.def("device_per_head_metric_workspace_bytes", &metric_ws_binding, nb::arg("policy"), nb::arg("queries"),
        nb::arg("k"), nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(),
        nb::arg("num_items"), nb::arg("prefill"));
  m.def("device_per_head_metric", &metric_binding, nb::arg("policy"), nb::arg("queries"), nb::arg("k"),
        nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(), nb::arg("seqs"),
        nb::arg("query_slots"), nb::arg("query_positions"), nb::arg("prefill"), nb::arg("status"),
        nb::arg("workspace"), nb::arg("stream"), nb::arg("check"),
        "kvp::cuda_per_head_metric on `stream` (kvpolicy.per_head_metric is the API).");
  m.def("device_per_head_workspace_bytes", &ws_bytes_binding, nb::arg("policy"), nb::arg("k"), nb::arg("v"),
        nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(), nb::arg("items"));
  m.def("device_compress_per_head", &compress_binding, nb::arg("policy"), nb::arg("k"), nb::arg("v"),
        nb::arg("metric"), nb::arg("tables"), nb::arg("lengths"), nb::arg("positions").none(), nb::arg("items"),
        nb::arg("out"), nb::arg("workspace"), nb::arg("stream"), nb::arg("check"),
        "kvp::cuda_per_head_executor on `stream` (kvpolicy.compress_per_head is the API).");
#endif
}

}  // namespace kvpy
