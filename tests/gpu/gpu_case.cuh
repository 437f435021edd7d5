// A random paged cache mirrored on the device, for host/device parity tests:
// the same bytes in host memory (for the host executor) and device memory (for
// the CUDA executor), in one of three engine layouts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <thrust/device_vector.h>
#include <thrust/fill.h>

#include "kvpolicy/kvpolicy.cuh"
#include "support/device_vectors.cuh"

namespace kvp_gpu {

#define KVP_CUDA_CHECK(expr) REQUIRE_EQ(cudaSuccess, (expr))

enum class layout_kind { nano_vllm, vllm_flash, hnd };

struct case_config {
  std::int32_t layers = 2, block_size = 16, kv_heads = 2, q_heads = 4, head_dim = 64, window = 32;
  kvp::dtype type = kvp::dtype::f32;
  layout_kind layout = layout_kind::nano_vllm;
  std::vector<std::int32_t> lengths{40, 64, 33};
  std::uint32_t seed = 1;
};

using kvp_test::to_device;
using kvp_test::to_host;

struct gpu_case {
  case_config cfg;
  std::int32_t num_blocks = 0, max_blocks = 0;
  std::vector<std::byte> kv;  // all K and V bytes, one allocation
  std::vector<std::byte> q;
  std::vector<float> f;
  std::vector<std::int32_t> table, lengths;
  std::size_t layer_bytes = 0;  // per-layer tensor (vllm_flash) or per-layer K (hnd)

  explicit gpu_case(case_config c) : cfg(std::move(c)) {
    std::mt19937 rng(cfg.seed);
    const std::int32_t b = cfg.block_size;
    for (auto T : cfg.lengths) max_blocks = std::max(max_blocks, (T + b - 1) / b);
    const auto S = static_cast<std::int32_t>(cfg.lengths.size());
    num_blocks = S * max_blocks + 3;  // spare blocks owned by nobody
    std::vector<std::int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(std::size_t(S) * max_blocks, -1);
    for (std::int32_t s = 0, next = 0; s < S; ++s)
      for (std::int32_t i = 0; i < (cfg.lengths[s] + b - 1) / b; ++i) table[std::size_t(s) * max_blocks + i] = perm[next++];
    lengths = cfg.lengths;
    const std::size_t es = kvp::size_of(cfg.type);
    const std::size_t block_elems = std::size_t(b) * cfg.kv_heads * cfg.head_dim;
    layer_bytes = block_elems * num_blocks * es * (cfg.layout == layout_kind::vllm_flash ? 2 : 1);
    kv.resize(2 * std::size_t(cfg.layers) * block_elems * num_blocks * es);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    fill(kv.data(), kv.size() / es, cfg.type, rng, u);
    q.resize(std::size_t(cfg.layers) * S * cfg.window * cfg.q_heads * cfg.head_dim * es);
    fill(q.data(), q.size() / es, cfg.type, rng, u);
    f.resize(std::size_t(cfg.layers) * num_blocks * b * cfg.kv_heads);
    for (auto& x : f) x = u(rng);
  }

  static void fill(std::byte* p, std::size_t n, kvp::dtype t, std::mt19937& rng, std::uniform_real_distribution<float>& u) {
    for (std::size_t i = 0; i < n; ++i) kvp::store_from_float(p, t, static_cast<std::int64_t>(i), 2.0f * u(rng));
  }

  kvp::cache_shape shape() const {
    return {cfg.layers, num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim, cfg.type};
  }

  // The view over `kv_base` (host or device bytes), with layer tables `layer_ptrs`
  // (in the same memory space) for the layouts that take one tensor per layer.
  kvp::paged_kv_view view(std::byte* kv_base, void* const* k_layers, void* const* v_layers,
                          const std::int32_t* table_ptr, const std::int32_t* lengths_ptr) const {
    const kvp::sequence_table seqs{kvp::block_table_view::dense(table_ptr, max_blocks), lengths_ptr,
                                   static_cast<std::int32_t>(lengths.size())};
    switch (cfg.layout) {
      case layout_kind::vllm_flash: return kvp::layouts::vllm_flash(k_layers, shape(), seqs);
      case layout_kind::hnd: return kvp::layouts::hnd(k_layers, v_layers, shape(), seqs);
      default: return kvp::layouts::nano_vllm(kv_base, shape(), seqs);
    }
  }

  // Per-layer tensor pointers into `base`: K layers then V layers (hnd), or one [2, ...] tensor per layer.
  std::vector<void*> layer_pointers(std::byte* base, bool values) const {
    std::vector<void*> p(cfg.layers);
    const std::size_t v_off = cfg.layout == layout_kind::hnd && values ? layer_bytes * cfg.layers : 0;
    for (std::int32_t l = 0; l < cfg.layers; ++l) p[l] = base + v_off + layer_bytes * l;
    return p;
  }

  kvp::query_window_view queries(const void* base) const {
    return kvp::query_window_view::contiguous(base, cfg.layers, static_cast<std::int32_t>(lengths.size()), cfg.window,
                                              cfg.q_heads, cfg.head_dim, cfg.type);
  }
  kvp::score_view scores(float* base) const {
    return kvp::score_view::contiguous(base, num_blocks, cfg.block_size, cfg.kv_heads);
  }
};

// A host copy of a case's mutable buffers, with its views.
struct host_side {
  std::vector<std::byte> kv;
  std::vector<float> f;
  std::vector<void*> k_layers, v_layers;
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;

  explicit host_side(const gpu_case& c) : kv(c.kv), f(c.f) {
    k_layers = c.layer_pointers(kv.data(), false);
    v_layers = c.layer_pointers(kv.data(), true);
    cache = c.view(kv.data(), k_layers.data(), v_layers.data(), c.table.data(), c.lengths.data());
    queries = c.queries(c.q.data());
    scores = c.scores(f.data());
  }
  host_side(const host_side&) = delete;
};

// The device copy of a case.
struct device_side {
  thrust::device_vector<std::byte> kv, q;
  thrust::device_vector<float> f;
  thrust::device_vector<std::int32_t> table, lengths;
  thrust::device_vector<void*> k_layers, v_layers;
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;

  explicit device_side(const gpu_case& c)
      : kv(to_device(c.kv)), q(to_device(c.q)), f(to_device(c.f)), table(to_device(c.table)), lengths(to_device(c.lengths)) {
    auto* base = thrust::raw_pointer_cast(kv.data());
    k_layers = to_device(c.layer_pointers(base, false));
    v_layers = to_device(c.layer_pointers(base, true));
    cache = c.view(base, thrust::raw_pointer_cast(k_layers.data()), thrust::raw_pointer_cast(v_layers.data()),
                   thrust::raw_pointer_cast(table.data()), thrust::raw_pointer_cast(lengths.data()));
    queries = c.queries(thrust::raw_pointer_cast(q.data()));
    scores = c.scores(thrust::raw_pointer_cast(f.data()));
  }
};

// Everything a CUDA compression writes, allocated for one batch.
struct device_outputs {
  thrust::device_vector<std::int32_t> status, new_lengths, released_counts, released_blocks;
  thrust::device_vector<std::uint8_t> keep;
  thrust::device_vector<float> final_scores;
  thrust::device_vector<kvp::batch_item> items;
  thrust::device_vector<std::byte> temp;
  kvp::device_batch batch;
  kvp::device_result result;

  device_outputs(const std::vector<kvp::batch_item>& host_items, std::int32_t max_tokens, std::int32_t rows_per_item,
                 std::int32_t max_blocks_per_item)
      : status(kvp::status_words, 0),
        new_lengths(host_items.size(), -1),
        released_counts(host_items.size(), -1),
        released_blocks(std::max<std::size_t>(1, host_items.size() * max_blocks_per_item), -1),
        keep(std::max<std::size_t>(1, host_items.size() * rows_per_item * max_tokens), 0),
        final_scores(keep.size(), 0.0f),
        items(host_items.begin(), host_items.end()) {
    batch = {thrust::raw_pointer_cast(items.data()), static_cast<std::int32_t>(host_items.size()), max_tokens, 0, 0};
    result = {thrust::raw_pointer_cast(status.data()),          thrust::raw_pointer_cast(new_lengths.data()),
              thrust::raw_pointer_cast(released_counts.data()), thrust::raw_pointer_cast(released_blocks.data()),
              thrust::raw_pointer_cast(keep.data()),            thrust::raw_pointer_cast(final_scores.data())};
  }

  // Two-phase: size the workspace, allocate it, run. The workspace starts as garbage
  // (every byte 0xff), as an engine's reused buffer may: nothing may rely on its content.
  template <class P>
  cudaError_t run(const kvp::cuda_executor& ex, const P& p, const device_side& d) {
    std::size_t bytes = 0;
    if (auto e = ex.compress(nullptr, bytes, p, d.cache, d.queries, d.scores, batch, result); e != cudaSuccess) return e;
    temp.resize(std::max<std::size_t>(bytes, 1));
    thrust::fill(temp.begin(), temp.end(), std::byte{0xff});
    return ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, p, d.cache, d.queries, d.scores, batch, result);
  }
};

}  // namespace kvp_gpu
