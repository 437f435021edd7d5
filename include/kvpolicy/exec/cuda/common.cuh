// Shared pieces of the CUDA executor's kernels: row decoding, the status check,
// block reductions, and the one rank order as 64-bit keys.
#pragma once

#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/architecture.cuh"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/exec/device_status.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// Every per-row kernel uses this many threads.
inline constexpr int row_threads = 256;

// What every kernel knows about the launch: rows are (item, layer, KV head).
struct row_space {
  const batch_item* items = nullptr;  // device
  std::int32_t num_items = 0;
  std::int32_t layer_begin = 0;
  std::int32_t num_layers = 0;
  std::int32_t num_heads = 0;
  std::int32_t max_tokens = 0;  // row pitch of the per-token work buffers
  std::int32_t* status = nullptr;  // device, status_words

  KVP_HOST_DEVICE std::int64_t rows() const noexcept {
    return std::int64_t{num_items} * num_layers * num_heads;
  }
};

struct row_coord {
  std::int32_t item, layer, head;
};

// x / v and x % v: a shift and a mask when v is a power of two (head counts, layer
// counts and head dims almost always are), else the division (some 20 instructions).
__device__ inline std::uint32_t div_by(std::uint32_t x, std::uint32_t v) {
  return (v & (v - 1)) == 0 ? x >> (__ffs(static_cast<int>(v)) - 1) : x / v;
}
__device__ inline std::uint32_t mod_by(std::uint32_t x, std::uint32_t v) {
  return (v & (v - 1)) == 0 ? x & (v - 1) : x % v;
}

// Rows are launched as blockIdx.x, so they fit 32 bits; 32-bit division is a
// fraction of the cost of 64-bit division, which every warp of every block pays here.
__device__ inline row_coord decode_row(const row_space& rs, std::uint32_t r) {
  const auto heads = static_cast<std::uint32_t>(rs.num_heads), layers = static_cast<std::uint32_t>(rs.num_layers);
  const std::uint32_t rest = div_by(r, heads);
  return {static_cast<std::int32_t>(div_by(rest, layers)), rs.layer_begin + static_cast<std::int32_t>(mod_by(rest, layers)),
          static_cast<std::int32_t>(mod_by(r, heads))};
}

// Blocks per row for a launch of few rows: the largest power of two up to `cap` (at
// least 1) whose rows * n blocks still fit the GPU's `slots` at once, so that a split
// never adds a wave.
KVP_HOST_DEVICE constexpr std::int32_t splits_to_fill(std::int64_t rows, std::int64_t slots, std::int64_t cap) {
  std::int32_t n = 1;
  while (2 * n <= cap && rows * 2 * n <= slots) n *= 2;
  return n;
}

// A flat grid over (row, tile of a row): a row's tiles are adjacent blocks, so the
// blocks that stream one row's keys run at the same time and find them in L2. (A grid
// of rows x tiles in y schedules every row's first tile before any second one, so a
// row's keys are read from DRAM once per tile.)
KVP_HOST_DEVICE constexpr std::int32_t tiles_per_row(std::int32_t max_tokens, std::int32_t tile) {
  return (max_tokens + tile - 1) / tile;
}
struct row_tile {
  std::uint32_t row, tile;
};
__device__ inline row_tile decode_row_tile(std::int32_t tiles) {
  const auto t = static_cast<std::uint32_t>(tiles);
  return {blockIdx.x / t, blockIdx.x % t};
}

// Programmatic dependent launch (sm_90): a kernel launched with it may start while
// the kernel before it in the stream still runs, once every block of that one has
// called allow_dependents (or ended). It must call wait_for_prerequisites, which
// returns once that kernel has finished and its writes are visible, before it
// reads what that kernel wrote, and before it ends if a later kernel relies on
// that kernel through it. Both are no-ops in a kernel launched plainly, and are
// compiled out before sm_90, where the executor never launches so.
__device__ inline void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ inline void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Waits for the prerequisites when the thread leaves the kernel, by any return: in
// every block, or (every_block false, where the block waited for its rows instead)
// only in the grid's last block, as last_block_waits_at_exit below.
struct prerequisites_at_exit {
  bool every_block = true;
  __device__ explicit prerequisites_at_exit(bool every = true) : every_block(every) {}
  __device__ ~prerequisites_at_exit() {
    if (every_block || blockIdx.x == gridDim.x - 1) wait_for_prerequisites();
  }
};

// The last block of a grid waits for the prerequisites as it leaves, so that the grid
// ends after them even where its other blocks waited for rows instead (row hand-off,
// below): later work in the stream then sees every kernel before this one finished.
struct last_block_waits_at_exit {
  __device__ ~last_block_waits_at_exit() {
    if (blockIdx.x == gridDim.x - 1) wait_for_prerequisites();
  }
};

// Row hand-off between two chained kernels, finer than the grid: the producer block of
// row r sets ready[r] once the row's results are written; the consumer block of row r
// waits for that flag instead of the whole producer grid, so rows whose producer
// finished early go on in the producer's last wave. Flags start at zero (the validate
// kernel clears them). The consumer is a programmatic dependent launch, which starts
// only once every producer block has started, so it never waits on a block that has
// no SM to run on. The release / acquire pair at GPU scope, each after or before a
// block barrier, makes every write of the producer block visible to every thread of
// the consumer block.
__device__ inline void publish_row(std::int32_t* ready, std::uint32_t row) {
  __syncthreads();
#if defined(__CUDA_ARCH__)
  if (threadIdx.x == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(ready + row), "r"(1) : "memory");
#endif
}
// The same for a producer with several blocks per row (lightning: one per cache
// block of the row): each adds 1 to ready[r] once its part of the row is written, and
// the consumer waits for all `parts` of them.
__device__ inline void publish_row_part(std::int32_t* ready, std::uint32_t row) {
  __syncthreads();
#if defined(__CUDA_ARCH__)
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ready + row), "r"(1) : "memory");
#endif
}
__device__ inline void await_row_parts(const std::int32_t* ready, std::uint32_t row, std::int32_t parts) {
#if defined(__CUDA_ARCH__)
  if (threadIdx.x == 0) {
    for (std::int32_t v = 0;;) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ready + row) : "memory");
      if (v >= parts) break;
      __nanosleep(200);
    }
  }
#endif
  __syncthreads();
}
__device__ inline void await_row(const std::int32_t* ready, std::uint32_t row) { await_row_parts(ready, row, 1); }

// A score kernel's row hand-off (none when `ready` is null): the epilogue reads
// redundancy too, so the row is published once the kernel before, lightning, is done
// (with its whole grid, or with the row where the block waited for the row's
// lightning blocks: redundancy_seen).
__device__ inline void publish_scores(std::int32_t* ready, std::uint32_t row, bool redundancy_seen = false) {
  if (!ready) return;
  if (!redundancy_seen) wait_for_prerequisites();
  publish_row(ready, row);
}

// Kernels after validation do nothing once an error was found, so a malformed
// batch never writes a byte.
__device__ inline bool failed(const row_space& rs) {
  return *static_cast<volatile const std::int32_t*>(rs.status) != 0;
}

__device__ inline void report(std::int32_t* status, status_code code, std::int32_t item, std::int32_t a = 0,
                              std::int32_t b = 0, std::int32_t c = 0, std::int32_t d = 0, std::int32_t e = 0,
                              std::int32_t f = 0) {
  static_assert(status_words == 8);
  if (atomicCAS(status, 0, static_cast<std::int32_t>(code)) == 0) {
    status[1] = item;
    status[2] = a;
    status[3] = b;
    status[4] = c;
    status[5] = d;
    status[6] = e;
    status[7] = f;
  }
}

// 2^x on the special function unit, results below 2^-126 flushed to zero: such a
// softmax term differs from the host's subnormal by under 1.2e-38, and exp2f spends
// four more instructions per call on that range.
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

using block_reduce = cub::BlockReduce<float, row_threads>;

struct max_op {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};

// Block-wide max / sum of a value each thread holds; result on every thread.
__device__ inline float block_max(float v, typename block_reduce::TempStorage& tmp, float& out) {
  const float r = block_reduce(tmp).Reduce(v, max_op{});
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const float res = out;
  __syncthreads();
  return res;
}
__device__ inline float block_sum(float v, typename block_reduce::TempStorage& tmp, float& out) {
  const float r = block_reduce(tmp).Sum(v);
  if (threadIdx.x == 0) out = r;
  __syncthreads();
  const float res = out;
  __syncthreads();
  return res;
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace cuda
KVP_NAMESPACE_END
