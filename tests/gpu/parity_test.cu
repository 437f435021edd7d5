// Host/device parity of the CUDA executor over random configurations: the keep
// masks agree (up to near-ties of fp32 scores, each one certified), scores agree to
// fp32 rounding, and every byte of K and V equals the host layout applied to the
// device's masks (so nothing outside the batch is written either).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "gpu_case.cuh"

namespace kvp_gpu {
namespace {

bool close(float a, float b) {
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= 1e-6f + 2e-3f * std::max(std::fabs(a), std::fabs(b));
}

// The same pipeline with layout `none`: scores, F and masks, nothing moved.
template <class S, class A, class R, class Sel, class L>
kvp::pipeline<S, A, R, Sel, kvp::none> without_layout(const kvp::pipeline<S, A, R, Sel, L>& p) {
  return {p.scorer, p.aggregate, p.redundancy, p.select, {}, p.protect};
}

// The CUDA executor's options a parity run sets (the rest as a user gets them).
struct executor_options {
  bool tensor_cores = true;
  std::int32_t overlap_groups = 0;  // 0: no overlap stream
  bool statistics_in_redundancy = true;
  std::int32_t full_pairs_rows = 0;
  bool split_rows = true;
};

struct parity_report {
  std::int64_t tokens = 0, mask_mismatches = 0;
  double max_score_error = 0;

  std::string summary() const {
    return fmt::format(fmt::runtime("{} tokens compared, {} near-tie mask differences, max |score error| {:.3g}"),
                       tokens, mask_mismatches, max_score_error);
  }
};

template <class P>
void check_parity(const P& preset, const case_config& cfg, const std::vector<kvp::batch_item>& items,
                  parity_report& rep, executor_options opt = {}) {
  gpu_case c(cfg);
  const std::int32_t H = cfg.kv_heads, L = cfg.layers;
  std::int32_t max_tokens = 0;
  for (auto T : cfg.lengths) max_tokens = std::max(max_tokens, T);
  const std::span<const kvp::batch_item> span(items);

  // Host, full pipeline: masks, final scores, new lengths, released blocks.
  host_side full(c);
  const kvp::host_executor hx{.record_keep_masks = true, .record_scores = true};
  const kvp::host_result want = hx.compress(preset, full.cache, full.queries, full.scores, {span});

  // Device.
  device_side dev(c);
  device_outputs out(items, max_tokens, L * H, c.max_blocks);
  kvp::cuda_executor cx;
  cx.tensor_cores = opt.tensor_cores;
  cx.statistics_in_redundancy = opt.statistics_in_redundancy;
  cx.full_pairs_rows = opt.full_pairs_rows;
  cx.split_rows = opt.split_rows;
  // Overlap: redundancy on a second stream, item groups pipelined over the two.
  cudaStream_t side = nullptr;
  cudaEvent_t fork_join[2] = {};
  if (opt.overlap_groups > 0) {
    REQUIRE_EQ(cudaSuccess, cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    for (auto& e : fork_join) REQUIRE_EQ(cudaSuccess, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cx.overlap_stream = side;
    cx.overlap_events = fork_join;
    cx.overlap_groups = opt.overlap_groups;
  }
  REQUIRE_EQ(cudaSuccess, out.run(cx, preset, dev));
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  if (side) {
    cudaStreamDestroy(side);
    for (auto e : fork_join) cudaEventDestroy(e);
  }
  const auto status = to_host(out.status);
  REQUIRE_MESSAGE(status[0] == 0, "device status ", status[0]);
  const auto keep = to_host(out.keep);
  const auto scores = to_host(out.final_scores);
  const auto new_lengths = to_host(out.new_lengths);
  const auto released_counts = to_host(out.released_counts);
  const auto released = to_host(out.released_blocks);

  // Expected bytes: host scores and F without moving, then the host layout applied
  // to the device's masks.
  host_side expect(c);
  hx.compress(without_layout(preset), expect.cache, expect.queries, expect.scores, {span});

  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::int32_t seq = items[i].seq, T = c.lengths[seq];
    CHECK(new_lengths[i] == want.new_lengths[i]);
    REQUIRE(released_counts[i] == static_cast<std::int32_t>(want.released_blocks[i].size()));
    for (std::int32_t k = 0; k < released_counts[i]; ++k)
      CHECK(released[i * c.max_blocks + k] == want.released_blocks[i][k]);
    for (std::int32_t row = 0; row < L * H; ++row) {
      const std::size_t dev_at = (i * L * H + row) * std::size_t(max_tokens), host_at = std::size_t(row) * T;
      // Boundary: the lowest final score the host kept.
      float boundary = __builtin_huge_valf();
      for (std::int32_t t = 0; t < T; ++t)
        if (want.keep_masks[i][host_at + t]) boundary = std::min(boundary, want.scores[i][host_at + t]);
      std::vector<std::uint8_t> dev_keep(T);
      for (std::int32_t t = 0; t < T; ++t) {
        const float h = want.scores[i][host_at + t], d = scores[dev_at + t];
        ++rep.tokens;
        if (!std::isinf(h)) rep.max_score_error = std::max<double>(rep.max_score_error, std::fabs(h - d));
        CHECK_MESSAGE(close(h, d), "score of token ", t, " row ", row, ": host ", h, " device ", d);
        dev_keep[t] = keep[dev_at + t];
        if (dev_keep[t] != want.keep_masks[i][host_at + t]) {
          ++rep.mask_mismatches;
          CHECK_MESSAGE(close(h, boundary), "mask differs at token ", t, " (score ", h, ") away from the boundary ",
                        boundary);
        }
      }
      const std::int32_t l = row / H, h = row % H;
      if constexpr (kvp::moves_tokens<typename P::layout_type>())
        kvp::host::compact_row(preset.layout, expect.cache, kvp::uses_score_cache<typename P::aggregate_type>()
                                                                ? expect.scores
                                                                : kvp::score_view{},
                               l, seq, h, dev_keep);
    }
  }
  const auto kv = to_host(dev.kv);
  REQUIRE(kv.size() == expect.kv.size());
  std::size_t first_diff = kv.size();
  for (std::size_t k = 0; k < kv.size() && first_diff == kv.size(); ++k)
    if (kv[k] != expect.kv[k]) first_diff = k;
  CHECK_MESSAGE(first_diff == kv.size(), "K/V byte ", first_diff, " of ", kv.size(), " differs");
  const auto f = to_host(dev.f);
  std::size_t f_bad = 0;
  for (std::size_t k = 0; k < f.size(); ++k) f_bad += !close(f[k], expect.f[k]);
  CHECK_MESSAGE(f_bad == 0, f_bad, " F entries differ");
}

// KVP_PARITY_SCALE (default 1) scales the case counts, e.g. 0.1 under compute-sanitizer.
int scaled(int cases) {
  const char* s = std::getenv("KVP_PARITY_SCALE");
  return s ? std::max(1, static_cast<int>(cases * std::atof(s))) : cases;
}

// The head dims of the random configurations: 64 and 128 run kernels built for them,
// 256 those that read the head dim at run time.
constexpr std::int32_t power_of_two_dims[] = {64, 128, 256};

template <class P>
void run_random(const char* name, P preset, int cases, std::uint32_t seed0, parity_report& rep,
                executor_options opt = {}, std::span<const std::int32_t> dims = power_of_two_dims) {
  std::mt19937 rng(seed0);
  cases = scaled(cases);
  const std::int32_t blocks[] = {16, 64, 256}, groups[] = {1, 4, 8};
  const kvp::dtype types[] = {kvp::dtype::f32, kvp::dtype::bf16, kvp::dtype::f16};
  const layout_kind layouts[] = {layout_kind::nano_vllm, layout_kind::vllm_flash, layout_kind::hnd};
  for (int k = 0; k < cases; ++k) {
    case_config cfg;
    cfg.block_size = blocks[rng() % 3];
    cfg.head_dim = dims[rng() % dims.size()];
    cfg.kv_heads = 1 + static_cast<std::int32_t>(rng() % 2);
    cfg.q_heads = cfg.kv_heads * groups[rng() % 3];
    cfg.type = types[rng() % 3];
    cfg.layout = layouts[rng() % 3];
    cfg.layers = 1 + static_cast<std::int32_t>(rng() % 2);
    // Keys past 128 dims on the FMA kernels (fp32, or tensor cores off), or with groups
    // of 8, can need more shared memory than the kernels have (an error the executor
    // reports): those cases take d 128.
    if (cfg.head_dim > 128 && (!opt.tensor_cores || cfg.type == kvp::dtype::f32 || cfg.q_heads / cfg.kv_heads > 4))
      cfg.head_dim = 128;
    cfg.window = 32;
    cfg.seed = rng();
    const std::int32_t b = cfg.block_size;
    const std::int32_t n_max = b == 16 ? 4 + static_cast<std::int32_t>(rng() % 6)
                               : b == 64 ? 2 + static_cast<std::int32_t>(rng() % 4)
                                         : 2 + static_cast<std::int32_t>(rng() % 2);
    const std::int32_t seqs = 1 + static_cast<std::int32_t>(rng() % 3);
    cfg.lengths.clear();
    std::vector<kvp::batch_item> items;
    for (std::int32_t s = 0; s < seqs + 1; ++s) {
      // Ragged: a full last block (Zipage's trigger) or a partial one.
      const std::int32_t T = n_max * b - (rng() % 2 ? 0 : static_cast<std::int32_t>(rng() % (b / 2)));
      cfg.lengths.push_back(T);
      if (s == seqs) break;  // the last sequence stays out of the batch
      const std::int32_t budget = std::max<std::int32_t>(std::min(T, (n_max - 1) * b), std::min(T, 48));
      const std::int32_t history = rng() % 2 ? 0 : budget;
      items.push_back({s, s, budget, history});
    }
    std::shuffle(items.begin(), items.end(), rng);
    INFO(std::string(name), " case ", k, ": b ", b, " d ", cfg.head_dim, " h_kv ", cfg.kv_heads, " h_q ", cfg.q_heads, " ",
         kvp::name_of(cfg.type), " layout ", static_cast<int>(cfg.layout), " lengths ", cfg.lengths[0]);
    check_parity(preset, cfg, items, rep, opt);
  }
}

// Splits of launches of few rows (cuda_executor::split_rows): the largest power of two
// whose blocks still fit the slots (264 compaction and 528 score blocks on an H100), so
// a split never adds a wave; compaction slices of at least 64 bytes on 16-byte bounds,
// score blocks of at least four 64-key tiles.
static_assert(kvp::cuda::compact_slices(64, 256, 264) == 4);   // one sequence, d 128
static_assert(kvp::cuda::compact_slices(256, 256, 264) == 1);  // four: 256 of 264 filled
static_assert(kvp::cuda::compact_slices(64, 128, 264) == 2);   // d 64: two 64-byte slices
static_assert(kvp::cuda::compact_slices(8, 96, 264) == 1);     // 48-byte halves
static_assert(kvp::cuda::score_key_splits(64, 2304, 528) == 8);
static_assert(kvp::cuda::score_key_splits(256, 2304, 528) == 2);
static_assert(kvp::cuda::score_key_splits(1024, 2304, 528) == 1);  // configuration A
static_assert(kvp::cuda::score_key_splits(4, 300, 528) == 1);      // 5 tiles

TEST_CASE("parity: every preset of the token-wise family on random configurations") {
  parity_report rep;
  run_random("zipage", kvp::presets::zipage{}, 60, 1, rep);
  run_random("rkv", kvp::presets::rkv{}, 30, 2, rep);
  run_random("gkv", kvp::presets::gkv{}, 30, 3, rep);
  run_random("snapkv", kvp::presets::snapkv{}, 40, 4, rep);
  run_random("h2o", kvp::presets::h2o{}, 40, 5, rep);
  run_random("streaming_llm", kvp::presets::streaming_llm{}, 40, 6, rep);
  // Per-head counts from calibrated top-p (temperatures solved in each call).
  run_random("hard_kv", kvp::presets::hard_kv{}, 40, 27, rep);
  run_random("hard_kv_rkv", kvp::presets::hard_kv_rkv{}, 20, 28, rep);
  auto variants = kvp::presets::zipage{};
  variants.scorer.group = kvp::group_reduce::max_logits;
  variants.redundancy.form = kvp::redundancy::combine_form::subtract;
  variants.aggregate.second.mode = kvp::aggregate::pool_mode::avg;
  run_random("zipage/max_logits/subtract/avg", variants, 30, 7, rep);
  auto mean_sum = kvp::presets::gkv{};
  mean_sum.scorer.group = kvp::group_reduce::sum;
  mean_sum.aggregate.mode = kvp::aggregate::global_mode::mean;
  mean_sum.protect.sinks = 4;
  run_random("gkv/sum/mean/sinks", mean_sum, 20, 8, rep);
  // theta < 0: the redundancy kernels fold diagonal tiles column by column (weight 0
  // would name the diagonal as a neighbour there).
  auto below_zero = kvp::presets::zipage{};
  below_zero.redundancy.theta = -0.25f;
  run_random("zipage/theta<0", below_zero, 15, 14, rep);
  auto gkv_below_zero = kvp::presets::gkv{};
  gkv_below_zero.redundancy.theta = -0.25f;
  run_random("gkv/theta<0", gkv_below_zero, 10, 15, rep);
  // Both tile sizes of full redundancy's tensor-core kernel: by default these small
  // batches take 128 keys (too few blocks of 256 to fill the GPU).
  run_random("gkv/full_pairs_rows=256", kvp::presets::gkv{}, 20, 18, rep, {.full_pairs_rows = 256});
  run_random("rkv/full_pairs_rows=256", kvp::presets::rkv{}, 10, 19, rep, {.full_pairs_rows = 256});
  run_random("gkv/full_pairs_rows=128", kvp::presets::gkv{}, 10, 20, rep, {.full_pairs_rows = 128});
  // The score kernel's own statistics pass, where lightning would compute them.
  run_random("zipage/statistics_in_score", kvp::presets::zipage{}, 30, 16, rep, {.statistics_in_redundancy = false});
  // Lightning's statistics over candidates that stop before the window (R-KV's scorer).
  auto before_window = kvp::presets::zipage{};
  before_window.scorer.keys_before_window = true;
  run_random("zipage/keys_before_window", before_window, 20, 17, rep);
  // These launches have few rows, so by default the score kernel and the compaction
  // split them over several blocks; one block per row is what large batches take.
  run_random("zipage/one_block_per_row", kvp::presets::zipage{}, 30, 25, rep, {.split_rows = false});
  run_random("snapkv/one_block_per_row", kvp::presets::snapkv{}, 15, 26, rep, {.split_rows = false});
  run_random("zipage/fma", kvp::presets::zipage{}, 20, 9, rep, {.tensor_cores = false});
  run_random("snapkv/fma", kvp::presets::snapkv{}, 20, 10, rep, {.tensor_cores = false});
  run_random("zipage/overlap", kvp::presets::zipage{}, 30, 11, rep, {.overlap_groups = 3});
  run_random("zipage/overlap1", kvp::presets::zipage{}, 15, 13, rep, {.overlap_groups = 1});
  run_random("rkv/overlap", kvp::presets::rkv{}, 15, 12, rep, {.overlap_groups = 2});
  MESSAGE(rep.summary());
}

// Head dims that are multiples of 16 (so the tensor-core kernels take them) but not
// powers of two: rows of 6, 10, 12, 14, 20 or 24 chunks of 16 bytes, which the copies
// into shared memory share among 2, 4 or 8 lanes each, on kernels built for a
// run-time head dim (wgmma on sm_90a, one unrolled MMA sequence per step count).
TEST_CASE("parity: head dims that are multiples of 16 but not powers of two") {
  parity_report rep;
  constexpr std::int32_t dims[] = {48, 80, 96, 112, 160, 192};
  run_random("zipage/d", kvp::presets::zipage{}, 24, 21, rep, {}, dims);
  run_random("gkv/d", kvp::presets::gkv{}, 12, 22, rep, {}, dims);
  run_random("gkv/full_pairs_rows=256/d", kvp::presets::gkv{}, 12, 23, rep, {.full_pairs_rows = 256}, dims);
  run_random("snapkv/d", kvp::presets::snapkv{}, 12, 24, rep, {}, dims);
  MESSAGE(rep.summary());
}

// Lightning computes the score's softmax statistics for run-time head dims up to 128
// too (its query fragments sized for 128, d / 16 k-steps used), and up to 256 where
// fewer than three of its blocks fit per SM (at blocks of 256 on the H100,
// lightning_mma_pair_kernel at d 144 to 208, lightning_mma_wide_kernel at d 224 to
// 256): cases that take that path by construction (16-bit keys, blocks of 256, so
// that 2 round32(w G) <= b), each checked to take it. Groups of 8 past d 128 would
// ask the score kernel for more shared memory than it has.
TEST_CASE("parity: lightning's softmax statistics at run-time head dims") {
  parity_report rep;
  case_config cfg{.layers = 2, .block_size = 256, .kv_heads = 2, .lengths = {3 * 256, 2 * 256 + 100, 300}};
  const std::vector<kvp::batch_item> items{{0, 0, 2 * 256, 0}, {1, 1, 256 + 50, 256 + 50}, {2, 2, 200, 0}};
  const kvp::presets::zipage zipage{};
  for (const std::int32_t d : {16, 48, 80, 96, 112, 144, 192, 208, 224, 240, 256})
    for (const std::int32_t G : {1, 4, 8})
      for (const kvp::dtype type : {kvp::dtype::bf16, kvp::dtype::f16}) {
        if (d > 128 && G > 4) continue;
        cfg.head_dim = d;
        cfg.q_heads = cfg.kv_heads * G;
        cfg.type = type;
        cfg.seed = static_cast<std::uint32_t>(d * 16 + G);
        INFO("d ", d, " G ", G, " ", kvp::name_of(type));
        const gpu_case c(cfg);
        const host_side h(c);
        REQUIRE(kvp::cuda_executor{}.redundancy_computes_statistics(zipage, h.cache, h.queries));
        check_parity(zipage, cfg, items, rep);
      }
  MESSAGE(rep.summary());
}

// Rows of 2^n bytes split the compaction's 16-byte slots by shifts; others (192 and
// 96 bytes here) by division, which the random configurations of every preset never
// reach (those of the head-dim test above do, for zipage, gkv and snapkv).
TEST_CASE("parity: rows whose size is not a power of two") {
  parity_report rep;
  case_config cfg{.layers = 2, .block_size = 64, .kv_heads = 2, .q_heads = 8, .lengths = {4 * 64, 3 * 64 + 17, 200}};
  const std::vector<kvp::batch_item> items{{0, 0, 3 * 64, 0}, {1, 1, 2 * 64, 2 * 64}};
  for (const auto& [d, type] : {std::pair{96, kvp::dtype::bf16}, std::pair{24, kvp::dtype::f32}}) {
    cfg.head_dim = d;
    cfg.type = type;
    INFO("d ", d, " ", kvp::name_of(type));
    check_parity(kvp::presets::zipage{}, cfg, items, rep);
    check_parity(kvp::presets::h2o{}, cfg, items, rep);
  }
  MESSAGE(rep.summary());
}

TEST_CASE("parity: rows too long for shared memory take the global-memory epilogue") {
  parity_report rep;
  case_config cfg;
  cfg.layers = 1;
  cfg.block_size = 256;
  cfg.kv_heads = 1;
  cfg.q_heads = 2;
  cfg.head_dim = 64;
  cfg.type = kvp::dtype::bf16;
  cfg.lengths = {128 * 256, 200};  // 32768 tokens: two floats per token exceed 227 KB
  const std::vector<kvp::batch_item> items{{0, 0, 127 * 256, 0}, {1, 1, 64, 0}};
  check_parity(kvp::presets::zipage{}, cfg, items, rep);
  cfg.seed = 2;
  const std::vector<kvp::batch_item> again{{0, 0, 120 * 256, 127 * 256}};
  check_parity(kvp::presets::zipage{}, cfg, again, rep);
  // Calibrated top-p keeps a third array per row (the scores before protect): rows of
  // 20480 tokens hold two in shared memory but not three, so hard_kv's epilogue takes
  // the global-memory path where zipage's does not.
  cfg.lengths = {80 * 256, 200};
  cfg.seed = 3;
  const std::vector<kvp::batch_item> calibrated{{0, 0, 79 * 256, 0}, {1, 1, 64, 0}};
  check_parity(kvp::presets::hard_kv{}, cfg, calibrated, rep);
  MESSAGE(rep.summary());
}

}  // namespace
}  // namespace kvp_gpu
