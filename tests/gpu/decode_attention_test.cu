// Decode attention on the GPU (cuda_decode_attention) against host::decode_attention:
// the output within bf16 / f16 tolerance of the host's fp64 result (||out - ref|| /
// ||ref|| per call, and per row), heads that attend nothing exactly zero; the metric
// (squared, into the per-head cache) and F (plain probabilities, paged) within the
// per-head metric tests' tolerance; every slot outside the batch's attended tokens
// untouched; outputs poisoned before the call fully written, the row past the batch
// not. Per-head caches, paged caches with per-head counts, a live mask (dropped-heavy
// too), both, and plain; G 1 / 4 / 5 / 8, d 64 / 128, bf16 and f16; lengths 0 to
// several thousand, not multiples of the block size; graph capture; refusals. Every
// case runs the plain split kernel and the staged one (cuda_decode_attention::staged).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <thrust/device_vector.h>

#include "kvpolicy/kvpolicy.cuh"
#include "support/decode_case.hpp"
#include "support/device_vectors.cuh"

namespace {

using i32 = std::int32_t;
using kvp_test::to_device;
using kvp_test::to_host;
template <class T>
T* raw(thrust::device_vector<T>& v) {
  return thrust::raw_pointer_cast(v.data());
}

#define KVP_CUDA_CHECK(expr) REQUIRE_EQ(cudaSuccess, (expr))

enum class kind { per_head, counts, counts_tail, live, counts_live, plain };
const char* name_of(kind k) {
  switch (k) {
    case kind::per_head:
      return "per_head";
    case kind::counts:
      return "counts";
    case kind::counts_tail:
      return "counts_tail";
    case kind::live:
      return "live";
    case kind::counts_live:
      return "counts_live";
    case kind::plain:
      return "plain";
  }
  return "?";
}

struct run_options {
  kind k = kind::per_head;
  kvp::decode_metric metric = kvp::decode_metric::none;
  i32 excluded_distance = 0;
  bool positions = false;
  bool capture = false;  // run the call as a captured graph, replayed once
  float scale = 0.0f;    // 0: 1 / sqrt(d)
};

// The queries of the batch's sequences in item order: [items, h_q, d].
std::vector<std::byte> item_queries(const kvp_test::decode_case& dc, const std::vector<i32>& items) {
  std::vector<std::byte> qi;
  const std::size_t row = static_cast<std::size_t>(dc.h_q()) * dc.d * dc.es();
  for (i32 s : items)
    qi.insert(qi.end(), dc.q.begin() + static_cast<std::ptrdiff_t>(s * row),
              dc.q.begin() + static_cast<std::ptrdiff_t>((s + 1) * row));
  return qi;
}

void check_against_host(kvp_test::decode_case dc, const run_options& o, const std::vector<i32>& items) {
  dc.build();
  CAPTURE(name_of(o.k));
  CAPTURE(dc.G);
  CAPTURE(dc.d);
  CAPTURE(kvp::name_of(dc.type));
  CAPTURE(static_cast<int>(o.metric));
  CAPTURE(o.excluded_distance);
  CAPTURE(o.capture);
  const float scale = o.scale > 0 ? o.scale : 1.0f / std::sqrt(static_cast<float>(dc.d));
  const bool per_head = o.k == kind::per_head;
  const bool counts = o.k == kind::counts || o.k == kind::counts_live || o.k == kind::counts_tail;
  const bool tail = o.k == kind::counts_tail;
  const bool live = o.k == kind::live || o.k == kind::counts_live;
  const auto n = static_cast<i32>(items.size());
  std::vector<i32> query_positions;
  for (i32 s : items) query_positions.push_back(3 * dc.max_len - 2 * s);  // past every token's position
  const std::vector<std::byte> qi = item_queries(dc, items);
  const std::size_t out_elems = static_cast<std::size_t>(n) * dc.h_q() * dc.d;

  // The host's result.
  std::vector<std::byte> host_out(out_elems * dc.es());
  std::vector<double> exact(out_elems);
  std::vector<float> host_metric = per_head ? dc.ph_metric : dc.pg_scores;
  std::vector<i32> ph_pos = dc.ph_positions, pg_pos = dc.pg_positions;
  const kvp::decode_batch host_batch{.seqs = items.data(),
                                     .num_items = n,
                                     .layer = dc.layer,
                                     .query_positions = o.positions ? query_positions.data() : nullptr};
  const auto host_q = kvp::decode_rows::contiguous(const_cast<std::byte*>(qi.data()), dc.h_q(), dc.d, dc.type);
  const auto host_o = kvp::decode_rows::contiguous(host_out.data(), dc.h_q(), dc.d, dc.type);
  std::vector<std::uint8_t> live_bytes = dc.pg_live;
  if (per_head) {
    const auto c = dc.per_head(dc.ph_k.data(), dc.ph_v.data(), host_metric.data(), dc.ph_table.data(),
                               dc.ph_lengths.data(), o.positions ? ph_pos.data() : nullptr);
    kvp::host::decode_attention(c, host_q, host_o, scale, host_batch,
                                {.kind = o.metric, .excluded_distance = o.excluded_distance}, exact);
  } else {
    const auto c = dc.paged(dc.pg_k.data(), dc.pg_v.data(), dc.pg_table.data(), dc.pg_lengths.data(),
                            live ? live_bytes.data() : nullptr, o.positions ? pg_pos.data() : nullptr);
    kvp::host::decode_attention(
        c, counts ? dc.counts(dc.pg_counts.data(), tail ? dc.pg_tail.data() : nullptr) : kvp::decode_head_counts{},
        host_q, host_o, scale, host_batch,
        {.kind = o.metric, .excluded_distance = o.excluded_distance, .scores = dc.scores(host_metric.data())}, exact);
  }

  // The device's, with the plain and the staged split kernel: the output poisoned (0xFF:
  // NaN in f16 and bf16), one row past the batch.
  for (bool staged : {false, true}) {
    CAPTURE(staged);
    thrust::device_vector<std::byte> k = to_device(per_head ? dc.ph_k : dc.pg_k),
                                     v = to_device(per_head ? dc.ph_v : dc.pg_v);
    thrust::device_vector<std::byte> q = to_device(qi);
    thrust::device_vector<std::byte> out(out_elems * dc.es() + static_cast<std::size_t>(dc.h_q()) * dc.d * dc.es(),
                                         std::byte{0xFF});
    thrust::device_vector<float> metric = to_device(per_head ? dc.ph_metric : dc.pg_scores);
    thrust::device_vector<i32> table = to_device(per_head ? dc.ph_table : dc.pg_table);
    thrust::device_vector<i32> lengths = to_device(per_head ? dc.ph_lengths : dc.pg_lengths);
    thrust::device_vector<i32> cnt = to_device(dc.pg_counts), tails = to_device(dc.pg_tail),
                               pos = to_device(per_head ? dc.ph_positions : dc.pg_positions);
    thrust::device_vector<std::uint8_t> lv = to_device(dc.pg_live);
    thrust::device_vector<i32> seqs = to_device(items), qpos = to_device(query_positions),
                               status(kvp::status_words, -1);
    const kvp::decode_batch batch{.seqs = raw(seqs),
                                  .num_items = n,
                                  .layer = dc.layer,
                                  .query_positions = o.positions ? raw(qpos) : nullptr,
                                  .status = raw(status)};
    const auto dq = kvp::decode_rows::contiguous(raw(q), dc.h_q(), dc.d, dc.type);
    const auto dout = kvp::decode_rows::contiguous(raw(out), dc.h_q(), dc.d, dc.type);
    cudaStream_t stream = nullptr;
    KVP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const kvp::cuda_decode_attention attn{.stream = stream, .staged = staged};
    const kvp::decode_epilogue epi_ph{.kind = o.metric, .excluded_distance = o.excluded_distance};
    const auto ph_view =
        dc.per_head(raw(k), raw(v), raw(metric), raw(table), raw(lengths), o.positions ? raw(pos) : nullptr);
    const auto pg_view =
        dc.paged(raw(k), raw(v), raw(table), raw(lengths), live ? raw(lv) : nullptr, o.positions ? raw(pos) : nullptr);
    const kvp::decode_head_counts hc =
        counts ? dc.counts(raw(cnt), tail ? raw(tails) : nullptr) : kvp::decode_head_counts{};
    const kvp::decode_epilogue epi_pg{
        .kind = o.metric, .excluded_distance = o.excluded_distance, .scores = dc.scores(raw(metric))};
    auto call = [&](void* temp, std::size_t& bytes) {
      return per_head ? attn.attend(temp, bytes, ph_view, dq, dout, scale, batch, epi_ph)
                      : attn.attend(temp, bytes, pg_view, hc, dq, dout, scale, batch, epi_pg);
    };
    std::size_t bytes = 0;
    KVP_CUDA_CHECK(call(nullptr, bytes));
    thrust::device_vector<std::byte> temp(bytes + 256);
    void* t = raw(temp);
    if (o.capture) {
      cudaGraph_t graph{};
      cudaGraphExec_t exec{};
      KVP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const cudaError_t e = call(t, bytes);
      KVP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      KVP_CUDA_CHECK(e);
      KVP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      KVP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KVP_CUDA_CHECK(cudaStreamSynchronize(stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    } else {
      KVP_CUDA_CHECK(call(t, bytes));
    }
    KVP_CUDA_CHECK(cudaStreamSynchronize(stream));
    KVP_CUDA_CHECK(cudaStreamDestroy(stream));
    const std::vector<i32> st = to_host(status);
    REQUIRE_NOTHROW(kvp::throw_if_error(st.data()));

    // Output: relative L2 error per call and per (item, query head) row; empty rows zero.
    const std::vector<std::byte> got = to_host(out);
    double err = 0, ref = 0, worst_row = 0;
    i32 nonfinite = 0, empty_nonzero = 0;
    for (std::size_t r = 0; r < out_elems / dc.d; ++r) {
      double e = 0, x = 0;
      for (i32 i = 0; i < dc.d; ++i) {
        const std::size_t at = r * dc.d + i;
        const double g = kvp::load_as_float(got.data(), dc.type, static_cast<std::int64_t>(at));
        nonfinite += !std::isfinite(g);
        e += (g - exact[at]) * (g - exact[at]);
        x += exact[at] * exact[at];
      }
      err += e, ref += x;
      if (x > 0)
        worst_row = std::max(worst_row, std::sqrt(e / x));
      else
        empty_nonzero += e > 0;  // a head that attended nothing: exactly zero
    }
    const double tol = dc.type == kvp::dtype::bf16 ? 1e-2 : 2e-3;
    CHECK(nonfinite == 0);  // every poisoned element written
    CHECK(empty_nonzero == 0);
    CHECK(std::sqrt(err / std::max(ref, 1e-30)) <= tol);
    CHECK(worst_row <= 2 * tol);
    i32 past = 0;
    for (std::size_t i = out_elems * dc.es(); i < got.size(); ++i) past += got[i] != std::byte{0xFF};
    CHECK(past == 0);  // the row past the batch untouched

    // Metric / F: within the metric tests' tolerance; untouched where the host added nothing.
    const std::vector<float> m = to_host(metric);
    const std::vector<float>& m0 = per_head ? dc.ph_metric : dc.pg_scores;
    float largest = 0.0f, worst = 0.0f;
    i32 untouched_changed = 0, changed = 0;
    for (std::size_t i = 0; i < m.size(); ++i) {
      largest = std::max(largest, std::abs(host_metric[i]));
      worst = std::max(worst, std::abs(m[i] - host_metric[i]));
      untouched_changed += host_metric[i] == m0[i] && m[i] != m0[i];
      changed += m[i] != m0[i];
    }
    CHECK(worst <= 1e-4f * std::max(largest, 1.0f));
    CHECK(untouched_changed == 0);
    if (o.metric == kvp::decode_metric::none) CHECK(changed == 0);
  }
}

}  // namespace

TEST_CASE("decode attention on the GPU: per-head caches against the host, G 1/4/5/8, d 64/128, bf16/f16") {
  std::uint32_t seed = 100;
  for (i32 G : {1, 4, 5, 8})
    for (i32 d : {64, 128})
      for (kvp::dtype t : {kvp::dtype::bf16, kvp::dtype::f16}) {
        kvp_test::decode_case dc;
        dc.G = G, dc.d = d, dc.type = t, dc.seed = seed++, dc.max_len = 1500;
        check_against_host(dc, {.k = kind::per_head, .metric = kvp::decode_metric::squared}, {2, 0});
      }
}

TEST_CASE(
    "decode attention on the GPU: paged caches (counts, counts and tail, live, both, plain) against the host, F by "
    "H2O's sums") {
  std::uint32_t seed = 200;
  for (kind k : {kind::counts, kind::counts_tail, kind::live, kind::counts_live, kind::plain})
    for (i32 d : {64, 128}) {
      kvp_test::decode_case dc;
      dc.G = 4, dc.d = d, dc.seed = seed++, dc.max_len = 1200, dc.heads = 4;
      check_against_host(dc, {.k = k, .metric = kvp::decode_metric::probability}, {1, 2, 0});
      dc.type = kvp::dtype::f16, dc.seed = seed++;
      check_against_host(dc, {.k = k}, {0, 2});
    }
}

TEST_CASE("decode attention on the GPU: long and empty rows, dropped-heavy masks, positions and excluded distance") {
  kvp_test::decode_case long_rows;
  long_rows.G = 4, long_rows.d = 128, long_rows.heads = 8, long_rows.layers = 1, long_rows.layer = 0;
  long_rows.min_len = 1, long_rows.max_len = 6000, long_rows.b = 16, long_rows.seed = 300;
  check_against_host(long_rows, {.k = kind::per_head, .metric = kvp::decode_metric::squared}, {0, 1, 2});
  check_against_host(long_rows, {.k = kind::live, .metric = kvp::decode_metric::probability}, {2, 1});
  check_against_host(long_rows, {.k = kind::counts_tail, .metric = kvp::decode_metric::squared}, {0, 2});

  kvp_test::decode_case empty;  // many heads of length 0 (min 0, max 3)
  empty.max_len = 3, empty.seed = 301, empty.b = 1;
  check_against_host(empty, {.k = kind::per_head, .metric = kvp::decode_metric::squared}, {0, 1, 2});
  check_against_host(empty, {.k = kind::counts, .metric = kvp::decode_metric::squared}, {0, 1, 2});

  kvp_test::decode_case dropped;  // 95% of the slots dropped, some heads none left
  dropped.dropped = 0.95, dropped.seed = 302, dropped.max_len = 900, dropped.b = 32;
  check_against_host(dropped, {.k = kind::live, .metric = kvp::decode_metric::squared}, {0, 1, 2});

  kvp_test::decode_case spread;  // large logits: the softmax is nearly one-hot
  spread.query_scale = 6.0f, spread.seed = 303, spread.d = 128;
  check_against_host(spread, {.k = kind::per_head, .metric = kvp::decode_metric::squared, .scale = 0.5f}, {1});

  kvp_test::decode_case excluded;
  excluded.seed = 304;
  check_against_host(excluded, {.k = kind::per_head, .metric = kvp::decode_metric::squared, .excluded_distance = 3},
                     {0, 2});
  check_against_host(
      excluded,
      {.k = kind::per_head, .metric = kvp::decode_metric::squared, .excluded_distance = 40, .positions = true}, {0, 2});
  check_against_host(
      excluded,
      {.k = kind::counts_tail, .metric = kvp::decode_metric::probability, .excluded_distance = 7, .positions = true},
      {1, 0});
}

TEST_CASE("decode attention on the GPU: a captured graph computes what the plain call does") {
  kvp_test::decode_case dc;
  dc.seed = 400, dc.max_len = 2500, dc.d = 128;
  check_against_host(dc, {.k = kind::per_head, .metric = kvp::decode_metric::squared, .capture = true}, {0, 1, 2});
  check_against_host(dc, {.k = kind::counts_live, .metric = kvp::decode_metric::probability, .capture = true}, {2, 0});
}

TEST_CASE("decode attention on the GPU: refusals name the field; a bad item writes nothing") {
  kvp_test::decode_case dc;
  dc.seed = 500, dc.min_len = 1, dc.max_len = 300;
  dc.build();
  const std::vector<i32> items = {0, 1};
  const std::vector<std::byte> qi = item_queries(dc, items);
  thrust::device_vector<std::byte> k = to_device(dc.ph_k), v = to_device(dc.ph_v), q = to_device(qi);
  thrust::device_vector<std::byte> out(qi.size(), std::byte{0xFF});
  thrust::device_vector<float> metric = to_device(dc.ph_metric);
  thrust::device_vector<i32> table = to_device(dc.ph_table), lengths = to_device(dc.ph_lengths);
  thrust::device_vector<i32> status(kvp::status_words, 0);
  const auto view = dc.per_head(raw(k), raw(v), raw(metric), raw(table), raw(lengths));
  const auto dq = kvp::decode_rows::contiguous(raw(q), dc.h_q(), dc.d, dc.type);
  const auto dout = kvp::decode_rows::contiguous(raw(out), dc.h_q(), dc.d, dc.type);
  const kvp::cuda_decode_attention attn{};
  const kvp::decode_epilogue sq{.kind = kvp::decode_metric::squared};
  std::size_t bytes = 0;
  const kvp::decode_batch batch{.num_items = 2, .layer = 1, .status = raw(status)};
  KVP_CUDA_CHECK(attn.attend(nullptr, bytes, view, dq, dout, 0.125f, batch, sq));
  thrust::device_vector<std::byte> temp(bytes);

  auto device_refusal = [&](const kvp::decode_batch& b, const char* field) {
    KVP_CUDA_CHECK(attn.attend(raw(temp), bytes, view, dq, dout, 0.125f, b, sq));
    KVP_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<i32> st = to_host(status);
    std::string got = "(none)";
    try {
      kvp::throw_if_error(st.data());
    } catch (const kvp::error& e) {
      got = e.field();
    }
    CHECK(got == field);
    CHECK(to_host(metric) == dc.ph_metric);
    const std::vector<std::byte> o = to_host(out);
    CHECK(std::all_of(o.begin(), o.end(), [](std::byte x) { return x == std::byte{0xFF}; }));
  };
  thrust::device_vector<i32> bad_seqs = to_device(std::vector<i32>{0, 3});
  kvp::decode_batch b1 = batch;
  b1.seqs = raw(bad_seqs);
  device_refusal(b1, "batch[1].seq");
  // A length over its row's table (layer 1, seq 1, head 0).
  std::vector<i32> bad_lengths = dc.ph_lengths;
  bad_lengths[static_cast<std::size_t>((1 * dc.seqs + 1) * dc.heads)] = dc.ph_max_blocks * dc.b + 5;
  thrust::copy(bad_lengths.begin(), bad_lengths.end(), lengths.begin());
  device_refusal(batch, "cache.lengths[layer 1][seq 1][head 0]");
  thrust::copy(dc.ph_lengths.begin(), dc.ph_lengths.end(), lengths.begin());
  // A block id out of the pool (layer 1, seq 0, head 1, entry 0).
  std::vector<i32> bad_table = dc.ph_table;
  bad_table[static_cast<std::size_t>((1 * dc.seqs + 0) * dc.heads + 1) * dc.ph_max_blocks] = dc.ph_blocks + 2;
  thrust::copy(bad_table.begin(), bad_table.end(), table.begin());
  device_refusal(batch, "cache.table[layer 1][seq 0][head 1][0]");
  thrust::copy(dc.ph_table.begin(), dc.ph_table.end(), table.begin());
  // max_tokens under a head's length.
  kvp::decode_batch b2 = batch;
  b2.max_tokens = 1;
  std::size_t small = 0;
  KVP_CUDA_CHECK(attn.attend(nullptr, small, view, dq, dout, 0.125f, b2, sq));
  device_refusal(b2, "batch.max_tokens");

  // Host-side refusals, before any launch.
  auto view96 = view;  // a consistent view of d 96: only the GPU's head dims refuse it
  view96.head_dim = 96;
  view96.k_stride = view96.v_stride = kvp::per_head_kv_strides::contiguous(dc.b, 96);
  view96.num_blocks = dc.ph_blocks * dc.d / 96;
  auto q96 = dq, o96 = dout;
  q96.head_dim = o96.head_dim = 96;
  q96.head_stride = o96.head_stride = 96;
  q96.item_stride = o96.item_stride = 96 * dc.h_q();
  CHECK_THROWS_WITH_AS(attn.attend(raw(temp), bytes, view96, q96, o96, 0.1f, batch, sq),
                       doctest::Contains("cache.head_dim"), kvp::error);
  kvp::decode_batch no_status = batch;
  no_status.status = nullptr;
  CHECK_THROWS_WITH_AS(attn.attend(raw(temp), bytes, view, dq, dout, 0.1f, no_status, sq),
                       doctest::Contains("batch.status"), kvp::error);
  std::size_t too_few = bytes - 1;
  CHECK_THROWS_WITH_AS(attn.attend(raw(temp), too_few, view, dq, dout, 0.1f, batch, sq),
                       doctest::Contains("temp_bytes"), kvp::error);
  auto q_odd = dq;
  q_odd.head_stride = dc.d + 1, q_odd.item_stride = (dc.d + 1) * dc.h_q();
  CHECK_THROWS_WITH_AS(attn.attend(raw(temp), bytes, view, q_odd, dout, 0.1f, batch, sq),
                       doctest::Contains("queries.head_stride"), kvp::error);
  // A paged cache's count over its sequence's length (device check).
  thrust::device_vector<std::byte> pk = to_device(dc.pg_k), pv = to_device(dc.pg_v);
  thrust::device_vector<i32> ptable = to_device(dc.pg_table), plengths = to_device(dc.pg_lengths);
  std::vector<i32> bad_counts = dc.pg_counts;
  bad_counts[static_cast<std::size_t>((1 * dc.seqs + 1) * dc.heads + 1)] = dc.pg_lengths[1] + 1;
  thrust::device_vector<i32> pcounts = to_device(bad_counts);
  const auto pview = dc.paged(raw(pk), raw(pv), raw(ptable), raw(plengths));
  std::size_t pbytes = 0;
  KVP_CUDA_CHECK(attn.attend(nullptr, pbytes, pview, dc.counts(raw(pcounts)), dq, dout, 0.1f, batch));
  thrust::device_vector<std::byte> ptemp(pbytes);
  KVP_CUDA_CHECK(attn.attend(raw(ptemp), pbytes, pview, dc.counts(raw(pcounts)), dq, dout, 0.1f, batch));
  KVP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<i32> st = to_host(status);
  CHECK_THROWS_WITH_AS(kvp::throw_if_error(st.data()), doctest::Contains("counts[layer 1][seq 1][head 1]"), kvp::error);
  const std::vector<std::byte> o = to_host(out);
  CHECK(std::all_of(o.begin(), o.end(), [](std::byte x) { return x == std::byte{0xFF}; }));
}
