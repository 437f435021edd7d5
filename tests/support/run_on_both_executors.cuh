// kvp_test::run for the CUDA build of the unit tests (KVP_TEST_CUDA_EXECUTOR, target
// kvpolicy_gpu_unit_tests, whose sources include this before the unit test): runs
// the pipeline on the host executor, exactly as the host build does, and on the CUDA
// executor over a device copy of the cache as it was, then checks that the two agree:
// new lengths, released blocks, keep masks, final scores (to fp32 rounding), every
// K/V byte and every F entry of the cache. It returns the host's result and leaves
// the host's bytes in `tc`, so every hand-computed check of the test still applies,
// now to results the device matched.
//
// Rows the CUDA executor cannot move (under 16 bytes: the hand cases' d = 1, 2, 3)
// run on a zero-padded copy, which computes the same thing (zero_padded_copy.hpp).
// A pipeline whose scorer is not known to ignore the padding runs on the host alone.
// A keep mask may differ only at a near-tie of scores, which rounding decides
// (docs/cuda.md); the bytes of such a compression cannot match and are not compared.
// Both are counted in agreement_tally.hpp and printed at the end of the run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kvpolicy/kvpolicy.cuh"  // first: kvpolicy before fmt under nvcc

#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <thrust/copy.h>
#include <thrust/device_vector.h>

#include "support/agreement.hpp"
#include "support/agreement_tally.hpp"
#include "support/device_copy.cuh"
#include "support/device_vectors.cuh"
#include "support/test_cache.hpp"
#include "support/test_policies.hpp"
#include "support/zero_padded_copy.hpp"

namespace kvp_test {

// The executors' scores differ by fp32 rounding only (their summation orders differ,
// docs/cuda.md); the GPU parity tests see about 1e-6.
inline constexpr float device_tolerance = 1e-5f;

// The smallest k for which rows of d * 4^k elements are a multiple of 16 bytes, as the
// CUDA executor needs for the cache and, when the scorer reads them, the queries.
inline int device_padding(const test_cache& tc, bool reads_queries) {
  const auto fits = [&](int k, kvp::dtype t) { return (tc.head_dim() << (2 * k)) * kvp::size_of(t) % 16 == 0; };
  int k = 0;
  while (!fits(k, tc.type()) || (reads_queries && !fits(k, tc.query_type()))) ++k;
  return k;
}

// A stage as the CUDA executor gets it: table_scorer's table copied to device memory
// (kept alive in `tables`); every other stage holds no pointer and goes as it is.
template <class Stage>
Stage for_device(const Stage& s, std::vector<thrust::device_vector<float>>&, i32) {
  return s;
}
inline table_scorer for_device(const table_scorer& s, std::vector<thrust::device_vector<float>>& tables, i32 tokens) {
  tables.emplace_back(s.values, s.values + tokens);
  return {thrust::raw_pointer_cast(tables.back().data())};
}

// A selector as the CUDA executor gets it. Calibrated top-p's state (temperatures and
// outcomes the engine keeps) goes as a device copy of the host arrays, copied back by
// copy_back(); every other selector holds no pointer and goes as it is.
template <class Sel>
struct selector_for_device {
  explicit selector_for_device(const Sel& s) : sel(s) {}
  Sel sel;
  void copy_back() const {}
};
template <>
struct selector_for_device<kvp::select::calibrated_top_p> {
  explicit selector_for_device(const kvp::select::calibrated_top_p& s) : sel(s), host(s.state) {
    if (host.empty()) return;
    const std::size_t n = entries(host);
    temperature.assign(host.temperature, host.temperature + n);
    outcome.assign(host.outcome, host.outcome + n);
    sel.state.temperature = thrust::raw_pointer_cast(temperature.data());
    sel.state.outcome = thrust::raw_pointer_cast(outcome.data());
  }
  static std::size_t entries(const kvp::calibration_state& st) {
    return static_cast<std::size_t>(st.num_slots) * st.num_layers * st.num_kv_heads;
  }
  void copy_back() const {
    if (host.empty()) return;
    thrust::copy(temperature.begin(), temperature.end(), host.temperature);
    thrust::copy(outcome.begin(), outcome.end(), host.outcome);
  }
  kvp::select::calibrated_top_p sel;
  kvp::calibration_state host;
  thrust::device_vector<float> temperature;
  thrust::device_vector<kvp::calibration_outcome> outcome;
};

// Runs p on the CUDA executor `ex` over a device copy of `tc`, copies K, V and F back
// into `tc`, and returns the results in the host executor's form.
template <class P>
kvp::host_result run_cuda(const P& p, test_cache& tc, const std::vector<kvp::batch_item>& items, i32 layer_begin,
                          i32 layer_count, kvp::prefix_targets targets = {}, const kvp::cuda_executor& ex = {}) {
  const i32 n = static_cast<i32>(items.size()), H = tc.kv_heads();
  const i32 layers = layer_count == 0 ? tc.num_layers() - layer_begin : layer_count;
  i32 max_tokens = 1;
  for (const auto& it : items) max_tokens = std::max(max_tokens, tc.length(it.seq));
  const std::size_t cells = static_cast<std::size_t>(n) * layers * H * max_tokens;

  const device_copy dev(tc);
  std::vector<thrust::device_vector<float>> tables;
  P on_device = p;
  on_device.scorer = for_device(p.scorer, tables, max_tokens);
  const selector_for_device<typename P::select_type> selector(p.select);
  on_device.select = selector.sel;
  const thrust::device_vector<kvp::batch_item> d_items(items.begin(), items.end());
  // The shared prefixes' targets, copied as they are (at least one entry each).
  std::vector<i32> h_indptr, h_targets;
  if (!targets.empty()) {
    h_indptr.assign(targets.indptr, targets.indptr + n + 1);
    h_targets.assign(targets.blocks, targets.blocks + h_indptr.back());
  }
  h_targets.push_back(-1);
  const thrust::device_vector<i32> d_indptr(h_indptr.begin(), h_indptr.end()), d_targets(h_targets.begin(), h_targets.end());
  const kvp::prefix_targets d_prefix =
      targets.empty() ? kvp::prefix_targets{} : kvp::prefix_targets{thrust::raw_pointer_cast(d_indptr.data()),
                                                                     thrust::raw_pointer_cast(d_targets.data())};
  const kvp::device_batch batch{thrust::raw_pointer_cast(d_items.data()), n, max_tokens, layer_begin, layer_count,
                                d_prefix};
  const i32 max_blocks = kvp::max_blocks(batch, dev.cache());
  // Filled with what no executor writes (a mask of 2, NaN), so an entry left unwritten shows.
  thrust::device_vector<i32> status(kvp::status_words, 0), new_lengths(std::max(n, 1), -1),
      released_counts(std::max(n, 1), -1), released(std::max<std::size_t>(std::size_t(n) * max_blocks, 1), -1);
  thrust::device_vector<std::uint8_t> keep(std::max<std::size_t>(cells, 1), 2);
  thrust::device_vector<float> scores(std::max<std::size_t>(cells, 1), std::numeric_limits<float>::quiet_NaN());
  const std::size_t rows = static_cast<std::size_t>(n) * layers * H;
  thrust::device_vector<i32> kept(std::max<std::size_t>(rows, 1), -1), nonfinite(std::max(n, 1), -1),
      new_tables(std::max<std::size_t>(std::size_t(n) * max_blocks, 1), -1);
  const kvp::device_result out{thrust::raw_pointer_cast(status.data()),
                               thrust::raw_pointer_cast(new_lengths.data()),
                               thrust::raw_pointer_cast(released_counts.data()),
                               thrust::raw_pointer_cast(released.data()),
                               thrust::raw_pointer_cast(keep.data()),
                               thrust::raw_pointer_cast(scores.data()),
                               thrust::raw_pointer_cast(kept.data()),
                               thrust::raw_pointer_cast(nonfinite.data()),
                               thrust::raw_pointer_cast(new_tables.data())};

  std::size_t bytes = 0;
  REQUIRE(cudaSuccess == ex.compress(nullptr, bytes, on_device, dev.cache(), dev.queries(), dev.scores(), batch, out));
  thrust::device_vector<std::byte> temp(std::max<std::size_t>(bytes, 1));
  REQUIRE(cudaSuccess == ex.compress(thrust::raw_pointer_cast(temp.data()), bytes, on_device, dev.cache(),
                                     dev.queries(), dev.scores(), batch, out));
  REQUIRE(cudaSuccess == cudaDeviceSynchronize());
  const auto st = to_host(status);
  if (st[0] != 0) {
    try {
      kvp::check(st.data());
    } catch (const kvp::error& e) {
      FAIL("the CUDA executor refused what the host executor ran: ", e.what());
    }
  }
  dev.copy_back(tc);
  selector.copy_back();

  const auto h_lengths = to_host(new_lengths), h_counts = to_host(released_counts), h_released = to_host(released);
  const auto h_keep = to_host(keep);
  const auto h_scores = to_host(scores);
  const auto h_kept = to_host(kept), h_nonfinite = to_host(nonfinite), h_tables = to_host(new_tables);
  kvp::host_result r;
  r.new_tables.resize(items.size());
  r.unshared_blocks.resize(items.size());
  r.new_lengths.assign(h_lengths.begin(), h_lengths.begin() + n);
  r.nonfinite_scores.assign(h_nonfinite.begin(), h_nonfinite.begin() + n);
  r.kept_counts.resize(items.size());
  r.released_blocks.resize(items.size());
  r.keep_masks.resize(items.size());
  r.scores.resize(items.size());
  for (i32 i = 0; i < n; ++i) {
    const std::size_t from = std::size_t(i) * max_blocks;
    r.released_blocks[i].assign(h_released.begin() + from, h_released.begin() + from + std::max(h_counts[i], 0));
    r.kept_counts[i].assign(h_kept.begin() + std::size_t(i) * layers * H, h_kept.begin() + std::size_t(i + 1) * layers * H);
    const i32 b = tc.block_size();
    r.new_tables[i].assign(h_tables.begin() + from, h_tables.begin() + from + (std::max(h_lengths[i], 0) + b - 1) / b);
    // The shared blocks an item leaves are its table's first blocks: the engine's to
    // know, the device reports none. Read from the table itself, which a test may have
    // pointed at another sequence's blocks (a shared prefix).
    for (i32 j = 0; j < targets.count(i); ++j)
      r.unshared_blocks[i].push_back(tc.raw_table()[tc.table_index(items[i].seq, j)]);
    // Device rows are [item][layer][head] with a pitch of max_tokens; the host's are T
    // long (the window's tokens, for a window-only layout).
    const i32 T = result_tokens(tc, items[i]);
    for (i32 row = 0; row < layers * H; ++row) {
      const std::size_t at = (std::size_t(i) * layers * H + row) * max_tokens;
      r.keep_masks[i].insert(r.keep_masks[i].end(), h_keep.begin() + at, h_keep.begin() + at + T);
      r.scores[i].insert(r.scores[i].end(), h_scores.begin() + at, h_scores.begin() + at + T);
    }
  }
  return r;
}

// What a selector keeps between compressions, around the two runs: the state before
// them, then the host's after (swap), compared with the device's (which ends in the
// arrays) and put back, so the test reads the host's. Temperatures agree to
// rounding, outcomes exactly.
template <class Sel>
struct selector_state {
  explicit selector_state(const Sel&) {}
  void swap() {}
  void check_same_and_restore() {}
};
template <>
struct selector_state<kvp::select::calibrated_top_p> {
  explicit selector_state(const kvp::select::calibrated_top_p& s) : st(s.state) {
    if (st.empty()) return;
    const std::size_t n = selector_for_device<kvp::select::calibrated_top_p>::entries(st);
    temperature.assign(st.temperature, st.temperature + n);
    outcome.assign(st.outcome, st.outcome + n);
  }
  void swap() {
    for (std::size_t i = 0; i < temperature.size(); ++i) {
      std::swap(temperature[i], st.temperature[i]);
      std::swap(outcome[i], st.outcome[i]);
    }
  }
  void check_same_and_restore() {
    for (std::size_t i = 0; i < temperature.size(); ++i) {
      CHECK_MESSAGE(outcome[i] == st.outcome[i], "calibration outcome ", i, ": host ", int(outcome[i]), " device ",
                    int(st.outcome[i]));
      CHECK_MESSAGE(std::fabs(temperature[i] - st.temperature[i]) <= 1e-4f * std::fabs(temperature[i]) + 1e-6f,
                    "temperature ", i, ": host ", temperature[i], " device ", st.temperature[i]);
      st.temperature[i] = temperature[i];
      st.outcome[i] = outcome[i];
    }
  }
  kvp::calibration_state st;
  std::vector<float> temperature;
  std::vector<kvp::calibration_outcome> outcome;
};

template <class P>
kvp::host_result run(const P& p, test_cache& tc, const std::vector<kvp::batch_item>& items, i32 layer_begin = 0,
                     i32 layer_count = 0, kvp::prefix_targets targets = {}) {
  using S = typename P::scorer_type;
  const int k = device_padding(tc, kvp::AttentionScorer<S>);
  if constexpr (!ignores_zero_padding<S>) {
    if (k > 0) {
      ++tally().host_only["rows under 16 bytes, and a key scorer not known to ignore zero padding"];
      return run_host(p, tc, items, layer_begin, layer_count, targets);
    }
  }
  test_cache on_device = zero_padded_copy(tc, k);  // the cache as the host executor finds it
  const std::vector<float> f_before = tc.raw_f();
  selector_state state(p.select);  // a selector's state as the host executor finds it
  kvp::host_result want = run_host(p, tc, items, layer_begin, layer_count, targets);
  state.swap();  // the device starts from the same state; the host's result is kept aside

  INFO("CUDA executor against the host executor, on ", tc.describe(),
       k > 0 ? " (device rows zero-padded to head_dim " + std::to_string(on_device.head_dim()) + ")" : "");
  const kvp::host_result got = run_cuda(p, on_device, items, layer_begin, layer_count, targets);
  const long near_ties = check_same_results(want, got, tc, items, device_tolerance, rank_key_of(p));
  // Masks that differ at a near-tie move different tokens: the bytes cannot be equal.
  if (near_ties == 0) check_same_cache(tc, on_device, f_before, device_tolerance);
  state.check_same_and_restore();

  auto& t = tally();
  ++t.compared;
  t.zero_padded += k > 0;
  t.near_tie_masks += near_ties;
  t.caches_not_compared += near_ties > 0;
  return want;
}

}  // namespace kvp_test
