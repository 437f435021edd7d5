// kvpolicy benchmarks: the CUDA executor on a nano-vllm paged cache, with Google
// Benchmark's manual timing (CUDA events around the compression only).
//
// Rows (bench/README.md explains each):
//   copy                            device-to-device cudaMemcpyAsync of 1 GiB: the bandwidth roof
//   e2e/<preset>/A                  configuration A, one compression, end to end, per preset
//   e2e_overlap<G>/zipage/A         the same with cuda_executor::overlap_stream: redundancy
//                                   beside scoring, items in G groups over two streams, G = 1 to 4
//   stage/zipage/A                  configuration A, zipage, per-stage times from the stage marks
//   e2e|stage/zipage_fill/A         zipage's selection with layout::fill: only kept tokens past the new length move
//   e2e|stage/zipage/A_dup          the same with one key in eight a near-copy of an earlier key
//                                   of its block (the PyTorch reference's inputs); e2e/gkv/A_dup
//   scale_seqs/zipage/<S>           S = 1, 4, 16, 64 sequences, T = 2304
//   scale_seqs_stage/zipage/<S>     S = 1, 4: per-stage times (rows fewer than the SMs' block slots)
//   scale_tokens/zipage/<T>         T = 2304, 4608, 9216 (N_max 9, 18, 36), 16 sequences
//   head_dim/{zipage,gkv}/<d>       configuration A with head dim d = 64, 96, 192, 256
//   head_dim_stage/zipage/<d>       the same, per-stage times from the stage marks
//   hnd/zipage/<d>, hnd_stage/...   configuration A (d 64, 128) in FlashInfer's HND layout
//   redundancy/lightning/<T>        redundancy stage only, 1 sequence, 1 layer (8 rows)
//   redundancy/full/<T>             the same with all-pairs redundancy (quadratic)
//   redundancy/lightning_batched/<T> lightning at configuration A's 16 sequences x 8 layers
//   e2e|stage/hard_kv/A[_reuse]     configuration A, hard_kv: temperatures solved at every call, or
//                                   solved once and reused; e2e/hard_kv_rkv/A
//   e2e|stage/hard_kv/A_cautious    A_reuse with a live view (cautious update) whose heads dropped 0..22%;
//                                   e2e/hard_kv_rkv/A_reuse and A_cautious, the same with full redundancy
//   calibration/hard_kv/<I>/<T>     stage rows, every row's search run to I iterations (T = 2304, 9216),
//                                   beside calibration/hard_kv/reuse/<T>: the epilogues' difference
//   e2e|stage/kara/KvLLM            Kara at a KvLLM compression event: 30 windows of 768 tokens, 32 layers
//                                   (config_kvllm); 60 blocks freed
//   e2e|stage/zipage/KvLLM_8k       Zipage freeing the same 60 blocks from whole sequences of 8192 tokens
//   e2e|stage/kv_compress/B[_positions]  KV-Compress over a per-head block cache, configuration B
//                                   (bench/per_head_rows.cuh states it and its byte model)
//   decode/<cache>/<shape>[_metric]  decode attention over per-head, per-head-count, live-mask and plain
//                                   paged caches (bench/decode_attention_rows.cuh states them and the byte model)
//
// Configuration A: 16 sequences, 8 layers per launch, h_kv 8, h_q 32, d 128, b 256,
// N_max 9 (T = 2304 tokens held, the last block full), w 16, bf16, budget
// (N_max - 1) * b = 2048; every sequence was compressed before (history = budget:
// Zipage's steady state, so the first-only pool is skipped).
//
// Byte model of a compression (the bytes an ideal single pass must touch; rows are
// the (sequence, layer, KV head) triples of the launch, es the element size):
//   K read once for every token of every row          rows * T * d * es     (pipelines that read keys)
//   queries read once                                 L * S * w * h_q * d * es (attention scorers)
//   F read and written for every token                rows * T * (4 + 4)   (pipelines that keep F)
//   K and V of every kept token whose slot changes,
//   read and written                                  moved * 2 * 2 * d * es
// `moved` (the moved_tokens counter) is counted once per configuration from an
// untimed run: kept tokens whose destination index differs from their position.
// GB/s = bytes / time; copy_fraction = GB/s / (best measured copy GB/s, read + write).
// host_us: the median CPU time of the compress call itself (validation and launches).
//
// Kara (a window-only layout): keys are read for the candidates alone (W \ U, 736 of
// each window), queries are the window's 768 per (layer, item, query head), no F;
// moved tokens are the window's kept tokens whose slot changes and every token after
// the window. Per stage (stage/kara/KvLLM): score = those keys and queries read, scores
// written (4 B / candidate); redundancy none; epilogue = scores read, mask written
// (1 B / token of the window and after); layout = mask read, moved K and V read and
// written. score_TFLOP(_per_s): QK^T's 2 d flops per (query, key) pair.
//
// Per-stage byte models (stage/zipage/A), each stage's own inputs and outputs,
// including the fp32 work buffers that pass scores between stages:
//   score       K + queries read, scores written (4 B / token)
//   redundancy  K read, redundancy written (4 B / token)
//   epilogue    scores and redundancy read (8 B / token), F read and written (8 B / token),
//               keep mask written (1 B / token)
//   layout      keep mask read (1 B / token), moved K and V read and written, moved F
//               read and written (8 B / moved token)
#include "kvpolicy/kvpolicy.cuh"  // first: it sets FMT_USE_CONSTEXPR before fmt is seen

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace {

// ---------------------------------------------------------------------------
// CUDA plumbing
// ---------------------------------------------------------------------------

void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what + ": " +
                             cudaGetErrorString(e));
}
#define KVP_BENCH_CHECK(expr) cuda_check((expr), #expr, __FILE__, __LINE__)

// An owning device allocation.
class dbuf {
 public:
  dbuf() = default;
  explicit dbuf(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) KVP_BENCH_CHECK(cudaMalloc(&p_, bytes_));
  }
  dbuf(dbuf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  dbuf& operator=(dbuf&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  ~dbuf() { reset(); }

  void reset() noexcept {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  template <class T = void>
  T* get() const noexcept {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

class event {
 public:
  event() { KVP_BENCH_CHECK(cudaEventCreate(&e_)); }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { cudaEventDestroy(e_); }
  operator cudaEvent_t() const noexcept { return e_; }

 private:
  cudaEvent_t e_{};
};

class stream_guard {
 public:
  stream_guard() { KVP_BENCH_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard() { cudaStreamDestroy(s_); }
  operator cudaStream_t() const noexcept { return s_; }

 private:
  cudaStream_t s_{};
};

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.0f;
  KVP_BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// ---------------------------------------------------------------------------
// Random data, generated on the device from a hash of the index (caches reach GBs)
// ---------------------------------------------------------------------------

__device__ inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Element i of the uniform stream `seed`, in [0, 1).
__device__ inline float uniform01(std::uint64_t seed, std::uint64_t i) {
  return static_cast<float>(splitmix64(seed * 0xD1B54A32D192ED03ull + i) >> 40) * (1.0f / 16777216.0f);
}

// p[i] = lo + (hi - lo) * uniform01(seed, i), stored as `type`.
__global__ void fill_uniform_kernel(void* p, std::size_t n, kvp::dtype type, std::uint64_t seed, float lo, float hi) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = lo + (hi - lo) * uniform01(seed, i);
    switch (type) {
      case kvp::dtype::f16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
      case kvp::dtype::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
      default: static_cast<float*>(p)[i] = v; break;
    }
  }
}

void fill_uniform(void* p, std::size_t n, kvp::dtype type, std::uint64_t seed, float lo, float hi, cudaStream_t s) {
  if (n == 0) return;
  const std::size_t blocks = std::min<std::size_t>((n + 255) / 256, 65536);
  fill_uniform_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p, n, type, seed, lo, hi);
  KVP_BENCH_CHECK(cudaGetLastError());
}

// Near-duplicate keys, as bench/reference/zipage_reference.py makes them: in a K half
// `[L, num_blocks, b, h_kv, d]` filled by fill_uniform(seed, lo -1, hi 1), key (slot t,
// head h) of each cache block becomes, with probability `fraction` (t > 0), key
// (slot s, h) of the same block for a uniform s < t plus noise in [-0.1, 0.1): cosine
// about 0.99, over zipage's theta. The source is recomputed from the hash, so every
// thread reads the original and the result does not depend on the order.
template <class Elem>
__global__ void near_duplicates_kernel(Elem* k, std::size_t blocks, std::int32_t b, std::int32_t heads,
                                       std::int32_t d, std::uint64_t seed, float fraction) {
  const std::size_t keys = blocks * b * heads, stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t key = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; key < keys; key += stride) {
    const auto t = static_cast<std::int32_t>(key / heads % b);
    if (t == 0 || uniform01(seed + 100, key) >= fraction) continue;
    const auto s = min(static_cast<std::int32_t>(uniform01(seed + 101, key) * float(t)), t - 1);
    const std::size_t src = key - std::size_t(t - s) * heads;
    for (std::int32_t i = 0; i < d; ++i) {
      const float v = -1.0f + 2.0f * uniform01(seed, src * d + i) - 0.1f + 0.2f * uniform01(seed + 102, key * d + i);
      k[key * d + i] = Elem(v);
    }
  }
}

void near_duplicates(void* k, std::size_t blocks, std::int32_t b, std::int32_t heads, std::int32_t d, kvp::dtype type,
                     std::uint64_t seed, float fraction, cudaStream_t s) {
  const std::size_t keys = blocks * b * heads;
  if (keys == 0 || fraction <= 0.0f) return;
  const auto grid = static_cast<unsigned>(std::min<std::size_t>((keys + 255) / 256, 65536));
  const auto launch = [&](auto* typed) {
    near_duplicates_kernel<<<grid, 256, 0, s>>>(typed, blocks, b, heads, d, seed, fraction);
  };
  switch (type) {
    case kvp::dtype::f16: launch(static_cast<__half*>(k)); break;
    case kvp::dtype::bf16: launch(static_cast<__nv_bfloat16*>(k)); break;
    default: launch(static_cast<float*>(k)); break;
  }
  KVP_BENCH_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------
// Device copy bandwidth: the roof every copy_fraction is measured against
// ---------------------------------------------------------------------------

int g_failed_rows = 0;  // rows that reported an error: main's exit status

constexpr std::size_t copy_bytes = std::size_t{1} << 30;  // 1 GiB
double g_copy_gbps = 0.0;                                 // best measured, read + write

// Times `reps` copies of 1 GiB; returns the best GB/s (2 x size per copy) and fills ms.
double measure_copy(int reps, std::vector<double>* ms_out = nullptr) {
  dbuf src(copy_bytes), dst(copy_bytes);
  stream_guard s;
  event a, b;
  fill_uniform(src.get(), copy_bytes / 4, kvp::dtype::f32, 7, -1.0f, 1.0f, s);
  KVP_BENCH_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, s));  // warm-up
  double best = 0.0;
  for (int r = 0; r < reps; ++r) {
    KVP_BENCH_CHECK(cudaEventRecord(a, s));
    KVP_BENCH_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, s));
    KVP_BENCH_CHECK(cudaEventRecord(b, s));
    KVP_BENCH_CHECK(cudaEventSynchronize(b));
    const double ms = elapsed_ms(a, b);
    if (ms_out) ms_out->push_back(ms);
    best = std::max(best, 2.0 * double(copy_bytes) / (ms * 1e-3) / 1e9);
  }
  return best;
}

void BM_copy(benchmark::State& state) {
  try {
    dbuf src(copy_bytes), dst(copy_bytes);
    stream_guard s;
    event a, b;
    fill_uniform(src.get(), copy_bytes / 4, kvp::dtype::f32, 11, -1.0f, 1.0f, s);
    KVP_BENCH_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, s));
    double total_s = 0.0, best = 0.0;
    for (auto _ : state) {
      KVP_BENCH_CHECK(cudaEventRecord(a, s));
      KVP_BENCH_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, s));
      KVP_BENCH_CHECK(cudaEventRecord(b, s));
      KVP_BENCH_CHECK(cudaEventSynchronize(b));
      const double sec = elapsed_ms(a, b) * 1e-3;
      state.SetIterationTime(sec);
      total_s += sec;
      best = std::max(best, 2.0 * double(copy_bytes) / sec / 1e9);
    }
    g_copy_gbps = std::max(g_copy_gbps, best);
    const double bytes = 2.0 * double(copy_bytes);
    state.counters["bytes"] = bytes;
    state.counters["GB_per_s"] = bytes * double(state.iterations()) / total_s / 1e9;
    state.counters["best_GB_per_s"] = best;
    state.counters["copy_fraction"] = state.counters["GB_per_s"] / g_copy_gbps;
  } catch (const std::exception& e) {
    ++g_failed_rows;
    state.SkipWithError(e.what());
  }
}

// ---------------------------------------------------------------------------
// A paged cache in nano-vllm's layout, with its queries, F and batch
// ---------------------------------------------------------------------------

struct shape {
  std::int32_t seqs = 16;
  std::int32_t layers = 8;  // layers of the cache; all of them compressed in one launch
  std::int32_t kv_heads = 8;
  std::int32_t q_heads = 32;
  std::int32_t head_dim = 128;
  std::int32_t block_size = 256;
  std::int32_t n_max = 9;
  std::int32_t window = 16;  // observation queries kept per slot (at least the scorer's window)
  kvp::dtype type = kvp::dtype::bf16;
  float near_duplicates = 0.0f;  // fraction of keys made near-copies of an earlier key of their block
  bool hnd = false;              // the same memory seen as FlashInfer's HND layout: [2, L, num_blocks, h_kv, b, d]
  // Calibrated top-p: keep temperatures in a state view, solved by the untimed first
  // run and reused by the timed ones (a request's later compressions); otherwise
  // solved at every call (its first).
  bool reuse_temperatures = false;
  // Cautious update: a live view in which head h of every row dropped h / 32 of its
  // tokens (a run from the middle on), as after an earlier head-adaptive compaction.
  bool cautious = false;
  // Tokens each sequence holds (at most n_max blocks); 0: n_max full blocks.
  std::int32_t length = 0;
  // Budget of every item; 0: Zipage's (N_max - 1) b.
  std::int32_t budget_tokens = 0;
  // Window-only layouts (Kara): the window's first token, batch_item::window_begin.
  std::int32_t window_begin = 0;

  std::int32_t tokens() const { return length > 0 ? length : n_max * block_size; }  // T
  std::int32_t budget() const { return budget_tokens > 0 ? budget_tokens : (n_max - 1) * block_size; }
  std::int32_t seen() const { return tokens() - window_begin; }  // tokens the pipeline sees per row
  std::int64_t rows() const { return std::int64_t{seqs} * layers * kv_heads; }
  std::int64_t es() const { return kvp::size_of(type); }
};

shape config_a() { return {}; }

// KvLLM's compression event (Kara B.1, C.4): 30 sequences, each compressing its
// trailing window of 768 uncompressed tokens (3 blocks of 256), every layer of
// R1-Llama-8B (32, h_kv 8, h_q 32, d 128) in one launch. Each sequence holds 28
// compressed blocks before the window (never read; their count does not change the
// work) and 128 tokens after it, in its last, partial block, which KvLLM leaves out of
// the window. The window keeps 257 tokens (budget 225 of W \ U, and the buffer of 32):
// 7168 + 257 + 128 = 7553 tokens in 30 blocks where 8064 took 32, so each window
// frees 2 blocks (60 in all). With the tail block full (T 8192) 7681 tokens would
// need 31 blocks: 1 block per window.
shape config_kvllm() {
  shape s;
  s.seqs = 30;
  s.layers = 32;
  s.n_max = 32;
  s.length = 31 * 256 + 128;
  s.window_begin = 28 * 256;
  s.budget_tokens = kvp::presets::kara::kara_budget;
  return s;
}

// Zipage freeing as many blocks from whole sequences of the same batch: 30 sequences
// of 8192 tokens (32 full blocks: Zipage's trigger), 32 layers, budget 30 blocks
// (7680 tokens), so each sequence frees 2 blocks, 60 in all, as Kara's windows do.
shape config_kvllm_zipage() {
  shape s = config_kvllm();
  s.length = 0;  // 32 full blocks
  s.window_begin = 0;
  s.budget_tokens = 30 * 256;
  return s;
}

// Everything one configuration needs on the device, built once per benchmark run.
// The cache is `[2, L, num_blocks, b, h_kv, d]`; each sequence holds N_max blocks
// drawn from a shuffled pool (plus spare blocks nobody owns); queries are
// `[L, slots, w, h_q, d]`; F is `[L, num_blocks, b, h_kv]` fp32. Compression is in
// place, so `kv0` and `f0` keep pristine copies that restore() puts back.
struct bench_case {
  shape s;
  std::int32_t num_blocks = 0, max_blocks = 0;
  std::size_t kv_elems = 0, q_elems = 0, f_elems = 0;
  dbuf kv, kv0, q, f, f0, live, live0, table, lengths, items, layer_ptrs;
  dbuf status, new_lengths, released_counts, released_blocks, keep, final_scores;
  dbuf temp;
  dbuf temperatures, outcomes;  // calibrated top-p's state, [slots = seqs, L, h_kv]
  kvp::paged_kv_view cache{};
  kvp::query_window_view queries{};
  kvp::score_view scores{};
  kvp::device_batch batch{};
  kvp::device_result result{};  // keep_masks null: the timed runs use the workspace's mask
  cudaStream_t stream{};

  bench_case(const shape& sh, cudaStream_t st, std::uint64_t seed = 1) : s(sh), stream(st) {
    const std::int32_t T = s.tokens(), b = s.block_size;
    max_blocks = s.n_max;
    num_blocks = s.seqs * s.n_max + std::max(8, s.seqs);  // spare blocks owned by nobody
    const std::size_t block_elems = std::size_t(b) * s.kv_heads * s.head_dim;
    kv_elems = 2 * std::size_t(s.layers) * num_blocks * block_elems;
    q_elems = std::size_t(s.layers) * s.seqs * s.window * s.q_heads * s.head_dim;
    f_elems = std::size_t(s.layers) * num_blocks * b * s.kv_heads;

    kv = dbuf(kv_elems * s.es());
    kv0 = dbuf(kv_elems * s.es());
    q = dbuf(q_elems * s.es());
    f = dbuf(f_elems * sizeof(float));
    f0 = dbuf(f_elems * sizeof(float));
    fill_uniform(kv0.get(), kv_elems, s.type, seed, -1.0f, 1.0f, stream);
    // The K half of every layer ([2, L, ...]: K first, layers contiguous).
    near_duplicates(kv0.get(), std::size_t(s.layers) * num_blocks, b, s.kv_heads, s.head_dim, s.type, seed,
                    s.near_duplicates, stream);
    fill_uniform(q.get(), q_elems, s.type, seed + 1, -1.0f, 1.0f, stream);
    // F: scores of an earlier compression, on the scale of attention probabilities.
    fill_uniform(f0.get(), f_elems, kvp::dtype::f32, seed + 2, 0.0f, 2.0f / float(T), stream);

    // Block table: a shuffled pool, N_max blocks per sequence.
    std::mt19937 rng(static_cast<std::uint32_t>(seed));
    std::vector<std::int32_t> perm(static_cast<std::size_t>(num_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<std::int32_t> h_table(std::size_t(s.seqs) * max_blocks);
    for (std::size_t i = 0; i < h_table.size(); ++i) h_table[i] = perm[i];
    const std::vector<std::int32_t> h_lengths(static_cast<std::size_t>(s.seqs), T);
    std::vector<kvp::batch_item> h_items(static_cast<std::size_t>(s.seqs));
    // History = budget: compressed before (Zipage's steady state). A window is new
    // tokens (and Kara keeps no F): history 0.
    const std::int32_t history = s.window_begin > 0 ? 0 : s.budget();
    for (std::int32_t i = 0; i < s.seqs; ++i) h_items[i] = {i, i, s.budget(), history, s.window_begin};
    table = upload(h_table);
    lengths = upload(h_lengths);
    items = upload(h_items);

    status = dbuf(kvp::status_words * sizeof(std::int32_t));
    new_lengths = dbuf(s.seqs * sizeof(std::int32_t));
    released_counts = dbuf(s.seqs * sizeof(std::int32_t));
    released_blocks = dbuf(std::size_t(s.seqs) * max_blocks * sizeof(std::int32_t));
    keep = dbuf(std::size_t(s.rows()) * T);

    const kvp::cache_shape cs{s.layers, num_blocks, b, s.kv_heads, s.head_dim, s.type};
    const kvp::sequence_table seqs{kvp::block_table_view::dense(table.get<std::int32_t>(), max_blocks),
                                   lengths.get<std::int32_t>(), s.seqs};
    if (s.hnd) {
      // Per-layer K and V pointers into the same tensor, which is then [2, L, num_blocks, h_kv, b, d].
      if (s.near_duplicates > 0.0f) throw std::invalid_argument("bench: near_duplicates assumes the NHD layout");
      std::vector<void*> ptrs(2 * std::size_t(s.layers));
      for (std::size_t i = 0; i < ptrs.size(); ++i)
        ptrs[i] = static_cast<std::byte*>(kv.get()) + i * std::size_t(num_blocks) * block_elems * s.es();
      layer_ptrs = upload(ptrs);
      void* const* k_layers = layer_ptrs.get<void*>();
      cache = kvp::layouts::hnd(k_layers, k_layers + s.layers, cs, seqs);
    } else {
      cache = kvp::layouts::nano_vllm(kv.get(), cs, seqs);
    }
    if (s.cautious) {
      // [L, num_blocks, b, h_kv] as F: the engine's state, put back by restore().
      std::vector<std::uint8_t> h_live(f_elems, 1);
      for (std::int32_t seq = 0; seq < s.seqs; ++seq)
        for (std::int32_t l = 0; l < s.layers; ++l)
          for (std::int32_t h = 0; h < s.kv_heads; ++h)
            for (std::int32_t t = T / 2; t < T / 2 + h * T / 32; ++t) {
              const std::size_t blk = std::size_t(h_table[std::size_t(seq) * max_blocks + t / b]);
              h_live[((std::size_t(l) * num_blocks + blk) * b + t % b) * s.kv_heads + h] = 0;
            }
      live0 = upload(h_live);
      live = dbuf(h_live.size());
      cache.live = kvp::live_view::contiguous(live.get<std::uint8_t>(), num_blocks, b, s.kv_heads);
    }
    queries = kvp::query_window_view::contiguous(q.get(), s.layers, s.seqs, s.window, s.q_heads, s.head_dim, s.type);
    scores = kvp::score_view::contiguous(f.get<float>(), num_blocks, b, s.kv_heads);
    batch = {items.get<kvp::batch_item>(), s.seqs, T, 0, 0};
    result = {status.get<std::int32_t>(), new_lengths.get<std::int32_t>(), released_counts.get<std::int32_t>(),
              released_blocks.get<std::int32_t>(), nullptr, nullptr};
    restore();
    KVP_BENCH_CHECK(cudaStreamSynchronize(stream));
  }

  // Calibrated top-p's state over this case's slots, layers and heads, all unsolved.
  kvp::calibration_state calibration() {
    const std::size_t n = std::size_t(s.seqs) * s.layers * s.kv_heads;
    temperatures = dbuf(n * sizeof(float));
    outcomes = dbuf(n * sizeof(kvp::calibration_outcome));
    KVP_BENCH_CHECK(cudaMemset(outcomes.get(), 0, outcomes.bytes()));
    return {temperatures.get<float>(), outcomes.get<kvp::calibration_outcome>(), s.seqs, s.layers, s.kv_heads};
  }

  template <class T>
  dbuf upload(const std::vector<T>& v) {
    dbuf d(v.size() * sizeof(T));
    KVP_BENCH_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }

  // Puts the pristine cache and F back (enqueued on the stream, never timed). F first:
  // what stays in L2 afterwards is the tail of the cache tensor (V of the last layer),
  // not F, which the compression reads.
  void restore() {
    KVP_BENCH_CHECK(cudaMemcpyAsync(f.get(), f0.get(), f.bytes(), cudaMemcpyDeviceToDevice, stream));
    if (s.cautious)
      KVP_BENCH_CHECK(cudaMemcpyAsync(live.get(), live0.get(), live.bytes(), cudaMemcpyDeviceToDevice, stream));
    KVP_BENCH_CHECK(cudaMemcpyAsync(kv.get(), kv0.get(), kv.bytes(), cudaMemcpyDeviceToDevice, stream));
  }

  // Sizes and allocates the workspace for the timed runs (no keep-mask output).
  template <class P>
  void prepare(const P& p) {
    kvp::cuda_executor ex;
    ex.stream = stream;
    std::size_t bytes = 0;
    KVP_BENCH_CHECK(ex.compress(nullptr, bytes, p, cache, queries, scores, batch, result));
    temp = dbuf(std::max<std::size_t>(bytes, 256));
  }

  // Overlap: a second stream and the fork and join events, used when groups > 0.
  struct overlap {
    cudaStream_t side = nullptr;
    cudaEvent_t* events = nullptr;
    std::int32_t groups = 0;
  };

  template <class P>
  cudaError_t compress(const P& p, cudaEvent_t* marks, bool with_keep = false, overlap o = {}) {
    kvp::cuda_executor ex;
    ex.stream = stream;
    ex.stage_marks = marks;
    if (o.groups > 0) {
      ex.overlap_stream = o.side;
      ex.overlap_events = o.events;
      ex.overlap_groups = o.groups;
    }
    kvp::device_result r = result;
    if (with_keep) r.keep_masks = keep.get<std::uint8_t>();
    std::size_t bytes = temp.bytes();
    return ex.compress(temp.get(), bytes, p, cache, queries, scores, batch, r);
  }

  // What one untimed compression with keep masks did: the kept tokens whose slot
  // changes (destination index != position) and the blocks released, over the batch.
  struct outcome {
    std::int64_t moved = 0, released = 0;
  };

  // Checks the device status and counts the outcome. Restores after.
  template <class P>
  outcome count_moved(const P& p) {
    restore();
    KVP_BENCH_CHECK(compress(p, nullptr, true));
    std::array<std::int32_t, kvp::status_words> st{};
    KVP_BENCH_CHECK(cudaMemcpyAsync(st.data(), status.get(), sizeof st, cudaMemcpyDeviceToHost, stream));
    KVP_BENCH_CHECK(cudaStreamSynchronize(stream));
    kvp::check(st.data());  // throws the kvp::error a failed device validation stands for
    std::vector<std::uint8_t> h(keep.bytes());
    KVP_BENCH_CHECK(cudaMemcpy(h.data(), keep.get(), h.size(), cudaMemcpyDeviceToHost));
    std::vector<std::int32_t> released(static_cast<std::size_t>(s.seqs));
    KVP_BENCH_CHECK(cudaMemcpy(released.data(), released_counts.get(), released.size() * sizeof(std::int32_t),
                               cudaMemcpyDeviceToHost));
    // Rows have a pitch of T (max_tokens); a window-only layout's cover its window
    // and what follows it, from window_begin (position 0 of the row).
    const std::int32_t T = s.tokens(), seen = s.seen();
    outcome o;
    for (std::int64_t row = 0; row < s.rows(); ++row) {
      std::int32_t kept = 0;
      const std::uint8_t* m = h.data() + row * T;
      if constexpr (kvp::fills_holes<typename P::layout_type>()) {
        // layout::fill: the kept tokens at or past the kept count move, nothing else.
        for (std::int32_t t = 0; t < seen; ++t) kept += m[t] != 0;
        for (std::int32_t t = kept; t < seen; ++t) o.moved += m[t] != 0;
      } else {
        for (std::int32_t t = 0; t < seen; ++t) {
          if (!m[t]) continue;
          if (kept != t) ++o.moved;  // layout::compact: the i-th kept token goes to position i
          ++kept;
        }
      }
    }
    o.released = std::accumulate(released.begin(), released.end(), std::int64_t{0});
    restore();
    KVP_BENCH_CHECK(cudaStreamSynchronize(stream));
    return o;
  }
};

// ---------------------------------------------------------------------------
// Byte models
// ---------------------------------------------------------------------------

template <class P>
constexpr bool reads_keys() {
  return kvp::AttentionScorer<typename P::scorer_type> || !std::same_as<typename P::redundancy_type, kvp::none>;
}

struct bytes_of {
  double k = 0, q = 0, f = 0, moved = 0;
  double total() const { return k + q + f + moved; }
};

// The end-to-end byte model (file comment). A window-only layout's scorer reads the
// keys of its candidates alone (Kara: W \ U, the window's first 736).
template <class P>
bytes_of model_bytes(const P& p, const shape& s, std::int64_t moved_tokens) {
  bytes_of m;
  const double rows = double(s.rows()), T = s.tokens(), row_bytes = double(s.head_dim) * double(s.es());
  const double keys = kvp::window_only<typename P::layout_type>() ? kvp::candidate_end(p.scorer, s.seen()) : T;
  if constexpr (reads_keys<P>()) m.k = rows * keys * row_bytes;
  if constexpr (kvp::AttentionScorer<typename P::scorer_type>)
    m.q = double(s.layers) * s.seqs * kvp::scorer_window(p.scorer) * s.q_heads * row_bytes;
  if constexpr (kvp::uses_score_cache<typename P::aggregate_type>()) m.f = rows * T * 8.0;
  m.moved = double(moved_tokens) * 2.0 * 2.0 * row_bytes;
  return m;
}

// ---------------------------------------------------------------------------
// The timed loop
// ---------------------------------------------------------------------------

enum class row_kind { e2e, stage, redundancy };

void set_rate(benchmark::State& state, const std::string& prefix, double bytes, double seconds) {
  const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters[prefix + "GB_per_s"] = gbps;
  state.counters[prefix + "copy_fraction"] = g_copy_gbps > 0 ? gbps / g_copy_gbps : 0.0;
}

#include "per_head_rows.cuh"
#include "decode_attention_rows.cuh"

// Runs pipeline `p` on configuration `s`. The manual time of an iteration is the
// whole compression (e2e, stage) or the redundancy stage alone (redundancy); the
// cache is restored before each iteration, outside the timed region.
template <class P>
void bench_pipeline(benchmark::State& state, const P& given, shape s, row_kind kind, std::int32_t groups = 0) {
  try {
    s.window = std::max(s.window, kvp::scorer_window(given.scorer));
    stream_guard stream;
    bench_case bc(s, stream);
    P p = given;
    if constexpr (std::same_as<typename P::select_type, kvp::select::calibrated_top_p>)
      if (s.reuse_temperatures) p.select.state = bc.calibration();
    bc.prepare(p);
    const bench_case::outcome outcome = bc.count_moved(p);  // also the warm-up
    const std::int64_t moved = outcome.moved;
    const bytes_of model = model_bytes(p, s, moved);

    event start, stop;
    std::array<event, 5> mark_events;
    std::array<cudaEvent_t, 5> marks{};
    for (int i = 0; i < 5; ++i) marks[i] = mark_events[i];
    const bool use_marks = kind != row_kind::e2e;
    stream_guard side;
    event fork, join;
    std::array<cudaEvent_t, 2> fork_join{fork, join};
    const bench_case::overlap o{side, fork_join.data(), groups};

    double e2e_s = 0.0;
    std::vector<double> host_us;  // the compress call itself, on the CPU (enqueue), per iteration
    std::array<double, 4> stage_s{};  // score, redundancy, epilogue, layout
    // Where the redundancy stage computes the softmax statistics it runs first: mark 1
    // then follows the redundancy stage and mark 2 the score stage.
    const bool red_first = kvp::cuda_executor{}.redundancy_computes_statistics(p, bc.cache, bc.queries);
    const int score_mark = red_first ? 1 : 0, red_mark = red_first ? 0 : 1;
    for (auto _ : state) {
      bc.restore();
      KVP_BENCH_CHECK(cudaEventRecord(start, stream));
      const auto t0 = std::chrono::steady_clock::now();
      const cudaError_t enqueued = bc.compress(p, use_marks ? marks.data() : nullptr, false, o);
      host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      KVP_BENCH_CHECK(enqueued);
      KVP_BENCH_CHECK(cudaEventRecord(stop, stream));
      KVP_BENCH_CHECK(cudaEventSynchronize(stop));
      const double e2e = elapsed_ms(start, stop) * 1e-3;
      e2e_s += e2e;
      double red = 0.0;
      if (use_marks) {
        for (int i = 0; i < 4; ++i) {
          const int from = i == 0 ? score_mark : i == 1 ? red_mark : i;
          stage_s[i] += elapsed_ms(marks[from], marks[from + 1]) * 1e-3;
        }
        red = elapsed_ms(marks[red_mark], marks[red_mark + 1]) * 1e-3;
      }
      state.SetIterationTime(kind == row_kind::redundancy ? red : e2e);
    }
    {  // the device status of the last timed run
      std::array<std::int32_t, kvp::status_words> st{};
      KVP_BENCH_CHECK(cudaMemcpy(st.data(), bc.status.get(), sizeof st, cudaMemcpyDeviceToHost));
      kvp::check(st.data());
    }

    const auto iters = static_cast<double>(state.iterations());
    const double e2e_mean = e2e_s / iters;
    const double T = s.tokens(), rows = double(s.rows()), d = s.head_dim;
    constexpr bool windowed = kvp::window_only<typename P::layout_type>();
    state.counters["tokens"] = T;
    state.counters["seqs"] = s.seqs;
    state.counters["rows"] = rows;
    state.counters["budget"] = s.budget();
    state.counters["moved_tokens"] = double(moved);
    // Block ids released over the batch (each holds b tokens of every layer and KV head).
    state.counters["released_blocks"] = double(outcome.released);
    state.counters["released_GiB"] = double(outcome.released) * 2.0 * s.layers * s.block_size * s.kv_heads * d *
                                     double(s.es()) / double(1ull << 30);
    state.counters["e2e_ms"] = e2e_mean * 1e3;
    std::nth_element(host_us.begin(), host_us.begin() + host_us.size() / 2, host_us.end());
    state.counters["host_us"] = host_us.empty() ? 0.0 : host_us[host_us.size() / 2];  // median

    if (kind != row_kind::redundancy) {
      state.counters["bytes"] = model.total();
      set_rate(state, "", model.total(), e2e_mean);
      state.counters["ns_per_token"] = e2e_mean * 1e9 / (rows * (windowed ? s.seen() : T));
    }
    // Kara's scorer: each of the window's |W| G queries against each candidate key,
    // 2 d flops a pair (QK^T alone): far more arithmetic per byte than a window of 16.
    const double score_flops = windowed ? rows * double(kvp::scorer_window(p.scorer)) * (s.q_heads / s.kv_heads) *
                                              double(kvp::candidate_end(p.scorer, s.seen())) * 2.0 * d
                                        : 0.0;
    if constexpr (windowed) {
      state.counters["window_begin"] = s.window_begin;
      state.counters["seen_tokens"] = s.seen();  // the window and the tokens after it
      state.counters["score_TFLOP"] = score_flops / 1e12;
    }
    if (kind == row_kind::stage && windowed) {
      // Per stage over the window: cand = rows * candidates (W \ U), seen = rows *
      // (T - window_begin), the rows the masks cover.
      static const char* names[4] = {"score", "redundancy", "epilogue", "layout"};
      const double cand = rows * kvp::candidate_end(p.scorer, s.seen()), seen = rows * s.seen();
      const double moved_kv = double(moved) * 2.0 * 2.0 * d * double(s.es());
      const std::array<double, 4> stage_bytes = {
          model.k + model.q + cand * 4.0,  // keys of W \ U and the window's queries in, scores out
          0.0,                             // no redundancy stage
          cand * 4.0 + seen * 1.0,         // scores in, mask out
          seen * 1.0 + moved_kv,           // mask in, moved K/V in/out
      };
      double staged = 0.0;
      for (int i = 0; i < 4; ++i) {
        const double mean = stage_s[i] / iters;
        staged += mean;
        const std::string n = names[i];
        state.counters[n + "_ms"] = mean * 1e3;
        state.counters[n + "_bytes"] = stage_bytes[i];
        set_rate(state, n + "_", stage_bytes[i], mean);
      }
      const double score_s = stage_s[0] / iters;
      state.counters["score_TFLOP_per_s"] = score_s > 0 ? score_flops / score_s / 1e12 : 0.0;
      state.counters["other_ms"] = (e2e_mean - staged) * 1e3;
    } else if (kind == row_kind::stage) {
      static const char* names[4] = {"score", "redundancy", "epilogue", "layout"};
      const double row_bytes = d * double(s.es()), cells = rows * T;
      const double moved_kv = double(moved) * 2.0 * 2.0 * row_bytes;
      const double f_moved = kvp::uses_score_cache<typename P::aggregate_type>() ? double(moved) * 8.0 : 0.0;
      const std::array<double, 4> stage_bytes = {
          model.k + model.q + cells * 4.0,                 // keys and queries in, scores out
          model.k + cells * 4.0,                           // keys in, redundancy out
          cells * 8.0 + model.f + cells * 1.0,             // scores + redundancy in, F in/out, mask out
          cells * 1.0 + moved_kv + f_moved,                // mask in, moved K/V/F in/out
      };
      double staged = 0.0;
      for (int i = 0; i < 4; ++i) {
        const double mean = stage_s[i] / iters;
        staged += mean;
        const std::string n = names[i];
        state.counters[n + "_ms"] = mean * 1e3;
        state.counters[n + "_bytes"] = stage_bytes[i];
        set_rate(state, n + "_", stage_bytes[i], mean);
      }
      // Before the first mark: the status reset (the score stage includes the device validation kernel).
      state.counters["other_ms"] = (e2e_mean - staged) * 1e3;
    }
    if constexpr (!std::same_as<typename P::redundancy_type, kvp::none>) {
      if (kind != row_kind::redundancy) return;
      const double red_mean = stage_s[1] / iters;
      state.counters["redundancy_ms"] = red_mean * 1e3;
      state.counters["ns_per_token"] = red_mean * 1e9 / (rows * T);
      state.counters["ns_per_token2"] = red_mean * 1e9 / (rows * T * T);
      // Pairs compared: b per token within a block (lightning) or T per token (full).
      const bool full = P::redundancy_type::pairs == kvp::redundancy::scope::full;
      const double pairs = rows * T * (full ? T : double(s.block_size));
      state.counters["pair_TFLOP_per_s"] = red_mean > 0 ? 2.0 * d * pairs / red_mean / 1e12 : 0.0;
      state.counters["bytes"] = model.k + rows * T * 4.0;  // keys in, redundancy out
      set_rate(state, "", model.k + rows * T * 4.0, red_mean);
    }
  } catch (const std::exception& e) {
    ++g_failed_rows;
    state.SkipWithError(e.what());
  }
}

// ---------------------------------------------------------------------------
// Pipelines
// ---------------------------------------------------------------------------

// Zipage with all-pairs redundancy in place of lightning, every other parameter the same.
struct zipage_full
    : kvp::pipeline<kvp::scorer::window_attention,
                    kvp::aggregate::then<kvp::aggregate::global_score, kvp::aggregate::pool>, kvp::redundancy::full,
                    kvp::select::top_k, kvp::layout::compact> {
  zipage_full() {
    const kvp::presets::zipage z;
    scorer = z.scorer;
    aggregate = z.aggregate;
    redundancy.theta = z.redundancy.theta;
    redundancy.tau = z.redundancy.tau;
    redundancy.lambda = z.redundancy.lambda;
    redundancy.eps = z.redundancy.eps;
    redundancy.form = z.redundancy.form;
    select = z.select;
    layout = z.layout;
    protect = z.protect;
  }
};

template <class P>
void add_row(const std::string& name, const P& p, const shape& s, row_kind kind, int iterations,
             std::int32_t overlap_groups = 0) {
  benchmark::RegisterBenchmark(name.c_str(), [p, s, kind, overlap_groups](benchmark::State& st) {
    bench_pipeline(st, p, s, kind, overlap_groups);
  })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(iterations);
}

void register_all() {
  // The copy roof first: every later row's copy_fraction divides by its best.
  benchmark::RegisterBenchmark("copy", BM_copy)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(20);
  register_per_head_rows();
  register_decode_attention_rows();

  const shape a = config_a();
  // End to end, configuration A, each preset of the family. gkv and rkv compare all
  // pairs of keys (O(T^2 d) per row): few iterations.
  add_row("e2e/zipage/A", kvp::presets::zipage{}, a, row_kind::e2e, 30);
  add_row("e2e/snapkv/A", kvp::presets::snapkv{}, a, row_kind::e2e, 30);
  add_row("e2e/h2o/A", kvp::presets::h2o{}, a, row_kind::e2e, 30);
  add_row("e2e/streaming_llm/A", kvp::presets::streaming_llm{}, a, row_kind::e2e, 30);
  add_row("e2e/gkv/A", kvp::presets::gkv{}, a, row_kind::e2e, 3);
  add_row("e2e/rkv/A", kvp::presets::rkv{}, a, row_kind::e2e, 3);
  // Overlapped: redundancy beside scoring; with 2 to 4 groups also one group's
  // epilogue and compaction beside the next group's scoring.
  for (std::int32_t groups : {1, 2, 3, 4})
    add_row("e2e_overlap" + std::to_string(groups) + "/zipage/A", kvp::presets::zipage{}, a, row_kind::e2e, 30, groups);

  // Per stage, configuration A, zipage.
  add_row("stage/zipage/A", kvp::presets::zipage{}, a, row_kind::stage, 30);
  // Zipage's selection with the fill layout (issue 31): the same keep masks, only the
  // kept tokens past the new length move.
  add_row("e2e/zipage_fill/A", kvp::with_layout(kvp::presets::zipage{}, kvp::layout::fill{}), a, row_kind::e2e, 30);
  add_row("stage/zipage_fill/A", kvp::with_layout(kvp::presets::zipage{}, kvp::layout::fill{}), a, row_kind::stage, 30);
  // The same with one key in eight a near-copy of an earlier key of its block, as the
  // PyTorch reference's inputs: random keys never cross theta, these do, so lightning's
  // dropped neighbours and the selection they change are exercised.
  {
    shape dup = a;
    dup.near_duplicates = 0.125f;
    add_row("e2e/zipage/A_dup", kvp::presets::zipage{}, dup, row_kind::e2e, 30);
    add_row("stage/zipage/A_dup", kvp::presets::zipage{}, dup, row_kind::stage, 30);
    add_row("e2e/gkv/A_dup", kvp::presets::gkv{}, dup, row_kind::e2e, 3);
  }

  // Scaling in sequences (T 2304) and in tokens held (16 sequences).
  for (int seqs : {1, 4, 16, 64}) {
    shape s = a;
    s.seqs = seqs;
    add_row("scale_seqs/zipage/" + std::to_string(seqs), kvp::presets::zipage{}, s, row_kind::e2e, 20);
    if (seqs < 16) add_row("scale_seqs_stage/zipage/" + std::to_string(seqs), kvp::presets::zipage{}, s, row_kind::stage, 20);
  }
  for (int n_max : {9, 18, 36}) {
    shape s = a;
    s.n_max = n_max;
    add_row("scale_tokens/zipage/" + std::to_string(s.tokens()), kvp::presets::zipage{}, s, row_kind::e2e, 20);
  }

  // Hard-KV: per-head counts from calibrated top-p. Temperatures solved at every call
  // (a request's first compression) or kept and reused (its later ones); the
  // difference in the epilogue is the temperature search.
  {
    shape reuse = a;
    reuse.reuse_temperatures = true;
    add_row("e2e/hard_kv/A", kvp::presets::hard_kv{}, a, row_kind::e2e, 30);
    add_row("e2e/hard_kv/A_reuse", kvp::presets::hard_kv{}, reuse, row_kind::e2e, 30);
    add_row("stage/hard_kv/A", kvp::presets::hard_kv{}, a, row_kind::stage, 30);
    add_row("stage/hard_kv/A_reuse", kvp::presets::hard_kv{}, reuse, row_kind::stage, 30);
    add_row("e2e/hard_kv_rkv/A", kvp::presets::hard_kv_rkv{}, a, row_kind::e2e, 3);
    // Cautious update: a later compression (temperatures reused) over heads that
    // dropped tokens before; against A_reuse, the cost of reading the live view.
    shape cautious = reuse;
    cautious.cautious = true;
    add_row("e2e/hard_kv/A_cautious", kvp::presets::hard_kv{}, cautious, row_kind::e2e, 30);
    add_row("stage/hard_kv/A_cautious", kvp::presets::hard_kv{}, cautious, row_kind::stage, 30);
    // The same with full redundancy over the held keys, beside its own A_reuse.
    add_row("e2e/hard_kv_rkv/A_reuse", kvp::presets::hard_kv_rkv{}, reuse, row_kind::e2e, 3);
    add_row("e2e/hard_kv_rkv/A_cautious", kvp::presets::hard_kv_rkv{}, cautious, row_kind::e2e, 3);
    // The search's cost against its iterations and the row length: a tolerance no mass
    // meets makes every row run all of them (after the two bound checks).
    for (int n_max : {9, 36}) {
      shape s = a;
      s.n_max = n_max;
      for (int iterations : {10, 20, 30}) {
        kvp::presets::hard_kv p;
        p.select.tolerance = 1e-9f;
        p.select.iterations = iterations;
        add_row("calibration/hard_kv/" + std::to_string(iterations) + "/" + std::to_string(s.tokens()), p, s,
                row_kind::stage, 20);
      }
      s.reuse_temperatures = true;
      add_row("calibration/hard_kv/reuse/" + std::to_string(s.tokens()), kvp::presets::hard_kv{}, s, row_kind::stage,
              20);
    }
  }

  // Kara at a KvLLM compression event (config_kvllm: 30 windows of 768 tokens, 32
  // layers), and Zipage freeing the same 60 blocks from whole 8k-token sequences.
  {
    const shape kara = config_kvllm(), zip = config_kvllm_zipage();
    add_row("e2e/kara/KvLLM", kvp::presets::kara{}, kara, row_kind::e2e, 20);
    add_row("stage/kara/KvLLM", kvp::presets::kara{}, kara, row_kind::stage, 20);
    add_row("e2e/zipage/KvLLM_8k", kvp::presets::zipage{}, zip, row_kind::e2e, 20);
    add_row("stage/zipage/KvLLM_8k", kvp::presets::zipage{}, zip, row_kind::stage, 20);
  }

  // Head dims other than configuration A's 128: 64 runs kernels built for it, as 128
  // does; 96, 192 and 256 those that read the head dim at run time (lightning with
  // three, two and one block per SM).
  for (int d : {64, 96, 192, 256}) {
    shape s = a;
    s.head_dim = d;
    add_row("head_dim/zipage/" + std::to_string(d), kvp::presets::zipage{}, s, row_kind::e2e, 20);
    add_row("head_dim/gkv/" + std::to_string(d), kvp::presets::gkv{}, s, row_kind::e2e, 3);
    add_row("head_dim_stage/zipage/" + std::to_string(d), kvp::presets::zipage{}, s, row_kind::stage, 20);
  }

  // FlashInfer's HND layout (a head's rows of a block contiguous) against nano-vllm's
  // NHD (a token's heads contiguous) at head dims 64 and 128.
  for (int d : {64, 128}) {
    shape s = a;
    s.head_dim = d;
    s.hnd = true;
    add_row("hnd/zipage/" + std::to_string(d), kvp::presets::zipage{}, s, row_kind::e2e, 20);
    add_row("hnd_stage/zipage/" + std::to_string(d), kvp::presets::zipage{}, s, row_kind::stage, 20);
  }

  // Lightning vs full redundancy as tokens grow: the redundancy stage alone. Full is
  // quadratic, so it runs on 1 sequence and 1 layer (8 rows); lightning runs on the
  // same shape, and on configuration A's 16 sequences x 8 layers (batched).
  for (int n_max : {9, 18, 36, 72}) {
    shape small = a;
    small.seqs = 1;
    small.layers = 1;
    small.n_max = n_max;
    const std::string T = std::to_string(small.tokens());
    add_row("redundancy/lightning/" + T, kvp::presets::zipage{}, small, row_kind::redundancy, 20);
    add_row("redundancy/full/" + T, zipage_full{}, small, row_kind::redundancy, n_max >= 36 ? 2 : 3);
    shape batched = a;
    batched.n_max = n_max;
    add_row("redundancy/lightning_batched/" + T, kvp::presets::zipage{}, batched, row_kind::redundancy,
            n_max >= 36 ? 5 : 10);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    int device = 0;
    KVP_BENCH_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    KVP_BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
    benchmark::AddCustomContext("gpu", prop.name);
    benchmark::AddCustomContext("gpu_sm_count", std::to_string(prop.multiProcessorCount));
    benchmark::AddCustomContext("gpu_memory_GiB", std::to_string(double(prop.totalGlobalMem) / double(1ull << 30)));
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime));
    benchmark::AddCustomContext("cuda_driver", std::to_string(driver));
    // The copy roof, once before any row, so every copy_fraction has it.
    g_copy_gbps = measure_copy(10);
    benchmark::AddCustomContext("copy_GB_per_s_startup", std::to_string(g_copy_gbps));
    std::fprintf(stderr, "kvpolicy_bench: %s, device copy %.1f GB/s (read + write)\n", prop.name, g_copy_gbps);
    // What the executor's plans read of the device, and what it launches for
    // configuration A under each preset: the kernels behind the rows' times.
    benchmark::AddCustomContext("kvp_device_limits", kvp::cuda::describe(kvp::cuda::device_limits::current()));
    benchmark::AddCustomContext("kvp_tuning", kvp::cuda::describe_tuning());
    {
      cudaStream_t stream = nullptr;
      KVP_BENCH_CHECK(cudaStreamCreate(&stream));
      const kvp::cuda_executor ex{.stream = stream};
      const auto plan_of = [&](const char* name, const auto& p) {
        shape sa = config_a();
        sa.window = std::max(sa.window, kvp::scorer_window(p.scorer));  // as bench_pipeline sizes it
        const bench_case a(sa, stream);
        benchmark::AddCustomContext(std::string("kvp_plan_") + name + "_A",
                                    kvp::cuda::describe(ex.plan(p, a.cache, a.queries, a.scores, a.batch)));
      };
      plan_of("zipage", kvp::presets::zipage{});
      plan_of("gkv", kvp::presets::gkv{});
      plan_of("snapkv", kvp::presets::snapkv{});
      cudaStreamDestroy(stream);
    }
  } catch (const std::exception& e) {
    // No usable GPU: rows still register (--benchmark_list_tests works) and each
    // reports the error instead of a time.
    std::fprintf(stderr, "kvpolicy_bench: %s\n", e.what());
  }
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (g_failed_rows > 0) std::fprintf(stderr, "kvpolicy_bench: %d row(s) failed\n", g_failed_rows);
  return g_failed_rows > 0 ? 1 : 0;
}
