// What an engine does with kvpolicy, in miniature: it owns a paged f32 KV cache in
// nano-vllm's layout, hands kvpolicy a view of it, and compresses one sequence with
// the Zipage preset on the host executor. Built by the package tests against an
// installed kvpolicy and through add_subdirectory. Returns nonzero on any failure.
#include <kvpolicy/kvpolicy.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "kvpolicy_consumer: FAILED: %s\n", what);
    ++failures;
  }
}

// Deterministic values in [-1, 1).
float next_value(std::uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
}

}  // namespace

int main() try {
  constexpr std::int32_t layers = 2, blocks = 6, block_size = 8, kv_heads = 2, q_heads = 4, dim = 16;
  constexpr std::int32_t length = 40, budget = 24, window = 8;

  // The engine's memory: one tensor [2, L, blocks, b, h_kv, d], a block table, lengths.
  std::vector<float> kv(std::size_t{2} * layers * blocks * block_size * kv_heads * dim);
  std::uint32_t seed = 12345u;
  for (float& x : kv) x = next_value(seed);
  const std::int32_t table[blocks] = {3, 0, 5, 1, 4, 2};  // logical block -> physical block
  const std::int32_t lengths[1] = {length};

  const kvp::cache_shape shape{.num_layers = layers,
                               .num_blocks = blocks,
                               .block_size = block_size,
                               .num_kv_heads = kv_heads,
                               .head_dim = dim,
                               .type = kvp::dtype::f32};
  const kvp::sequence_table seqs{
      .table = kvp::block_table_view::dense(table, blocks), .lengths = lengths, .num_seqs = 1};
  const kvp::paged_kv_view cache = kvp::layouts::nano_vllm(kv.data(), shape, seqs);
  // A second view of the untouched copy, to check what moved where.
  std::vector<float> before = kv;
  const kvp::paged_kv_view reference = kvp::layouts::nano_vllm(before.data(), shape, seqs);

  // The observation queries [L, slots, w, h_q, d] and the global score cache F.
  std::vector<float> q(std::size_t{layers} * 1 * window * q_heads * dim);
  for (float& x : q) x = next_value(seed);
  const auto queries = kvp::query_window_view::contiguous(q.data(), layers, 1, window, q_heads, dim, kvp::dtype::f32);
  std::vector<float> f(std::size_t{layers} * blocks * block_size * kv_heads, 0.0f);
  const auto scores = kvp::score_view::contiguous(f.data(), blocks, block_size, kv_heads);

  // Zipage's defaults, with a shorter observation window for this tiny cache.
  kvp::presets::zipage policy{};
  policy.scorer.window = window;
  policy.protect.window = window;

  const kvp::batch_item items[] = {{.seq = 0, .query_slot = 0, .budget = budget, .history_tokens = 0}};
  const kvp::compression_batch batch{.items = items};

  kvp::host_executor executor{};
  executor.record_keep_masks = true;
  const kvp::host_result result = executor.compress(policy, cache, queries, scores, batch);

  check(result.new_lengths.size() == 1 && result.new_lengths[0] == budget, "new length is the budget");
  // 40 tokens used 5 blocks, 24 need 3: logical blocks 3 and 4 are released.
  check(result.released_blocks.size() == 1 && result.released_blocks[0] == std::vector<std::int32_t>{table[3], table[4]},
        "the blocks past the new length are released");

  check(result.keep_masks.size() == 1 && result.keep_masks[0].size() == std::size_t{layers} * kv_heads * length,
        "a keep mask per (layer, head)");
  const std::size_t row_bytes = static_cast<std::size_t>(cache.row_bytes());
  for (std::int32_t l = 0; l < layers && failures == 0; ++l) {
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      const std::uint8_t* keep = result.keep_masks[0].data() + (std::size_t(l) * kv_heads + h) * length;
      std::int32_t kept = 0;
      for (std::int32_t t = 0; t < length; ++t) {
        if (!keep[t]) continue;
        // The i-th kept token now sits at position i, K and V alike.
        check(std::memcmp(cache.k_row(l, 0, kept, h), reference.k_row(l, 0, t, h), row_bytes) == 0, "K moved");
        check(std::memcmp(cache.v_row(l, 0, kept, h), reference.v_row(l, 0, t, h), row_bytes) == 0, "V moved");
        ++kept;
      }
      check(kept == budget, "each (layer, head) keeps the budget");
      for (std::int32_t t = length - window; t < length; ++t) check(keep[t] == 1, "the observation window is kept");
    }
  }

  if (failures != 0) return 1;
  std::printf("kvpolicy_consumer: kvpolicy %d.%d.%d, zipage kept %d of %d tokens per head, released %zu blocks\n",
              KVPOLICY_VERSION_MAJOR, KVPOLICY_VERSION_MINOR, KVPOLICY_VERSION_PATCH, budget, length,
              result.released_blocks[0].size());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvpolicy_consumer: %s\n", e.what());
  return 1;
}
