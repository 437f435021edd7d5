// Device-side validation of a per-head compression: the items, and every (layer,
// seq, head) row of the engine's lengths and block tables, as validate_per_head and
// host::compress_per_head check them on the host. Runs first; the kernels after it
// do nothing once it reported, so a malformed call writes no byte of the cache.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/per_head_workspace.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

__device__ inline bool failed(const per_head_space& s) { return *static_cast<volatile const std::int32_t*>(s.status) != 0; }

// Blocks [0, layers x seqs): one (layer, seq) each, its heads' lengths and block ids;
// each id is claimed in `owner` (one pool, or one per layer) by atomicCAS, so an id
// held twice is found whichever holder comes first. Then one thread per item.
template <int = 0>
__global__ void __launch_bounds__(row_threads) per_head_validate_kernel(per_head_kv_view c, per_head_space s,
                                                                        per_head_workspace w) {
  const std::int32_t table_blocks = c.num_layers * c.num_seqs;
  if (static_cast<std::int32_t>(blockIdx.x) < table_blocks) {
    const std::int32_t l = static_cast<std::int32_t>(blockIdx.x) / c.num_seqs;
    const std::int32_t seq = static_cast<std::int32_t>(blockIdx.x) % c.num_seqs;
    const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
    std::int32_t* owner = w.owner + (c.shared_pool ? 0 : std::int64_t{l} * c.num_blocks);
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      const std::int32_t T = c.length(l, seq, h);
      if (T < 0 || T > capacity) {
        if (threadIdx.x == 0)
          report(s.status, status_code::head_length_out_of_range, -1, l, seq, h, T, static_cast<std::int32_t>(capacity));
        continue;
      }
      const std::int32_t* row = c.table.row(l, seq, h);
      for (std::int32_t i = threadIdx.x; i < c.blocks_for(T); i += blockDim.x) {
        const std::int32_t id = row[i];
        if (id < 0 || id >= c.num_blocks) {
          report(s.status, status_code::head_block_out_of_range, -1, l, seq, h, i, id, c.num_blocks);
          continue;
        }
        // The claim names the holding (layer, seq, head): with one pool it may sit in any layer.
        const std::int32_t claim = (l * c.num_seqs + seq) * c.num_kv_heads + h;
        const std::int32_t prev = atomicCAS(owner + id, -1, claim);
        if (prev != -1) {
          const std::int32_t other_head = prev % c.num_kv_heads, rest = prev / c.num_kv_heads;
          report(s.status, status_code::head_block_repeated, rest % c.num_seqs, l, seq, h, i, id,
                 (rest / c.num_seqs) * 65536 + other_head);
        }
      }
    }
    return;
  }
  const std::int32_t i = (static_cast<std::int32_t>(blockIdx.x) - table_blocks) * row_threads +
                         static_cast<std::int32_t>(threadIdx.x);
  if (i >= s.num_items) return;
  const per_head_item it = s.items[i];
  if (it.seq < 0 || it.seq >= c.num_seqs) {
    report(s.status, status_code::seq_out_of_range, i, it.seq);
    return;
  }
  const std::int32_t prev = atomicCAS(w.item_of_seq + it.seq, -1, i);
  if (prev != -1) report(s.status, status_code::seq_repeated, prev > i ? prev : i, it.seq);
  auto negative = [&](std::int64_t count, std::int32_t layer) {
    const auto u = static_cast<std::uint64_t>(count);
    report(s.status, status_code::blocks_to_free_negative, i, static_cast<std::int32_t>(u & 0xffffffffu),
           static_cast<std::int32_t>(u >> 32), layer);
  };
  if (s.budget == select::block_budget::sequence) {
    if (it.blocks_to_free < 0) negative(it.blocks_to_free, -1);
  } else if (it.per_layer == nullptr) {
    report(s.status, status_code::per_layer_missing, i, c.num_layers);
  } else {
    for (std::int32_t l = 0; l < c.num_layers; ++l)
      if (it.per_layer[l] < 0) negative(it.per_layer[l], l);
  }
  if (!c.positions.empty() && it.logical_length < 0)
    report(s.status, status_code::logical_length_missing, i, it.logical_length);
}

// Clears what the kernels accumulate into (the workspace holds anything from before)
// and the status; memsets, so a capture records them too.
inline void per_head_reset(const per_head_workspace& w, const per_head_workspace_layout& layout,
                           const per_head_space& s, std::int64_t* freed, std::int64_t* nonfinite,
                           std::int32_t num_blocks, std::int32_t num_seqs, cudaStream_t stream) {
  cudaMemsetAsync(s.status, 0, status_words * sizeof(std::int32_t), stream);
  cudaMemsetAsync(w.owner, 0xff, sizeof(std::int32_t) * static_cast<std::size_t>(layout.pools) * num_blocks, stream);
  cudaMemsetAsync(w.item_of_seq, 0xff, sizeof(std::int32_t) * static_cast<std::size_t>(num_seqs), stream);
  cudaMemsetAsync(w.hist, 0, static_cast<std::size_t>(layout.hist_bytes), stream);
  cudaMemsetAsync(w.rows, 0, static_cast<std::size_t>(layout.row_bytes), stream);
  cudaMemsetAsync(w.groups, 0, sizeof(per_head_group_state) * static_cast<std::size_t>(s.groups()), stream);
  cudaMemsetAsync(w.cheaper, 0, static_cast<std::size_t>(layout.cheaper_bytes), stream);
  const std::size_t items = sizeof(std::int64_t) * static_cast<std::size_t>(s.num_items);
  if (freed && items) cudaMemsetAsync(freed, 0, items, stream);
  if (nonfinite && items) cudaMemsetAsync(nonfinite, 0, items, stream);
}

inline void launch_per_head_validate(const per_head_kv_view& c, const per_head_space& s, const per_head_workspace& w,
                                     cudaStream_t stream) {
  const std::int32_t blocks = c.num_layers * c.num_seqs + (s.num_items + row_threads - 1) / row_threads;
  per_head_validate_kernel<<<blocks, row_threads, 0, stream>>>(c, s, w);
}

}  // namespace cuda
KVP_NAMESPACE_END
