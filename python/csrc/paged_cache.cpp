#include "paged_cache.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

#include <kvpolicy/core/error.hpp>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "layouts.hpp"
#include "side_views.hpp"

namespace nb = nanobind;
using kvp::require;
using kvp::detail::format;

namespace kvpy {
namespace {

// Whether this build can run on CUDA memory.
constexpr bool with_cuda =
#ifdef KVPOLICY_PYTHON_WITH_CUDA
    true;
#else
    false;
#endif

// The tensors of one role (the combined K/V, or K, or V), every layer of them.
struct tensor_group {
  std::vector<std::byte*> layers;  // where each layer's tensor starts
  std::vector<std::int64_t> sizes, strides;  // per axis of the layout's (per-layer) axes
  kvp::dtype type{};
  place where;
  std::string field;  // the argument, for errors
  nb::handle first;   // the first tensor object (its type names the framework)

  std::int64_t size(char axis, std::string_view axes) const {
    const auto i = axes.find(axis);
    return i == std::string_view::npos ? 1 : sizes[i];
  }
  std::int64_t stride(char axis, std::string_view axes) const { return strides[axes.find(axis)]; }
};

// Reads `src`: for a per-layer layout a list (or tuple) of per-layer tensors, or one
// tensor with a leading layer axis; otherwise one tensor with its own layer axis.
tensor_group read_group(nb::handle src, const layout_spec& spec, const std::string& field,
                        std::vector<mut_array>& keep) {
  tensor_group g;
  g.field = field;
  const std::string_view axes = spec.axes;
  const bool listed = nb::isinstance<nb::list>(src) || nb::isinstance<nb::tuple>(src);
  require(!listed || spec.per_layer, field, "is a {}; layout '{}' takes one tensor {}",
          nb::cast<std::string>(nb::type_name(src.type())), spec.name, spec.engine);
  if (listed) {
    const nb::sequence seq = nb::borrow<nb::sequence>(src);
    const std::size_t n = nb::len(seq);
    require(n > 0, field, "is an empty {}; one tensor per layer is needed", nb::cast<std::string>(nb::type_name(src.type())));
    for (std::size_t l = 0; l < n; ++l) {
      const std::string at = format("{}[{}]", field, l);
      mut_array a = writable(seq[l], at);
      require_ndim(a, axes.size(), at, spec.engine.data());
      if (l == 0) {
        g.type = cache_dtype(a, at);
        g.where = place_of(a, at);
        g.first = seq[0];
        for (std::size_t i = 0; i < a.ndim(); ++i) {
          g.sizes.push_back(static_cast<std::int64_t>(a.shape(i)));
          g.strides.push_back(a.stride(i));
        }
      } else {
        // One view describes every layer: the same shape, strides and type.
        const std::string first = format("{}[0]", field);
        require(cache_dtype(a, at) == g.type, at, "has element type {}; {} has {}", dtype_name(a), first,
                kvp::name_of(g.type));
        require_place(place_of(a, at), g.where, at);
        for (std::size_t i = 0; i < a.ndim(); ++i) {
          require(static_cast<std::int64_t>(a.shape(i)) == g.sizes[i], at, "has shape {}; {} has another", shape_of(a),
                  first);
          require(a.shape(i) <= 1 || a.stride(i) == g.strides[i], at, "has strides {}; {} has other strides",
                  strides_of(a), first);
        }
      }
      g.layers.push_back(static_cast<std::byte*>(a.data()));
      keep.push_back(std::move(a));
    }
    return g;
  }
  mut_array a = writable(src, field);
  const std::string full = spec.per_layer ? "L" + std::string(axes) : std::string(axes);
  require_ndim(a, full.size(), field,
               spec.per_layer ? format("(a list of per-layer tensors, or one with a leading layer axis) of {}", spec.engine).c_str()
                              : spec.engine.data());
  g.type = cache_dtype(a, field);
  g.where = place_of(a, field);
  g.first = src;
  const std::size_t li = full.find('L');
  const std::int64_t layer_stride = a.stride(li) * kvp::size_of(g.type);
  for (std::size_t l = 0; l < a.shape(li); ++l)
    g.layers.push_back(static_cast<std::byte*>(a.data()) + static_cast<std::int64_t>(l) * layer_stride);
  require(!g.layers.empty(), field, "has shape {}; no layer", shape_of(a));
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    if (i == li) continue;
    g.sizes.push_back(static_cast<std::int64_t>(a.shape(i)));
    g.strides.push_back(a.stride(i));
  }
  keep.push_back(std::move(a));
  return g;
}

// The layout's axes without the layer axis (how tensor_group indexes sizes).
std::string axes_without_layer(const layout_spec& spec) {
  std::string a(spec.axes);
  if (const auto i = a.find('L'); i != std::string::npos) a.erase(i, 1);
  return a;
}

std::int32_t to_int32(std::int64_t v, const std::string& field, const char* what) {
  require(v > 0 && v <= INT32_MAX, field, "has {} {}; must be in [1, 2^31)", what, v);
  return static_cast<std::int32_t>(v);
}

paged_cache make_cache(const std::string& layout, nb::handle kv, nb::handle k, nb::handle v, nb::handle block_table,
                       nb::handle block_indptr, nb::handle block_indices, nb::handle lengths, nb::handle positions,
                       nb::handle live, nb::handle refcounts, nb::handle shared_bitmask) {
  const layout_spec& spec = find_layout(layout, "layout");
  paged_cache c;
  c.layout = spec.name;
  cache_description& d = c.desc;
  const std::string axes = axes_without_layer(spec);

  // K and V: one group (both in each tensor, V at the '2' axis' index 1) or two.
  std::optional<tensor_group> kg, vg;
  if (spec.split_kv) {
    require(kv.is_none(), "kv", "is given; layout '{}' takes separate k and v ({})", spec.name, spec.engine);
    require(!k.is_none(), "k", "is None; layout '{}' takes separate k and v ({})", spec.name, spec.engine);
    require(!v.is_none(), "v", "is None; layout '{}' takes separate k and v ({})", spec.name, spec.engine);
    kg = read_group(k, spec, "k", c.written);
    vg = read_group(v, spec, "v", c.written);
    require(vg->layers.size() == kg->layers.size(), "v", "has {} layers; k has {}", vg->layers.size(), kg->layers.size());
    require(vg->type == kg->type, "v", "has element type {}; k has {}", kvp::name_of(vg->type), kvp::name_of(kg->type));
    require_place(vg->where, kg->where, "v");
    require(vg->sizes == kg->sizes, "v", "has other sizes than k; both are {}", spec.engine);
  } else {
    require(k.is_none() && v.is_none(), k.is_none() ? "v" : "k", "is given; layout '{}' takes one kv argument ({})",
            spec.name, spec.engine);
    require(!kv.is_none(), "kv", "is None; layout '{}' takes the cache as kv ({})", spec.name, spec.engine);
    kg = read_group(kv, spec, "kv", c.written);
  }
  const tensor_group& K = *kg;
  const std::string module = nb::cast<std::string>(nb::handle(K.first.type()).attr("__module__"));
  c.framework = module.substr(0, module.find('.'));
  // K and V side by side along one axis (C): V starts head_dim elements along it.
  const bool packed = axes.find('C') != std::string::npos;
  if (packed) {
    require(K.size('C', axes) % 2 == 0, K.field, "has {} elements on its K|V axis; expected 2 * head_dim ({})",
            K.size('C', axes), spec.engine);
  } else if (!spec.split_kv) {
    require(K.size('2', axes) == 2, K.field, "has {} entries on its K/V axis; expected 2 ({})", K.size('2', axes),
            spec.engine);
  }
  d.shape.num_layers = to_int32(static_cast<std::int64_t>(K.layers.size()), K.field, "layer count");
  d.shape.num_blocks = to_int32(K.size('B', axes), K.field, "block count");
  d.shape.block_size = to_int32(K.size('T', axes), K.field, "block size");
  d.shape.num_kv_heads = to_int32(K.size('H', axes), K.field, "KV head count");
  d.shape.head_dim = to_int32(packed ? K.size('C', axes) / 2 : K.size('D', axes), K.field, "head dim");
  d.shape.type = K.type;
  d.on_device = K.where.device;
  d.device_id = K.where.id;
  require(!d.on_device || with_cuda, K.field,
          "lives on {}, but this kvpolicy was built without its CUDA path (KVPOLICY_PYTHON_CUDA=OFF, or no nvcc "
          "when it was built); reinstall it with nvcc on PATH: pip install ./python",
          describe(K.where));

  // Strides in elements. Without a token axis (SGLang: blocks of one token) the slot
  // is always 0. The stride of an axis of size 1 is never multiplied by a nonzero
  // index, and frameworks leave it arbitrary (a broadcast, an unsqueeze): it becomes
  // the extent it would have in a packed tensor, so the executors' checks that rows
  // do not overlap hold.
  const auto strides_of_group = [&](const tensor_group& g) {
    const bool has_token = axes.find('T') != std::string::npos;
    const std::int64_t b = d.shape.block_size, h = d.shape.num_kv_heads, hd = d.shape.head_dim;
    kvp::kv_strides s{g.stride('B', axes), has_token ? g.stride('T', axes) : 0, g.stride('H', axes),
                      g.stride(packed ? 'C' : 'D', axes)};
    if (hd == 1) s.dim = 1;
    if (b == 1) s.token = std::max(hd, s.head * h);
    if (h == 1) s.head = std::max(hd, s.token * b);
    if (d.shape.num_blocks == 1) s.block = (b - 1) * s.token + (h - 1) * s.head + hd;
    return s;
  };
  d.k_stride = strides_of_group(K);
  d.v_stride = strides_of_group(spec.split_kv ? *vg : K);
  for (std::size_t l = 0; l < K.layers.size(); ++l) {
    d.k_layers.push_back(K.layers[l]);
    const std::int64_t v_offset = packed ? d.shape.head_dim * K.stride('C', axes) : K.stride('2', axes);
    d.v_layers.push_back(spec.split_kv ? static_cast<void*>(vg->layers[l])
                                       : K.layers[l] + v_offset * kvp::size_of(K.type));
  }

  // The block table: dense [num_seqs, max_blocks] or CSR (indptr, indices).
  const bool csr = !block_indptr.is_none() || !block_indices.is_none();
  if (csr) {
    require(block_table.is_none(), "block_table", "is given with block_indptr / block_indices; pass one table");
    array indptr = readable(block_indptr, "block_indptr");
    array indices = readable(block_indices, "block_indices");
    for (auto* a : {&indptr, &indices}) {
      const std::string f = a == &indptr ? "block_indptr" : "block_indices";
      require_vector(*a, f);
      require_dtype(*a, int32_type, f, "int32");
      require_place(place_of(*a, f), K.where, f);
    }
    require(indptr.shape(0) >= 2, "block_indptr", "has shape {}; a CSR table of n sequences has n + 1 entries",
            shape_of(indptr));
    d.seqs.table = kvp::block_table_view::csr(static_cast<const std::int32_t*>(indptr.data()),
                                              static_cast<const std::int32_t*>(indices.data()));
    d.seqs.num_seqs = static_cast<std::int32_t>(indptr.shape(0) - 1);
    d.max_tokens = static_cast<std::int32_t>(
        std::min<std::int64_t>(INT32_MAX, static_cast<std::int64_t>(indices.shape(0)) * d.shape.block_size));
    c.read.push_back(std::move(indptr));
    c.read.push_back(std::move(indices));
  } else {
    array table = readable(block_table, "block_table");
    require_ndim(table, 2, "block_table", "[num_seqs, max_blocks] (or pass block_indptr and block_indices)");
    require_dtype(table, int32_type, "block_table", "int32");
    require_place(place_of(table, "block_table"), K.where, "block_table");
    require(table.shape(1) <= 1 || table.stride(1) == 1, "block_table",
            "has strides {}; each row's entries must be adjacent", strides_of(table));
    require(table.shape(0) > 0 && table.shape(1) > 0, "block_table", "has shape {}; empty", shape_of(table));
    // A dense row's capacity is its stride to the executors: a padded or sliced row
    // would be read past its entries, so rows must be packed.
    require(table.shape(0) == 1 || table.stride(0) == static_cast<std::int64_t>(table.shape(1)), "block_table",
            "has shape {} and strides {}; rows must be contiguous and unpadded", shape_of(table), strides_of(table));
    d.seqs.table = kvp::block_table_view::dense(static_cast<const std::int32_t*>(table.data()),
                                                static_cast<std::int64_t>(table.shape(1)));
    d.seqs.num_seqs = static_cast<std::int32_t>(table.shape(0));
    d.max_tokens = static_cast<std::int32_t>(
        std::min<std::int64_t>(INT32_MAX, static_cast<std::int64_t>(table.shape(1)) * d.shape.block_size));
    c.read.push_back(std::move(table));
  }

  array lens = readable(lengths, "lengths");
  require_vector(lens, "lengths");
  require_dtype(lens, int32_type, "lengths", "int32");
  require_place(place_of(lens, "lengths"), K.where, "lengths");
  require(static_cast<std::int64_t>(lens.shape(0)) == d.seqs.num_seqs, "lengths",
          "has {} entries; the block table has {} sequences", lens.shape(0), d.seqs.num_seqs);
  d.seqs.lengths = static_cast<const std::int32_t*>(lens.data());
  c.read.push_back(std::move(lens));

  if (!positions.is_none()) {
    mut_array p;
    d.positions = slot_array<std::int32_t>(positions, "positions", d.shape, K.where, "int32", p);
    c.written.push_back(std::move(p));
  }
  if (!live.is_none()) {
    mut_array a;
    d.live = slot_array<std::uint8_t>(live, "live", d.shape, K.where, "uint8 or bool", a, {bool_type});
    c.written.push_back(std::move(a));
  }
  if (!refcounts.is_none()) {
    array r = readable(refcounts, "refcounts");
    require_vector(r, "refcounts");
    require_dtype(r, int32_type, "refcounts", "int32");
    require_place(place_of(r, "refcounts"), K.where, "refcounts");
    require(static_cast<std::int64_t>(r.shape(0)) >= d.shape.num_blocks, "refcounts",
            "has {} entries; the cache has {} blocks", r.shape(0), d.shape.num_blocks);
    d.seqs.sharing.refcounts = static_cast<const std::int32_t*>(r.data());
    c.read.push_back(std::move(r));
  }
  if (!shared_bitmask.is_none()) {
    array b = readable(shared_bitmask, "shared_bitmask");
    require_vector(b, "shared_bitmask");
    require(b.dtype() == int32_type || b.dtype() == uint32_type, "shared_bitmask",
            "has element type {}; expected uint32 (or int32) words", dtype_name(b));
    require_place(place_of(b, "shared_bitmask"), K.where, "shared_bitmask");
    const std::int64_t words = (std::int64_t{d.shape.num_blocks} + 31) / 32;
    require(static_cast<std::int64_t>(b.shape(0)) >= words, "shared_bitmask",
            "has {} words; {} blocks need {}", b.shape(0), d.shape.num_blocks, words);
    d.seqs.sharing.bitmask = static_cast<const std::uint32_t*>(b.data());
    c.read.push_back(std::move(b));
  }
  return c;
}

}  // namespace

void register_paged_cache(nb::module_& m) {
  nb::class_<paged_cache>(m, "PagedCache",
                          "An engine's paged KV cache, read in place: K/V tensors in a named layout, the block table "
                          "and the lengths (and optionally positions, the live bytes of cautious update and "
                          "shared-block markers).\n\n"
                          "The shape (layers, blocks, block size, KV heads, head dim, dtype) and the strides are read "
                          "off the tensors. Nothing is copied; the arrays stay referenced by this object. The executors "
                          "write K, V, positions and live bytes in place and never write the block table or lengths.")
      .def(
          "__init__",
          [](paged_cache* self, const std::string& layout, nb::handle kv, nb::handle k, nb::handle v,
             nb::handle block_table, nb::handle block_indptr, nb::handle block_indices, nb::handle lengths,
             nb::handle positions, nb::handle live, nb::handle refcounts, nb::handle shared_bitmask) {
            require(!lengths.is_none(), "lengths", "is None; the tokens held by each sequence ([num_seqs] int32) are needed");
            require(!block_table.is_none() || !block_indptr.is_none() || !block_indices.is_none(), "block_table",
                    "is None; pass a dense block_table [num_seqs, max_blocks] or block_indptr and block_indices");
            new (self) paged_cache(make_cache(layout, kv, k, v, block_table, block_indptr, block_indices, lengths,
                                              positions, live, refcounts, shared_bitmask));
          },
          nb::arg("layout"), nb::arg("kv") = nb::none(), nb::kw_only(), nb::arg("k") = nb::none(),
          nb::arg("v") = nb::none(), nb::arg("block_table") = nb::none(), nb::arg("block_indptr") = nb::none(),
          nb::arg("block_indices") = nb::none(), nb::arg("lengths") = nb::none(), nb::arg("positions") = nb::none(),
          nb::arg("live") = nb::none(), nb::arg("refcounts") = nb::none(), nb::arg("shared_bitmask") = nb::none())
      .def_ro("layout", &paged_cache::layout)
      .def_ro("framework", &paged_cache::framework, "the module of the cache tensors' type: 'numpy', 'torch', ...")
      .def_prop_ro("num_layers", [](const paged_cache& c) { return c.desc.shape.num_layers; })
      .def_prop_ro("num_blocks", [](const paged_cache& c) { return c.desc.shape.num_blocks; })
      .def_prop_ro("block_size", [](const paged_cache& c) { return c.desc.shape.block_size; })
      .def_prop_ro("num_kv_heads", [](const paged_cache& c) { return c.desc.shape.num_kv_heads; })
      .def_prop_ro("head_dim", [](const paged_cache& c) { return c.desc.shape.head_dim; })
      .def_prop_ro("num_seqs", [](const paged_cache& c) { return c.desc.seqs.num_seqs; })
      .def_prop_ro("dtype", [](const paged_cache& c) {
        switch (c.desc.shape.type) {
          case kvp::dtype::f16: return "float16";
          case kvp::dtype::bf16: return "bfloat16";
          default: return "float32";
        }
      })
      .def_prop_ro("device", [](const paged_cache& c) -> nb::object {
        return c.desc.on_device ? nb::object(nb::int_(c.desc.device_id)) : nb::none();
      }, "the CUDA device of the tensors, or None for host memory")
      .def_prop_ro("max_tokens", [](const paged_cache& c) { return c.desc.max_tokens; },
                   "the most tokens the block table has room for in one sequence (the device path's default "
                   "max_tokens)")
      .def(
          "describe",
          [](const paged_cache& c) {
            const auto strides = [](const kvp::kv_strides& s) { return nb::make_tuple(s.block, s.token, s.head, s.dim); };
            const auto addresses = [](const std::vector<void*>& v) {
              nb::list l;
              for (void* p : v) l.append(reinterpret_cast<std::uintptr_t>(p));
              return l;
            };
            nb::dict d;
            d["k_stride"] = strides(c.desc.k_stride);
            d["v_stride"] = strides(c.desc.v_stride);
            d["k_layers"] = addresses(c.desc.k_layers);
            d["v_layers"] = addresses(c.desc.v_layers);
            d["csr"] = c.desc.seqs.table.is_csr();
            return d;
          },
          "The view the executors get: K and V strides (block, token, head, dim) in elements and each layer's K and "
          "V address.")
      .def("__repr__", [](const paged_cache& c) {
        const auto& s = c.desc.shape;
        return format("PagedCache(layout='{}', layers={}, blocks={}, block_size={}, kv_heads={}, head_dim={}, dtype={}, "
                      "seqs={}, on {})",
                      c.layout, s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim,
                      kvp::name_of(s.type), c.desc.seqs.num_seqs,
                      describe(place{c.desc.on_device, c.desc.device_id}));
      });

  nb::dict layouts;
  for (const layout_spec& s : layout_specs) layouts[nb::str(s.name.data(), s.name.size())] = nb::make_tuple(
      nb::str(s.axes.data(), s.axes.size()), s.split_kv, s.per_layer, nb::str(s.engine.data(), s.engine.size()));
  m.attr("LAYOUTS") = layouts;
}

}  // namespace kvpy
