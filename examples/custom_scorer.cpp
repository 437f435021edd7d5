// Extending kvpolicy: a new scorer, and specialisations of existing policies.
//
// 1. `knorm` scores each key by minus its L2 norm, as kvpress's KnormPress: keys of
//    low norm are kept. It is a KeyScorer: one KVP_HOST_DEVICE hook, no state, so
//    it is trivially copyable and runs unchanged in the host loop and in a kernel.
//    It runs alone, then inside Zipage's pipeline in place of Zipage's scorer.
// 2. `squared_window` derives from scorer::window_attention and squares each
//    probability before the reductions (the derived transform hides the base's);
//    `recency_top_k` derives from select::top_k and adds a recency bonus to its
//    rank key. Both compose with Zipage's other stages.
//
// Each runs on the host executor; built by nvcc (custom_scorer.cu, which includes
// this file) each also runs on the CUDA executor over a device copy of the same
// cache, with no other code than the policy's, and must give the same keep mask.

#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <random>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#include "kvpolicy/kvpolicy.cuh"  // first: kvpolicy before fmt under nvcc
#include <cuda_runtime.h>
#else
#include "kvpolicy/kvpolicy.hpp"
#endif

#include <fmt/format.h>

// --- 1. a new scorer ---------------------------------------------------------

struct knorm {
  // Score of the key k at position t of T: higher is kept.
  KVP_HOST_DEVICE float key_score(kvp::row_ref k, std::int32_t /*t*/, std::int32_t /*T*/) const noexcept {
    float ss = 0.0f;
    for (std::int32_t i = 0; i < k.size(); ++i) ss += k[i] * k[i];
    return -sqrtf(ss);
  }
};
static_assert(kvp::KeyScorer<knorm>);
static_assert(kvp::Scorer<knorm> && !kvp::AttentionScorer<knorm>);

// --- 2. specialising existing policies -----------------------------------------

// Window attention with squared probabilities (KV-Compress's L2 idea on SnapKV's scorer).
struct squared_window : kvp::scorer::window_attention {
  KVP_HOST_DEVICE constexpr float transform(float p) const noexcept { return p * p; }
};
static_assert(kvp::AttentionScorer<squared_window>);

// Top-k that favours recent tokens: rank key = score + bonus * t / T.
struct recency_top_k : kvp::select::top_k {
  float bonus = 0.0f;
  KVP_HOST_DEVICE constexpr float rank_key(float s, std::int32_t t, std::int32_t T) const noexcept {
    return s + bonus * static_cast<float>(t) / static_cast<float>(T);
  }
};
static_assert(kvp::Selector<recency_top_k>);

// A preset with one stage replaced: every other stage and parameter (and protect)
// taken from the preset.
template <class Scorer, class Preset>
constexpr auto with_scorer(const Preset& p, Scorer s = {}) {
  kvp::pipeline<Scorer, typename Preset::aggregate_type, typename Preset::redundancy_type,
                typename Preset::select_type, typename Preset::layout_type>
      out;
  out.scorer = s;
  out.aggregate = p.aggregate;
  out.redundancy = p.redundancy;
  out.select = p.select;
  out.layout = p.layout;
  out.protect = p.protect;
  return out;
}
template <class Selector, class Preset>
constexpr auto with_selector(const Preset& p, Selector sel) {
  kvp::pipeline<typename Preset::scorer_type, typename Preset::aggregate_type, typename Preset::redundancy_type,
                Selector, typename Preset::layout_type>
      out;
  out.scorer = p.scorer;
  out.aggregate = p.aggregate;
  out.redundancy = p.redundancy;
  out.select = sel;
  out.layout = p.layout;
  out.protect = p.protect;
  return out;
}

// --- a small cache to run them on ----------------------------------------------

constexpr std::int32_t T = 64, b = 8, d = 16, h_q = 2, w = 16, budget = 40;

// One sequence, one layer, one KV head, f32, separate K and V tensors in NHD
// (`[num_blocks, b, h_kv, d]`, FlashInfer's NHD). Tokens in `low` get keys of a
// tenth of the usual norm; tokens in `hot` get keys along the queries' direction.
struct toy_cache {
  std::vector<float> k, v, f, q;
  std::vector<std::int32_t> table, lengths{T};
  std::vector<void*> k_layers, v_layers;
  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;
  std::vector<bool> low, hot;

  toy_cache() {
    const std::int32_t blocks = T / b + 2;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    k.resize(std::size_t(blocks) * b * d);
    v.resize(k.size());
    f.assign(std::size_t(blocks) * b, 0.0f);
    for (std::int32_t i = 0; i < T / b; ++i) table.push_back(blocks - 1 - i);  // blocks in reverse order
    k_layers = {k.data()};
    v_layers = {v.data()};
    const kvp::cache_shape shape{.num_layers = 1, .num_blocks = blocks, .block_size = b, .num_kv_heads = 1,
                                 .head_dim = d, .type = kvp::dtype::f32};
    cache = kvp::layouts::nhd(k_layers.data(), v_layers.data(), shape,
                              {.table = kvp::block_table_view::dense(table.data(), T / b),
                               .lengths = lengths.data(),
                               .num_seqs = 1});
    scores = kvp::score_view::contiguous(f.data(), blocks, b, 1);

    std::vector<float> dir(d);
    for (float& x : dir) x = nd(rng) / 4.0f;  // |dir| about 1
    low.assign(T, false);
    hot.assign(T, false);
    for (std::int32_t t : {5, 13, 14, 22, 30, 37, 41, 45}) low[t] = true;
    for (std::int32_t t : {2, 9, 19, 27, 34}) hot[t] = true;
    for (std::int32_t t = 0; t < T; ++t) {
      float* kr = reinterpret_cast<float*>(cache.k_row(0, 0, t, 0));
      float* vr = reinterpret_cast<float*>(cache.v_row(0, 0, t, 0));
      for (std::int32_t i = 0; i < d; ++i) {
        kr[i] = (low[t] ? 0.1f : 1.0f) * nd(rng) + (hot[t] ? 6.0f * dir[i] : 0.0f);
        vr[i] = nd(rng);
      }
    }
    q.resize(std::size_t(w) * h_q * d);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = 6.0f * dir[i % d] + 0.3f * nd(rng);
    queries = kvp::query_window_view::contiguous(q.data(), 1, 1, w, h_q, d, kvp::dtype::f32);
  }
};

#if defined(__CUDACC__)
// The same compression on the CUDA executor, over a device copy of a fresh toy cache.
// Returns the keep mask (empty without a GPU).
template <class Pipeline>
std::vector<std::uint8_t> run_on_gpu(const Pipeline& p) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return {};
  toy_cache c;
  const auto copy = [](const auto& host) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    T* dev = nullptr;
    cudaMalloc(&dev, host.size() * sizeof(T));
    cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return dev;
  };
  float *k = copy(c.k), *v = copy(c.v), *f = copy(c.f), *q = copy(c.q);
  std::int32_t *table = copy(c.table), *lengths = copy(c.lengths);
  void** k_layers = copy(std::vector<void*>{k});
  void** v_layers = copy(std::vector<void*>{v});
  const kvp::batch_item item{.seq = 0, .query_slot = 0, .budget = budget};
  kvp::batch_item* items = copy(std::vector<kvp::batch_item>{item});
  const std::int32_t blocks = T / b + 2;
  const kvp::cache_shape shape{.num_layers = 1, .num_blocks = blocks, .block_size = b, .num_kv_heads = 1,
                               .head_dim = d, .type = kvp::dtype::f32};
  const kvp::paged_kv_view cache = kvp::layouts::nhd(
      k_layers, v_layers, shape, {.table = kvp::block_table_view::dense(table, T / b), .lengths = lengths, .num_seqs = 1});
  const auto queries = kvp::query_window_view::contiguous(q, 1, 1, w, h_q, d, kvp::dtype::f32);
  const auto scores = kvp::score_view::contiguous(f, blocks, b, 1);
  std::int32_t* out = copy(std::vector<std::int32_t>(kvp::status_words + 3 + T / b, 0));
  std::uint8_t* keep = copy(std::vector<std::uint8_t>(T, 0));
  const kvp::device_batch batch{.items = items, .num_items = 1, .max_tokens = T};
  const kvp::device_result result{.status = out,
                                  .new_lengths = out + kvp::status_words,
                                  .released_counts = out + kvp::status_words + 1,
                                  .released_blocks = out + kvp::status_words + 2,
                                  .keep_masks = keep};
  const kvp::cuda_executor ex;
  std::size_t bytes = 0;
  (void)ex.compress(nullptr, bytes, p, cache, queries, scores, batch, result);
  void* temp = nullptr;
  cudaMalloc(&temp, bytes);
  const cudaError_t launched = ex.compress(temp, bytes, p, cache, queries, scores, batch, result);
  std::vector<std::uint8_t> mask(T);
  std::int32_t status[kvp::status_words] = {};
  cudaMemcpy(mask.data(), keep, T, cudaMemcpyDeviceToHost);
  cudaMemcpy(status, out, sizeof status, cudaMemcpyDeviceToHost);
  for (void* ptr : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(f), static_cast<void*>(q),
                    static_cast<void*>(table), static_cast<void*>(lengths), static_cast<void*>(k_layers),
                    static_cast<void*>(v_layers), static_cast<void*>(items), static_cast<void*>(out),
                    static_cast<void*>(keep), temp})
    cudaFree(ptr);
  if (launched != cudaSuccess) throw std::runtime_error(cudaGetErrorString(launched));
  kvp::check(status);
  return mask;
}
#endif

template <class Pipeline>
void run(const char* title, const Pipeline& p) {
  toy_cache c;  // fresh: compression rewrites the cache in place
  const kvp::batch_item item{.seq = 0, .query_slot = 0, .budget = budget};
  const kvp::host_executor ex{.record_keep_masks = true};
  const kvp::host_result r = ex.compress(p, c.cache, c.queries, c.scores, {.items = {&item, 1}});
  const auto& keep = r.keep_masks[0];
  std::string marks, kept;
  int low_kept = 0, hot_kept = 0;
  for (std::int32_t t = 0; t < T; ++t) {
    if (t > 0 && t % b == 0) marks += ' ', kept += ' ';
    marks += c.low[t] ? 'L' : c.hot[t] ? 'A' : '.';
    kept += keep[t] ? '#' : '_';
    low_kept += c.low[t] && keep[t];
    hot_kept += c.hot[t] && keep[t];
  }
  fmt::print("{}\n  {}\n  {}\n  kept {} of {} tokens: {} of 8 low-norm (L), {} of 5 attended (A)\n", title, marks,
             kept, r.new_lengths[0], T, low_kept, hot_kept);
#if defined(__CUDACC__)
  const std::vector<std::uint8_t> gpu = run_on_gpu(p);
  if (gpu.empty()) {
    fmt::print("  CUDA executor: no GPU here, host only\n");
  } else {
    const auto differ = std::inner_product(gpu.begin(), gpu.end(), keep.begin(), 0, std::plus<>(), std::not_equal_to<>());
    fmt::print("  CUDA executor: {}\n", differ == 0 ? "the same keep mask" : fmt::format("{} tokens differ", differ));
    if (differ != 0) throw std::runtime_error("the executors disagree");
  }
#endif
  fmt::print("\n");
}

int main() {
  try {
    const kvp::presets::zipage zipage;
    fmt::print("one sequence of {} tokens, budget {}, the last {} protected; # kept, _ evicted\n\n", T, budget,
               zipage.protect.window);

    // knorm alone: scores straight to top-k.
    kvp::pipeline<knorm, kvp::none, kvp::none, kvp::select::top_k, kvp::layout::compact> knorm_only;
    knorm_only.protect = zipage.protect;
    run("knorm -> top-k -> compact", knorm_only);

    // knorm in Zipage's pipeline: global score, max pool 5, lightning redundancy, top-k, compact.
    run("knorm in zipage's pipeline (global score, max pool 5, lightning redundancy, top-k, compact)",
        with_scorer<knorm>(zipage));

    run("zipage as shipped (window attention)", zipage);
    run("zipage with squared_window (probabilities squared)", with_scorer<squared_window>(zipage));
    run("zipage with recency_top_k (bonus 0.02)", with_selector(zipage, recency_top_k{{}, 0.02f}));
    return 0;
  } catch (const kvp::error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
