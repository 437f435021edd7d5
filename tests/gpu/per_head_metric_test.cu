// KV-Compress's metric on the GPU (cuda_per_head_metric) against the host's
// scorer::squared_attention_metric, row by row: the prefill form (last w queries,
// squared, summed, max-pooled per query head, summed over the group) and a decode
// step added to an existing metric, over G 1 / 4 / 8, d 64 / 128, bf16 and f32, pool
// 7 and 1, excluded distance 0 and 3, ragged heads shorter and longer than the window.
// fp32 on both sides with different summation orders and exp: compared within a
// relative 1e-4 of each row's largest value. Refusals: nothing written.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <thrust/device_vector.h>

#include "kvpolicy/exec/cuda_per_head_metric.cuh"
#include "kvpolicy/kvpolicy.hpp"
#include "support/device_vectors.cuh"

namespace {

using i32 = std::int32_t;
using kvp_test::to_device;
using kvp_test::to_host;

#define KVP_CUDA_CHECK(expr) REQUIRE_EQ(cudaSuccess, (expr))

struct metric_case {
  i32 layers = 2, seqs = 3, heads = 2, G = 4, d = 64, b = 16, w = 32, max_len = 90;
  kvp::dtype type = kvp::dtype::bf16;
  kvp::scorer::squared_attention_metric m{};
  std::uint32_t seed = 1;

  i32 nb = 0, max_blocks = 0;
  std::vector<std::byte> k, q;
  std::vector<float> metric;
  std::vector<i32> table, lengths;

  void build() {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<i32> len(1, max_len);
    for (i32 i = 0; i < layers * seqs * heads; ++i) lengths.push_back(len(rng));
    for (i32 T : lengths) max_blocks = std::max(max_blocks, (T + b - 1) / b);
    nb = layers * seqs * heads * max_blocks;
    std::vector<i32> ids(static_cast<std::size_t>(nb));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.end());  // every row max_blocks entries
    const std::size_t es = kvp::size_of(type);
    k.resize(static_cast<std::size_t>(nb) * b * d * es);
    q.resize(static_cast<std::size_t>(layers) * seqs * w * heads * G * d * es);
    std::normal_distribution<float> u(0.0f, 1.0f);
    for (std::size_t i = 0; i < k.size() / es; ++i) kvp::store_from_float(k.data(), type, static_cast<std::int64_t>(i), 2.0f * u(rng));
    for (std::size_t i = 0; i < q.size() / es; ++i) kvp::store_from_float(q.data(), type, static_cast<std::int64_t>(i), 2.0f * u(rng));
    metric.resize(static_cast<std::size_t>(nb) * b);
    std::uniform_real_distribution<float> r(0.0f, 1.0f);
    for (auto& x : metric) x = r(rng);
  }
  i32 row(i32 l, i32 s, i32 h) const { return (l * seqs + s) * heads + h; }
  kvp::per_head_kv_view view(std::byte* kb, float* mb, const i32* tab, const i32* len) const {
    kvp::per_head_kv_view c;
    c.num_layers = layers, c.num_blocks = nb, c.block_size = b, c.num_kv_heads = heads, c.head_dim = d;
    c.num_seqs = seqs, c.max_blocks = max_blocks, c.type = type;
    c.k = c.v = {kb, 0, nullptr, 0};
    c.k_stride = c.v_stride = kvp::per_head_kv_strides::contiguous(b, d);
    c.table = kvp::per_head_array::dense(tab, seqs, heads, max_blocks);
    c.lengths = kvp::per_head_array::dense(len, seqs, heads);
    c.metric = kvp::per_slot_metric::shared(mb, b);
    return c;
  }
  kvp::query_window_view queries(const void* base) const {
    return kvp::query_window_view::contiguous(base, layers, seqs, w, heads * G, d, type);
  }

  // The host reference over the whole cache: items are sequences `items`, slot = seq.
  std::vector<float> host(bool prefill, const std::vector<i32>& items) const {
    std::vector<float> out = metric;
    const std::size_t es = kvp::size_of(type);
    for (i32 s : items)
      for (i32 l = 0; l < layers; ++l)
        for (i32 h = 0; h < heads; ++h) {
          const i32 T = lengths[static_cast<std::size_t>(row(l, s, h))];
          const i32 n = prefill ? std::min(w, T) : 1;
          std::vector<float> keys(static_cast<std::size_t>(T) * d), qs(static_cast<std::size_t>(n) * G * d), mt(static_cast<std::size_t>(T));
          auto slot_of = [&](i32 t) {
            return static_cast<std::size_t>(table[static_cast<std::size_t>(row(l, s, h)) * max_blocks + t / b]) * b + t % b;
          };
          for (i32 t = 0; t < T; ++t)
            for (i32 i = 0; i < d; ++i)
              keys[static_cast<std::size_t>(t) * d + i] = kvp::load_as_float(k.data(), type, static_cast<std::int64_t>(slot_of(t) * d + i));
          const auto qv = queries(q.data());
          for (i32 j = 0; j < n; ++j)
            for (i32 g = 0; g < G; ++g) {
              const std::byte* r = qv.row(l, s, w - n + j, h * G + g);
              for (i32 i = 0; i < d; ++i) qs[(static_cast<std::size_t>(j) * G + g) * d + i] = kvp::load_as_float(r, type, i);
            }
          for (i32 t = 0; t < T; ++t) mt[static_cast<std::size_t>(t)] = metric[slot_of(t)];
          if (prefill) m.prefill(qs, keys, G, d, mt);
          else m.decode(qs, keys, G, d, mt);
          for (i32 t = 0; t < T; ++t) out[slot_of(t)] = mt[static_cast<std::size_t>(t)];
        }
    return out;
  }
};

void check_metric(metric_case mc, bool prefill) {
  mc.build();
  CAPTURE(prefill);
  CAPTURE(mc.G);
  CAPTURE(mc.d);
  CAPTURE(kvp::name_of(mc.type));
  CAPTURE(mc.m.pool_kernel);
  CAPTURE(mc.m.excluded_distance);
  std::vector<i32> items{2, 0};
  if (mc.seqs < 3) items = {0};
  const std::vector<float> want = mc.host(prefill, items);

  thrust::device_vector<std::byte> k = to_device(mc.k), q = to_device(mc.q);
  thrust::device_vector<float> metric = to_device(mc.metric);
  thrust::device_vector<i32> table = to_device(mc.table), lengths = to_device(mc.lengths);
  thrust::device_vector<i32> seqs = to_device(items), slots = to_device(items), status(kvp::status_words, -1);
  const auto view = mc.view(thrust::raw_pointer_cast(k.data()), thrust::raw_pointer_cast(metric.data()),
                            thrust::raw_pointer_cast(table.data()), thrust::raw_pointer_cast(lengths.data()));
  const auto qv = mc.queries(thrust::raw_pointer_cast(q.data()));
  const kvp::device_metric_batch batch{thrust::raw_pointer_cast(seqs.data()), thrust::raw_pointer_cast(slots.data()),
                                       static_cast<i32>(items.size()), nullptr, thrust::raw_pointer_cast(status.data())};
  kvp::cuda_per_head_metric run;
  if (prefill) {
    std::size_t bytes = 0;
    KVP_CUDA_CHECK(run.prefill(nullptr, bytes, mc.m, view, qv, batch));
    thrust::device_vector<std::byte> temp(bytes);
    KVP_CUDA_CHECK(run.prefill(thrust::raw_pointer_cast(temp.data()), bytes, mc.m, view, qv, batch));
  } else {
    KVP_CUDA_CHECK(run.decode(mc.m, view, qv, batch));
  }
  KVP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<i32> st = to_host(status);
  REQUIRE_NOTHROW(kvp::throw_if_error(st.data()));
  const std::vector<float> got = to_host(metric);
  float largest = 0.0f;
  for (float x : want) largest = std::max(largest, std::abs(x));
  float worst = 0.0f;
  i32 untouched_changed = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]));
    untouched_changed += want[i] == mc.metric[i] && got[i] != mc.metric[i];
  }
  CHECK(worst <= 1e-4f * std::max(largest, 1.0f));
  CHECK(untouched_changed == 0);  // slots of sequences outside the batch, free slots
}

}  // namespace

TEST_CASE("per-head metric on the GPU: prefill and decode against the host, G 1/4/8, d 64/128, bf16/f32") {
  std::uint32_t seed = 1;
  for (i32 G : {1, 4, 8})
    for (i32 d : {64, 128})
      for (kvp::dtype t : {kvp::dtype::bf16, kvp::dtype::f32})
        for (bool prefill : {true, false}) {
          metric_case mc;
          mc.G = G, mc.d = d, mc.type = t, mc.seed = seed++;
          check_metric(mc, prefill);
        }
}

TEST_CASE("per-head metric on the GPU: pooling off, excluded distance, long heads, windows past the head") {
  metric_case mc;
  mc.m.pool_kernel = 1, mc.m.excluded_distance = 3, mc.seed = 40;
  check_metric(mc, true);
  check_metric(mc, false);
  metric_case long_heads;
  long_heads.max_len = 3000, long_heads.heads = 8, long_heads.layers = 1, long_heads.seed = 41;
  check_metric(long_heads, true);
  metric_case short_heads;
  short_heads.max_len = 10, short_heads.m.window = 32, short_heads.seed = 42;
  check_metric(short_heads, true);
}

TEST_CASE("per-head metric on the GPU: refusals name the field; a bad item writes nothing") {
  metric_case mc;
  mc.build();
  thrust::device_vector<std::byte> k = to_device(mc.k), q = to_device(mc.q);
  thrust::device_vector<float> metric = to_device(mc.metric);
  thrust::device_vector<i32> table = to_device(mc.table), lengths = to_device(mc.lengths);
  thrust::device_vector<i32> seqs = to_device(std::vector<i32>{0, mc.seqs}), slots = to_device(std::vector<i32>{0, 0});
  thrust::device_vector<i32> status(kvp::status_words, 0);
  const auto view = mc.view(thrust::raw_pointer_cast(k.data()), thrust::raw_pointer_cast(metric.data()),
                            thrust::raw_pointer_cast(table.data()), thrust::raw_pointer_cast(lengths.data()));
  const auto qv = mc.queries(thrust::raw_pointer_cast(q.data()));
  const kvp::device_metric_batch batch{thrust::raw_pointer_cast(seqs.data()), thrust::raw_pointer_cast(slots.data()), 2,
                                       nullptr, thrust::raw_pointer_cast(status.data())};
  kvp::cuda_per_head_metric run;
  KVP_CUDA_CHECK(run.decode(mc.m, view, qv, batch));
  KVP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<i32> st = to_host(status);
  std::string field = "(none)";
  try {
    kvp::throw_if_error(st.data());
  } catch (const kvp::error& e) {
    field = e.field();
  }
  CHECK(field == "batch[1].seq");
  CHECK(to_host(metric) == mc.metric);
  // Host-side refusals, before any launch.
  auto bad_window = mc.m;
  bad_window.pool_kernel = 4;
  CHECK_THROWS_WITH_AS(run.decode(bad_window, view, qv, batch), doctest::Contains("pipeline.scorer.pool_kernel"),
                       kvp::error);
  auto qbad = qv;
  qbad.head_dim = 32;
  CHECK_THROWS_WITH_AS(run.decode(mc.m, view, qbad, batch), doctest::Contains("queries.head_dim"), kvp::error);
}
