// KV-Compress on the GPU (cuda_per_head_executor) against the host reference
// (host::compress_per_head) on random per-head caches: the same new lengths, evicted
// counts and freed blocks, and every byte of K, V, the metric and the positions equal
// afterwards (whole buffers: nothing outside the batch's heads written). Block sizes
// 1 / 16 / 32, head dims 64 / 128, bf16 and f32, one pool or one per layer, tables as
// one tensor or one per layer, K and V apart or interleaved, positions or none,
// budgets per sequence or per layer, metrics with ties, NaN and infinities; graph
// capture and replay; device refusals naming the field with nothing written.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <thrust/device_vector.h>

#include "kvpolicy/exec/cuda_per_head_executor.cuh"
#include "kvpolicy/kvpolicy.hpp"
#include "support/device_vectors.cuh"

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;
using kvp_test::to_device;
using kvp_test::to_host;

#define KVP_CUDA_CHECK(expr) REQUIRE_EQ(cudaSuccess, (expr))

struct ph_config {
  i32 layers = 2, seqs = 3, heads = 2, block_size = 16, head_dim = 64;
  kvp::dtype type = kvp::dtype::bf16;
  bool shared_pool = true;
  bool per_layer_tables = false;
  bool interleaved = false;  // K and V in one [N, 2, b, d] tensor; else apart, V rows padded (2-byte copies)
  bool positions = true;     // tokens hold positions of an earlier compression (shuffled, with gaps)
  i32 max_len = 300;
  i32 metric_levels = 0;  // > 0: metrics quantised to so many values (ties)
  i32 protected_window = 64, sinks = 0;
  kvp::select::block_budget budget = kvp::select::block_budget::sequence;
  std::uint32_t seed = 1;
};

// Host arrays of a per-head cache and their device mirror.
struct ph_case {
  ph_config cfg;
  i32 nb = 0, max_blocks = 0, pools = 1, logical = 0;
  i64 k_block = 0, k_token = 0, v_block = 0, v_token = 0, v_offset = 0, pool_k = 0, pool_v = 0;
  std::vector<std::byte> k, v;
  std::vector<float> metric;
  std::vector<i32> positions, table, lengths;
  std::vector<i32> logical_lengths;  // per sequence

  explicit ph_case(ph_config c) : cfg(c) {
    std::mt19937 rng(cfg.seed);
    const i32 L = cfg.layers, S = cfg.seqs, H = cfg.heads, b = cfg.block_size, d = cfg.head_dim;
    std::uniform_int_distribution<i32> len(0, cfg.max_len);
    for (i32 i = 0; i < L * S * H; ++i) lengths.push_back(len(rng));
    i32 longest = 1;
    for (i32 T : lengths) longest = std::max(longest, (T + b - 1) / b);
    max_blocks = longest + 1;
    pools = cfg.shared_pool ? 1 : L;
    i32 need = 0;
    for (i32 p = 0; p < pools; ++p) {
      i32 n = 0;
      for (i32 l = 0; l < L; ++l)
        if (cfg.shared_pool || l == p)
          for (i32 r = 0; r < S * H; ++r) n += (lengths[l * S * H + r] + b - 1) / b;
      need = std::max(need, n);
    }
    nb = need + 5;
    table.assign(static_cast<std::size_t>(L) * S * H * max_blocks, -1);
    std::vector<i32> ids(static_cast<std::size_t>(nb));
    for (i32 p = 0; p < pools; ++p) {
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::size_t next = 0;
      for (i32 l = 0; l < L; ++l) {
        if (!cfg.shared_pool && l != p) continue;
        for (i32 r = 0; r < S * H; ++r) {
          const i32 row = l * S * H + r;
          for (i32 i = 0; i < (lengths[row] + b - 1) / b; ++i) table[static_cast<std::size_t>(row) * max_blocks + i] = ids[next++];
        }
      }
    }
    const i64 es = kvp::size_of(cfg.type);
    if (cfg.interleaved) {
      k_token = v_token = d;
      k_block = v_block = 2 * i64{b} * d;
      v_offset = i64{b} * d;
    } else {
      k_token = d;
      k_block = i64{b} * d;
      v_token = d + 3;  // rows not on 16-byte boundaries: the 2-byte copy path
      v_block = i64{b} * (d + 3) + 1;
    }
    pool_k = nb * k_block;
    pool_v = cfg.interleaved ? pool_k : nb * v_block + 5;
    k.resize(static_cast<std::size_t>(pools * pool_k * es));
    if (!cfg.interleaved) v.resize(static_cast<std::size_t>(pools * pool_v * es));
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& x : k) x = static_cast<std::byte>(byte(rng));
    for (auto& x : v) x = static_cast<std::byte>(byte(rng));
    metric.resize(static_cast<std::size_t>(pools) * nb * b);
    positions.assign(metric.size(), -1);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& m : metric) {
      m = cfg.metric_levels > 0 ? std::floor(u(rng) * cfg.metric_levels) / cfg.metric_levels : u(rng);
      const float r = u(rng);
      if (r < 0.01f) m = std::numeric_limits<float>::quiet_NaN();
      else if (r < 0.015f) m = std::numeric_limits<float>::infinity();
      else if (r < 0.02f) m = -std::numeric_limits<float>::infinity();
      else if (r < 0.03f) m = -0.0f;
    }
    // Positions: each head holds a random subset of the sequence's positions, shuffled
    // (an earlier compression with fill), so slots are not positions.
    for (i32 s = 0; s < S; ++s) {
      i32 most = 0;
      for (i32 l = 0; l < L; ++l)
        for (i32 h = 0; h < H; ++h) most = std::max(most, length(l, s, h));
      logical_lengths.push_back(cfg.positions ? most + most / 3 : (s % 2 ? most + 7 : -1));
      for (i32 l = 0; l < L; ++l)
        for (i32 h = 0; h < H; ++h) {
          std::vector<i32> p(static_cast<std::size_t>(cfg.positions ? logical_lengths[s] : length(l, s, h)));
          std::iota(p.begin(), p.end(), 0);
          if (cfg.positions) std::shuffle(p.begin(), p.end(), rng);
          for (i32 t = 0; t < length(l, s, h); ++t) positions[slot(l, block(l, s, h, t / b), t % b)] = p[t];
        }
    }
  }

  i32 row(i32 l, i32 s, i32 h) const { return (l * cfg.seqs + s) * cfg.heads + h; }
  i32 length(i32 l, i32 s, i32 h) const { return lengths[row(l, s, h)]; }
  i32 block(i32 l, i32 s, i32 h, i32 i) const { return table[static_cast<std::size_t>(row(l, s, h)) * max_blocks + i]; }
  std::size_t slot(i32 l, i32 blk, i32 sl) const {
    return (static_cast<std::size_t>(cfg.shared_pool ? 0 : l) * nb + blk) * cfg.block_size + sl;
  }

  // The view over host arrays (base pointers) or device ones; per-layer tables and
  // K bases come as pointer lists in the same memory.
  kvp::per_head_kv_view view(std::byte* kb, std::byte* vb, float* m, i32* pos, const i32* tab, const i32* len,
                             const i32* const* tab_layers, const i32* const* len_layers, void* const* k_layers) const {
    kvp::per_head_kv_view c;
    c.num_layers = cfg.layers, c.num_blocks = nb, c.block_size = cfg.block_size, c.num_kv_heads = cfg.heads;
    c.head_dim = cfg.head_dim, c.num_seqs = cfg.seqs, c.max_blocks = max_blocks, c.type = cfg.type;
    c.shared_pool = cfg.shared_pool;
    if (cfg.shared_pool) c.k = {kb, 0, nullptr, 0};
    else c.k = {nullptr, 0, k_layers, 0};
    c.v = {cfg.interleaved ? kb : vb, cfg.shared_pool ? 0 : pool_v, nullptr, v_offset};
    c.k_stride = {k_block, k_token, 1};
    c.v_stride = {v_block, v_token, 1};
    if (cfg.per_layer_tables) {
      c.table = kvp::per_head_array::per_layer(tab_layers, cfg.heads, max_blocks);
      c.lengths = kvp::per_head_array::per_layer(len_layers, cfg.heads);
    } else {
      c.table = kvp::per_head_array::dense(tab, cfg.seqs, cfg.heads, max_blocks);
      c.lengths = kvp::per_head_array::dense(len, cfg.seqs, cfg.heads);
    }
    c.metric = cfg.shared_pool ? kvp::per_slot_metric::shared(m, cfg.block_size)
                               : kvp::per_slot_metric::per_layer(m, nb, cfg.block_size);
    if (cfg.positions)
      c.positions = cfg.shared_pool ? kvp::per_slot_positions::shared(pos, cfg.block_size)
                                    : kvp::per_slot_positions::per_layer(pos, nb, cfg.block_size);
    return c;
  }
};

// The same case in device memory.
struct ph_device {
  thrust::device_vector<std::byte> k, v;
  thrust::device_vector<float> metric;
  thrust::device_vector<i32> positions, table, lengths;
  thrust::device_vector<const i32*> tab_layers, len_layers;
  thrust::device_vector<void*> k_layers;

  explicit ph_device(const ph_case& c)
      : k(to_device(c.k)), v(to_device(c.v)), metric(to_device(c.metric)), positions(to_device(c.positions)),
        table(to_device(c.table)), lengths(to_device(c.lengths)) {
    std::vector<const i32*> tl, ll;
    std::vector<void*> kl;
    const std::size_t es = kvp::size_of(c.cfg.type);
    for (i32 l = 0; l < c.cfg.layers; ++l) {
      tl.push_back(thrust::raw_pointer_cast(table.data()) + static_cast<std::size_t>(l) * c.cfg.seqs * c.cfg.heads * c.max_blocks);
      ll.push_back(thrust::raw_pointer_cast(lengths.data()) + static_cast<std::size_t>(l) * c.cfg.seqs * c.cfg.heads);
      kl.push_back(thrust::raw_pointer_cast(k.data()) + (c.cfg.shared_pool ? 0 : l * c.pool_k * es));
    }
    tab_layers = to_device(tl);
    len_layers = to_device(ll);
    k_layers = to_device(kl);
  }
  kvp::per_head_kv_view view(const ph_case& c) {
    return c.view(thrust::raw_pointer_cast(k.data()), thrust::raw_pointer_cast(v.data()),
                  thrust::raw_pointer_cast(metric.data()), thrust::raw_pointer_cast(positions.data()),
                  thrust::raw_pointer_cast(table.data()), thrust::raw_pointer_cast(lengths.data()),
                  thrust::raw_pointer_cast(tab_layers.data()), thrust::raw_pointer_cast(len_layers.data()),
                  thrust::raw_pointer_cast(k_layers.data()));
  }
};

struct host_tables {
  std::vector<const i32*> tl, ll;
  std::vector<void*> kl;
  host_tables(ph_case& c) {
    const std::size_t es = kvp::size_of(c.cfg.type);
    for (i32 l = 0; l < c.cfg.layers; ++l) {
      tl.push_back(c.table.data() + static_cast<std::size_t>(l) * c.cfg.seqs * c.cfg.heads * c.max_blocks);
      ll.push_back(c.lengths.data() + static_cast<std::size_t>(l) * c.cfg.seqs * c.cfg.heads);
      kl.push_back(c.k.data() + (c.cfg.shared_pool ? 0 : l * c.pool_k * es));
    }
  }
  kvp::per_head_kv_view view(ph_case& c) {
    return c.view(c.k.data(), c.v.data(), c.metric.data(), c.positions.data(), c.table.data(), c.lengths.data(),
                  tl.data(), ll.data(), kl.data());
  }
};

// Items: a shuffled subset of the sequences (at least one left out when there are
// several), each asking a random number of blocks (sometimes more than it can free).
struct ph_items {
  std::vector<kvp::per_head_item> host;
  std::vector<i64> per_layer;  // [items][layers]
  thrust::device_vector<i64> per_layer_device;
  thrust::device_vector<kvp::per_head_item> device;

  ph_items(const ph_case& c, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<i32> seqs(static_cast<std::size_t>(c.cfg.seqs));
    std::iota(seqs.begin(), seqs.end(), 0);
    std::shuffle(seqs.begin(), seqs.end(), rng);
    if (seqs.size() > 1) seqs.pop_back();
    const i32 L = c.cfg.layers, H = c.cfg.heads, b = c.cfg.block_size;
    for (i32 s : seqs) {
      i64 held = 0;
      for (i32 l = 0; l < L; ++l) {
        i64 layer_held = 0;
        for (i32 h = 0; h < H; ++h) layer_held += (c.length(l, s, h) + b - 1) / b;
        per_layer.push_back(std::uniform_int_distribution<i64>(0, layer_held + 1)(rng));
        held += layer_held;
      }
      host.push_back({.seq = s,
                      .blocks_to_free = std::uniform_int_distribution<i64>(0, held * 3 / 4 + 1)(rng),
                      .per_layer = nullptr,
                      .logical_length = c.logical_lengths[static_cast<std::size_t>(s)]});
    }
    per_layer_device = to_device(per_layer);
    std::vector<kvp::per_head_item> dev = host;
    for (std::size_t i = 0; i < host.size(); ++i) {
      host[i].per_layer = per_layer.data() + i * static_cast<std::size_t>(L);
      dev[i].per_layer = thrust::raw_pointer_cast(per_layer_device.data()) + i * static_cast<std::size_t>(L);
    }
    device = to_device(dev);
  }
};

struct device_outputs {
  thrust::device_vector<i32> status, new_lengths, freed_counts, freed_blocks, evicted, moved;
  thrust::device_vector<i64> freed, nonfinite;
  device_outputs(i32 rows, i32 items, i32 max_blocks)
      : status(kvp::status_words, 0), new_lengths(static_cast<std::size_t>(rows), -1),
        freed_counts(static_cast<std::size_t>(rows), -1),
        freed_blocks(static_cast<std::size_t>(rows) * max_blocks, -1), evicted(static_cast<std::size_t>(rows), -1),
        moved(static_cast<std::size_t>(rows), -1),
        freed(static_cast<std::size_t>(items), -1), nonfinite(static_cast<std::size_t>(items), -1) {}
  kvp::device_per_head_result result() {
    return {thrust::raw_pointer_cast(status.data()),       thrust::raw_pointer_cast(new_lengths.data()),
            thrust::raw_pointer_cast(freed_counts.data()), thrust::raw_pointer_cast(freed_blocks.data()),
            thrust::raw_pointer_cast(evicted.data()),      thrust::raw_pointer_cast(moved.data()),
            thrust::raw_pointer_cast(freed.data()),
            thrust::raw_pointer_cast(nonfinite.data())};
  }
};

kvp::select::head_adaptive_blocks selector(const ph_config& cfg) {
  return {.protected_window = cfg.protected_window, .sinks = cfg.sinks, .budget = cfg.budget};
}

// Runs both executors on copies of one case and compares everything.
void check_parity(const ph_config& cfg, bool graph = false) {
  CAPTURE(cfg.block_size);
  CAPTURE(cfg.head_dim);
  CAPTURE(kvp::name_of(cfg.type));
  CAPTURE(cfg.shared_pool);
  CAPTURE(cfg.per_layer_tables);
  CAPTURE(cfg.interleaved);
  CAPTURE(cfg.positions);
  CAPTURE(cfg.metric_levels);
  CAPTURE(static_cast<int>(cfg.budget));
  CAPTURE(cfg.seed);
  ph_case host_case(cfg);
  ph_device dev(host_case);
  ph_items items(host_case, cfg.seed + 100);
  const auto sel = selector(cfg);

  host_tables ht(host_case);
  const kvp::per_head_result want = kvp::host::compress_per_head(sel, ht.view(host_case), items.host);

  const auto n_items = static_cast<i32>(items.host.size());
  const i32 rows = n_items * cfg.layers * cfg.heads;
  device_outputs out(rows, n_items, host_case.max_blocks);
  const kvp::per_head_kv_view dv = dev.view(host_case);
  const kvp::device_per_head_batch batch{thrust::raw_pointer_cast(items.device.data()), n_items};
  kvp::cuda_per_head_executor ex;
  std::size_t bytes = 0;
  KVP_CUDA_CHECK(ex.compress(nullptr, bytes, sel, dv, batch, out.result()));
  thrust::device_vector<std::byte> temp(bytes);
  if (graph) {
    cudaStream_t stream;
    KVP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ex.stream = stream;
    cudaGraph_t g;
    cudaGraphExec_t exec;
    KVP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    KVP_CUDA_CHECK(ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, sel, dv, batch, out.result()));
    KVP_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    KVP_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    KVP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVP_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  } else {
    KVP_CUDA_CHECK(ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, sel, dv, batch, out.result()));
  }
  KVP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<i32> status = to_host(out.status);
  REQUIRE_NOTHROW(kvp::throw_if_error(status.data()));

  const std::vector<i32> new_lengths = to_host(out.new_lengths), freed_counts = to_host(out.freed_counts),
                         freed_blocks = to_host(out.freed_blocks), evicted = to_host(out.evicted),
                         moved = to_host(out.moved);
  const std::vector<i64> freed = to_host(out.freed), nonfinite = to_host(out.nonfinite);
  i32 mismatched_rows = 0;
  for (i32 i = 0; i < n_items; ++i) {
    CHECK(freed[static_cast<std::size_t>(i)] == want.freed[static_cast<std::size_t>(i)]);
    CHECK(nonfinite[static_cast<std::size_t>(i)] == want.nonfinite[static_cast<std::size_t>(i)]);
    for (i32 r = 0; r < cfg.layers * cfg.heads; ++r) {
      const std::size_t row = static_cast<std::size_t>(i) * cfg.layers * cfg.heads + r;
      const auto& fb = want.freed_blocks[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
      bool same = new_lengths[row] == want.new_lengths[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)] &&
                  evicted[row] == want.evicted[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)] &&
                  moved[row] == want.moved[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)] &&
                  freed_counts[row] == static_cast<i32>(fb.size());
      for (std::size_t j = 0; same && j < fb.size(); ++j) same = freed_blocks[row * host_case.max_blocks + j] == fb[j];
      mismatched_rows += !same;
    }
  }
  CHECK(mismatched_rows == 0);
  // Every byte, whole buffers.
  CHECK(to_host(dev.k) == host_case.k);
  CHECK(to_host(dev.v) == host_case.v);
  CHECK(to_host(dev.positions) == host_case.positions);
  const std::vector<float> m = to_host(dev.metric);
  i32 metric_diff = 0;
  for (std::size_t j = 0; j < m.size(); ++j)
    metric_diff += std::memcmp(&m[j], &host_case.metric[j], sizeof(float)) != 0;
  CHECK(metric_diff == 0);
  CHECK(to_host(dev.lengths) == host_case.lengths);  // the engine's, never written
  CHECK(to_host(dev.table) == host_case.table);
}

}  // namespace

TEST_CASE("per-head GPU parity: block sizes 1 / 16 / 32, head dims 64 / 128, both dtypes") {
  std::uint32_t seed = 1;
  for (i32 b : {1, 16, 32})
    for (i32 d : {64, 128})
      for (kvp::dtype t : {kvp::dtype::bf16, kvp::dtype::f32}) {
        ph_config cfg;
        cfg.block_size = b, cfg.head_dim = d, cfg.type = t, cfg.seed = seed++;
        cfg.max_len = b == 1 ? 120 : 400;
        cfg.protected_window = b == 1 ? 8 : 64;
        check_parity(cfg);
      }
}

TEST_CASE("per-head GPU parity: pools, tables, K/V forms, positions, budgets, ties") {
  std::uint32_t seed = 50;
  for (bool shared : {true, false})
    for (bool layer_tables : {false, true})
      for (bool interleaved : {false, true})
        for (bool positions : {true, false})
          for (auto budget : {kvp::select::block_budget::sequence, kvp::select::block_budget::layer}) {
            ph_config cfg;
            cfg.shared_pool = shared, cfg.per_layer_tables = layer_tables, cfg.interleaved = interleaved;
            cfg.positions = positions, cfg.budget = budget, cfg.seed = seed++;
            cfg.metric_levels = seed % 3 == 0 ? 4 : 0;
            cfg.sinks = seed % 2 ? 4 : 0;
            cfg.layers = 3, cfg.heads = 4, cfg.max_len = 150, cfg.protected_window = 16;
            check_parity(cfg);
          }
}

TEST_CASE("per-head GPU parity: long heads (several histogram tiles), heavy ties, KV-Compress's 8 heads") {
  ph_config cfg;
  cfg.layers = 4, cfg.heads = 8, cfg.seqs = 4, cfg.head_dim = 128, cfg.max_len = 5000;
  for (i32 levels : {0, 2, 64}) {
    cfg.metric_levels = levels;
    cfg.seed = 200 + static_cast<std::uint32_t>(levels);
    check_parity(cfg);
  }
  cfg.budget = kvp::select::block_budget::layer;
  check_parity(cfg);
}

TEST_CASE("per-head GPU parity: heads longer than the shared-memory keys (read from the cache)") {
  ph_config cfg;
  cfg.layers = 1, cfg.seqs = 2, cfg.heads = 2, cfg.max_len = 20000, cfg.head_dim = 128, cfg.seed = 250;
  check_parity(cfg);
  cfg.metric_levels = 3, cfg.seed = 251;
  check_parity(cfg);
}

TEST_CASE("per-head GPU: a captured graph gives the same results as a plain call") {
  ph_config cfg;
  cfg.heads = 4, cfg.max_len = 600, cfg.seed = 300;
  check_parity(cfg, /*graph=*/true);
  cfg.budget = kvp::select::block_budget::layer, cfg.positions = false, cfg.seed = 301;
  check_parity(cfg, /*graph=*/true);
}

namespace {

// Runs the device executor on a case broken by `breaks` (after the host copy), and
// expects one of `fields` named, with every byte of the cache as it was.
template <class Break>
void device_refuses(std::vector<std::string> fields, Break breaks, ph_config cfg = {}) {
  CAPTURE(fields.front());
  ph_case c(cfg);
  ph_items items(c, 7);
  breaks(c, items);
  ph_device dev(c);
  items.per_layer_device = to_device(items.per_layer);
  std::vector<kvp::per_head_item> d = items.host;
  for (std::size_t i = 0; i < d.size(); ++i)
    d[i].per_layer = items.host[i].per_layer == nullptr
                         ? nullptr
                         : thrust::raw_pointer_cast(items.per_layer_device.data()) + i * static_cast<std::size_t>(cfg.layers);
  items.device = to_device(d);
  const auto n_items = static_cast<i32>(items.host.size());
  device_outputs out(n_items * cfg.layers * cfg.heads, n_items, c.max_blocks);
  const auto sel = selector(cfg);
  kvp::cuda_per_head_executor ex;
  std::size_t bytes = 0;
  const kvp::device_per_head_batch batch{thrust::raw_pointer_cast(items.device.data()), n_items};
  KVP_CUDA_CHECK(ex.compress(nullptr, bytes, sel, dev.view(c), batch, out.result()));
  thrust::device_vector<std::byte> temp(bytes);
  KVP_CUDA_CHECK(ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, sel, dev.view(c), batch, out.result()));
  KVP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<i32> status = to_host(out.status);
  std::string got = "(no error)";
  try {
    kvp::throw_if_error(status.data());
  } catch (const kvp::error& e) {
    got = e.field();
    MESSAGE(e.what());
  }
  CHECK(std::find(fields.begin(), fields.end(), got) != fields.end());
  CHECK(to_host(dev.k) == c.k);
  CHECK(to_host(dev.v) == c.v);
  CHECK(to_host(dev.positions) == c.positions);
  const std::vector<float> m = to_host(dev.metric);
  CHECK(std::memcmp(m.data(), c.metric.data(), m.size() * sizeof(float)) == 0);
}

// Gives an empty head one token in a block of its pool no head holds.
void ensure_tokens(ph_case& c, i32 l, i32 s, i32 h) {
  if (c.length(l, s, h) > 0) return;
  std::vector<bool> used(static_cast<std::size_t>(c.nb), false);
  for (i32 ll = 0; ll < c.cfg.layers; ++ll) {
    if (!c.cfg.shared_pool && ll != l) continue;
    for (i32 ss = 0; ss < c.cfg.seqs; ++ss)
      for (i32 hh = 0; hh < c.cfg.heads; ++hh)
        for (i32 i = 0; i < (c.length(ll, ss, hh) + c.cfg.block_size - 1) / c.cfg.block_size; ++i)
          used[static_cast<std::size_t>(c.block(ll, ss, hh, i))] = true;
  }
  const auto free_id = static_cast<i32>(std::find(used.begin(), used.end(), false) - used.begin());
  REQUIRE(free_id < c.nb);
  c.lengths[static_cast<std::size_t>(c.row(l, s, h))] = 1;
  c.table[static_cast<std::size_t>(c.row(l, s, h)) * c.max_blocks] = free_id;
  c.positions[c.slot(l, free_id, 0)] = 0;
}

}  // namespace

TEST_CASE("per-head GPU refusals name the field and write nothing") {
  device_refuses({"cache.lengths[layer 1][seq 0][head 1]"}, [](ph_case& c, ph_items&) {
    c.lengths[static_cast<std::size_t>(c.row(1, 0, 1))] = c.max_blocks * c.cfg.block_size + 1;
  });
  device_refuses({"cache.table[layer 0][seq 1][head 0][0]"}, [](ph_case& c, ph_items&) {
    ensure_tokens(c, 0, 1, 0);
    c.table[static_cast<std::size_t>(c.row(0, 1, 0)) * c.max_blocks] = c.nb;
  });
  // A block two heads hold: either holder may be found first.
  device_refuses({"cache.table[layer 1][seq 0][head 1][0]", "cache.table[layer 0][seq 2][head 0][0]"},
                 [](ph_case& c, ph_items&) {
                   ensure_tokens(c, 1, 0, 1);
                   ensure_tokens(c, 0, 2, 0);
                   c.table[static_cast<std::size_t>(c.row(1, 0, 1)) * c.max_blocks] =
                       c.table[static_cast<std::size_t>(c.row(0, 2, 0)) * c.max_blocks];
                 });
  device_refuses({"batch[0].seq"}, [](ph_case& c, ph_items& it) { it.host[0].seq = c.cfg.seqs; });
  device_refuses({"batch[1].seq"}, [](ph_case&, ph_items& it) { it.host[1].seq = it.host[0].seq; });
  device_refuses({"batch[0].blocks_to_free"}, [](ph_case&, ph_items& it) { it.host[0].blocks_to_free = -3; });
  device_refuses({"batch[0].logical_length"}, [](ph_case&, ph_items& it) { it.host[0].logical_length = -1; });
  device_refuses({"cache.positions (batch[0], layer 0, head 0, token 0)"}, [](ph_case& c, ph_items& it) {
    const i32 s = it.host[0].seq;
    ensure_tokens(c, 0, s, 0);
    c.positions[c.slot(0, c.block(0, s, 0, 0), 0)] = it.host[0].logical_length;
  });
  ph_config per_layer;
  per_layer.budget = kvp::select::block_budget::layer;
  device_refuses({"batch[1].per_layer"}, [](ph_case&, ph_items& it) { it.host[1].per_layer = nullptr; }, per_layer);
  device_refuses({"batch[0].per_layer[1]"}, [](ph_case&, ph_items& it) { it.per_layer[1] = -1; }, per_layer);
}
