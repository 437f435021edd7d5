// `--preset kv_compress --device cuda|both` (kv_compress_demo.hpp, in the CUDA build of
// compress_demo): one compression by kvp::cuda_per_head_executor over a device copy of
// the demo's per-head cache, read back into the demo's buffers in the host result's
// shape, so the same checks and report read the GPU's work.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "kvpolicy/exec/cuda_per_head_executor.cuh"

namespace {

// K, V, metric and positions are compressed on the device and copied back into `c`;
// tables and lengths are the engine's (kvc_apply), read only here. `ms` gets the GPU
// time of the schedule (validation included) and of the moves, from a second run on
// the same input (the first loads the kernels).
kvp::per_head_result kvc_compress_cuda(const kvp::presets::kv_compress& p, kvc_cache& c,
                                       const std::vector<kvp::per_head_item>& items, std::pair<double, double>& ms) {
  const auto num_items = static_cast<i32>(items.size());
  const std::size_t rows = items.size() * static_cast<std::size_t>(c.L) * c.H;

  device_buffer<std::byte> k(c.k), v(c.v);
  device_buffer<float> metric(c.metric);
  device_buffer<i32> positions(c.positions), table(c.table), lengths(c.lengths);
  device_buffer<kvp::per_head_item> d_items(items);  // sequence budgets: per_layer stays null
  const kvp::per_head_kv_view cache =
      kvc_view(c, k.get(), v.get(), metric.get(), positions.get(), table.get(), lengths.get());

  device_buffer<i32> status(kvp::status_words), new_lengths(rows), freed_counts(rows),
      freed_blocks(rows * static_cast<std::size_t>(c.max_blocks)), evicted(rows);
  device_buffer<std::int64_t> freed(items.size()), nonfinite(items.size());
  const kvp::device_per_head_batch batch{.items = d_items.get(), .num_items = num_items};
  const kvp::device_per_head_result out{.status = status.get(),
                                        .new_lengths = new_lengths.get(),
                                        .freed_counts = freed_counts.get(),
                                        .freed_blocks = freed_blocks.get(),
                                        .evicted = evicted.get(),
                                        .freed = freed.get(),
                                        .nonfinite = nonfinite.get()};

  stage_events marks;  // the executor records 3: start, after the schedule, after the moves
  kvp::cuda_per_head_executor ex;
  ex.stage_marks = marks.e;
  std::size_t temp_bytes = 0;
  DEMO_CUDA(ex.compress(nullptr, temp_bytes, p.select, cache, batch, out));
  device_buffer<std::byte> temp(temp_bytes);
  auto run_once = [&] {
    DEMO_CUDA(ex.compress(temp.get(), temp_bytes, p.select, cache, batch, out));
    DEMO_CUDA(cudaDeviceSynchronize());
    std::vector<i32> host_status;
    status.download(host_status);
    try {
      kvp::throw_if_error(host_status.data());
    } catch (const kvp::error& e) {
      throw std::runtime_error(str("the per-head executor's device-side checks rejected the batch: {}", e.what()));
    }
  };
  // The warm-up compresses the device copy in place: the cache goes up again after it.
  run_once();
  k.upload(c.k);
  v.upload(c.v);
  metric.upload(c.metric);
  positions.upload(c.positions);
  run_once();
  ms = {1e3 * marks.seconds(0, 1), 1e3 * marks.seconds(1, 2)};

  k.download(c.k);
  v.download(c.v);
  metric.download(c.metric);
  positions.download(c.positions);
  std::vector<i32> h_new, h_counts, h_blocks, h_evicted;
  std::vector<std::int64_t> h_freed, h_nonfinite;
  new_lengths.download(h_new);
  freed_counts.download(h_counts);
  freed_blocks.download(h_blocks);
  evicted.download(h_evicted);
  freed.download(h_freed);
  nonfinite.download(h_nonfinite);

  // Rows (item x L + layer) x H + head, as the host result's [item][layer x H + head].
  kvp::per_head_result res;
  const auto per_item = static_cast<std::size_t>(c.L) * c.H;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto first = static_cast<std::ptrdiff_t>(i * per_item), last = first + static_cast<std::ptrdiff_t>(per_item);
    res.new_lengths.emplace_back(h_new.begin() + first, h_new.begin() + last);
    res.evicted.emplace_back(h_evicted.begin() + first, h_evicted.begin() + last);
    auto& blocks = res.freed_blocks.emplace_back();
    for (std::size_t j = 0; j < per_item; ++j) {
      const auto at = h_blocks.begin() + static_cast<std::ptrdiff_t>((i * per_item + j) * c.max_blocks);
      blocks.emplace_back(at, at + std::clamp(h_counts[i * per_item + j], 0, c.max_blocks));
    }
  }
  res.freed = h_freed;
  res.nonfinite = h_nonfinite;
  return res;
}

}  // namespace
