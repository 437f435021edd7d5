#include "decode_attention.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

#include <kvpolicy/attention/decode_attention_reference.hpp>
#include <kvpolicy/core/error.hpp>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "paged_cache.hpp"
#include "per_head_tensors.hpp"
#include "side_views.hpp"
#include "tensor_args.hpp"

#ifdef KVPOLICY_PYTHON_WITH_CUDA
#include <kvpolicy/exec/device_status.hpp>

#include "device_compress.hpp"
#include "device_decode_attention.hpp"
#endif

namespace nb = nanobind;
using kvp::require;

namespace kvpy {
namespace {

// Everything one call reads besides the cache, with the arrays kept alive.
struct call_args {
  kvp::decode_rows queries{}, out{};
  kvp::decode_batch batch{};
  kvp::decode_epilogue epilogue{};
  kvp::decode_head_counts counts{};
  float scale = 0.0f;
  array queries_keep, seqs_keep, positions_keep, counts_keep, tail_keep;
  mut_array out_keep, scores_keep, status_keep;
};

kvp::decode_metric metric_kind(const std::string& update) {
  if (update == "none") return kvp::decode_metric::none;
  if (update == "squared") return kvp::decode_metric::squared;
  if (update == "probability") return kvp::decode_metric::probability;
  require(false, "update", "is '{}'; expected None, 'squared' (KV-Compress) or 'probability' (H2O)", update);
  return {};
}

// [items, h_q, d]: the query rows or the output rows, a row's d elements adjacent.
template <class A>
kvp::decode_rows rows_of(A& a, const char* field, const place& at) {
  require_ndim(a, 3, field, "[items, num_q_heads, head_dim]");
  require_place(place_of(a, field), at, field);
  require(a.shape(2) <= 1 || a.stride(2) == 1, field,
          "has strides {}; a row's head_dim elements must be adjacent (last stride 1)", strides_of(a));
  require(a.shape(0) <= INT32_MAX && a.shape(1) <= INT32_MAX && a.shape(2) <= INT32_MAX, field,
          "has shape {}; each axis at most 2^31 - 1", shape_of(a));
  // The stride of an axis of one entry means nothing (frameworks report any value there: a
  // [1, h, d] view of a transposed tensor is "contiguous" with stride(0) d): take the span.
  const std::int64_t head_stride = a.shape(1) <= 1 ? a.shape(2) : a.stride(1);
  const std::int64_t item_stride = a.shape(0) <= 1 ? a.shape(1) * head_stride : a.stride(0);
  return {const_cast<void*>(static_cast<const void*>(a.data())), static_cast<std::int32_t>(a.shape(1)),
          static_cast<std::int32_t>(a.shape(2)), cache_dtype(a, field), item_stride, head_stride};
}

// An optional int32 vector of `n` entries where the cache lives.
const std::int32_t* int_vector(nb::handle h, const char* field, std::size_t n, const place& at, array& keep) {
  if (h.is_none()) return nullptr;
  keep = readable(h, field);
  require_vector(keep, field);
  require_dtype(keep, int32_type, field, "int32");
  require_place(place_of(keep, field), at, field);
  require(keep.shape(0) == n, field, "has {} entries; expected {}", keep.shape(0), n);
  return static_cast<const std::int32_t*>(keep.data());
}

void read_call(call_args& a, const place& at, nb::handle queries, nb::handle out, nb::handle seqs,
               std::int32_t layer, float scale, const std::string& update, std::int32_t excluded_distance,
               nb::handle query_positions, std::int32_t max_tokens) {
  a.queries_keep = readable(queries, "queries");
  a.queries = rows_of(a.queries_keep, "queries", at);
  a.out_keep = writable(out, "out");
  a.out = rows_of(a.out_keep, "out", at);
  require(a.out_keep.shape(0) == a.queries_keep.shape(0), "out", "has shape {}; queries has {}", shape_of(a.out_keep),
          shape_of(a.queries_keep));
  const std::size_t n = a.queries_keep.shape(0);
  a.batch.num_items = static_cast<std::int32_t>(n);
  a.batch.seqs = int_vector(seqs, "seqs", n, at, a.seqs_keep);
  a.batch.query_positions = int_vector(query_positions, "query_positions", n, at, a.positions_keep);
  a.batch.layer = layer;
  a.batch.max_tokens = max_tokens;
  a.epilogue.kind = metric_kind(update);
  a.epilogue.excluded_distance = excluded_distance;
  a.scale = scale;
}

// Heads' own counts ([layers, seqs, h_kv]) and where each sequence's tail begins ([seqs]).
void read_counts(call_args& a, const cache_description& c, const place& at, nb::handle counts, nb::handle tail_from) {
  require(counts.is_none() == tail_from.is_none(), counts.is_none() ? "counts" : "tail_from",
          "is None while {} is given; per-head counts need both", counts.is_none() ? "tail_from" : "counts");
  if (counts.is_none()) return;
  a.counts_keep = readable(counts, "counts");
  const array& k = a.counts_keep;
  require_ndim(k, 3, "counts", "[layers, seqs, kv_heads]");
  require_dtype(k, int32_type, "counts", "int32");
  require_place(place_of(k, "counts"), at, "counts");
  require(static_cast<std::int64_t>(k.shape(0)) == c.shape.num_layers &&
              static_cast<std::int64_t>(k.shape(1)) == c.seqs.num_seqs &&
              static_cast<std::int64_t>(k.shape(2)) == c.shape.num_kv_heads,
          "counts", "has shape {}; the cache needs ({}, {}, {})", shape_of(k), c.shape.num_layers, c.seqs.num_seqs,
          c.shape.num_kv_heads);
  a.counts.counts = {static_cast<const std::int32_t*>(k.data()), nullptr, k.stride(0), k.stride(1), k.stride(2)};
  a.counts.tail_from = int_vector(tail_from, "tail_from", static_cast<std::size_t>(c.seqs.num_seqs), at, a.tail_keep);
}

void host_per_head(nb::handle k, nb::handle v, nb::handle tables, nb::handle lengths, nb::handle metric,
                   nb::handle positions, nb::handle queries, nb::handle out, nb::handle seqs, std::int32_t layer,
                   float scale, const std::string& update, std::int32_t excluded_distance,
                   nb::handle query_positions) {
  per_head_tensors t = read_per_head(k, v, metric, tables, lengths, positions, /*metric_required=*/false);
  require(!t.at.device, "k", "lives on CUDA device {}; the host path runs on host memory", t.at.id);
  call_args a;
  read_call(a, t.at, queries, out, seqs, layer, scale, update, excluded_distance, query_positions, 0);
  nb::gil_scoped_release quiet;
  kvp::host::decode_attention(t.view, a.queries, a.out, a.scale, a.batch, a.epilogue);
}

void host_paged(const paged_cache& cache, nb::handle scores, nb::handle counts, nb::handle tail_from,
                nb::handle queries, nb::handle out, nb::handle seqs, std::int32_t layer, float scale,
                const std::string& update, std::int32_t excluded_distance, nb::handle query_positions) {
  const cache_description& c = cache.desc;
  require(!c.on_device, "cache", "lives on CUDA device {}; the host path runs on host memory", c.device_id);
  const place at{false, 0};
  call_args a;
  read_call(a, at, queries, out, seqs, layer, scale, update, excluded_distance, query_positions, 0);
  read_counts(a, c, at, counts, tail_from);
  a.epilogue.scores = scores_view(scores, c, a.scores_keep);
  const kvp::paged_kv_view view = c.view(c.k_layers.data(), c.v_layers.data());
  nb::gil_scoped_release quiet;
  kvp::host::decode_attention(view, a.counts, a.queries, a.out, a.scale, a.batch, a.epilogue);
}

#ifdef KVPOLICY_PYTHON_WITH_CUDA

// The device call over the arguments; the status is only needed to launch.
decode_attention_call device_call_of(call_args& a, const place& at, nb::handle status, std::uintptr_t stream,
                                     bool staged) {
  decode_attention_call call;
  call.queries = a.queries;
  call.out = a.out;
  call.scale = a.scale;
  call.batch = a.batch;
  call.epilogue = a.epilogue;
  call.counts = a.counts;
  call.staged = staged;
  call.device_id = at.id;
  call.stream = reinterpret_cast<void*>(stream);
  if (!status.is_none()) {
    a.status_keep = writable(status, "status");
    require_vector(a.status_keep, "status");
    require_dtype(a.status_keep, int32_type, "status", "int32");
    require(a.status_keep.shape(0) == kvp::status_words, "status", "has {} words; expected {}",
            a.status_keep.shape(0), kvp::status_words);
    require_place(place_of(a.status_keep, "status"), at, "status");
    call.batch.status = static_cast<std::int32_t*>(a.status_keep.data());
  } else {
    static std::int32_t some[kvp::status_words];  // sizing only checks it is non-null
    call.batch.status = some;
  }
  return call;
}

// Sizing (workspace None: returns the bytes, launches nothing), or the launch.
std::size_t run_device(decode_attention_call& call, nb::handle workspace, const place& at, bool check,
                       bool describe_only, std::string* plan) {
  if (describe_only) {
    *plan = describe_decode_attention(call);
    return 0;
  }
  if (workspace.is_none()) return device_decode_attention_workspace_bytes(call);
  mut_array ws = writable(workspace, "workspace");
  require_place(place_of(ws, "workspace"), at, "workspace");
  require(ws.ndim() == 1 && (ws.shape(0) <= 1 || ws.stride(0) == 1), "workspace",
          "has shape {} and strides {}; expected a contiguous 1-D array", shape_of(ws), strides_of(ws));
  device_decode_attention(call, ws.data(), ws.nbytes());
  if (check) {
    const device_scope on(at.id);
    check_status(call.batch.status, call.stream);
  }
  return ws.nbytes();
}

nb::object device_per_head(nb::handle k, nb::handle v, nb::handle tables, nb::handle lengths, nb::handle metric,
                           nb::handle positions, nb::handle queries, nb::handle out, nb::handle seqs,
                           std::int32_t layer, float scale, const std::string& update, std::int32_t excluded_distance,
                           nb::handle query_positions, std::int32_t max_tokens, nb::handle status,
                           nb::handle workspace, std::uintptr_t stream, bool staged, bool check, bool describe) {
  per_head_tensors t = read_per_head(k, v, metric, tables, lengths, positions, /*metric_required=*/false);
  require(t.at.device, "k", "lives on the host; the device path runs on CUDA memory");
  call_args a;
  read_call(a, t.at, queries, out, seqs, layer, scale, update, excluded_distance, query_positions, max_tokens);
  decode_attention_call call = device_call_of(a, t.at, status, stream, staged);
  call.per_head = &t.view;
  std::string plan;
  const std::size_t bytes = run_device(call, workspace, t.at, check, describe, &plan);
  return describe ? nb::cast(plan) : nb::cast(bytes);
}

nb::object device_paged(const paged_cache& cache, nb::handle scores, nb::handle counts, nb::handle tail_from,
                        nb::handle queries, nb::handle out, nb::handle seqs, std::int32_t layer, float scale,
                        const std::string& update, std::int32_t excluded_distance, nb::handle query_positions,
                        std::int32_t max_tokens, nb::handle status, nb::handle workspace, std::uintptr_t stream,
                        bool staged, bool check, bool describe) {
  const cache_description& c = cache.desc;
  require(c.on_device, "cache", "lives on the host; the device path runs on CUDA memory");
  const place at{true, c.device_id};
  call_args a;
  read_call(a, at, queries, out, seqs, layer, scale, update, excluded_distance, query_positions,
            max_tokens ? max_tokens : c.max_tokens);
  read_counts(a, c, at, counts, tail_from);
  a.epilogue.scores = scores_view(scores, c, a.scores_keep);
  decode_attention_call call = device_call_of(a, at, status, stream, staged);
  call.paged = &c;
  std::string plan;
  const std::size_t bytes = run_device(call, workspace, at, check, describe, &plan);
  return describe ? nb::cast(plan) : nb::cast(bytes);
}

#endif

}  // namespace

void register_decode_attention(nb::module_& m) {
  m.def("host_decode_attention_per_head", &host_per_head, nb::arg("k"), nb::arg("v"), nb::arg("tables"),
        nb::arg("lengths"), nb::arg("metric").none(), nb::arg("positions").none(), nb::arg("queries"), nb::arg("out"),
        nb::arg("seqs").none(), nb::arg("layer"), nb::arg("scale"), nb::arg("update"), nb::arg("excluded_distance"),
        nb::arg("query_positions").none(),
        "kvp::host::decode_attention over a per-head cache (kvpolicy.decode_attention_per_head is the API).");
  m.def("host_decode_attention", &host_paged, nb::arg("cache"), nb::arg("scores").none(), nb::arg("counts").none(),
        nb::arg("tail_from").none(), nb::arg("queries"), nb::arg("out"), nb::arg("seqs").none(), nb::arg("layer"),
        nb::arg("scale"), nb::arg("update"), nb::arg("excluded_distance"), nb::arg("query_positions").none(),
        "kvp::host::decode_attention over a PagedCache (kvpolicy.decode_attention is the API).");
#ifdef KVPOLICY_PYTHON_WITH_CUDA
  m.def("device_decode_attention_per_head", &device_per_head, nb::arg("k"), nb::arg("v"), nb::arg("tables"),
        nb::arg("lengths"), nb::arg("metric").none(), nb::arg("positions").none(), nb::arg("queries"), nb::arg("out"),
        nb::arg("seqs").none(), nb::arg("layer"), nb::arg("scale"), nb::arg("update"), nb::arg("excluded_distance"),
        nb::arg("query_positions").none(), nb::arg("max_tokens"), nb::arg("status").none(),
        nb::arg("workspace").none(), nb::arg("stream"), nb::arg("staged"), nb::arg("check"), nb::arg("describe"),
        "kvp::cuda_decode_attention over a per-head cache on `stream`; workspace None returns the bytes it needs, "
        "describe the plan (kvpolicy.decode_attention_per_head is the API).");
  m.def("device_decode_attention", &device_paged, nb::arg("cache"), nb::arg("scores").none(), nb::arg("counts").none(),
        nb::arg("tail_from").none(), nb::arg("queries"), nb::arg("out"), nb::arg("seqs").none(), nb::arg("layer"),
        nb::arg("scale"), nb::arg("update"), nb::arg("excluded_distance"), nb::arg("query_positions").none(),
        nb::arg("max_tokens"), nb::arg("status").none(), nb::arg("workspace").none(), nb::arg("stream"),
        nb::arg("staged"), nb::arg("check"), nb::arg("describe"),
        "kvp::cuda_decode_attention over a PagedCache on `stream` (kvpolicy.decode_attention is the API).");
#endif
}

}  // namespace kvpy
