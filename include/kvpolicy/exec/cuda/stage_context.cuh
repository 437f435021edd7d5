// What every stage kind's plan and launch read: the pipeline, the views, the device,
// the executor's options; and the workspace each stage carves its buffers from.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/mma.cuh"
#include "kvpolicy/exec/cuda/tuning.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The cuda_executor fields the stages' plans read (the facade documents each).
struct executor_options {
  bool tensor_cores = true;
  bool statistics_in_redundancy = true;
  std::int32_t full_pairs_rows = 0;
  bool split_rows = true;
};

template <class P>
struct stage_context {
  const P& p;
  const paged_kv_view& cache;
  const query_window_view& queries;
  const score_view& f;
  const device_limits& dev;
  const executor_options& opt;
  std::int32_t max_tokens;  // the batch's bound on its lengths: the pitch of every per-token buffer

  // Query heads per KV head (attention scorers).
  std::int32_t group_size() const { return queries.num_q_heads / cache.num_kv_heads; }
  // Keys on tensor cores: a 16-bit cache whose head dim is a multiple of 16.
  bool mma_keys() const { return opt.tensor_cores && cache.type != dtype::f32 && mma_head_dim(cache.head_dim); }
  // Q.K^T on tensor cores: the queries of the cache's type too.
  bool mma_scores() const { return mma_keys() && queries.type == cache.type; }
  // Cache blocks of a row of max_tokens tokens.
  std::int32_t blocks_per_row() const { return (max_tokens + cache.block_size - 1) / cache.block_size; }
  // Head dims built as constants (the MMA loops unroll whole); any other is read at run time.
  bool constant_head_dim() const { return cache.head_dim == 64 || cache.head_dim == 128; }
};

// Calls f.template operator()<Elem, HeadDim>() for the cache's 16-bit type and head
// dim: 64 and 128 as constants, any other as 0 (read at run time).
template <class F>
void with_mma_types(const paged_kv_view& cache, F&& f) {
  const auto by_dim = [&]<dtype Elem>() {
    switch (cache.head_dim) {
      case 64: return f.template operator()<Elem, 64>();
      case 128: return f.template operator()<Elem, 128>();
      default: return f.template operator()<Elem, 0>();
    }
  };
  if (cache.type == dtype::bf16)
    by_dim.template operator()<dtype::bf16>();
  else
    by_dim.template operator()<dtype::f16>();
}

// Offsets of buffers in the caller's workspace, 256-byte aligned.
struct workspace_builder {
  std::size_t total = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

// A buffer of T per row of the whole batch (`per_row` each), as a stage finds it for
// the launch group whose first row is row0.
template <class T>
T* rows_of(std::byte* ws, std::size_t offset, std::int64_t row0, std::int64_t per_row) {
  return reinterpret_cast<T*>(ws + offset) + row0 * per_row;
}

}  // namespace cuda
KVP_NAMESPACE_END
