// kvpolicy demo: compress a paged KV cache of synthetic reasoning-like sequences.
//
// The demo plays the engine. It owns a paged cache in host memory (bf16 by default,
// laid out as nano-vllm's `[2, L, num_blocks, b, h_kv, d]` or vLLM's per-layer
// `[2, num_blocks, b, h_kv, d]`, blocks handed out in shuffled order), an
// observation-query buffer and the global score buffer F. It plants, per sequence:
//
//   sinks          the first 4 tokens; their keys lie along a direction every query
//                  attends to, whatever the topic
//   heavy hitters  a few tokens whose keys align with the current topic's queries
//   repeats        a segment of 4 keys written three times in one block with small
//                  noise (a model repeating itself); the older copies are redundant
//   recent window  the last tokens, protected by every policy
//
// It then compresses with a preset (`--preset`), hands the released blocks back to
// its free list, appends tokens on a new topic and compresses again with
// `history_tokens` = the previous budget, so presets with a global score remember
// the earlier heavy hitters. Per sequence it prints what was kept, and per stage
// how long it took.
//
// `--preset hard_kv` keeps a count per (layer, KV head): each head's slots past its
// own count hold tokens it dropped. The demo keeps the engine's live bytes
// (paged_kv_view::live, cautious update: 1 where a head still holds its token), writes
// 1 for every head of each token it appends, and so can compress such a cache again:
// per round it prints seq 0's counts and checks that every head holds a subset of the
// tokens it held before. `hard_kv_rkv` does the same, its redundancy over the keys
// each head holds.
//
// `--preset kara` compresses a window of each sequence instead of the whole cache
// (Kara, KvLLM): the last `--window` tokens in whole blocks before the last, partial
// block, after context that is never read or written again. trigger::periodic makes
// the items (window_begin, the budget within the window), the query slot holds the
// window's own queries, and each later round appends what makes a new window of
// uncompressed tokens. Per round it also draws, for sequence 0's first row, what
// Token2Chunk chose (anchors, chunk interiors, fill) from the executor's final
// scores, as Kara's figure 7 does, and checks that against the executor's keep mask.
//
// `--preset kv_compress` runs KV-Compress over a per-head block cache instead
// (kv_compress_demo.hpp): ragged per-head lengths, the preset's prefill metric, one
// compression by host::compress_per_head (or kvp::cuda_per_head_executor with
// `--device cuda|both`, kv_compress_demo_gpu.cuh), per (layer, KV head) lengths before
// and after, the blocks freed per sequence, and the per-head invariants checked.
//
// One source, two builds. Compiled as C++ (this file) the demo has the host executor
// only. Compiled as CUDA (compress_demo.cu includes this file; examples/CMakeLists.txt
// builds kvpolicy_demo from it when CUDA is enabled) it also has `--device cuda`,
// the default when a GPU is present: the demo copies K/V (and, for vllm_flash, a
// table of the per-layer device addresses), the block table, lengths, queries, F, the
// live bytes (hard_kv) and the batch to the GPU, runs kvp::cuda_executor once to warm
// up and once timed (on the same input), and copies K/V, F, the live bytes and the
// keep masks back into its host buffers, so the statistics and the "kept K/V rows
// moved intact" check read the GPU's result. Stage times on the GPU are CUDA events
// around the kernels (copies excluded); the aggregate is fused into the select kernel
// there. `--device both` runs both executors on identical copies of the cache, prints
// their stage times side by side and compares their keep masks, lengths, released
// blocks, K/V bytes and live bytes; the demo goes on with the GPU's result.
//
//   kvpolicy_demo [--preset zipage|rkv|gkv|snapkv|h2o|streaming_llm|hard_kv|hard_kv_rkv|kara|kv_compress]
//                 [--device cuda|host|both] [--layout nano_vllm|vllm_flash] [--dtype bf16|f16|f32]
//                 [--seqs N] [--layers N] [--kv-heads N] [--q-heads N] [--head-dim N]
//                 [--block-size N] [--n-max N] [--rounds N] [--append N] [--seed N]
//                 [--window N] [--buffer N] [--keep N] [--cache-tokens N] [--rate R] [--show-mask]
//
// fmt under nvcc: every format string here is checked at run time (str() and say()
// below), never at compile time, and <fmt/...> comes after the kvpolicy headers.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "kvpolicy/kvpolicy.cuh"
#else
#include "kvpolicy/kvpolicy.hpp"
#endif

#include <fmt/format.h>

namespace {

using i32 = std::int32_t;

// Runtime-checked formatting: fmt 9's compile-time format strings do not compile
// under nvcc, and this file is compiled by nvcc in the CUDA build.
template <class... Args>
std::string str(std::string_view f, const Args&... args) {
  return fmt::vformat(f, fmt::make_format_args(args...));
}
template <class... Args>
void say(std::string_view f, const Args&... args) {
  fmt::vprint(f, fmt::make_format_args(args...));
}
template <class... Args>
void say_err(std::string_view f, const Args&... args) {
  fmt::vprint(stderr, f, fmt::make_format_args(args...));
}

// ---------------------------------------------------------------------------
// Command line

enum class device { host, cuda, both };

std::string_view name_of(device d) {
  switch (d) {
    case device::host: return "host";
    case device::cuda: return "cuda";
    default: return "both";
  }
}

struct options {
  std::string preset = "zipage";
  std::optional<device> dev;  // unset: cuda when built with CUDA and a GPU is present, else host
  std::string layout = "nano_vllm";
  kvp::dtype type = kvp::dtype::bf16;
  i32 seqs = 4, layers = 2, kv_heads = 2, q_heads = 8, head_dim = 64, block_size = 16, n_max = 9;
  i32 rounds = 2;
  bool rounds_given = false;
  i32 append = 0;  // tokens appended before each later round; 0: two blocks, or more to clear the window
  std::uint64_t seed = 1;
  bool show_mask = false;
  bool n_max_given = false, append_given = false;
  // Kara: |W|, |U| and the tokens kept of W \ U. Smaller than KvLLM's 768 / 32 / 225,
  // whose host scorer costs |W| G (|W| - |U|) d per row and would make the demo slow.
  i32 window = 96, buffer = 8, keep = 28;
  bool kara_sizes_given = false;
  // kv_compress's budget: tokens per (layer, KV head) (the paper's C = 128), or a rate.
  i32 cache_tokens = 128;
  double rate = 1.0;
  bool cache_tokens_given = false, rate_given = false;
};

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr std::string_view usage = R"(usage: kvpolicy_demo [options]
  --preset NAME     zipage (default), rkv, gkv, snapkv, h2o, streaming_llm,
                    hard_kv (per-head counts, printed each round; later rounds skip
                    the tokens each head dropped), hard_kv_rkv (the same, with R-KV's
                    redundancy over the keys each head holds),
                    kara (a window of each sequence; Token2Chunk drawn per round),
                    kv_compress (a per-head block cache, one compression; per-head lengths)
  --device NAME     cuda: the CUDA executor (the default when the demo is built with
                    CUDA and a GPU is present); host: the host executor (the default
                    otherwise); both: host and cuda on identical copies of the cache,
                    stage times side by side, keep masks, K/V and live bytes compared
  --layout NAME     nano_vllm (default) or vllm_flash
  --dtype NAME      bf16 (default), f16, f32
  --seqs N          sequences (4)          --layers N      layers (2)
  --kv-heads N      KV heads (2)           --q-heads N     query heads (8)
  --head-dim N      head dimension (64)    --block-size N  tokens per block (16)
  --n-max N         Zipage's block cap N_max (9): budget (N_max - 1) * block size
  --rounds N        compressions per sequence (2); later rounds
                    append tokens first
  --append N        tokens appended before each later round (two blocks, or
                    one block more than the preset's protected window)
  --seed N          random seed (1)
  --window N        kara: |W|, tokens of each window, a multiple of the block size (96)
  --buffer N        kara: |U|, the window's newest tokens, never evicted (8)
  --keep N          kara: tokens kept of the window's first |W| - |U| (28); KvLLM's
                    setting is --window 768 --buffer 32 --keep 225 --block-size 256.
                    kara takes neither --n-max nor --append: each later round
                    appends what makes a new window of uncompressed tokens
  --cache-tokens N  kv_compress: tokens per (layer, KV head) each sequence keeps on
                    average (max_cache_tokens, 128)
  --rate R          kv_compress: instead, the fraction of the positions past the
                    protected window kept (compression_rate, in (0, 1]; 0.125 is 8x)
  --show-mask       print the keep map of sequence 0, layer 0, KV head 0
GPU stage times are CUDA events around the kernels (copies to and from the GPU
excluded), from a second run on the same input (the first loads the kernels).
)";

double parse_rate(std::string_view flag, std::string_view s) {
  const std::string text(s);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !(v > 0.0 && v <= 1.0))
    throw usage_error(str("{}: '{}' is not a number in (0, 1]", flag, s));
  return v;
}

i32 parse_int(std::string_view flag, std::string_view s, i32 lo) {
  i32 v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size() || v < lo)
    throw usage_error(str("{}: '{}' is not an integer >= {}", flag, s, lo));
  return v;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view flag = argv[i], value;
    if (flag == "-h" || flag == "--help") throw usage_error("");
    if (flag == "--show-mask") {
      o.show_mask = true;
      continue;
    }
    if (const auto eq = flag.find('='); eq != std::string_view::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw usage_error(str("{} needs a value", flag));
    }
    if (flag == "--preset") {
      o.preset = value;
    } else if (flag == "--device") {
      if (value == "host") o.dev = device::host;
      else if (value == "cuda") o.dev = device::cuda;
      else if (value == "both") o.dev = device::both;
      else throw usage_error(str("--device: '{}' is not cuda, host or both", value));
    } else if (flag == "--layout") {
      if (value != "nano_vllm" && value != "vllm_flash")
        throw usage_error(str("--layout: '{}' is neither nano_vllm nor vllm_flash", value));
      o.layout = value;
    } else if (flag == "--dtype") {
      if (value == "bf16") o.type = kvp::dtype::bf16;
      else if (value == "f16") o.type = kvp::dtype::f16;
      else if (value == "f32") o.type = kvp::dtype::f32;
      else throw usage_error(str("--dtype: '{}' is not bf16, f16 or f32", value));
    } else if (flag == "--seqs") {
      o.seqs = parse_int(flag, value, 1);
    } else if (flag == "--layers") {
      o.layers = parse_int(flag, value, 1);
    } else if (flag == "--kv-heads") {
      o.kv_heads = parse_int(flag, value, 1);
    } else if (flag == "--q-heads") {
      o.q_heads = parse_int(flag, value, 1);
    } else if (flag == "--head-dim") {
      o.head_dim = parse_int(flag, value, 1);
    } else if (flag == "--block-size") {
      o.block_size = parse_int(flag, value, 1);
    } else if (flag == "--n-max") {
      o.n_max = parse_int(flag, value, 2);
      o.n_max_given = true;
    } else if (flag == "--rounds") {
      o.rounds = parse_int(flag, value, 1);
      o.rounds_given = true;
    } else if (flag == "--append") {
      o.append = parse_int(flag, value, 1);
      o.append_given = true;
    } else if (flag == "--window") {
      o.window = parse_int(flag, value, 2);
      o.kara_sizes_given = true;
    } else if (flag == "--buffer") {
      o.buffer = parse_int(flag, value, 0);
      o.kara_sizes_given = true;
    } else if (flag == "--keep") {
      o.keep = parse_int(flag, value, 1);
      o.kara_sizes_given = true;
    } else if (flag == "--cache-tokens") {
      o.cache_tokens = parse_int(flag, value, 0);
      o.cache_tokens_given = true;
    } else if (flag == "--rate") {
      o.rate = parse_rate(flag, value);
      o.rate_given = true;
    } else if (flag == "--seed") {
      o.seed = static_cast<std::uint64_t>(parse_int(flag, value, 0));
    } else {
      throw usage_error(str("unknown option {}", flag));
    }
  }
  return o;
}

// ---------------------------------------------------------------------------
// Presets: one type each, chosen at run time.

using any_preset = std::variant<kvp::presets::zipage, kvp::presets::rkv, kvp::presets::gkv, kvp::presets::snapkv,
                                kvp::presets::h2o, kvp::presets::streaming_llm, kvp::presets::hard_kv,
                                kvp::presets::hard_kv_rkv, kvp::presets::kara>;

// Whether a preset compresses a window of each sequence (batch_item::window_begin).
template <class P>
constexpr bool windowed = kvp::window_only<typename P::layout_type>();

// Whether a preset keeps a count per (layer, KV head), leaving each head's slots past
// its own count to tokens it dropped.
template <class P>
constexpr bool per_head = kvp::ScoreDependentSelector<typename P::select_type>;

any_preset make_preset(const options& o) {
  const std::string_view name = o.preset;
  if (name == "kara") {
    kvp::presets::kara k;
    k.scorer.window = o.window;
    k.scorer.buffer = o.buffer;
    return k;
  }
  if (o.kara_sizes_given) throw usage_error(str("--window, --buffer and --keep are kara's; the preset is {}", name));
  if (o.cache_tokens_given || o.rate_given)
    throw usage_error(str("--cache-tokens and --rate are kv_compress's; the preset is {}", name));
  if (name == "zipage") return kvp::presets::zipage{};
  if (name == "rkv") return kvp::presets::rkv{};
  if (name == "gkv") return kvp::presets::gkv{};
  if (name == "snapkv") return kvp::presets::snapkv{};
  if (name == "h2o") return kvp::presets::h2o{};
  if (name == "streaming_llm") return kvp::presets::streaming_llm{};
  if (name == "hard_kv") return kvp::presets::hard_kv{};
  if (name == "hard_kv_rkv") return kvp::presets::hard_kv_rkv{};
  throw usage_error(str("--preset: unknown preset '{}'", name));
}

// ---------------------------------------------------------------------------
// The engine's side: memory, block table, lengths, and what each token is.

enum class role : std::uint8_t { background, sink, heavy, dup_old, dup_newest };

struct token_info {
  role kind = role::background;
  i32 round = 0;    // the round (topic) that appended it
  i32 dup_of = -1;  // for a repeat: the token id of the segment's first copy
};

constexpr i32 num_sinks = 4;

struct demo_cache {
  options o;
  kvp::cache_shape shape;
  i32 max_blocks = 0;                    // dense block table row length
  i32 query_window = 0;                  // positions per query slot
  std::vector<std::byte> kv;             // all K and V bytes
  std::vector<void*> layer_tensors;      // vllm_flash: one `[2, NB, b, h, d]` tensor per layer
  std::vector<float> f;                  // the global score F, `[L, NB, b, h_kv]`
  std::vector<std::uint8_t> live;        // cautious presets: which slots each head holds, as F; else empty
  std::vector<std::byte> q;              // observation queries, `[L, seqs, w, h_q, d]`
  std::vector<i32> table;                // `[seqs, max_blocks]`, -1 where unused
  std::vector<i32> lengths;              // tokens per sequence
  std::vector<i32> free_blocks;          // the engine's free list
  std::vector<std::vector<token_info>> tokens;  // per sequence, by token id
  std::vector<std::vector<i32>> ids;     // per (seq, layer, KV head) row: token id at each position, -1
                                         // where the head dropped its token (per-head counts)
  std::vector<std::vector<std::vector<float>>> dirs;  // per (layer, KV head): [0] sinks, [r] topic r
  std::mt19937_64 rng;

  kvp::paged_kv_view cache;
  kvp::query_window_view queries;
  kvp::score_view scores;

  std::size_t row(i32 seq, i32 l, i32 h) const {
    return (static_cast<std::size_t>(seq) * o.layers + l) * o.kv_heads + h;
  }
};

// The views over one copy of the demo's buffers, host or device: the same
// constructors whatever the memory. `kv` is that copy of demo_cache::kv, `live` of
// demo_cache::live (null when that is empty).
std::vector<void*> layer_pointers(const demo_cache& c, std::byte* kv) {
  std::vector<void*> p;
  if (c.o.layout == "vllm_flash") {
    const std::size_t layer_bytes = 2 * std::size_t(c.shape.num_blocks) * c.shape.block_size * c.shape.num_kv_heads *
                                    c.shape.head_dim * static_cast<std::size_t>(kvp::size_of(c.shape.type));
    for (i32 l = 0; l < c.o.layers; ++l) p.push_back(kv + l * layer_bytes);
  }
  return p;
}

kvp::paged_kv_view cache_view(const demo_cache& c, std::byte* kv, void* const* layers, const i32* table,
                              const i32* lengths, std::uint8_t* live) {
  const kvp::sequence_table seqs{
      .table = kvp::block_table_view::dense(table, c.max_blocks), .lengths = lengths, .num_seqs = c.o.seqs};
  kvp::paged_kv_view v = c.o.layout == "vllm_flash" ? kvp::layouts::vllm_flash(layers, c.shape, seqs)
                                                    : kvp::layouts::nano_vllm(kv, c.shape, seqs);
  if (live) v.live = kvp::live_view::contiguous(live, c.shape.num_blocks, c.shape.block_size, c.o.kv_heads);
  return v;
}

kvp::query_window_view query_view(const demo_cache& c, const std::byte* q) {
  return kvp::query_window_view::contiguous(q, c.o.layers, c.o.seqs, c.query_window, c.o.q_heads, c.o.head_dim,
                                            c.o.type);
}

kvp::score_view f_view(const demo_cache& c, float* f) {
  return kvp::score_view::contiguous(f, c.shape.num_blocks, c.shape.block_size, c.o.kv_heads);
}

// Sequence s starts with N_max + (s mod 3) blocks, the last one full: Zipage's
// trigger (N >= N_max blocks, full last block) has just fired for all of them.
i32 initial_blocks(const options& o, i32 seq) { return o.n_max + seq % 3; }

std::vector<float> gaussian(std::mt19937_64& rng, i32 n, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = nd(rng);
  return v;
}

// Unit vector orthogonal to `basis` (Gram-Schmidt), so sinks and topics are independent.
std::vector<float> direction(std::mt19937_64& rng, i32 d, const std::vector<std::vector<float>>& basis) {
  std::vector<float> v = gaussian(rng, d, 1.0f);
  for (const auto& b : basis) {
    float dot = 0.0f;
    for (i32 i = 0; i < d; ++i) dot += v[i] * b[i];
    for (i32 i = 0; i < d; ++i) v[i] -= dot * b[i];
  }
  float norm = 0.0f;
  for (float x : v) norm += x * x;
  norm = std::sqrt(norm);
  for (float& x : v) x /= norm;
  return v;
}

// Blocks the demo needs: a table row's length and the pool.
struct cache_size {
  i32 max_blocks = 0, num_blocks = 0;
};

// Whole-cache presets: initial_blocks at first, later the budget plus a round's append.
// A per-head preset's length is its largest count, which only the tokens its heads
// hold bound: its sequences may keep every round's append.
cache_size whole_cache_size(const options& o, i32 budget, bool per_head_counts) {
  const i32 b = o.block_size;
  const i32 rounds_kept = per_head_counts ? std::max(o.rounds - 1, 1) : 1;
  const i32 grow = (rounds_kept * o.append + b - 1) / b;  // blocks a sequence may gain
  i32 total = 0;
  for (i32 s = 0; s < o.seqs; ++s) total += initial_blocks(o, s);
  const i32 row = per_head_counts ? o.n_max + 2 + grow : (budget + o.append + b - 1) / b;
  return {std::max(o.n_max + 2, row), total + o.seqs * grow + 4};
}

// Kara's sequences: context before the window (1 to 3 blocks, the sinks among it),
// the window (whole blocks), and 1 to b tokens after it in the last block, which
// KvLLM never compresses (Kara C.4). trigger::periodic finds the window there.
struct kara_shape {
  i32 b = 0, window = 0, buffer = 0;
  i32 kept = 0;  // tokens kept of W \ U: the budget

  i32 context(i32 seq) const { return (1 + seq % 3) * b; }
  i32 tail(i32 seq, i32 round) const { return b == 1 ? 1 : 1 + (3 + 5 * seq + 7 * round) % (b - 1); }
  // Where the next window of a sequence the last compression left at `len` tokens
  // starts: the first block boundary at or after it, so that the window holds no
  // token a compression kept (trigger::periodic's rule).
  i32 next_begin(i32 len) const { return (len + b - 1) / b * b; }
  // A round leaves at most the window's kept tokens and a block after its start.
  cache_size size(i32 seqs, i32 rounds) const {
    const i32 peak = 3 * b + (rounds - 1) * ((kept + buffer + b - 1) / b * b + b) + window + b;
    const i32 row = (peak + b - 1) / b;
    return {row, seqs * row + 4};
  }
};

demo_cache make_cache(const options& o, cache_size size, i32 window, bool with_live) {
  demo_cache c;
  c.o = o;
  c.rng.seed(o.seed);
  const i32 b = o.block_size;
  c.max_blocks = size.max_blocks;
  const i32 num_blocks = size.num_blocks;
  c.query_window = std::max(window, 1);
  c.shape = {.num_layers = o.layers, .num_blocks = num_blocks, .block_size = b, .num_kv_heads = o.kv_heads,
             .head_dim = o.head_dim, .type = o.type};

  const std::size_t elem = static_cast<std::size_t>(kvp::size_of(o.type));
  const std::size_t per_layer = std::size_t(num_blocks) * b * o.kv_heads * o.head_dim;  // one of K or V
  c.kv.assign(2 * o.layers * per_layer * elem, std::byte{0});
  c.f.assign(std::size_t(o.layers) * num_blocks * b * o.kv_heads, 0.0f);
  if (with_live) c.live.assign(c.f.size(), 0);  // a slot is live once a token is appended to it
  c.q.assign(std::size_t(o.layers) * o.seqs * c.query_window * o.q_heads * o.head_dim * elem, std::byte{0});
  c.table.assign(std::size_t(o.seqs) * c.max_blocks, -1);
  c.lengths.assign(static_cast<std::size_t>(o.seqs), 0);
  c.tokens.resize(static_cast<std::size_t>(o.seqs));
  c.ids.resize(std::size_t(o.seqs) * o.layers * o.kv_heads);

  // The free list in shuffled order: sequences get scattered, non-contiguous blocks.
  c.free_blocks.resize(static_cast<std::size_t>(num_blocks));
  for (i32 i = 0; i < num_blocks; ++i) c.free_blocks[i] = i;
  std::shuffle(c.free_blocks.begin(), c.free_blocks.end(), c.rng);

  // The views: constructors of one paged_kv_view over the engine's own memory.
  c.layer_tensors = layer_pointers(c, c.kv.data());
  c.cache = cache_view(c, c.kv.data(), c.layer_tensors.data(), c.table.data(), c.lengths.data(),
                       with_live ? c.live.data() : nullptr);
  c.queries = query_view(c, c.q.data());
  c.scores = f_view(c, c.f.data());

  // Per (layer, KV head): the sink direction, then one topic direction per round.
  c.dirs.resize(std::size_t(o.layers) * o.kv_heads);
  for (auto& d : c.dirs)
    for (i32 r = 0; r <= o.rounds; ++r) d.push_back(direction(c.rng, o.head_dim, d));
  return c;
}

// Decides what the `count` tokens appended to `seq` at positions [len, len + count)
// are: sinks (first round), repeats and heavy hitters, all before the protected window.
void plan(demo_cache& c, i32 seq, i32 count, i32 round, i32 window) {
  const i32 b = c.o.block_size, len = c.lengths[seq], end = len + count;
  auto& tok = c.tokens[seq];
  const i32 first_id = static_cast<i32>(tok.size());
  tok.resize(tok.size() + count, token_info{role::background, round, -1});
  auto at = [&](i32 pos) -> token_info& { return tok[first_id + pos - len]; };

  i32 lo = len;
  if (len == 0) {
    for (i32 t = 0; t < std::min(num_sinks, end); ++t) at(t).kind = role::sink;
    lo = std::min(num_sinks, end);
  }
  const i32 hi = end - window;  // planted tokens lie before the window
  if (hi <= lo) return;

  // Repeats: a segment of L keys written three times within one block (so both the
  // lightning and the full redundancy see them), in about a third of the blocks.
  const i32 L = std::min(4, (b - 2) / 3);
  std::vector<i32> blocks;
  for (i32 blk = std::max((lo + b - 1) / b, 1); (blk + 1) * b <= hi; ++blk) blocks.push_back(blk);
  std::shuffle(blocks.begin(), blocks.end(), c.rng);
  const std::size_t groups = L < 1 || blocks.empty() ? 0 : std::max<std::size_t>(1, blocks.size() / 3);
  for (std::size_t g = 0; g < groups; ++g) {
    const i32 o0 = blocks[g] * b + std::uniform_int_distribution<i32>(0, b - 3 * L - 2)(c.rng);
    const i32 orig = first_id + o0 - len;
    for (i32 copy = 0; copy < 3; ++copy)
      for (i32 k = 0; k < L; ++k) {
        token_info& ti = at(o0 + copy * (L + 1) + k);
        ti.kind = copy == 2 ? role::dup_newest : role::dup_old;
        ti.dup_of = copy == 0 ? -1 : orig + k;
      }
  }

  // Heavy hitters: one per 24 plannable tokens, at least one, on free positions.
  std::vector<i32> free_pos;
  for (i32 t = lo; t < hi; ++t)
    if (at(t).kind == role::background) free_pos.push_back(t);
  std::shuffle(free_pos.begin(), free_pos.end(), c.rng);
  const std::size_t heavy = std::min<std::size_t>(free_pos.size(), std::max(1, (hi - lo) / 24));
  for (std::size_t i = 0; i < heavy; ++i) at(free_pos[i]).kind = role::heavy;
}

// Appends `count` tokens to `seq`: takes blocks off the free list, plans the tokens
// and writes their K and V through the view (so the demo uses the same address math
// as the library, whatever the layout).
void append_tokens(demo_cache& c, i32 seq, i32 count, i32 round, i32 window) {
  const options& o = c.o;
  const i32 b = o.block_size, len = c.lengths[seq], end = len + count, d = o.head_dim;
  for (i32 blk = (len + b - 1) / b; blk < (end + b - 1) / b; ++blk) {
    if (c.free_blocks.empty()) throw std::runtime_error("demo: out of cache blocks");
    c.table[std::size_t(seq) * c.max_blocks + blk] = c.free_blocks.back();
    c.free_blocks.pop_back();
  }
  plan(c, seq, count, round, window);
  c.lengths[seq] = end;

  const auto& tok = c.tokens[seq];
  const i32 first_id = static_cast<i32>(tok.size()) - count;
  std::normal_distribution<float> unit(0.0f, 1.0f), small(0.0f, 0.05f);
  for (i32 l = 0; l < o.layers; ++l)
    for (i32 h = 0; h < o.kv_heads; ++h) {
      const auto& dir = c.dirs[std::size_t(l) * o.kv_heads + h];
      std::vector<float> keys(std::size_t(count) * d);
      auto& ids = c.ids[c.row(seq, l, h)];
      for (i32 k = 0; k < count; ++k) {
        const token_info& ti = tok[first_id + k];
        float* key = &keys[std::size_t(k) * d];
        for (i32 i = 0; i < d; ++i) {
          switch (ti.kind) {
            case role::sink: key[i] = 16.0f * dir[0][i] + unit(c.rng); break;
            case role::heavy: key[i] = 8.0f * dir[ti.round][i] + unit(c.rng); break;
            default:
              key[i] = ti.dup_of >= 0 ? keys[std::size_t(ti.dup_of - first_id) * d + i] + small(c.rng) : unit(c.rng);
          }
        }
        std::byte* krow = c.cache.k_row(l, seq, len + k, h);
        std::byte* vrow = c.cache.v_row(l, seq, len + k, h);
        for (i32 i = 0; i < d; ++i) {
          kvp::store_from_float(krow, o.type, i, key[i]);
          kvp::store_from_float(vrow, o.type, i, unit(c.rng));
        }
        ids.push_back(first_id + k);
        // Cautious update: every head holds what the engine appends.
        if (!c.cache.live.empty()) c.cache.live.at(l, c.cache.physical_block(seq, len + k), (len + k) % b, h) = 1;
      }
    }

  // The observation queries of the newest positions: attend to the sinks and to the
  // current topic. query_window_view::row is read-only; the demo owns the buffer.
  const i32 G = o.q_heads / o.kv_heads;
  for (i32 l = 0; l < o.layers; ++l)
    for (i32 j = 0; j < c.query_window; ++j)
      for (i32 hq = 0; hq < o.q_heads; ++hq) {
        const auto& dir = c.dirs[std::size_t(l) * o.kv_heads + hq / G];
        auto* row = const_cast<std::byte*>(c.queries.row(l, seq, j, hq));
        for (i32 i = 0; i < d; ++i)
          kvp::store_from_float(row, o.type, i, 3.0f * dir[0][i] + 4.0f * dir[round][i] + 0.5f * unit(c.rng));
      }
}

// Kara's later rounds: appends to `seq` what its next window needs, first the tokens
// up to the block boundary where it starts (nothing planted: they stay before every
// window, uncompressed), then a window and the tokens after it, planted as in the
// first round. Returns how many.
i32 append_window(demo_cache& c, const kara_shape& k, i32 seq, i32 round) {
  const i32 len = c.lengths[seq], begin = k.next_begin(len), tail = k.tail(seq, round);
  if (begin > len) append_tokens(c, seq, begin - len, round, begin - len);
  append_tokens(c, seq, k.window + tail, round, k.buffer + tail);
  return c.lengths[seq] - len;
}

// ---------------------------------------------------------------------------
// The GPU, when the demo is built with CUDA.

struct gpu_info {
  int count = 0;
  std::string name;  // of device 0
  std::string why;    // when count == 0: why not, in a few words
  std::string error;  // and the message for `--device cuda|both`
};

#if defined(__CUDACC__)

void cuda_check(cudaError_t e, std::string_view call) {
  if (e != cudaSuccess)
    throw std::runtime_error(str("CUDA error {} ({}) from {}", cudaGetErrorName(e), cudaGetErrorString(e), call));
}
#define DEMO_CUDA(call) cuda_check((call), #call)

gpu_info probe_gpu() {
  gpu_info g;
  if (const cudaError_t e = cudaGetDeviceCount(&g.count); e != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    g.count = 0;
    g.why = str("no usable CUDA device: cudaGetDeviceCount failed with {} ({})", cudaGetErrorName(e),
                cudaGetErrorString(e));
    g.error = g.why + "; run on a machine with an NVIDIA GPU and its driver, or use --device host";
    return g;
  }
  if (g.count == 0) {
    g.why = "no CUDA device found (cudaGetDeviceCount reports 0)";
    g.error = g.why + "; run on a machine with an NVIDIA GPU, or use --device host";
    return g;
  }
  cudaDeviceProp prop{};
  DEMO_CUDA(cudaGetDeviceProperties(&prop, 0));
  g.name = prop.name;
  return g;
}

// cudaMalloc'ed array of n T, freed on scope exit; every copy checked.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    DEMO_CUDA(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& v) : device_buffer(v.size()) { upload(v); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (p_) cudaFree(p_);
  }
  T* get() const { return static_cast<T*>(p_); }
  void upload(const std::vector<T>& v) {
    if (v.size() != n_) throw std::logic_error("device_buffer::upload: size mismatch");
    DEMO_CUDA(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(std::vector<T>& v) const {
    v.resize(n_);
    DEMO_CUDA(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
  }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

// The executor's stage_marks: before the first kernel, after score, redundancy,
// epilogue (aggregate + select) and layout (redundancy before score where it
// computes the softmax statistics).
struct stage_events {
  cudaEvent_t e[5]{};
  stage_events() {
    for (auto& ev : e) DEMO_CUDA(cudaEventCreate(&ev));
  }
  stage_events(const stage_events&) = delete;
  stage_events& operator=(const stage_events&) = delete;
  ~stage_events() {
    for (auto ev : e)
      if (ev) cudaEventDestroy(ev);
  }
  double seconds(int from, int to) const {
    float ms = 0.0f;
    DEMO_CUDA(cudaEventElapsedTime(&ms, e[from], e[to]));
    return 1e-3 * ms;
  }
};

// One compression with kvp::cuda_executor, from the demo's host buffers (read only)
// to `kv_out`, `f_out` and `live_out` (which may be c.kv, c.f and c.live themselves;
// `live_out` stays empty where c.live is). Returns what the host executor would: new
// lengths, released blocks, keep masks in the host layout `[layer][kv_head][T]` (T
// the window's tokens for a windowed preset), the final scores in the same layout when
// asked for, and the GPU time per stage.
template <class Preset>
kvp::host_result compress_cuda(const Preset& p, const demo_cache& c, const kvp::compression_batch& batch,
                               std::vector<std::byte>& kv_out, std::vector<float>& f_out,
                               std::vector<std::uint8_t>& live_out, bool want_scores) {
  const auto num_items = static_cast<i32>(batch.items.size());
  const std::size_t rows = std::size_t(c.o.layers) * c.o.kv_heads;  // the batch covers every layer
  i32 max_tokens = 1;
  for (const kvp::batch_item& it : batch.items) max_tokens = std::max(max_tokens, c.lengths[it.seq]);
  const i32 b = c.o.block_size, blocks_per_item = (max_tokens + b - 1) / b;
  const std::vector<kvp::batch_item> items(batch.items.begin(), batch.items.end());

  // The cache on the device: K/V bytes, per-layer device addresses (vllm_flash),
  // block table, lengths, live bytes; the queries, F and the batch.
  device_buffer<std::byte> kv(c.kv), q(c.q);
  device_buffer<float> f(c.f);
  device_buffer<i32> table(c.table), lengths(c.lengths);
  device_buffer<std::uint8_t> live(c.live);
  const std::vector<void*> layer_addrs = layer_pointers(c, kv.get());
  device_buffer<void*> layers(layer_addrs);
  device_buffer<kvp::batch_item> d_items(items);
  const kvp::paged_kv_view cache = cache_view(c, kv.get(), layers.get(), table.get(), lengths.get(),
                                              c.live.empty() ? nullptr : live.get());
  const kvp::query_window_view queries = query_view(c, q.get());
  const kvp::score_view scores = f_view(c, f.get());

  // The results, in the device layout: keep masks `[item][layer][kv_head][max_tokens]`.
  device_buffer<i32> status(kvp::status_words), new_lengths(items.size()), released_counts(items.size()),
      released_blocks(items.size() * blocks_per_item);
  device_buffer<std::uint8_t> keep(items.size() * rows * max_tokens);
  device_buffer<float> final_scores(want_scores ? items.size() * rows * max_tokens : 0);
  device_buffer<i32> kept(items.size() * rows);
  const kvp::device_batch dbatch{.items = d_items.get(), .num_items = num_items, .max_tokens = max_tokens};
  const kvp::device_result out{.status = status.get(),
                               .new_lengths = new_lengths.get(),
                               .released_counts = released_counts.get(),
                               .released_blocks = released_blocks.get(),
                               .keep_masks = keep.get(),
                               .scores = want_scores ? final_scores.get() : nullptr,
                               .kept_counts = kept.get()};

  stage_events marks;
  kvp::cuda_executor ex;
  ex.stage_marks = marks.e;
  std::size_t temp_bytes = 0;
  DEMO_CUDA(ex.compress(nullptr, temp_bytes, p, cache, queries, scores, dbatch, out));
  device_buffer<std::byte> temp(temp_bytes);

  std::vector<i32> host_status;
  auto run_once = [&] {
    DEMO_CUDA(ex.compress(temp.get(), temp_bytes, p, cache, queries, scores, dbatch, out));
    DEMO_CUDA(cudaDeviceSynchronize());  // and any error of a kernel
    status.download(host_status);
    try {
      kvp::check(host_status.data());
    } catch (const kvp::error& e) {
      throw std::runtime_error(str("the CUDA executor's device-side checks rejected the batch: {}", e.what()));
    }
  };
  // Warm-up: the first launch of each kernel loads the module. It compresses the
  // device copy in place, so K/V, F and the live bytes are uploaded again before the
  // timed run.
  run_once();
  kv.upload(c.kv);
  f.upload(c.f);
  live.upload(c.live);
  run_once();

  kvp::host_result res;
  // The validation kernel counts with the first of score and redundancy.
  const int red_first = ex.redundancy_computes_statistics(p, cache, queries) ? 1 : 0;
  res.times[kvp::stage::score] = marks.seconds(red_first, red_first + 1);
  res.times[kvp::stage::redundancy] = marks.seconds(1 - red_first, 2 - red_first);
  res.times[kvp::stage::select] = marks.seconds(2, 3);  // the epilogue: aggregate + protect + select
  res.times[kvp::stage::layout] = marks.seconds(3, 4);

  kv.download(kv_out);
  f.download(f_out);
  live.download(live_out);
  std::vector<i32> h_new, h_counts, h_blocks, h_kept;
  std::vector<std::uint8_t> h_keep;
  std::vector<float> h_scores;
  if (want_scores) final_scores.download(h_scores);
  kept.download(h_kept);
  new_lengths.download(h_new);
  released_counts.download(h_counts);
  released_blocks.download(h_blocks);
  keep.download(h_keep);
  res.new_lengths = h_new;
  res.released_blocks.resize(items.size());
  res.keep_masks.resize(items.size());
  res.kept_counts.resize(items.size());
  if (want_scores) res.scores.resize(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    res.kept_counts[i].assign(h_kept.begin() + static_cast<std::ptrdiff_t>(i * rows),
                              h_kept.begin() + static_cast<std::ptrdiff_t>((i + 1) * rows));
    const auto first = h_blocks.begin() + static_cast<std::ptrdiff_t>(i * blocks_per_item);
    res.released_blocks[i].assign(first, first + std::clamp(h_counts[i], 0, blocks_per_item));
    // Rows of max_tokens on the device, of T (the window's tokens, when windowed) here.
    const auto T = static_cast<std::size_t>(c.lengths[items[i].seq] - items[i].window_begin);
    auto& mask = res.keep_masks[i];
    mask.resize(rows * T);
    if (want_scores) res.scores[i].resize(rows * T);
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t at = (i * rows + r) * static_cast<std::size_t>(max_tokens);
      std::copy(h_keep.data() + at, h_keep.data() + at + T, mask.begin() + static_cast<std::ptrdiff_t>(r * T));
      if (want_scores)
        std::copy(h_scores.data() + at, h_scores.data() + at + T,
                  res.scores[i].begin() + static_cast<std::ptrdiff_t>(r * T));
    }
  }
  return res;
}

#else  // host-only build

gpu_info probe_gpu() {
  gpu_info g;
  g.why = "built without CUDA";
  g.error = "this kvpolicy_demo was built without CUDA and has the host executor only; rebuild it with CUDA "
            "(nvcc found, -DKVPOLICY_ENABLE_CUDA=ON) or use --device host";
  return g;
}

#endif

// ---------------------------------------------------------------------------
// One compression on the chosen device(s).

// Host and GPU results of one round, compared (--device both).
struct agreement {
  long mask_rows = 0, mask_rows_differ = 0, mask_tokens_differ = 0;
  long items_differ = 0;                   // new length or released blocks
  long kv_rows = 0, kv_rows_differ = 0;    // held (token, head) rows of K and V, in rows whose masks agree
  long live_rows = 0, live_rows_differ = 0;  // cautious presets: (layer, KV head) rows of live bytes, likewise
  double f_max_diff = 0.0;                 // over all of F
};

struct outcome {
  // What the demo goes on with (the GPU's, when it ran). Keep masks cover whole
  // sequences (widen_masks); scores, recorded for a pattern selector, the window.
  kvp::host_result res;
  std::optional<kvp::stage_times> host_times, gpu_times;
  std::optional<agreement> diff;
};

// A windowed preset's keep masks cover each item's window; the demo's bookkeeping
// reads masks over whole sequences, in which the tokens before the window are kept.
void widen_masks(kvp::host_result& res, const kvp::compression_batch& batch, const demo_cache& c) {
  const std::size_t rows = std::size_t(c.o.layers) * c.o.kv_heads;
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const auto wb = static_cast<std::size_t>(batch.items[i].window_begin);
    if (wb == 0) continue;
    const auto T = static_cast<std::size_t>(c.lengths[batch.items[i].seq]), window_tokens = T - wb;
    std::vector<std::uint8_t> whole(rows * T, 1);
    for (std::size_t r = 0; r < rows; ++r)
      std::copy_n(res.keep_masks[i].begin() + static_cast<std::ptrdiff_t>(r * window_tokens), window_tokens,
                  whole.begin() + static_cast<std::ptrdiff_t>(r * T + wb));
    res.keep_masks[i] = std::move(whole);
  }
}

template <class Preset>
outcome compress_on(device dev, const Preset& p, demo_cache& c, const kvp::compression_batch& batch) {
  // A pattern selector's choices are drawn again from its final scores (print_window).
  constexpr bool want_scores = kvp::PatternSelector<typename Preset::select_type>;
  const kvp::host_executor host{.record_keep_masks = true, .record_scores = want_scores};
  outcome out;
  if (dev == device::host) {
    out.res = host.compress(p, c.cache, c.queries, c.scores, batch);
    widen_masks(out.res, batch, c);
    out.host_times = out.res.times;
    return out;
  }
#if defined(__CUDACC__)
  if (dev == device::cuda) {
    out.res = compress_cuda(p, c, batch, c.kv, c.f, c.live, want_scores);
    widen_masks(out.res, batch, c);
    out.gpu_times = out.res.times;
    return out;
  }
  // both: the host executor on a copy of K/V, F and the live bytes, the GPU's result
  // back into the demo's own buffers. The block table and lengths are the engine's to
  // update, so both executors read the same ones.
  std::vector<std::byte> kv_h(c.kv);
  std::vector<float> f_h(c.f);
  std::vector<std::uint8_t> live_h(c.live);
  const std::vector<void*> layers_h = layer_pointers(c, kv_h.data());
  const kvp::paged_kv_view cache_h = cache_view(c, kv_h.data(), layers_h.data(), c.table.data(), c.lengths.data(),
                                                live_h.empty() ? nullptr : live_h.data());
  kvp::host_result h = host.compress(p, cache_h, c.queries, f_view(c, f_h.data()), batch);
  out.res = compress_cuda(p, c, batch, c.kv, c.f, c.live, want_scores);
  widen_masks(h, batch, c);
  widen_masks(out.res, batch, c);
  out.host_times = h.times;
  out.gpu_times = out.res.times;

  agreement a;
  const std::size_t rows = std::size_t(c.o.layers) * c.o.kv_heads;
  const auto row_bytes = static_cast<std::size_t>(c.cache.row_bytes());
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const i32 seq = batch.items[i].seq, T = c.lengths[seq], n = out.res.new_lengths[i];
    const bool same_item = h.new_lengths[i] == n && h.released_blocks[i] == out.res.released_blocks[i];
    a.items_differ += !same_item;
    for (std::size_t r = 0; r < rows; ++r) {
      const auto l = static_cast<i32>(r / c.o.kv_heads), hd = static_cast<i32>(r % c.o.kv_heads);
      long tokens = 0;
      for (i32 t = 0; t < T; ++t) tokens += h.keep_masks[i][r * T + t] != out.res.keep_masks[i][r * T + t];
      ++a.mask_rows;
      a.mask_rows_differ += tokens > 0;
      a.mask_tokens_differ += tokens;
      if (tokens > 0 || !same_item) continue;
      for (i32 t = 0; t < n; ++t) {
        if (!c.cache.alive(l, seq, t, hd)) continue;  // a slot the head dropped holds no token of it
        a.kv_rows += 2;
        a.kv_rows_differ += std::memcmp(cache_h.k_row(l, seq, t, hd), c.cache.k_row(l, seq, t, hd), row_bytes) != 0;
        a.kv_rows_differ += std::memcmp(cache_h.v_row(l, seq, t, hd), c.cache.v_row(l, seq, t, hd), row_bytes) != 0;
      }
      // The live bytes both layouts wrote: every slot of the row before the compression.
      if (c.cache.live.empty()) continue;
      bool live_same = true;
      for (i32 t = 0; t < T; ++t) {
        const i32 blk = c.cache.physical_block(seq, t);
        live_same &= cache_h.live.at(l, blk, t % c.o.block_size, hd) == c.cache.live.at(l, blk, t % c.o.block_size, hd);
      }
      ++a.live_rows;
      a.live_rows_differ += !live_same;
    }
  }
  for (std::size_t k = 0; k < f_h.size(); ++k)
    a.f_max_diff = std::max(a.f_max_diff, static_cast<double>(std::fabs(f_h[k] - c.f[k])));
  out.diff = a;
  return out;
#else
  throw std::logic_error(str("--device {} in a build without CUDA", name_of(dev)));
#endif
}

// ---------------------------------------------------------------------------
// Reporting

struct tally {
  long present = 0, kept = 0;
  void add(bool k) {
    ++present;
    kept += k;
  }
  std::string pct() const {
    return present == 0 ? std::string("-") : str("{:.0f}%", 100.0 * double(kept) / double(present));
  }
};

struct seq_report {
  tally sinks, heavy, earlier_heavy, dup_old, dup_newest;
};

// Keep map of one row: the planted roles above, the keep mask below, one block per group.
void print_mask(const demo_cache& c, i32 seq, std::span<const std::uint8_t> keep) {
  const auto& ids = c.ids[c.row(seq, 0, 0)];
  const i32 b = c.o.block_size, round_now = c.tokens[seq].back().round;
  std::string roles, kept;
  bool dropped = false;
  for (std::size_t t = 0; t < ids.size(); ++t) {
    if (t > 0 && t % b == 0) {
      roles += ' ';
      kept += ' ';
    }
    kept += keep[t] ? '#' : '_';
    if (ids[t] < 0) {
      roles += 'x';
      dropped = true;
      continue;
    }
    const token_info& ti = c.tokens[seq][ids[t]];
    char ch = '.';
    switch (ti.kind) {
      case role::sink: ch = 'S'; break;
      case role::heavy: ch = ti.round == round_now ? 'H' : 'h'; break;
      case role::dup_old: ch = 'd'; break;
      case role::dup_newest: ch = 'D'; break;
      default: break;
    }
    roles += ch;
  }
  const std::size_t width = 4 * (b + 1);  // four blocks a line
  say("  keep map, seq {} layer 0 KV head 0 (S sink, H heavy, h earlier heavy, d older repeat, "
      "D newest repeat{}; # kept, _ evicted)\n",
      seq, dropped ? ", x dropped by this head in an earlier round" : "");
  for (std::size_t i = 0; i < roles.size(); i += width) {
    say("    {}\n    {}\n", roles.substr(i, width), kept.substr(i, width));
  }
}

// Kara's figure 7 for one row (layer 0, KV head 0): Token2Chunk's choices drawn
// again from the executor's final scores with the selector's host form
// (keep_pattern), under the planted roles, and checked against the executor's keep
// mask. `scores` and `mask` cover the window and the tokens after it. Returns whether
// the two agree.
template <class Preset>
bool print_window(const Preset& p, const demo_cache& c, i32 seq, i32 wb, i32 budget, std::span<const float> scores,
                  std::span<const std::uint8_t> mask) {
  const auto T = static_cast<i32>(scores.size());
  const i32 n = p.scorer.key_end(T), b = c.o.block_size, round_now = c.tokens[seq].back().round;
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(n));
  const auto choice = p.select.keep_pattern(scores.first(static_cast<std::size_t>(n)), budget, keep);
  i32 differ = 0;
  for (i32 t = 0; t < T; ++t) differ += (t < n ? keep[t] : std::uint8_t{1}) != mask[t];

  std::string what(static_cast<std::size_t>(T), '_');
  for (i32 t : choice.anchors) what[t] = 'A';
  i32 interior = 0;
  std::string chunks;
  for (auto [lo, hi] : choice.chunks) {
    for (i32 t = lo + 1; t < hi; ++t) what[t] = 'c';
    interior += hi - lo - 1;
    chunks += str(", {}..{} R {:.3g}", lo, hi, (scores[lo] + scores[hi]) * float(hi - lo - 1));
  }
  for (i32 t : choice.fill) what[t] = 'f';
  for (i32 t = n; t < T; ++t) what[t] = t < p.scorer.window ? 'U' : 't';

  // Planted roles above, choices below, in groups of a block (of 16 tokens for larger blocks).
  const auto& ids = c.ids[c.row(seq, 0, 0)];
  const i32 group = std::min(b, 16), per_line = std::max(1, 64 / group);
  std::string roles, drawn;
  for (i32 t = 0; t < T; ++t) {
    if (t > 0 && t % group == 0) {
      roles += ' ';
      drawn += ' ';
    }
    const token_info& ti = c.tokens[seq][ids[wb + t]];
    char ch = '.';
    switch (ti.kind) {
      case role::sink: ch = 'S'; break;
      case role::heavy: ch = ti.round == round_now ? 'H' : 'h'; break;
      case role::dup_old: ch = 'd'; break;
      case role::dup_newest: ch = 'D'; break;
      default: break;
    }
    roles += ch;
    drawn += what[t];
  }
  say("  window of seq {}, layer 0, KV head 0: tokens [{}, {}) and the {} after it, positions from the window's start\n"
      "  (Kara fig. 7; above: H heavy, d older repeat, D newest repeat; below: A anchor, the top {} by score,\n"
      "  c chunk interior added by Token2Chunk, f fill, _ evicted, U buffer, t after the window)\n",
      seq, wb, wb + p.scorer.window, T - p.scorer.window, choice.anchors.size());
  const auto width = static_cast<std::size_t>(per_line * (group + 1));
  for (std::size_t i = 0; i < roles.size(); i += width) {
    std::string above = roles.substr(i, width), below = drawn.substr(i, width);
    if (above.back() == ' ') {  // the gap before the next line's first group
      above.pop_back();
      below.pop_back();
    }
    say("    {}\n    {}\n", above, below);
  }
  say("  Token2Chunk on the row's final scores: {} anchors, {} chunks (+{} tokens{}), {} fill: {} of {} kept\n",
      choice.anchors.size(), choice.chunks.size(), interior, chunks, choice.fill.size(),
      choice.anchors.size() + interior + choice.fill.size(), n);
  say("  the executor's keep mask of the row: {}\n",
      differ == 0 ? std::string("the same") : str("DIFFERS in {} of {} tokens", differ, T));
  return differ == 0;
}

// One line comparing the host's and the GPU's results of a round (--device both).
void print_agreement(const agreement& a) {
  std::string masks = a.mask_rows_differ == 0
                          ? str("keep masks identical in all {} (layer, KV head) rows", a.mask_rows)
                          : str("keep masks differ in {} of {} rows, {} tokens (near-ties of fp32 scores)",
                                a.mask_rows_differ, a.mask_rows, a.mask_tokens_differ);
  say("  host vs cuda: {}; new lengths and released blocks {}; kept K/V rows {}{}; F max |host - gpu| {:.3g}\n",
      masks, a.items_differ == 0 ? std::string("identical") : str("differ in {} items", a.items_differ),
      a.kv_rows_differ == 0 ? str("byte-identical ({} rows of K and V)", a.kv_rows)
                            : str("DIFFER: {} of {} rows whose masks agree", a.kv_rows_differ, a.kv_rows),
      a.live_rows == 0 ? std::string()
      : a.live_rows_differ == 0
          ? str("; live bytes identical ({} rows)", a.live_rows)
          : str("; live bytes DIFFER in {} of {} rows whose masks agree", a.live_rows_differ, a.live_rows),
      a.f_max_diff);
}

struct round_times {
  std::optional<kvp::stage_times> host, gpu;
};

// Per stage and round: host ms, GPU ms, or both side by side ("host | gpu").
void print_times(const std::vector<round_times>& rounds, const std::string& gpu_name) {
  if (rounds.empty()) return;
  const bool h = rounds.front().host.has_value(), g = rounds.front().gpu.has_value();
  const std::string gpu_what =
      str("  (gpu: time between CUDA events on {}; copies to and from the GPU excluded)\n", gpu_name);
  if (h && g) say("\ntime per stage, ms: host executor | cuda executor\n{}", gpu_what);
  else if (g) say("\nGPU time per stage (cuda executor), ms\n{}", gpu_what);
  else say("\nhost time per stage, ms\n");

  const std::size_t w = h && g ? 19 : 9;
  say("  {:<10}", "stage");
  for (std::size_t r = 0; r < rounds.size(); ++r) say("  {:>{}}", str("round {}", r + 1), w);
  say("\n");
  if (h && g) {
    say("  {:<10}", "");
    for (std::size_t r = 0; r < rounds.size(); ++r) say("  {:>{}}", str("{:>8} | {:>8}", "host", "gpu"), w);
    say("\n");
  }
  const auto ms = [](double s) { return str("{:.3f}", 1e3 * s); };
  const auto cell = [&](const round_times& rt, std::optional<kvp::stage> st) {
    std::string hs, gs;
    if (h) hs = ms(st ? (*rt.host)[*st] : rt.host->total());
    if (g) gs = st == kvp::stage::aggregate ? std::string("-") : ms(st ? (*rt.gpu)[*st] : rt.gpu->total());
    return h && g ? str("{:>8} | {:>8}", hs, gs) : h ? hs : gs;
  };
  for (std::size_t i = 0; i < kvp::stage_names.size(); ++i) {
    const auto st = static_cast<kvp::stage>(i);
    say("  {:<10}", kvp::stage_names[i]);
    for (const auto& rt : rounds) say("  {:>{}}", cell(rt, st), w);
    say("{}\n", g && st == kvp::stage::aggregate ? "  (gpu: fused into select)" : "");
  }
  say("  {:<10}", "total");
  for (const auto& rt : rounds) say("  {:>{}}", cell(rt, std::nullopt), w);
  say("\n");
  if (g)
    say("  gpu: score includes the validation kernel; select is the fused epilogue (aggregate, protect, select)\n");
}

// A head-adaptive selector's counts for the first sequence: one row per layer, one
// column per KV head; the sequence keeps the largest, and each head's slots past its
// own count are padding its attention skips (docs/integration.md, "Per-head counts").
// `held`: the tokens each head held of the T slots; after a first round, fewer than T.
void print_head_counts(const options& o, i32 T, const std::vector<i32>& held, const std::vector<i32>& kept,
                       i32 new_length) {
  const bool all_held = std::ranges::all_of(held, [T](i32 n) { return n == T; });
  if (all_held)
    say("tokens kept per (layer, KV head) of seq 0, of {} (the sequence keeps {}, the largest):\n", T, new_length);
  else
    say("tokens kept per (layer, KV head) of seq 0, of those it held (kept/held) in {} slots (the sequence keeps "
        "{}, the largest):\n",
        T, new_length);
  for (i32 l = 0; l < o.layers; ++l) {
    std::string line = str("  layer {:>2}:", l);
    for (i32 h = 0; h < o.kv_heads; ++h) {
      const std::size_t row = std::size_t(l) * o.kv_heads + h;
      line += all_held ? str(" {:>5}", kept[row]) : str(" {:>9}", str("{}/{}", kept[row], held[row]));
    }
    say("{}\n", line);
  }
}

// Hands released blocks back, trims the table, and follows each row's kept tokens: a
// head that keeps fewer than the new length holds no token in its slots past its count.
void apply_result(demo_cache& c, const kvp::compression_batch& batch, const kvp::host_result& res) {
  const options& o = c.o;
  for (std::size_t i = 0; i < batch.items.size(); ++i) {
    const i32 seq = batch.items[i].seq, T = c.lengths[seq], n = res.new_lengths[i];
    for (i32 blk : res.released_blocks[i]) c.free_blocks.push_back(blk);
    for (i32 blk = (n + o.block_size - 1) / o.block_size; blk < c.max_blocks; ++blk)
      c.table[std::size_t(seq) * c.max_blocks + blk] = -1;
    c.lengths[seq] = n;
    for (i32 l = 0; l < o.layers; ++l)
      for (i32 h = 0; h < o.kv_heads; ++h) {
        auto& ids = c.ids[c.row(seq, l, h)];
        const std::uint8_t* keep = &res.keep_masks[i][(std::size_t(l) * o.kv_heads + h) * T];
        std::vector<i32> next;
        for (i32 t = 0; t < T; ++t)
          if (keep[t]) next.push_back(ids[t]);
        next.resize(static_cast<std::size_t>(n), -1);
        ids = std::move(next);
      }
  }
}

// Cautious update: the token ids each (layer, KV head) row of seq holds (its live
// slots), sorted.
std::vector<std::vector<i32>> held_tokens(const demo_cache& c, i32 seq) {
  std::vector<std::vector<i32>> held;
  for (i32 l = 0; l < c.o.layers; ++l)
    for (i32 h = 0; h < c.o.kv_heads; ++h) {
      const auto& ids = c.ids[c.row(seq, l, h)];
      auto& row = held.emplace_back();
      for (i32 t = 0; t < c.lengths[seq]; ++t)
        if (c.cache.alive(l, seq, t, h)) row.push_back(ids[t]);
      std::ranges::sort(row);
    }
  return held;
}

// Cautious update's promise, checked after apply_result: a dropped token stays
// dropped. Each row holds a subset of the tokens `before` says it held, and its live
// bytes mark exactly the slots its keep mask filled (else the next round would score
// a slot the demo counts as dropped, or skip a token it counts as held). Returns the
// slots that break either.
long held_violations(const demo_cache& c, i32 seq, const std::vector<std::vector<i32>>& before) {
  long bad = 0;
  for (i32 l = 0; l < c.o.layers; ++l)
    for (i32 h = 0; h < c.o.kv_heads; ++h) {
      const auto& ids = c.ids[c.row(seq, l, h)];
      const auto& was = before[std::size_t(l) * c.o.kv_heads + h];
      for (i32 t = 0; t < c.lengths[seq]; ++t) {
        const bool live = c.cache.alive(l, seq, t, h);
        if (live != (ids[t] >= 0)) ++bad;
        else if (live && !std::ranges::binary_search(was, ids[t])) ++bad;
      }
    }
  return bad;
}

// The bytes of every (token, head) row of K and V of a sequence, to check the moves.
std::vector<std::byte> snapshot(const demo_cache& c, i32 seq) {
  const auto bytes = static_cast<std::size_t>(c.cache.row_bytes());
  std::vector<std::byte> out;
  for (i32 l = 0; l < c.o.layers; ++l)
    for (i32 h = 0; h < c.o.kv_heads; ++h)
      for (i32 t = 0; t < c.lengths[seq]; ++t) {
        const std::byte* k = c.cache.k_row(l, seq, t, h);
        const std::byte* v = c.cache.v_row(l, seq, t, h);
        out.insert(out.end(), k, k + bytes);
        out.insert(out.end(), v, v + bytes);
      }
  return out;
}

// Invariant 1 of SPEC.md: each kept token's K and V bytes, at its new position, equal
// its bytes before the move. Returns the rows that differ.
long verify_moves(const demo_cache& c, i32 seq, i32 T, std::span<const std::byte> before,
                  std::span<const std::uint8_t> mask) {
  const auto bytes = static_cast<std::size_t>(c.cache.row_bytes());
  long bad = 0;
  for (i32 l = 0; l < c.o.layers; ++l)
    for (i32 h = 0; h < c.o.kv_heads; ++h) {
      const std::size_t row = std::size_t(l) * c.o.kv_heads + h;
      i32 dst = 0;
      for (i32 t = 0; t < T; ++t) {
        if (!mask[row * T + t]) continue;
        const std::byte* old = before.data() + (row * T + t) * 2 * bytes;
        bad += std::memcmp(c.cache.k_row(l, seq, dst, h), old, bytes) != 0;
        bad += std::memcmp(c.cache.v_row(l, seq, dst, h), old + bytes, bytes) != 0;
        ++dst;
      }
    }
  return bad;
}

// The device: cuda by default when this build has CUDA and there is a GPU.
device choose_device(options& o, gpu_info& gpu, std::string& dev_note) {
  if (o.dev != device::host) gpu = probe_gpu();
  if (!o.dev) {
    o.dev = gpu.count > 0 ? device::cuda : device::host;
    dev_note = gpu.count > 0 ? std::string(" (default)") : str(" (default; {})", gpu.why);
  } else if (*o.dev != device::host && gpu.count == 0) {
    throw std::runtime_error(str("--device {}: {}", name_of(*o.dev), gpu.error));
  }
  return *o.dev;
}

}  // namespace

#include "kv_compress_demo.hpp"

namespace {

int run(options o) {
  const auto wall0 = std::chrono::steady_clock::now();
  if (o.q_heads % o.kv_heads != 0)
    throw usage_error(str("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads, o.kv_heads));
  if (o.preset == "kv_compress") {
    gpu_info gpu;
    std::string dev_note;
    const device dev = choose_device(o, gpu, dev_note);
    return run_kv_compress(o, dev, gpu, dev_note);
  }
  const any_preset preset = make_preset(o);

  gpu_info gpu;
  std::string dev_note;
  const device dev = choose_device(o, gpu, dev_note);

  // Per-head counts leave each head's slots past its own count to tokens it dropped;
  // a later round skips them through the live bytes (cautious update), which the demo
  // keeps for such presets.
  const bool per_head_counts =
      std::visit([](const auto& p) { return per_head<std::remove_cvref_t<decltype(p)>>; }, preset);
  const i32 b = o.block_size;
  // A windowed preset (kara) compresses a window of each sequence: the budget is what
  // each window keeps of its compressible region, and each later round appends what
  // a new window needs, per sequence.
  const bool is_windowed =
      std::visit([](const auto& p) { return windowed<std::remove_cvref_t<decltype(p)>>; }, preset);
  kara_shape kara;
  if (is_windowed) {
    if (o.n_max_given) throw usage_error("--n-max: kara keeps --keep tokens of each window; N_max does not apply");
    if (o.append_given) throw usage_error("--append: kara appends, per sequence, what its next window needs");
    if (o.window % b != 0)
      throw usage_error(str("--window {} is not a multiple of --block-size {}: a window is whole blocks", o.window, b));
    if (o.buffer >= o.window)
      throw usage_error(str("--buffer {} leaves nothing of the window of {} to compress", o.buffer, o.window));
    if (o.keep > o.window - o.buffer)
      throw usage_error(str("--keep {}: the window's compressible region holds {} tokens", o.keep,
                            o.window - o.buffer));
    kara = {.b = b, .window = o.window, .buffer = o.buffer, .kept = o.keep};
  }
  const i32 budget = is_windowed ? o.keep : (o.n_max - 1) * b;
  // The window the preset protects, and how many queries its scorer reads (kara's
  // query slot holds the window's own queries).
  const auto [protect_window, score_window] = std::visit(
      [](const auto& p) { return std::pair<i32, i32>{p.protect.window, kvp::scorer_window(p.scorer)}; }, preset);
  // By default each later round appends at least one block beyond the protected
  // window, so that some of its new tokens are up for eviction at once.
  if (o.append == 0) o.append = std::max(2 * b, (protect_window + b - 1) / b * b + b);
  demo_cache c =
      make_cache(o, is_windowed ? kara.size(o.seqs, o.rounds) : whole_cache_size(o, budget, per_head_counts),
                 std::max(protect_window, score_window), per_head_counts);

  const std::string executor = dev == device::host   ? std::string("host executor")
                               : dev == device::cuda ? str("cuda executor on {}", gpu.name)
                                                     : str("host and cuda executors (cuda on {})", gpu.name);
  say("kvpolicy {}.{}.{} demo: preset {}, {}{}, {}, layout {}\n", KVPOLICY_VERSION_MAJOR, KVPOLICY_VERSION_MINOR,
      KVPOLICY_VERSION_PATCH, o.preset, executor, dev_note, kvp::name_of(o.type), o.layout);
  if (is_windowed) {
    say("cache: {} seqs, {} layers, h_kv {}, h_q {}, d {}, b {}; {} physical blocks, handed out shuffled\n", o.seqs,
        o.layers, o.kv_heads, o.q_heads, o.head_dim, b, c.shape.num_blocks);
    std::visit(
        [&](const auto& p) {
          if constexpr (windowed<std::remove_cvref_t<decltype(p)>>) {
            const i32 n = o.window - o.buffer;
            say("window |W| {} tokens ({} blocks), buffer |U| {}: budget {} of the {} compressible tokens per "
                "(layer, KV head), {} of {} with the buffer; Token2Chunk gamma {}, alpha {}: {} anchors, at most {} "
                "chunks\n",
                o.window, o.window / b, o.buffer, budget, n, budget + o.buffer, o.window, p.select.gamma,
                p.select.alpha, p.select.anchors(n, budget), p.select.max_chunks());
          }
        },
        preset);
    if (!o.kara_sizes_given)
      say("  (the demo's sizes, small for the host executor; KvLLM's: --window 768 --buffer 32 --keep 225 "
          "--block-size 256)\n");
  } else {
    say("cache: {} seqs, {} layers, h_kv {}, h_q {}, d {}, b {}, N_max {}: budget {} tokens per (layer, KV head);"
        " {} physical blocks, handed out shuffled\n",
        o.seqs, o.layers, o.kv_heads, o.q_heads, o.head_dim, b, o.n_max, budget, c.shape.num_blocks);
  }
  // Zipage eq. 2 for this shape: what 1 GiB holds, with the preset's query window and
  // F only where the preset keeps one (kvp::plan_memory, engine/memory_plan.hpp). It
  // counts N_max blocks a request; Kara caps no sequence, so it has no such plan.
  if (!is_windowed) {
    const auto [keeps_f, plan_window] = std::visit(
        [](const auto& p) {
          return std::pair<bool, i32>{kvp::uses_score_cache<decltype(p.aggregate)>(), kvp::scorer_window(p.scorer)};
        },
        preset);
    const kvp::memory_plan mp = kvp::plan_memory(
        {.available_bytes = std::int64_t{1} << 30, .num_layers = o.layers, .num_kv_heads = o.kv_heads,
         .num_q_heads = o.q_heads, .head_dim = o.head_dim, .block_size = b, .kv_type = o.type, .max_blocks = o.n_max,
         .query_window = plan_window, .query_type = o.type,
         .score_type = keeps_f ? std::optional<kvp::dtype>(kvp::dtype::f32) : std::nullopt});
    say("memory plan (Zipage eq. 2): 1 GiB holds M {} compressible requests (N_max blocks and a query slot each),"
        " N_total {} blocks; a block {} B of K/V + {} B of F, a query slot (w {}) {} B\n",
        mp.max_requests, mp.total_blocks, mp.kv_block_bytes, mp.score_block_bytes, plan_window, mp.query_slot_bytes);
  }

  if (is_windowed) {
    // The context first (only the sinks planted: no window reads it), then the window
    // and the tokens after it, the heavy hitters and repeats in the window's first
    // |W| - |U| tokens.
    for (i32 s = 0; s < o.seqs; ++s) {
      append_tokens(c, s, kara.context(s), 1, kara.context(s));
      append_tokens(c, s, o.window + kara.tail(s, 1), 1, o.buffer + kara.tail(s, 1));
    }
  } else {
    for (i32 s = 0; s < o.seqs; ++s) append_tokens(c, s, initial_blocks(o, s) * b, 1, protect_window);
  }

  say("columns: share of the planted tokens kept, over all layers and KV heads\n"
      "  heavy: heavy hitters of this round's topic; earlier heavy: of earlier topics, which the current\n"
      "         queries ignore (a preset that keeps scores in F remembers them)\n"
      "  copies: each repeated segment is written three times; a redundancy-aware preset drops the older\n"
      "         copies and keeps the newest\n");
  if (is_windowed)
    say("  kara: the sinks and what earlier rounds kept lie before the window, never read or written again;\n"
        "         the planted tokens of each round lie in its window's first |W| - |U| tokens\n");
  if (per_head_counts)
    say("  {}: each head counts only the tokens it still holds; one it dropped in an earlier round stays dropped\n",
        o.preset);
  if (dev == device::both)
    say("both executors compress identical copies of each round's cache; the statistics are the cuda executor's,\n"
        "and the demo goes on with its result\n");

  auto print_row = [](const auto&... cells) {
    say("  {:>3}  {:>10}  {:>7}  {:>8}  {:>5}  {:>5}  {:>13}  {:>12}  {:>11}\n", cells...);
  };
  std::vector<round_times> times;
  long bad_rows = 0, masks_differ = 0, kv_differ = 0, live_differ = 0, windows_differ = 0, drop_violations = 0;
  // Kara's sequences as an engine tracks them: trigger::periodic (Kara C.4) makes the
  // window items (window_begin, the budget within the window) at each compression
  // event. A round appends its tokens at once; the event's step moves on as if each
  // sequence had generated them one per decode step, to the next multiple of the period.
  const kvp::trigger::periodic periodic{
      .block_size = b, .window = o.window, .buffer = o.buffer, .window_keep = o.keep + o.buffer, .max_items = 0};
  std::vector<kvp::sequence_state> running;
  if (is_windowed)
    for (i32 s = 0; s < o.seqs; ++s) running.push_back({.seq = s, .query_slot = s, .length = c.lengths[s]});
  std::int64_t step = (o.window / periodic.period + 1) * periodic.period;  // the first event past the window
  std::vector<i32> appended(static_cast<std::size_t>(o.seqs), 0);
  // Whole-cache presets: the length each sequence's last compression left (its next
  // history_tokens; 0 before the first).
  std::vector<i32> compressed(static_cast<std::size_t>(o.seqs), 0);
  for (i32 round = 1; round <= o.rounds; ++round) {
    if (round > 1) {
      i32 most = 0;
      for (i32 s = 0; s < o.seqs; ++s) {
        if (is_windowed) {
          appended[s] = append_window(c, kara, s, round);
          running[s].append(appended[s]);
          most = std::max(most, appended[s]);
        } else {
          append_tokens(c, s, o.append, round, protect_window);
        }
      }
      step += (most + periodic.period - 1) / periodic.period * periodic.period;
    }

    std::vector<kvp::batch_item> items;
    if (is_windowed) {
      kvp::due_items(periodic, running, step, items);
      if (items.size() != static_cast<std::size_t>(o.seqs))
        throw std::logic_error(str("demo: {} of {} sequences due at step {}", items.size(), o.seqs, step));
    } else {
      // A per-head preset's sequence may hold fewer tokens than the budget in a later
      // round, and an item's budget is at most its length (calibrated_top_p reads it
      // only with union_top_k).
      for (i32 s = 0; s < o.seqs; ++s)
        items.push_back(
            {.seq = s, .query_slot = s, .budget = std::min(budget, c.lengths[s]), .history_tokens = compressed[s]});
    }
    const kvp::compression_batch batch{.items = items};

    std::vector<i32> len_before(c.lengths);
    std::vector<std::vector<std::byte>> before;
    for (i32 s = 0; s < o.seqs; ++s) before.push_back(snapshot(c, s));
    std::vector<std::vector<std::vector<i32>>> held_before;  // per item: the tokens each row holds
    if (per_head_counts)
      for (const kvp::batch_item& it : items) held_before.push_back(held_tokens(c, it.seq));

    const outcome oc = std::visit([&](const auto& p) { return compress_on(dev, p, c, batch); }, preset);
    const kvp::host_result& res = oc.res;
    times.push_back({oc.host_times, oc.gpu_times});

    if (is_windowed) {
      say("\nround {}: {}trigger::periodic's items at step {}, each window the last {} tokens in whole blocks before "
          "the last block{}\n",
          round, round == 1 ? "" : "a new topic; ", step, o.window,
          round == 1 ? "" : str(", all appended since round {}", round - 1));
      std::string line = "  windows [begin, end) and the tokens after:";
      for (std::size_t i = 0; i < items.size(); ++i) {
        const i32 seq = items[i].seq, wb = items[i].window_begin;
        if (i > 0 && i % 2 == 0) line += "\n   ";
        line += str(" seq {} [{}, {}) +{}{}", seq, wb, wb + o.window, len_before[seq] - wb - o.window,
                    round > 1 ? str(" ({} appended)", appended[seq]) : std::string());
        if (i + 1 < items.size()) line += ';';
      }
      say("{}\n", line);
    } else {
      say("\nround {}: {}\n", round,
          round == 1  ? std::string("first compression, history_tokens 0")
          : per_head_counts ? str("{} tokens appended on a new topic, live in every head; history_tokens: the length "
                            "each sequence's last compression left",
                            o.append)
                      : str("{} tokens appended on a new topic; history_tokens {}: F holds the scores of "
                            "positions [0, {})",
                            o.append, budget, budget));
    }
    print_row("seq", "tokens", "blocks", "released", "sinks", "heavy", "earlier heavy", "older copies", "newest copy");
    seq_report total;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const i32 seq = items[i].seq, T = len_before[seq], n = res.new_lengths[i];
      seq_report r;
      for (i32 l = 0; l < o.layers; ++l)
        for (i32 h = 0; h < o.kv_heads; ++h) {
          const auto& ids = c.ids[c.row(seq, l, h)];
          const std::uint8_t* keep = &res.keep_masks[i][(std::size_t(l) * o.kv_heads + h) * T];
          for (i32 t = 0; t < T; ++t) {
            if (ids[t] < 0) continue;  // dropped by this head in an earlier round: no token of it
            const token_info& ti = c.tokens[seq][ids[t]];
            const bool k = keep[t] != 0;
            switch (ti.kind) {
              case role::sink: r.sinks.add(k); break;
              case role::heavy: (ti.round == round ? r.heavy : r.earlier_heavy).add(k); break;
              case role::dup_old: r.dup_old.add(k); break;
              case role::dup_newest: r.dup_newest.add(k); break;
              default: break;
            }
          }
        }
      for (auto [to, from] : {std::pair{&total.sinks, &r.sinks}, std::pair{&total.heavy, &r.heavy},
                              std::pair{&total.earlier_heavy, &r.earlier_heavy},
                              std::pair{&total.dup_old, &r.dup_old}, std::pair{&total.dup_newest, &r.dup_newest}}) {
        to->present += from->present;
        to->kept += from->kept;
      }
      print_row(seq, str("{} -> {}", T, n), str("{} -> {}", (T + b - 1) / b, (n + b - 1) / b),
                res.released_blocks[i].size(), r.sinks.pct(), r.heavy.pct(), r.earlier_heavy.pct(), r.dup_old.pct(),
                r.dup_newest.pct());
      bad_rows += verify_moves(c, seq, T, before[i], res.keep_masks[i]);
    }
    print_row("all", "", "", "", total.sinks.pct(), total.heavy.pct(), total.earlier_heavy.pct(), total.dup_old.pct(),
              total.dup_newest.pct());
    if (oc.diff) {
      print_agreement(*oc.diff);
      masks_differ += oc.diff->mask_rows_differ + oc.diff->items_differ;
      kv_differ += oc.diff->kv_rows_differ;
      live_differ += oc.diff->live_rows_differ;
    }
    if (per_head_counts) {
      std::vector<i32> held(res.kept_counts[0].size());
      std::ranges::transform(held_before[0], held.begin(), [](const auto& row) { return i32(row.size()); });
      print_head_counts(o, len_before[items[0].seq], held, res.kept_counts[0], res.new_lengths[0]);
    }
    std::visit(
        [&](const auto& p) {
          if constexpr (kvp::PatternSelector<std::remove_cvref_t<decltype(p.select)>>) {
            const i32 wb = items[0].window_begin, T = len_before[items[0].seq];
            const auto window_tokens = static_cast<std::size_t>(T - wb);
            windows_differ += !print_window(p, c, items[0].seq, wb, budget,
                                            std::span(res.scores[0]).first(window_tokens),
                                            std::span(res.keep_masks[0]).subspan(static_cast<std::size_t>(wb),
                                                                                 window_tokens));
          }
        },
        preset);
    if (o.show_mask) print_mask(c, 0, std::span(res.keep_masks[0]).first(static_cast<std::size_t>(len_before[0])));
    apply_result(c, batch, res);
    if (per_head_counts) {
      long bad = 0;
      for (std::size_t i = 0; i < items.size(); ++i) bad += held_violations(c, items[i].seq, held_before[i]);
      say("dropped tokens stayed dropped: {}\n",
          bad == 0 ? std::string("yes (each head of each sequence holds a subset of what it held before the round)")
                   : str("NO, {} slots hold a token their head had dropped or disagree with the keep masks", bad));
      drop_violations += bad;
    }
    if (is_windowed) {
      kvp::record_compression(running, items, res.new_lengths, step);
    } else {
      for (std::size_t i = 0; i < items.size(); ++i) compressed[items[i].seq] = res.new_lengths[i];
    }
  }

  say("\nkept K/V rows moved intact: {}\n", bad_rows == 0 ? std::string("yes") : str("NO, {} rows differ", bad_rows));
  if (per_head_counts)
    say("dropped tokens stayed dropped, every round: {}\n",
        drop_violations == 0 ? std::string("yes") : str("NO, {} violations", drop_violations));
  if (dev == device::both)
    say("host and cuda agree: {}\n",
        masks_differ == 0 && kv_differ == 0 && live_differ == 0
            ? str("yes (keep masks, lengths, released blocks, kept K/V bytes{})", per_head_counts ? ", live bytes" : "")
            : str("{} mask rows or items differ (near-ties), {} K/V rows{} differ where the masks agree",
                  masks_differ, kv_differ, per_head_counts ? str(" and {} live-byte rows", live_differ) : std::string()));

  print_times(times, gpu.name);
  say("wall time {:.1f} ms\n", 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count());
  return bad_rows == 0 && kv_differ == 0 && live_differ == 0 && windows_differ == 0 && drop_violations == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const usage_error& e) {
    if (!*e.what()) {  // --help
      say("{}", usage);
      return 0;
    }
    say_err("error: {}\n(kvpolicy_demo --help lists the options)\n", e.what());
    return 2;
  } catch (const kvp::error& e) {
    say_err("error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    say_err("error: {}\n", e.what());
    return 1;
  }
}
