// The CUDA executor inside a CUDA graph, and malformed device data: caught on the
// device, reported as the host's kvp::error, with nothing written.
#include <algorithm>
#include <cstdint>
#include <cstring>
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
                           const std::vector<std::int32_t>& targets) {
    device_side dev(c);
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
                           const std::vector<std::int32_t>& targets, const char* field) {
    const auto [status, unchanged, kv, kv_before] = attempt(items, indptr, targets);
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
  SUBCASE("no target for the shared block") { refused({{1, 1, 192, 0}}, {0, 0}, {-1}, "cache.table[seq 1][0]"); }
  SUBCASE("the prefix's owner in the batch, writing it") {
    refused({{0, 0, 192, 0}, {1, 1, 192, 0}}, {0, 0, 1}, {free[0]}, "cache.table[seq 0][0]");
  }
}

}  // namespace
}  // namespace kvp_gpu
