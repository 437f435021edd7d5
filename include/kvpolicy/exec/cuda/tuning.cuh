// Every device-dependent choice of the CUDA executor, as named values: what the
// device offers (asked once per device), and the tuning constants of each stage.
// The measurements behind each constant are in bench/results/README.md
// ("Tuning constants"); a comment here says only why the knob exists.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What the executor asks of the current device. All zero where there is none (a
// build machine): every size check then fails, as the launch would.
struct device_limits {
  int device = -1;
  int multiprocessors = 0;
  std::size_t smem_per_block = 0;  // dynamic shared memory one block may opt in to
  std::size_t smem_per_sm = 0;
  std::size_t smem_reserved_per_block = 0;  // what the runtime keeps of an SM's shared memory per block

  // How many blocks of `smem` bytes of dynamic shared memory fit on one SM.
  std::size_t blocks_per_sm(std::size_t smem) const {
    return smem_per_sm / (smem + smem_reserved_per_block);
  }

  // The current device's, asked of the runtime once per device and kept.
  static device_limits current() {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0) {
      (void)cudaGetLastError();
      return {};
    }
    static std::mutex guard;
    static std::array<device_limits, 64> known{};
    const std::lock_guard lock(guard);
    if (device >= static_cast<int>(known.size())) return query(device);
    if (known[static_cast<std::size_t>(device)].device != device) known[static_cast<std::size_t>(device)] = query(device);
    return known[static_cast<std::size_t>(device)];
  }

 private:
  static device_limits query(int device) {
    int sms = 0, per_block = 0, per_sm = 0, reserved = 0;
    const bool ok = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) == cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();
      return {};
    }
    return {device, sms, static_cast<std::size_t>(per_block), static_cast<std::size_t>(per_sm),
            static_cast<std::size_t>(reserved)};
  }
};

inline std::string describe(const device_limits& d) {
  return detail::format("device {}: {} SMs, shared memory {} B per block (opt-in), {} B per SM, {} B reserved per block",
                        d.device, d.multiprocessors, d.smem_per_block, d.smem_per_sm, d.smem_reserved_per_block);
}

// The score stage (attention_score_mma_kernel).
struct score_tuning {
  // Blocks per SM the kernel's registers are capped for (__launch_bounds__): more
  // blocks hide the key tiles' latency better than more registers save spills.
  static constexpr int blocks_per_sm = 4;
  // A row split over several blocks (few rows) gives each block at least this many
  // 64-key tiles, so that loading the row's queries stays a small share of its work.
  static constexpr int min_tiles_per_split = 4;
};

// The epilogue (aggregate, redundancy combine, protect, select).
struct epilogue_tuning {
  // Register cap: enough blocks per SM that a batch's rows fit in one wave and a
  // block fits beside the score kernel's last ones when rows are handed on.
  static constexpr int blocks_per_sm = 8;
  // Tokens per thread whose loads are issued before any of their stores.
  static constexpr int load_batch = 4;
};

// The compaction.
struct compact_tuning {
  // Shared memory the chunks' rows are staged in: as much as leaves two blocks per SM
  // beside the kernel's static arrays.
  static constexpr std::size_t staging_bytes = 96 * 1024;
  static constexpr int blocks_per_sm = 2;
  static constexpr std::size_t static_reserve = 16 * 1024;  // the kernel's static shared memory, rounded up
  // Column slices of a row (launches of few rows) are at least this wide.
  static constexpr std::int64_t min_slice_bytes = 64;

  // Staging bytes where the device allows them, else what it allows (no device: the
  // default, and the launch fails anyway).
  static std::size_t staging_limit(const device_limits& dev) {
    const bool room = dev.smem_per_block > staging_bytes + static_reserve;
    const bool unknown = dev.smem_per_block <= static_reserve;
    return room || unknown ? staging_bytes : dev.smem_per_block - static_reserve;
  }
};

// Lightning redundancy on tensor cores: one kernel template, three register budgets.
// Threads per block, the blocks per SM its registers are capped for, and the largest
// head dim whose softmax statistics (for the score stage) fit in those registers.
template <int Threads, int BlocksPerSm, std::int32_t StatisticsMaxHeadDim>
struct lightning_tuning {
  static constexpr int threads = Threads;
  static constexpr int blocks_per_sm = BlocksPerSm;
  static constexpr std::int32_t statistics_max_head_dim = StatisticsMaxHeadDim;
};
// Three blocks per SM fit in shared memory (b 256 up to d 128).
using lightning_three = lightning_tuning<256, 3, 128>;
// Two fit and not three (b 256 at d 144 to 208): the cap of two has room for the
// statistics' query fragments up to d 256.
using lightning_pair = lightning_tuning<256, 2, 256>;
// One fits (b 256 at d 224 to 256): twice the threads, so the SM still runs 16 warps.
using lightning_wide = lightning_tuning<512, 1, 256>;

// Every tuning constant above, one line per stage (the bench records it beside its times).
inline std::string describe_tuning() {
  const auto lightning = [](auto t) {
    using T = decltype(t);
    return detail::format("{} threads, {} blocks/SM, statistics up to d {}", T::threads, T::blocks_per_sm,
                          T::statistics_max_head_dim);
  };
  return detail::format(
      "score: {} blocks/SM, at least {} key tiles per split\n"
      "epilogue: {} blocks/SM, {} loads ahead\n"
      "compact: {} B staging, {} blocks/SM, slices of at least {} B\n"
      "lightning three: {}\nlightning pair: {}\nlightning wide: {}",
      score_tuning::blocks_per_sm, score_tuning::min_tiles_per_split, epilogue_tuning::blocks_per_sm,
      epilogue_tuning::load_batch, compact_tuning::staging_bytes, compact_tuning::blocks_per_sm,
      compact_tuning::min_slice_bytes, lightning(lightning_three{}), lightning(lightning_pair{}),
      lightning(lightning_wide{}));
}

}  // namespace cuda
KVP_NAMESPACE_END
