#include "device_binding.hpp"

#ifdef KVPOLICY_PYTHON_WITH_CUDA

#include <cstdint>
#include <string>
#include <vector>

#include <kvpolicy/core/error.hpp>
#include <kvpolicy/exec/validate.hpp>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "device_compress.hpp"
#include "items.hpp"
#include "paged_cache.hpp"
#include "policy.hpp"
#include "side_views.hpp"

namespace nb = nanobind;
using kvp::require;

namespace kvpy {
namespace {

void* as_stream(std::uintptr_t s) { return reinterpret_cast<void*>(s); }

// The call's description from the arguments kvpolicy.compress passes.
struct call_args {
  device_call call;
  array items_keep, queries_keep;
  mut_array scores_keep;
  std::vector<kvp::batch_item> host_items;
};

void describe_call(call_args& a, const paged_cache& cache, nb::handle items_arg, nb::handle queries,
                   nb::handle scores, std::int32_t layer_begin, std::int32_t layer_count, std::int32_t max_tokens,
                   std::uintptr_t stream) {
  const cache_description& c = cache.desc;
  require(c.on_device, "cache", "lives on the host; the device path runs on CUDA memory");
  device_call& call = a.call;
  call.cache = &c;
  call.stream = as_stream(stream);
  call.layer_begin = layer_begin;
  call.layer_count = layer_count;
  call.max_tokens = max_tokens ? max_tokens : c.max_tokens;
  call.queries = queries_view(queries, c, a.queries_keep);
  call.scores = scores_view(scores, c, a.scores_keep);

  a.items_keep = readable(items_arg, "items");
  const array& items = a.items_keep;
  const kvp::batch_item* rows = item_rows(items);
  call.num_items = static_cast<std::int32_t>(items.shape(0));
  const place at = place_of(items, "items");
  if (at.device) {
    require_place(at, place{true, c.device_id}, "items");
    call.device_items = rows;
  } else {
    a.host_items.assign(rows, rows + call.num_items);
    call.host_items = a.host_items.data();
  }
}

template <class T>
T* output(const nb::dict& out, const char* name, nb::dlpack::dtype type, const char* type_name,
          std::vector<std::size_t> shape, const cache_description& c, std::vector<mut_array>& keep) {
  const std::string field = std::string("out.") + name;
  if (!out.contains(name) || out[name].is_none()) return nullptr;
  mut_array a = writable(out[name], field);
  require_dtype(a, type, field, type_name);
  require_place(place_of(a, field), place{true, c.device_id}, field);
  bool packed = a.ndim() == shape.size();
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); packed && i-- > 0;) {
    packed = a.shape(i) == shape[i] && (shape[i] <= 1 || a.stride(i) == expect);
    expect *= static_cast<std::int64_t>(shape[i]);
  }
  std::string want = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) want += kvp::detail::format(i ? ", {}" : "{}", shape[i]);
  require(packed, field, "has shape {} and strides {}; expected a contiguous {})", shape_of(a), strides_of(a), want);
  T* p = static_cast<T*>(a.data());
  keep.push_back(std::move(a));
  return p;
}

std::size_t workspace_bytes(const policy& pol, const paged_cache& cache, nb::handle items, nb::handle queries,
                            nb::handle scores, std::int32_t layer_begin, std::int32_t layer_count,
                            std::int32_t max_tokens, bool return_masks) {
  call_args a;
  describe_call(a, cache, items, queries, scores, layer_begin, layer_count, max_tokens, 0);
  a.call.masks = return_masks;
  return std::visit(
      [&](const auto& p) -> std::size_t {
        return device_workspace_bytes(p, a.call);
      },
      pol);
}

void compress(const policy& pol, const paged_cache& cache, nb::handle items, nb::handle queries, nb::handle scores,
              std::int32_t layer_begin, std::int32_t layer_count, std::int32_t max_tokens, const nb::dict& out,
              nb::handle workspace, std::uintptr_t stream, bool check) {
  call_args a;
  describe_call(a, cache, items, queries, scores, layer_begin, layer_count, max_tokens, stream);
  device_call& call = a.call;
  const cache_description& c = cache.desc;

  const std::size_t n = static_cast<std::size_t>(call.num_items);
  const std::size_t max_blocks = (call.max_tokens + c.shape.block_size - 1) / c.shape.block_size;
  const kvp::layer_range range = kvp::resolve_layers(
      kvp::compression_batch{{}, layer_begin, layer_count}, c.view(c.k_layers.data(), c.v_layers.data()));
  const std::int32_t layers = range.end - range.begin;
  const std::size_t h = static_cast<std::size_t>(c.shape.num_kv_heads), L = static_cast<std::size_t>(layers);
  const std::size_t width = static_cast<std::size_t>(call.max_tokens);
  std::vector<mut_array> keep;
  device_outputs o;
  o.status = output<std::int32_t>(out, "status", int32_type, "int32", {8}, c, keep);
  o.new_lengths = output<std::int32_t>(out, "new_lengths", int32_type, "int32", {n}, c, keep);
  o.released_counts = output<std::int32_t>(out, "released_counts", int32_type, "int32", {n}, c, keep);
  o.released_blocks = output<std::int32_t>(out, "released_blocks", int32_type, "int32", {n, max_blocks}, c, keep);
  o.kept_counts = output<std::int32_t>(out, "kept_counts", int32_type, "int32", {n, L, h}, c, keep);
  o.nonfinite = output<std::int32_t>(out, "nonfinite_scores", int32_type, "int32", {n}, c, keep);
  o.keep_masks = output<std::uint8_t>(out, "keep_masks", nb::dtype<std::uint8_t>(), "uint8", {n, L, h, width}, c, keep);
  o.scores = output<float>(out, "scores", float32_type, "float32", {n, L, h, width}, c, keep);
  require(o.status && o.new_lengths && o.released_counts && o.released_blocks, "out",
          "needs status, new_lengths, released_counts and released_blocks");
  call.masks = o.keep_masks != nullptr;

  mut_array ws = writable(workspace, "workspace");
  require_place(place_of(ws, "workspace"), place{true, c.device_id}, "workspace");
  require(ws.ndim() == 1 && (ws.shape(0) <= 1 || ws.stride(0) == 1), "workspace",
          "has shape {} and strides {}; expected a contiguous 1-D array", shape_of(ws), strides_of(ws));
  std::visit(
      [&](const auto& p) { device_compress(p, call, o, ws.data(), ws.nbytes()); },
      pol);
  if (check) check_status(o.status, call.stream);  // kvpolicy.compress refuses check under capture
}

// Device memory for a framework kvpolicy cannot allocate with: freed, on the same
// stream, when the last array over it goes. Returned as nanobind's array-API object
// (__dlpack__ and __dlpack_device__, each export a fresh capsule), not a bare DLPack
// capsule, which a consumer could import only once and which recent PyTorch refuses.
nb::ndarray<nb::array_api> device_empty(std::vector<std::size_t> shape, const std::string& type, int device, std::uintptr_t stream) {
  nb::dlpack::dtype t;
  if (type == "int32") t = int32_type;
  else if (type == "uint8") t = nb::dtype<std::uint8_t>();
  else if (type == "float32") t = float32_type;
  else if (type == "int64") t = nb::dtype<std::int64_t>();  // compress_per_head's counts
  else require(false, "dtype", "is '{}'; expected int32, int64, uint8 or float32", type);
  std::size_t bytes = t.bits / 8;
  for (std::size_t s : shape) bytes *= s;
  const device_scope on(device);
  struct owned {
    void* p;
    void* stream;
  };
  auto* o = new owned{device_alloc(bytes, as_stream(stream)), as_stream(stream)};
  nb::capsule owner(o, [](void* p) noexcept {
    auto* o = static_cast<owned*>(p);
    device_free(o->p, o->stream);
    delete o;
  });
  return nb::ndarray<nb::array_api>(o->p, shape.size(), shape.data(), owner, nullptr, t, nb::device::cuda::value,
                                    device);
}

}  // namespace

void register_device(nb::module_& m) {
  m.attr("has_cuda") = true;
  m.def("device_workspace_bytes", &workspace_bytes, nb::arg("policy"), nb::arg("cache"), nb::arg("items"),
        nb::arg("queries").none(), nb::arg("scores").none(), nb::arg("layer_begin"), nb::arg("layer_count"),
        nb::arg("max_tokens"), nb::arg("return_masks"));
  m.def("device_compress", &compress, nb::arg("policy"), nb::arg("cache"), nb::arg("items"), nb::arg("queries").none(),
        nb::arg("scores").none(), nb::arg("layer_begin"), nb::arg("layer_count"), nb::arg("max_tokens"),
        nb::arg("out"), nb::arg("workspace"), nb::arg("stream"), nb::arg("check"),
        "kvp::cuda_executor on `stream` (kvpolicy.compress is the API).");
  m.def(
      "check_device_status",
      [](nb::handle status, std::uintptr_t stream) {
        const array a = readable(status, "status");
        require_vector(a, "status");
        require_dtype(a, int32_type, "status", "int32");
        require(place_of(a, "status").device && a.shape(0) == 8, "status", "must be the 8 int32 words of a device result");
        const device_scope on(a.device_id());
        check_status(static_cast<const std::int32_t*>(a.data()), as_stream(stream));
      },
      nb::arg("status"), nb::arg("stream"), "Waits for `stream`, then raises the kvpolicy.Error the status holds.");
  m.def("stream_is_capturing", [](std::uintptr_t stream) { return stream_is_capturing(as_stream(stream)); });
  m.def("device_empty", &device_empty, nb::arg("shape"), nb::arg("dtype"), nb::arg("device"), nb::arg("stream"));
}

}  // namespace kvpy

#else

namespace kvpy {
void register_device(nanobind::module_& m) { m.attr("has_cuda") = false; }
}  // namespace kvpy

#endif
