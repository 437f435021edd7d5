// The CUDA executor inside a CUDA graph, and malformed device data: caught on the
// device, reported as the host's kvp::error, with nothing written.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "gpu_case.cuh"

namespace kvp_gpu {
namespace {

case_config zipage_case() {
  case_config cfg;
  cfg.layers = 2;
  cfg.block_size = 64;
  cfg.kv_heads = 2;
  cfg.q_heads = 8;
  cfg.head_dim = 128;
  cfg.type = kvp::dtype::bf16;
  cfg.lengths = {256, 256, 192};
  return cfg;
}

// Captures a compression (on one stream, or overlapped over two in `groups` item
// groups) in a CUDA graph, replays it, and compares with a direct run.
void capture_and_replay(std::int32_t groups = 0) {
  const gpu_case c(zipage_case());
  const std::vector<kvp::batch_item> items{{0, 0, 192, 0}, {1, 1, 192, 0}};
  const kvp::presets::zipage p;

  // Reference: a direct run on one copy.
  device_side direct(c);
  device_outputs direct_out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  REQUIRE_EQ(cudaSuccess, direct_out.run(kvp::cuda_executor{}, p, direct));

  // Graph: size and allocate outside the capture, capture the call, replay.
  device_side graphed(c);
  device_outputs out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  std::int32_t* pinned = nullptr;
  REQUIRE_EQ(cudaSuccess, cudaMallocHost(&pinned, sizeof(std::int32_t) * (kvp::status_words + items.size())));
  cudaStream_t stream, side;
  cudaEvent_t fork_join[2];
  REQUIRE_EQ(cudaSuccess, cudaStreamCreate(&stream));
  REQUIRE_EQ(cudaSuccess, cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  for (auto& e : fork_join) REQUIRE_EQ(cudaSuccess, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  kvp::cuda_executor ex{.stream = stream, .mirror = {.status = pinned, .new_lengths = pinned + kvp::status_words}};
  if (groups > 0) {
    ex.overlap_stream = side;
    ex.overlap_events = fork_join;
    ex.overlap_groups = groups;
  }
  std::size_t bytes = 0;
  REQUIRE_EQ(cudaSuccess, ex.compress(nullptr, bytes, p, graphed.cache, graphed.queries, graphed.scores, out.batch, out.result));
  out.temp.resize(bytes);
  thrust::fill(out.temp.begin(), out.temp.end(), std::byte{0xff});  // garbage, as a reused buffer holds
  void* temp = thrust::raw_pointer_cast(out.temp.data());
  cudaGraph_t graph;
  REQUIRE_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE_EQ(cudaSuccess, ex.compress(temp, bytes, p, graphed.cache, graphed.queries, graphed.scores, out.batch, out.result));
  REQUIRE_EQ(cudaSuccess, cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  REQUIRE_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
  REQUIRE_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
  REQUIRE_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  CHECK(pinned[0] == 0);
  CHECK(pinned[kvp::status_words] == 192);
  CHECK(pinned[kvp::status_words + 1] == 192);
  CHECK(to_host(graphed.kv) == to_host(direct.kv));
  CHECK(to_host(graphed.f) == to_host(direct.f));
  CHECK(to_host(out.keep) == to_host(direct_out.keep));

  // A second replay compresses the already compressed cache again: lengths are the
  // engine's to update, so the graph sees the same lengths and must still run clean.
  REQUIRE_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
  REQUIRE_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  CHECK(pinned[0] == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto e : fork_join) cudaEventDestroy(e);
  cudaStreamDestroy(side);
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
}

TEST_CASE("a whole compression is captured in a CUDA graph and replays to the same bytes") {
  capture_and_replay();
}

TEST_CASE("an overlapped compression (item groups on two streams) is captured in a CUDA graph and replays") {
  capture_and_replay(2);
}

TEST_CASE("a compression with its redundancy stage on a second stream is captured in a CUDA graph and replays") {
  capture_and_replay(1);
}

template <class Mutate>
void expect_device_error(Mutate mutate, const char* field) {
  gpu_case c(zipage_case());
  std::vector<kvp::batch_item> items{{0, 0, 192, 0}, {1, 1, 192, 0}};
  mutate(c, items);
  device_side dev(c);
  const auto kv_before = to_host(dev.kv);
  const auto f_before = to_host(dev.f);
  device_outputs out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, kvp::presets::zipage{}, dev));
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  const auto status = to_host(out.status);
  REQUIRE(status[0] != 0);
  try {
    kvp::check(status.data());
    FAIL("check() did not throw");
  } catch (const kvp::error& e) {
    CHECK(e.field().find(field) != std::string::npos);
    MESSAGE(std::string(e.what()));
  }
  CHECK(to_host(dev.kv) == kv_before);
  CHECK(to_host(dev.f) == f_before);
}

TEST_CASE("malformed device data is reported with the field and nothing is written") {
  expect_device_error([](gpu_case& c, auto&) { c.table[1] = c.num_blocks + 7; }, "cache.table");
  expect_device_error([](gpu_case& c, auto&) { c.table[c.max_blocks + 1] = c.table[0]; }, "cache.table");
  expect_device_error([](gpu_case& c, auto&) { c.table[2] = c.table[0]; }, "cache.table");
  expect_device_error([](gpu_case&, auto& items) { items[1].budget = 300; }, "batch[1].budget");
  expect_device_error([](gpu_case&, auto& items) { items[0].budget = 8; }, "batch[0].budget");
  expect_device_error([](gpu_case&, auto& items) { items[1].seq = 0; }, "batch[1].seq");
  expect_device_error([](gpu_case&, auto& items) { items[0].query_slot = 9; }, "batch[0].query_slot");
  expect_device_error([](gpu_case&, auto& items) { items[0].history_tokens = 999; }, "batch[0].history_tokens");
  expect_device_error([](gpu_case& c, auto&) { c.lengths[0] = 999; }, "cache.lengths[0]");
  // Sequence 2 is outside the batch: its length is checked where its blocks are read,
  // and a block it shares with a batch sequence stops the compression.
  expect_device_error([](gpu_case& c, auto&) { c.lengths[2] = 999; }, "cache.lengths[2]");
  expect_device_error([](gpu_case& c, auto&) { c.table[2 * c.max_blocks + 1] = c.num_blocks + 3; }, "cache.table[seq 2][1]");
  expect_device_error([](gpu_case& c, auto&) { c.table[2 * c.max_blocks] = c.table[0]; }, "cache.table[seq 0][0]");
  expect_device_error([](gpu_case& c, auto&) { c.table[2 * c.max_blocks + 2] = c.table[c.max_blocks + 3]; },
                      "cache.table[seq 1][3]");
}

// The engine's marker of shared blocks (refcounts or a bitmask, in device memory): a
// batch sequence holding a marked block is refused with nothing written; a marked
// block no batch sequence holds changes nothing.
TEST_CASE("blocks the engine marks as shared are never written on the device") {
  const gpu_case c(zipage_case());
  const std::vector<kvp::batch_item> items{{0, 0, 192, 0}, {1, 1, 192, 0}};
  const auto run_marked = [&](std::int32_t marked_block, bool bitmask) {
    device_side dev(c);
    std::vector<std::int32_t> refcounts(static_cast<std::size_t>(c.num_blocks), 1);
    std::vector<std::uint32_t> bits(static_cast<std::size_t>(c.num_blocks + 31) / 32, 0u);
    refcounts[static_cast<std::size_t>(marked_block)] = 2;
    bits[static_cast<std::size_t>(marked_block / 32)] |= 1u << (marked_block % 32);
    const thrust::device_vector<std::int32_t> d_refcounts = to_device(refcounts);
    const thrust::device_vector<std::uint32_t> d_bits = to_device(bits);
    if (bitmask)
      dev.cache.sharing.bitmask = thrust::raw_pointer_cast(d_bits.data());
    else
      dev.cache.sharing.refcounts = thrust::raw_pointer_cast(d_refcounts.data());
    const auto kv_before = to_host(dev.kv);
    device_outputs out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
    REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, kvp::presets::zipage{}, dev));
    REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
    const auto status = to_host(out.status);
    return std::pair{status, to_host(dev.kv) == kv_before};
  };
  for (const bool bitmask : {false, true}) {
    CAPTURE(bitmask);
    const auto [status, unchanged] = run_marked(c.table[c.max_blocks + 1], bitmask);  // seq 1, block 1
    REQUIRE(status[0] != 0);
    CHECK(unchanged);
    try {
      kvp::check(status.data());
      FAIL("check() did not throw");
    } catch (const kvp::error& e) {
      CHECK(e.field() == "cache.table[seq 1][1]");
      CHECK(std::string(e.what()).find("cache.sharing") != std::string::npos);
    }
    // A block of sequence 2, which is not compressed: no error.
    CHECK(run_marked(c.table[2 * c.max_blocks], bitmask).first[0] == 0);
  }
}

TEST_CASE("malformed shapes throw before any launch") {
  const gpu_case c(zipage_case());
  device_side dev(c);
  const std::vector<kvp::batch_item> items{{0, 0, 192, 0}};
  device_outputs out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  kvp::presets::zipage p;
  p.aggregate.second.kernel = 4;
  std::size_t bytes = 0;
  CHECK_THROWS_AS(kvp::cuda_executor{}.compress(nullptr, bytes, p, dev.cache, dev.queries, dev.scores, out.batch, out.result),
                  kvp::error);
  auto bad = dev.cache;
  bad.k_stride.dim = 2;
  CHECK_THROWS_AS(kvp::cuda_executor{}.compress(nullptr, bytes, kvp::presets::zipage{}, bad, dev.queries, dev.scores,
                                                out.batch, out.result),
                  kvp::error);
  // The executor's options: the overlap's events, group count and second stream, and
  // full redundancy's tile of keys (128 or 256, or 0: chosen per device), each named.
  const auto option_error = [&](const kvp::cuda_executor& ex, const char* field) {
    try {
      (void)ex.compress(nullptr, bytes, kvp::presets::zipage{}, dev.cache, dev.queries, dev.scores, out.batch, out.result);
      FAIL("compress() did not throw for ", field);
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
      MESSAGE(std::string(e.what()));
    }
  };
  cudaStream_t side;
  cudaEvent_t fork_join[2] = {};
  REQUIRE_EQ(cudaSuccess, cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  option_error({.overlap_stream = side}, "overlap_events");
  option_error({.overlap_stream = side, .overlap_events = fork_join, .overlap_groups = 0}, "overlap_groups");
  option_error({.stream = side, .overlap_stream = side, .overlap_events = fork_join}, "overlap_stream");
  cudaStreamDestroy(side);
  option_error({.full_pairs_rows = 100}, "full_pairs_rows");
  // Full redundancy launches a block per (row, 64-key tile) in one grid dimension:
  // a batch that would need more blocks than it holds is refused, naming the count.
  auto huge = out.batch;
  huge.num_items = 1 << 28;
  try {
    (void)kvp::cuda_executor{}.compress(nullptr, bytes, kvp::presets::gkv{}, dev.cache, dev.queries, dev.scores, huge,
                                        out.result);
    FAIL("compress() did not throw for a grid of too many blocks");
  } catch (const kvp::error& e) {
    CHECK(e.field() == "batch.num_items");
    MESSAGE(std::string(e.what()));
  }
  auto no_f = dev.scores;
  no_f.base = nullptr;
  CHECK_THROWS_AS(kvp::cuda_executor{}.compress(nullptr, bytes, kvp::presets::zipage{}, dev.cache, dev.queries, no_f,
                                                out.batch, out.result),
                  kvp::error);
}

}  // namespace
}  // namespace kvp_gpu

namespace kvp_gpu {
namespace {

// Hand case on the device: all-zero keys and queries give every candidate the same
// score under every stage of zipage (uniform attention, zero similarity), so the
// tie rule alone decides: each (layer, head) keeps exactly the most recent tokens.
TEST_CASE("ties go to the most recent token on the device") {
  case_config cfg = zipage_case();
  cfg.lengths = {256, 200};
  gpu_case c(cfg);
  std::fill(c.kv.begin(), c.kv.end(), std::byte{0});
  std::fill(c.q.begin(), c.q.end(), std::byte{0});
  std::fill(c.f.begin(), c.f.end(), 0.0f);
  const std::vector<kvp::batch_item> items{{0, 0, 100, 0}, {1, 1, 64, 0}};
  device_side dev(c);
  device_outputs out(items, 256, cfg.layers * cfg.kv_heads, c.max_blocks);
  REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, kvp::presets::zipage{}, dev));
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  REQUIRE(to_host(out.status)[0] == 0);
  const auto keep = to_host(out.keep);
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::int32_t T = c.lengths[items[i].seq], k = items[i].budget;
    for (std::int32_t row = 0; row < cfg.layers * cfg.kv_heads; ++row)
      for (std::int32_t t = 0; t < T; ++t)
        CHECK_MESSAGE(keep[(i * cfg.layers * cfg.kv_heads + row) * 256 + t] == (t >= T - k ? 1 : 0), "item ", i,
                      " row ", row, " token ", t);
  }
  CHECK(to_host(out.new_lengths) == std::vector<std::int32_t>{100, 64});
}

}  // namespace
}  // namespace kvp_gpu

namespace kvp_gpu {
namespace {

// Shared prefixes on the device (device_batch::targets): seq 1's first block is seq
// 0's. Compressed into a free target it runs clean and leaves the shared block as it
// was; a target another sequence holds, and a prefix block that another item of the
// batch writes, are refused with nothing written.
TEST_CASE("shared prefixes compress into targets on the device; bad targets are refused") {
  gpu_case c(zipage_case());
  c.table[c.max_blocks] = c.table[0];  // seq 1's block 0 is seq 0's
  std::vector<std::int32_t> free;
  for (std::int32_t id = 0; id < c.num_blocks; ++id)
    if (std::find(c.table.begin(), c.table.end(), id) == c.table.end()) free.push_back(id);
  REQUIRE(free.size() >= 2);
  const std::int32_t shared_block = c.table[0];
  const auto attempt = [&](const std::vector<kvp::batch_item>& items, const std::vector<std::int32_t>& indptr,
                           const std::vector<std::int32_t>& targets, std::int32_t marked = -1) {
    device_side dev(c);
    // The engine's marks: every block held once, `marked` (if any) by another request too.
    std::vector<std::int32_t> refcounts(static_cast<std::size_t>(c.num_blocks), 1);
    if (marked >= 0) refcounts[static_cast<std::size_t>(marked)] = 2;
    const thrust::device_vector<std::int32_t> d_refcounts = to_device(refcounts);
    if (marked >= 0) dev.cache.sharing.refcounts = thrust::raw_pointer_cast(d_refcounts.data());
    const auto kv_before = to_host(dev.kv);
    device_outputs out(items, 256, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
    const thrust::device_vector<std::int32_t> d_indptr = to_device(indptr), d_targets = to_device(targets);
    out.batch.targets = {thrust::raw_pointer_cast(d_indptr.data()), thrust::raw_pointer_cast(d_targets.data())};
    REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, kvp::presets::zipage{}, dev));
    REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
    const auto kv = to_host(dev.kv);
    return std::tuple{to_host(out.status), kv == kv_before, kv, kv_before};
  };
  SUBCASE("a free target: compressed, the shared block untouched") {
    const auto [status, unchanged, kv, kv_before] = attempt({{1, 1, 192, 0}}, {0, 1}, {free[0]});
    CHECK(status[0] == 0);
    CHECK_FALSE(unchanged);
    // Every byte of the shared block, in every layer, K and V: offsets from a host view.
    host_side at(c);
    const auto offset = [&](const std::byte* row) { return static_cast<std::size_t>(row - at.kv.data()); };
    const auto row_bytes = static_cast<std::size_t>(at.cache.row_bytes());
    for (std::int32_t l = 0; l < c.cfg.layers; ++l)
      for (std::int32_t slot = 0; slot < c.cfg.block_size; ++slot)
        for (std::int32_t h = 0; h < c.cfg.kv_heads; ++h)
          for (const std::byte* row : {at.cache.k_row_at(l, shared_block, slot, h), at.cache.v_row_at(l, shared_block, slot, h)})
            CHECK(std::memcmp(kv.data() + offset(row), kv_before.data() + offset(row), row_bytes) == 0);
  }
  const auto refused = [&](const std::vector<kvp::batch_item>& items, const std::vector<std::int32_t>& indptr,
                           const std::vector<std::int32_t>& targets, const char* field, std::int32_t marked = -1) {
    const auto [status, unchanged, kv, kv_before] = attempt(items, indptr, targets, marked);
    REQUIRE(status[0] != 0);
    CHECK(unchanged);
    try {
      kvp::check(status.data());
      FAIL("check() did not throw");
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
      MESSAGE(std::string(e.what()));
    }
  };
  SUBCASE("a target seq 2 holds") { refused({{1, 1, 192, 0}}, {0, 1}, {c.table[2 * c.max_blocks + 1]}, "batch.targets (item 0)"); }
  SUBCASE("a target the engine marks as shared") {  // found by the fuzz harness: the device wrote it
    refused({{1, 1, 192, 0}}, {0, 1}, {free[0]}, "batch.targets.blocks[0]", free[0]);
  }
  SUBCASE("no target for the shared block") { refused({{1, 1, 192, 0}}, {0, 0}, {-1}, "cache.table[seq 1][0]"); }
  SUBCASE("the prefix's owner in the batch, writing it") {
    refused({{0, 0, 192, 0}, {1, 1, 192, 0}}, {0, 0, 1}, {free[0]}, "cache.table[seq 0][0]");
  }
}

}  // namespace
}  // namespace kvp_gpu

namespace kvp_gpu {
namespace {

// Kara (presets::kara: bidirectional window scores, Token2Chunk, window-only
// compaction) on the device. Three sequences, each with a window of 96 tokens at its
// own window_begin and its own tail after it; bf16, head_dim 64 and GQA 4, so the
// scores take the tensor-core kernel. The data (gpu_case's seed 1) was checked on the
// host: every keep mask of both sets of windows below stays the same when each score
// is moved by up to 3e-5 of itself, so the device's rounding cannot flip a mask.
case_config kara_case() {
  case_config cfg;
  cfg.layers = 2;
  cfg.block_size = 16;
  cfg.kv_heads = 2;
  cfg.q_heads = 8;  // GQA 4
  cfg.head_dim = 64;
  cfg.type = kvp::dtype::bf16;
  cfg.window = 96;  // each slot holds the window's 96 queries
  cfg.lengths = {3 * 16 + 96 + 5, 96 + 16, 2 * 16 + 96 + 1};
  return cfg;
}
constexpr std::int32_t kara_max_tokens = 3 * 16 + 96 + 5;  // the longest sequence: 149

kvp::presets::kara kara_pipeline() {
  kvp::presets::kara p;
  p.scorer = {.window = 96, .buffer = 8};  // W \ U: the window's first 88 tokens
  p.select = {.gamma = 5, .alpha = 6};
  return p;
}

// Windows at 48 (tail 5), 0 (tail 16) and 32 (tail 1).
std::vector<kvp::batch_item> kara_items() {
  return {{.seq = 0, .query_slot = 2, .budget = 30, .window_begin = 48},
          {.seq = 1, .query_slot = 0, .budget = 30, .window_begin = 0},
          {.seq = 2, .query_slot = 1, .budget = 40, .window_begin = 32}};
}

// Kara's new length, counted from the sequence's start: the tokens before the window,
// the budget of W \ U, then the buffer (8) and the tail.
std::int32_t kara_length(const gpu_case& c, const kvp::batch_item& it) {
  return it.window_begin + it.budget + (c.lengths[it.seq] - it.window_begin - 88);
}

// The optional results device_outputs leaves out: kept counts and new block tables.
struct kara_extras {
  thrust::device_vector<std::int32_t> kept, tables;
  kara_extras(device_outputs& out, std::size_t items, std::int32_t rows_per_item, std::int32_t max_blocks)
      : kept(items * rows_per_item, -1), tables(items * max_blocks, -1) {
    out.result.kept_counts = thrust::raw_pointer_cast(kept.data());
    out.result.new_tables = thrust::raw_pointer_cast(tables.data());
  }
};

// Everything a compression wrote, in host memory.
struct kara_outcome {
  std::vector<std::int32_t> status, new_lengths, released_counts, released_blocks, kept, tables;
  std::vector<std::uint8_t> keep;
  std::vector<float> scores, f;
  std::vector<std::byte> kv;
};

kara_outcome outcome_of(const device_outputs& out, const kara_extras& x, const device_side& dev) {
  return {to_host(out.status), to_host(out.new_lengths), to_host(out.released_counts), to_host(out.released_blocks),
          to_host(x.kept),     to_host(x.tables),        to_host(out.keep),            to_host(out.final_scores),
          to_host(dev.f),      to_host(dev.kv)};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Captured once, the graph compresses a fresh copy of the cache to the direct run's
// bytes and results; the items are read from device memory at each replay, so new
// windows written there before a replay are compressed as the host executor does.
TEST_CASE("kara is captured in a CUDA graph, replays to the direct run's bytes, and replays new windows") {
  const gpu_case c(kara_case());
  const kvp::presets::kara p = kara_pipeline();
  const std::vector<kvp::batch_item> items = kara_items();
  const std::int32_t rows = c.cfg.layers * c.cfg.kv_heads, max_blocks = c.max_blocks;
  REQUIRE(max_blocks == (kara_max_tokens + 15) / 16);  // the released-block and table pitch the executor uses

  // Reference: a direct run on one copy.
  device_side direct(c);
  device_outputs direct_out(items, kara_max_tokens, rows, max_blocks);
  const kara_extras direct_x(direct_out, items.size(), rows, max_blocks);
  REQUIRE_EQ(cudaSuccess, direct_out.run(kvp::cuda_executor{}, p, direct));
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  const kara_outcome want = outcome_of(direct_out, direct_x, direct);
  REQUIRE(want.status[0] == 0);
  for (std::size_t i = 0; i < items.size(); ++i) CHECK(want.new_lengths[i] == kara_length(c, items[i]));
  CHECK(want.kv != c.kv);

  // Graph: size and allocate outside the capture, capture the call, replay on a fresh copy.
  device_side graphed(c);
  device_outputs out(items, kara_max_tokens, rows, max_blocks);
  kara_extras x(out, items.size(), rows, max_blocks);
  std::int32_t* pinned = nullptr;
  const std::size_t mirrored = kvp::status_words + items.size();
  REQUIRE_EQ(cudaSuccess, cudaMallocHost(&pinned, sizeof(std::int32_t) * mirrored));
  cudaStream_t stream;
  REQUIRE_EQ(cudaSuccess, cudaStreamCreate(&stream));
  const kvp::cuda_executor ex{.stream = stream, .mirror = {.status = pinned, .new_lengths = pinned + kvp::status_words}};
  std::size_t bytes = 0;
  REQUIRE_EQ(cudaSuccess, ex.compress(nullptr, bytes, p, graphed.cache, graphed.queries, graphed.scores, out.batch, out.result));
  out.temp.resize(bytes);
  thrust::fill(out.temp.begin(), out.temp.end(), std::byte{0xff});  // garbage, as a reused buffer holds
  void* temp = thrust::raw_pointer_cast(out.temp.data());
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  cudaGraph_t graph;
  REQUIRE_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE_EQ(cudaSuccess, ex.compress(temp, bytes, p, graphed.cache, graphed.queries, graphed.scores, out.batch, out.result));
  REQUIRE_EQ(cudaSuccess, cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  REQUIRE_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
  std::fill(pinned, pinned + mirrored, -5);
  REQUIRE_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
  REQUIRE_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  CHECK(pinned[0] == 0);
  for (std::size_t i = 0; i < items.size(); ++i) CHECK(pinned[kvp::status_words + i] == want.new_lengths[i]);
  const kara_outcome got = outcome_of(out, x, graphed);
  CHECK(got.status == want.status);
  CHECK(got.new_lengths == want.new_lengths);
  CHECK(got.released_counts == want.released_counts);
  CHECK(got.released_blocks == want.released_blocks);
  CHECK(got.kept == want.kept);
  CHECK(got.tables == want.tables);
  CHECK(got.keep == want.keep);
  CHECK(same_bits(got.scores, want.scores));
  CHECK(got.kv == want.kv);
  CHECK(got.f == want.f);

  // New windows in the device items (the graph's pointer), the cache's original bytes
  // back in the same buffers, the results filled with what no executor writes; replay.
  std::vector<kvp::batch_item> moved = items;
  moved[0].window_begin = 32;  // 117 tokens from 32: tail 21
  moved[1].window_begin = 16;  // 96 from 16: no tail
  moved[2].window_begin = 0;   // 129 from 0: tail 33
  thrust::copy(moved.begin(), moved.end(), out.items.begin());
  thrust::copy(c.kv.begin(), c.kv.end(), graphed.kv.begin());
  thrust::copy(c.f.begin(), c.f.end(), graphed.f.begin());
  thrust::fill(out.status.begin(), out.status.end(), -5);
  for (auto* v : {&out.new_lengths, &out.released_counts, &out.released_blocks, &x.kept, &x.tables})
    thrust::fill(v->begin(), v->end(), -1);
  thrust::fill(out.keep.begin(), out.keep.end(), std::uint8_t{2});
  thrust::fill(out.final_scores.begin(), out.final_scores.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(pinned, pinned + mirrored, -5);
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  REQUIRE_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
  REQUIRE_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  const kara_outcome again = outcome_of(out, x, graphed);
  REQUIRE_MESSAGE(again.status[0] == 0, "device status ", again.status[0]);
  CHECK(pinned[0] == 0);

  // The host executor on another fresh copy, with the new windows.
  host_side host(c);
  const kvp::host_executor hx{.record_keep_masks = true, .record_scores = true};
  const kvp::host_result h = hx.compress(p, host.cache, host.queries, host.scores, {std::span<const kvp::batch_item>(moved)});
  for (std::size_t i = 0; i < moved.size(); ++i) {
    CAPTURE(i);
    const std::int32_t Tw = c.lengths[moved[i].seq] - moved[i].window_begin;  // masks and scores cover the window
    CHECK(again.new_lengths[i] == h.new_lengths[i]);
    CHECK(again.new_lengths[i] == kara_length(c, moved[i]));
    CHECK(pinned[kvp::status_words + i] == h.new_lengths[i]);
    REQUIRE(again.released_counts[i] == static_cast<std::int32_t>(h.released_blocks[i].size()));
    const auto from = [&](const std::vector<std::int32_t>& v, std::size_t at, std::size_t n) {
      return std::vector<std::int32_t>(v.begin() + static_cast<std::ptrdiff_t>(at),
                                       v.begin() + static_cast<std::ptrdiff_t>(at + n));
    };
    CHECK(from(again.released_blocks, i * max_blocks, h.released_blocks[i].size()) == h.released_blocks[i]);
    CHECK(from(again.kept, i * rows, static_cast<std::size_t>(rows)) == h.kept_counts[i]);
    CHECK(from(again.tables, i * max_blocks, h.new_tables[i].size()) == h.new_tables[i]);
    REQUIRE(h.keep_masks[i].size() == static_cast<std::size_t>(rows) * Tw);
    REQUIRE(h.scores[i].size() == static_cast<std::size_t>(rows) * Tw);
    long masks_differ = 0, scores_differ = 0;
    for (std::int32_t row = 0; row < rows; ++row)
      for (std::int32_t t = 0; t < Tw; ++t) {
        const std::size_t dev_at = (i * rows + row) * std::size_t{kara_max_tokens} + t, host_at = std::size_t(row) * Tw + t;
        masks_differ += again.keep[dev_at] != h.keep_masks[i][host_at];
        const float a = h.scores[i][host_at], b = again.scores[dev_at];
        const bool agree = std::isinf(a) || std::isinf(b)
                               ? a == b
                               : std::fabs(a - b) <= 1e-5f * std::max({1.0f, std::fabs(a), std::fabs(b)});
        scores_differ += !agree;
      }
    CHECK_MESSAGE(masks_differ == 0, masks_differ, " keep-mask entries differ from the host's");
    CHECK_MESSAGE(scores_differ == 0, scores_differ, " final scores differ from the host's beyond 1e-5");
  }
  CHECK(again.kv == host.kv);  // every K/V byte, before the windows too
  CHECK(again.f == host.f);
  CHECK(again.kv != want.kv);  // the new windows compressed other tokens

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
}

// Runs `preset` over the Kara case with `items` and expects the device to refuse it:
// status set, kvp::check throwing the kvp::error of `field` (its message holding
// `what`), and no byte of the cache written.
template <class P>
void expect_window_refused(const P& preset, const std::vector<kvp::batch_item>& items, const char* field,
                           const char* what) {
  CAPTURE(field);
  CAPTURE(what);
  const gpu_case c(kara_case());
  device_side dev(c);
  device_outputs out(items, kara_max_tokens, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, preset, dev));
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  const auto status = to_host(out.status);
  REQUIRE(status[0] != 0);
  try {
    kvp::check(status.data());
    FAIL("check() did not throw");
  } catch (const kvp::error& e) {
    CHECK(e.field() == field);
    CHECK(std::string(e.what()).find(what) != std::string::npos);
    MESSAGE(std::string(e.what()));
  }
  CHECK(to_host(dev.kv) == c.kv);
  CHECK(to_host(dev.f) == c.f);
}

std::vector<kvp::batch_item> kara_items_with(std::size_t i, std::int32_t window_begin) {
  auto items = kara_items();
  items[i].window_begin = window_begin;
  return items;
}

TEST_CASE("kara: a window the device refuses is reported with the field and nothing is written") {
  const kvp::presets::kara p = kara_pipeline();
  // Checked by window_rows_kernel, before validation.
  expect_window_refused(p, kara_items_with(0, 40), "batch[0].window_begin", "is 40; a window starts on a block boundary");
  expect_window_refused(p, kara_items_with(2, -16), "batch[2].window_begin", "is -16; a window starts on a block boundary");
  expect_window_refused(p, kara_items_with(1, 112), "batch[1].window_begin", "is 112; seq 1 holds 112 tokens");
  expect_window_refused(p, kara_items_with(0, 160), "batch[0].window_begin", "is 160; seq 0 holds 149 tokens");
  // A valid window_begin whose window (149 - 64 = 85 tokens) cannot hold the scorer's
  // 96: validation sees the window's length, not the sequence's.
  expect_window_refused(p, kara_items_with(0, 64), "pipeline.scorer.window", "is 96; longer than seq 0 (batch[0]) of 85");
}

TEST_CASE("a window_begin with a layout that is not window-only is refused on the device") {
  const kvp::presets::snapkv p;  // window 32, protect 32: budgets of 64 fit every sequence
  std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 2, .budget = 64},
                                     {.seq = 1, .query_slot = 0, .budget = 64},
                                     {.seq = 2, .query_slot = 1, .budget = 64}};
  {
    // The batch as it is runs clean: the window is all that is wrong below.
    const gpu_case c(kara_case());
    device_side dev(c);
    device_outputs out(items, kara_max_tokens, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
    REQUIRE_EQ(cudaSuccess, out.run(kvp::cuda_executor{}, p, dev));
    REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
    CHECK(to_host(out.status)[0] == 0);
  }
  items[1].window_begin = 16;
  expect_window_refused(p, items, "batch[1].window_begin", "only a window-only layout");
}

// The facade's host-side check: shared-prefix targets mean nothing to a window-only
// layout (it never writes a block before the window), so compress() throws, both when
// sizing the workspace and when running, before any launch: the status words keep
// what they held (a launch clears them first) and no byte is written.
TEST_CASE("kara: batch.targets with a window-only layout throw before any launch") {
  const gpu_case c(kara_case());
  const kvp::presets::kara p = kara_pipeline();
  device_side dev(c);
  const std::vector<kvp::batch_item> items = kara_items();
  device_outputs out(items, kara_max_tokens, c.cfg.layers * c.cfg.kv_heads, c.max_blocks);
  std::int32_t free_block = -1;
  for (std::int32_t id = 0; id < c.num_blocks && free_block < 0; ++id)
    if (std::find(c.table.begin(), c.table.end(), id) == c.table.end()) free_block = id;
  REQUIRE(free_block >= 0);
  const thrust::device_vector<std::int32_t> indptr = to_device(std::vector<std::int32_t>{0, 1, 1, 1}),
                                            blocks = to_device(std::vector<std::int32_t>{free_block});
  std::size_t bytes = 0;
  REQUIRE_EQ(cudaSuccess,
             kvp::cuda_executor{}.compress(nullptr, bytes, p, dev.cache, dev.queries, dev.scores, out.batch, out.result));
  out.temp.resize(std::max<std::size_t>(bytes, 1));
  thrust::fill(out.status.begin(), out.status.end(), -7);
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  kvp::device_batch with_targets = out.batch;
  with_targets.targets = {thrust::raw_pointer_cast(indptr.data()), thrust::raw_pointer_cast(blocks.data())};
  void* const temps[] = {nullptr, thrust::raw_pointer_cast(out.temp.data())};
  for (void* temp : temps) {
    CAPTURE(temp == nullptr);
    std::size_t size = bytes;
    try {
      (void)kvp::cuda_executor{}.compress(temp, size, p, dev.cache, dev.queries, dev.scores, with_targets, out.result);
      FAIL("compress() did not throw");
    } catch (const kvp::error& e) {
      CHECK(e.field() == "batch.targets");
      CHECK(std::string(e.what()).find("window-only") != std::string::npos);
      MESSAGE(std::string(e.what()));
    }
  }
  REQUIRE_EQ(cudaSuccess, cudaDeviceSynchronize());
  CHECK(to_host(out.status) == std::vector<std::int32_t>(kvp::status_words, -7));
  CHECK(to_host(dev.kv) == c.kv);
  CHECK(to_host(dev.f) == c.f);
}

}  // namespace
}  // namespace kvp_gpu
