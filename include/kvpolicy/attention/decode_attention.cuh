// Decode attention on the GPU over head-adaptive caches (host::decode_attention in
// decode_attention_reference.hpp is the law): one new query token per item, GQA,
// bf16 / f16, head dim 64 or 128, over one layer of a per-head block cache, a paged
// cache whose heads attend their own counts or skip dropped tokens (live view), or a
// plain paged cache; optionally, in the same call, each attended token's squared
// (KV-Compress) or plain (H2O) probabilities, summed over the group, added to its
// metric.
//
// As CUB: a null workspace asks its size (temp_bytes), which depends on the items,
// the heads and batch.max_tokens only, so size it once for the largest batch. No
// allocation, no host synchronisation: a call can be captured in a CUDA graph.
// Shapes, dtypes and strides are checked on the host (kvp::error names the field);
// what lives in device memory (sequences, lengths, counts, block ids) by the first
// kernel, which records the first violation in batch.status (kvp::throw_if_error
// after copying it back); every later kernel then returns at once, so nothing is
// written.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kvpolicy/attention/decode_attention_checks.hpp"
#include "kvpolicy/attention/decode_attention_params.hpp"
#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/decode_attention_kernel.cuh"
#include "kvpolicy/exec/cuda/decode_attention_sources.cuh"
#include "kvpolicy/exec/cuda/decode_attention_staged_kernel.cuh"
#include "kvpolicy/exec/cuda/decode_attention_tuning.cuh"
#include "kvpolicy/exec/cuda/launch.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"
#include "kvpolicy/exec/device_status.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What one call launches and the workspace it needs: validation, sizing and the
// launches all read this.
struct decode_attention_plan {
  launch_plan validate, split, combine;
  std::int32_t rows = 0;          // items x KV heads
  std::int32_t max_tokens = 0;    // the longest row the grid covers
  std::int32_t split_tokens = 0;  // tokens per split block
  std::int32_t splits = 0;        // split blocks per row and group chunk
  std::int32_t group_chunk = 0;   // query heads per split block
  std::int32_t group_chunks = 0;
  std::int32_t metric_tokens = 0;  // tokens per combine block (epilogue)
  bool staged = false;             // the split step's K and V staged through shared memory
  std::size_t stats_bytes = 0, partial_bytes = 0, logits_bytes = 0, temp_bytes = 0;
};

inline std::string describe(const decode_attention_plan& p) {
  return detail::format(
      "decode attention: {} rows, up to {} tokens, splits of {} tokens ({} per row), {} x {} query heads per block, "
      "workspace {} B (stats {}, partial {}, logits {})\n  validate: {}\n  split:    {}\n  combine:  {}",
      p.rows, p.max_tokens, p.split_tokens, p.splits, p.group_chunks, p.group_chunk, p.temp_bytes, p.stats_bytes,
      p.partial_bytes, p.logits_bytes, describe(p.validate), describe(p.split), describe(p.combine));
}

namespace decode_detail {

inline std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// Every row 16-byte aligned: the kernels read K, V and queries 16 bytes a lane.
inline void check_alignment(std::int64_t stride_elems, dtype t, const char* field) {
  require((stride_elems * size_of(t)) % 16 == 0, field,
          "is {} elements ({} bytes); the GPU reads rows 16 bytes at a time", stride_elems, stride_elems * size_of(t));
}
inline void check_pointer(const void* p, const char* field) {
  require(reinterpret_cast<std::uintptr_t>(p) % 16 == 0, field, "address {} is not 16-byte aligned", p);
}

inline void check_device_shape(std::int32_t d, dtype t, const decode_rows& q, const decode_rows& out) {
  require(d == 64 || d == 128, "cache.head_dim", "is {}; the GPU kernels are built for 64 and 128", d);
  require(t == dtype::bf16 || t == dtype::f16, "cache.type", "is {}; the GPU kernels read bf16 or f16", name_of(t));
  check_alignment(q.item_stride, t, "queries.item_stride");
  check_alignment(q.head_stride, t, "queries.head_stride");
  check_alignment(out.item_stride, t, "out.item_stride");
  check_alignment(out.head_stride, t, "out.head_stride");
  check_pointer(q.base, "queries.base");
  check_pointer(out.base, "out.base");
}

inline decode_attention_plan make_decode_plan(std::int32_t items, std::int32_t kv_heads, std::int32_t G, std::int32_t d,
                                              std::int32_t max_tokens, std::int32_t block_size, bool epilogue,
                                              bool live, bool staged) {
  using tuning = decode_attention_tuning;
  decode_attention_plan p;
  p.rows = items * kv_heads;
  p.max_tokens = max_tokens;
  p.group_chunk = G == 1 ? 1 : G == 2 ? 2 : tuning::max_group_chunk;
  p.group_chunks = (G + p.group_chunk - 1) / p.group_chunk;
  // Splits: as few tokens per block as leave the grid `waves` full waves when every
  // row is max_tokens long, in whole tiles of 64 tokens.
  const device_limits dev = device_limits::current();
  const std::int64_t target = std::int64_t{std::max(dev.multiprocessors, 1)} * tuning::blocks_per_sm * tuning::waves;
  const std::int64_t work = std::int64_t{max_tokens} * p.rows * p.group_chunks;
  std::int64_t split = (work + target - 1) / std::max<std::int64_t>(target, 1);
  split = (split + 63) / 64 * 64;
  split = std::clamp<std::int64_t>(split, tuning::min_split_tokens, tuning::max_split_tokens);
  split = std::min<std::int64_t>(split, std::max<std::int64_t>(64, (std::int64_t{max_tokens} + 63) / 64 * 64));
  p.split_tokens = static_cast<std::int32_t>(split);
  p.splits = std::max<std::int32_t>(1, static_cast<std::int32_t>((max_tokens + split - 1) / split));
  p.metric_tokens = tuning::metric_tokens;
  const auto rows = static_cast<std::size_t>(p.rows);
  p.stats_bytes = round_up(rows * p.splits * G * sizeof(float2), 256);
  p.partial_bytes = round_up(rows * p.splits * G * d * sizeof(float), 256);
  p.logits_bytes = epilogue ? round_up(rows * G * static_cast<std::size_t>(max_tokens) * sizeof(float), 256) : 0;
  p.temp_bytes = p.stats_bytes + p.partial_bytes + p.logits_bytes;
  if (items == 0) return p;
  const std::int64_t split_blocks = std::int64_t{p.rows} * p.splits * p.group_chunks;
  require(split_blocks < (std::int64_t{1} << 31), "batch", "needs {} split blocks; at most 2^31 - 1 fit a grid",
          split_blocks);
  const std::int32_t parts =
      epilogue ? std::max<std::int32_t>(1, (max_tokens + p.metric_tokens - 1) / p.metric_tokens) : 1;
  require(parts <= 65535, "batch.max_tokens", "is {}; the metric epilogue covers at most {} tokens", max_tokens,
          std::int64_t{65535} * p.metric_tokens);
  // The span's table entries: up to two partial blocks at each end of its two parts.
  const std::size_t table = (static_cast<std::size_t>(p.split_tokens) / static_cast<std::size_t>(block_size) + 4) * 4;
  p.validate = {"decode_validate_kernel", static_cast<unsigned>(items), 1, tuning::combine_threads, 0};
  if (staged)
    p.split = {d == 64 ? "decode_attention_staged_kernel<d 64>" : "decode_attention_staged_kernel<d 128>",
               static_cast<unsigned>(split_blocks), 1, tuning::threads,
               decode_staged_layout::bytes(p.split_tokens, block_size, live)};
  else
    p.split = {d == 64 ? "decode_attention_split_kernel<d 64>" : "decode_attention_split_kernel<d 128>",
               static_cast<unsigned>(split_blocks), 1, tuning::threads, table};
  p.staged = staged;
  p.combine = {"decode_attention_combine_kernel", static_cast<unsigned>(p.rows), static_cast<unsigned>(parts),
               tuning::combine_threads, static_cast<std::size_t>(G) * sizeof(float2)};
  return p;
}

template <class Source, int D, class E>
void launch_decode(const decode_attention_plan& p, cudaStream_t stream, const Source& src, const decode_space& s) {
  if constexpr (std::is_same_v<Source, per_head_decode_source>)
    launch(p.validate, stream, false, decode_validate_per_head_kernel<>, src, s);
  else
    launch(p.validate, stream, false, decode_validate_paged_kernel<Source::live>, src, s);
  if (p.staged) {
    switch (p.group_chunk) {
      case 1:
        launch(p.split, stream, false, decode_attention_staged_kernel<Source, D, 1, E>, src, s);
        break;
      case 2:
        launch(p.split, stream, false, decode_attention_staged_kernel<Source, D, 2, E>, src, s);
        break;
      default:
        launch(p.split, stream, false, decode_attention_staged_kernel<Source, D, 4, E>, src, s);
        break;
    }
  } else {
    switch (p.group_chunk) {
      case 1:
        launch(p.split, stream, false, decode_attention_split_kernel<Source, D, 1, E>, src, s);
        break;
      case 2:
        launch(p.split, stream, false, decode_attention_split_kernel<Source, D, 2, E>, src, s);
        break;
      default:
        launch(p.split, stream, false, decode_attention_split_kernel<Source, D, 4, E>, src, s);
        break;
    }
  }
  launch(p.combine, stream, false, decode_attention_combine_kernel<Source, D, E>, src, s);
}

template <class Source>
void launch_decode(const decode_attention_plan& p, cudaStream_t stream, const Source& src, const decode_space& s,
                   std::int32_t d, dtype t) {
  if (d == 64)
    t == dtype::bf16 ? launch_decode<Source, 64, __nv_bfloat16>(p, stream, src, s)
                     : launch_decode<Source, 64, __half>(p, stream, src, s);
  else
    t == dtype::bf16 ? launch_decode<Source, 128, __nv_bfloat16>(p, stream, src, s)
                     : launch_decode<Source, 128, __half>(p, stream, src, s);
}

}  // namespace decode_detail
}  // namespace cuda

struct cuda_decode_attention {
  cudaStream_t stream = nullptr;
  // The split step with K and V staged through shared memory (cp.async, several tiles
  // in flight per lane; dropped tokens of a live view not read): same results, same
  // workspace. Off by default: not yet measured against the plain split kernel.
  bool staged = false;

  // (a) A per-head block cache (KV-Compress); the epilogue adds to cache.metric.
  cuda::decode_attention_plan plan(const per_head_kv_view& c, const decode_rows& q, const decode_rows& out, float scale,
                                   const decode_batch& batch, const decode_epilogue& epi = {}) const {
    check_decode_attention(c, q, out, scale, batch, epi, /*host_tables=*/false);
    check_device(c.head_dim, c.type, q, out, batch);
    cuda::decode_detail::check_alignment(c.k_stride.token, c.type, "cache.k_stride.token");
    cuda::decode_detail::check_alignment(c.k_stride.block, c.type, "cache.k_stride.block");
    cuda::decode_detail::check_alignment(c.v_stride.token, c.type, "cache.v_stride.token");
    cuda::decode_detail::check_alignment(c.v_stride.block, c.type, "cache.v_stride.block");
    if (!c.k.table) cuda::decode_detail::check_pointer(c.k.layer(batch.layer, c.type), "cache.k");
    if (!c.v.table) cuda::decode_detail::check_pointer(c.v.layer(batch.layer, c.type), "cache.v");
    const std::int64_t capacity = std::int64_t{c.max_blocks} * c.block_size;
    const std::int64_t max_tokens =
        batch.max_tokens > 0 ? std::min<std::int64_t>(batch.max_tokens, capacity) : capacity;
    require(max_tokens < (std::int64_t{1} << 31), "cache.max_blocks", "gives rows of {} tokens; at most 2^31 - 1",
            max_tokens);
    return cuda::decode_detail::make_decode_plan(batch.num_items, c.num_kv_heads, q.num_heads / c.num_kv_heads,
                                                 c.head_dim, static_cast<std::int32_t>(max_tokens), c.block_size,
                                                 epi.writes(), false, staged);
  }

  // (b), (c) A paged cache with a shared block table: the heads' own counts where
  // `counts` is given, the live view's dropped tokens skipped where the cache has one;
  // the epilogue adds to epi.scores.
  cuda::decode_attention_plan plan(const paged_kv_view& c, const decode_head_counts& counts, const decode_rows& q,
                                   const decode_rows& out, float scale, const decode_batch& batch,
                                   const decode_epilogue& epi = {}) const {
    check_decode_attention(c, counts, q, out, scale, batch, epi, /*host_tables=*/false);
    check_device(c.head_dim, c.type, q, out, batch);
    for (const auto& [stride, name] :
         {std::pair{c.k_stride.token, "cache.k_stride.token"}, std::pair{c.k_stride.block, "cache.k_stride.block"},
          std::pair{c.k_stride.head, "cache.k_stride.head"}, std::pair{c.v_stride.token, "cache.v_stride.token"},
          std::pair{c.v_stride.block, "cache.v_stride.block"}, std::pair{c.v_stride.head, "cache.v_stride.head"}})
      cuda::decode_detail::check_alignment(stride, c.type, name);
    if (!c.k.table) cuda::decode_detail::check_pointer(c.k.layer(batch.layer, c.type), "cache.k");
    if (!c.v.table) cuda::decode_detail::check_pointer(c.v.layer(batch.layer, c.type), "cache.v");
    require(batch.max_tokens > 0 || !c.table.is_csr(), "batch.max_tokens",
            "is 0; with a CSR block table the rows' capacity is not known on the host: give an upper bound");
    const std::int64_t capacity = c.table.row_stride * c.block_size;
    const std::int64_t max_tokens = batch.max_tokens > 0 ? batch.max_tokens : capacity;
    require(max_tokens < (std::int64_t{1} << 31), "cache.table.row_stride", "gives rows of {} tokens; at most 2^31 - 1",
            max_tokens);
    return cuda::decode_detail::make_decode_plan(batch.num_items, c.num_kv_heads, q.num_heads / c.num_kv_heads,
                                                 c.head_dim, static_cast<std::int32_t>(max_tokens), c.block_size,
                                                 epi.writes(), !c.live.empty(), staged);
  }

  cudaError_t attend(void* temp, std::size_t& temp_bytes, const per_head_kv_view& c, const decode_rows& q,
                     const decode_rows& out, float scale, const decode_batch& batch,
                     const decode_epilogue& epi = {}) const {
    const cuda::decode_attention_plan p = plan(c, q, out, scale, batch, epi);
    if (temp == nullptr) return temp_bytes = p.temp_bytes, cudaSuccess;
    cuda::decode_space s = space(p, temp, temp_bytes, q, out, scale, batch, epi, c.num_kv_heads, c.num_blocks);
    s.capacity = std::int64_t{c.max_blocks} * c.block_size;
    if (!reset_status(batch)) return cudaGetLastError();
    cuda::decode_detail::launch_decode(p, stream, cuda::per_head_decode_source{c}, s, c.head_dim, c.type);
    return cudaGetLastError();
  }

  cudaError_t attend(void* temp, std::size_t& temp_bytes, const paged_kv_view& c, const decode_head_counts& counts,
                     const decode_rows& q, const decode_rows& out, float scale, const decode_batch& batch,
                     const decode_epilogue& epi = {}) const {
    const cuda::decode_attention_plan p = plan(c, counts, q, out, scale, batch, epi);
    if (temp == nullptr) return temp_bytes = p.temp_bytes, cudaSuccess;
    const cuda::decode_space s = space(p, temp, temp_bytes, q, out, scale, batch, epi, c.num_kv_heads, c.num_blocks);
    if (!reset_status(batch)) return cudaGetLastError();
    if (c.live.empty())
      cuda::decode_detail::launch_decode(p, stream, cuda::paged_decode_source<false>{c, counts}, s, c.head_dim, c.type);
    else
      cuda::decode_detail::launch_decode(p, stream, cuda::paged_decode_source<true>{c, counts}, s, c.head_dim, c.type);
    return cudaGetLastError();
  }

 private:
  static void check_device(std::int32_t d, dtype t, const decode_rows& q, const decode_rows& out,
                           const decode_batch& batch) {
    cuda::decode_detail::check_device_shape(d, t, q, out);
    require(batch.status != nullptr, "batch.status", "is a null pointer; the device check reports there");
  }

  // Clears the status; false when there is nothing to launch.
  bool reset_status(const decode_batch& batch) const {
    cudaMemsetAsync(batch.status, 0, status_words * sizeof(std::int32_t), stream);
    return batch.num_items > 0;
  }

  static cuda::decode_space space(const cuda::decode_attention_plan& p, void* temp, std::size_t temp_bytes,
                                  const decode_rows& q, const decode_rows& out, float scale, const decode_batch& batch,
                                  const decode_epilogue& epi, std::int32_t kv_heads, std::int32_t num_blocks) {
    require(temp_bytes >= p.temp_bytes, "temp_bytes", "is {}; the call needs {}", temp_bytes, p.temp_bytes);
    require(reinterpret_cast<std::uintptr_t>(temp) % 256 == 0, "temp", "address {} is not 256-byte aligned", temp);
    auto* bytes = static_cast<std::byte*>(temp);
    cuda::decode_space s;
    const std::int64_t es = size_of(q.type);
    s.q = q.base, s.q_item_stride = q.item_stride * es, s.q_head_stride = q.head_stride * es;
    s.out = out.base, s.out_item_stride = out.item_stride * es, s.out_head_stride = out.head_stride * es;
    s.seqs = batch.seqs, s.query_positions = batch.query_positions;
    s.num_items = batch.num_items, s.layer = batch.layer, s.num_kv_heads = kv_heads, s.group = q.num_heads / kv_heads;
    s.num_blocks = num_blocks;
    s.split_tokens = p.split_tokens, s.splits = p.splits, s.group_chunks = p.group_chunks;
    s.max_tokens = p.max_tokens, s.metric_tokens = p.metric_tokens;
    s.scale_log2 = scale * 1.4426950408889634f;
    s.stats = reinterpret_cast<float2*>(bytes);
    s.partial = reinterpret_cast<float*>(bytes + p.stats_bytes);
    s.logits = epi.writes() ? reinterpret_cast<float*>(bytes + p.stats_bytes + p.partial_bytes) : nullptr;
    s.status = batch.status;
    s.epilogue = epi;
    return s;
  }
};

KVP_NAMESPACE_END
