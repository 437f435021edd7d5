// Block-wide selection over one row's 64-bit rank keys (select/rank_order.hpp: all
// distinct), 8 bits at a time, the keys recomputed by the caller's function on each
// pass (no copy of the row). Every selector kind's kernel calls these; every thread
// of the block calls each one and gets the same result.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/cuda/common.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// One thread per 8-bit digit.
static_assert(row_threads == 256, "the radix select gives each of the 256 digits a thread");
using digit_scan = cub::BlockScan<std::int32_t, row_threads>;
using mass_scan = cub::BlockScan<float, row_threads>;

// Adds each lane's digit to a shared histogram, one atomic per distinct digit of the
// warp: keys of a row crowd a few digits in the high passes (a float's exponent), and
// same-address shared atomics serialise. Every lane of the warp must call it (full
// mask); a lane with nothing to add passes no_digit.
inline constexpr std::uint32_t no_digit = 256;
__device__ inline void count_digit(std::uint32_t* hist, std::uint32_t digit) {
  const unsigned peers = __match_any_sync(0xffffffffu, digit);
  if (digit != no_digit && (threadIdx.x & 31u) == static_cast<unsigned>(__ffs(static_cast<int>(peers)) - 1))
    atomicAdd(hist + digit, static_cast<std::uint32_t>(__popc(peers)));
}

struct radix_select_storage {
  typename digit_scan::TempStorage scan;
  std::uint32_t hist[256];
  std::uint64_t prefix;
  std::int32_t remaining;
  bool settled;  // every key under the prefix is selected: lower digits change nothing
};

// The threshold of the k largest of the n keys key_of(t), t in [0, n): exactly the
// k keys at or above it. k in [0, n]; k = 0 gives a threshold above every key.
template <class KeyOf>
__device__ std::uint64_t block_kth_largest(KeyOf key_of, std::int32_t n, std::int32_t k, radix_select_storage& sh) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.remaining = k;
    sh.settled = false;
  }
  std::uint64_t mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    sh.hist[threadIdx.x] = 0;
    __syncthreads();
    const std::uint64_t prefix = sh.prefix;
    const std::int32_t remaining = sh.remaining;
    // Whole warps walk the keys, so each digit is added once per warp (count_digit).
    for (std::int32_t t0 = 0; t0 < n; t0 += static_cast<std::int32_t>(blockDim.x)) {
      const std::int32_t t = t0 + static_cast<std::int32_t>(threadIdx.x);
      std::uint32_t digit = no_digit;
      if (t < n) {
        const std::uint64_t key = key_of(t);
        if ((key & mask) == prefix) digit = static_cast<std::uint32_t>(key >> shift) & 0xffu;
      }
      count_digit(sh.hist, digit);
    }
    __syncthreads();
    // Thread i holds digit 255 - i; counts from the top digit down, the selected digit
    // is the first whose running count reaches `remaining` (the last digit when none
    // does, 255 when nothing remains: as a serial walk would choose).
    const std::int32_t i = static_cast<std::int32_t>(threadIdx.x), digit = 255 - i;
    const auto count = static_cast<std::int32_t>(sh.hist[digit]);
    std::int32_t through = 0;
    digit_scan(sh.scan).InclusiveSum(count, through);
    const std::int32_t above = through - count;
    if ((through >= remaining || i == 255) && (i == 0 || above < remaining)) {
      sh.remaining = remaining - above;
      sh.prefix = prefix | (static_cast<std::uint64_t>(digit) << shift);
      sh.settled = count == remaining - above;
    }
    mask |= 0xffull << shift;
    __syncthreads();
    if (sh.settled) break;  // keys >= the prefix with zero low bits are exactly the selected ones
  }
  const std::uint64_t threshold = sh.prefix;
  __syncthreads();  // the storage is free for the next call
  return threshold;
}

struct weighted_select_storage {
  typename mass_scan::TempStorage mass_scan_storage;
  radix_select_storage base;
  float mass[256];     // per digit; then the running mass from the top digit down
  float through[256];
  std::int32_t above;  // keys ranked above the prefix's range
  float need;          // weight still to reach within the range
  std::int32_t result;  // >= 0 once found
};

// The fewest of the n keys, taken from the largest down, whose weights weight_of(t)
// (each >= 0) add up to at least `target`; n when all of them fall short. Per pass, a
// histogram of counts and of weights per digit under the prefix: the digit where the
// weights, from the top digit down, reach what is still needed holds the last key
// taken. Weights are added in shared memory in the order the threads come, so a
// total within rounding of `target` may go either way (docs/cuda.md).
template <class KeyOf, class WeightOf>
__device__ std::int32_t block_fewest_reaching(KeyOf key_of, WeightOf weight_of, std::int32_t n, float target,
                                              weighted_select_storage& sh) {
  if (!(target > 0.0f)) return 0;
  if (threadIdx.x == 0) {
    sh.base.prefix = 0;
    sh.above = 0;
    sh.need = target;
    sh.result = -1;
  }
  std::uint64_t mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    sh.base.hist[threadIdx.x] = 0;
    sh.mass[threadIdx.x] = 0.0f;
    __syncthreads();
    const std::uint64_t prefix = sh.base.prefix;
    const float need = sh.need;
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
      const std::uint64_t key = key_of(t);
      if ((key & mask) == prefix) {
        const std::uint32_t digit = (key >> shift) & 0xffu;
        atomicAdd(&sh.base.hist[digit], 1u);
        atomicAdd(&sh.mass[digit], static_cast<float>(weight_of(t)));
      }
    }
    __syncthreads();
    const std::int32_t i = static_cast<std::int32_t>(threadIdx.x), digit = 255 - i;
    const auto count = static_cast<std::int32_t>(sh.base.hist[digit]);
    const float mass = sh.mass[digit];
    std::int32_t through = 0;
    float summed = 0.0f, through_mass = 0.0f;
    digit_scan(sh.base.scan).InclusiveSum(count, through);
    mass_scan(sh.mass_scan_storage).InclusiveSum(mass, summed);
    __syncthreads();
    // A running max of the running sums: non-decreasing to the bit (a tree of float
    // additions need not be), so exactly one digit is the first to reach `need`.
    mass_scan(sh.mass_scan_storage).InclusiveScan(summed, through_mass, max_op{});
    sh.through[i] = through_mass;
    __syncthreads();
    const float above_mass = i == 0 ? 0.0f : sh.through[i - 1];
    if (through_mass >= need && (i == 0 || above_mass < need)) {
      // The last key taken has this digit: keys of higher digits are all taken.
      sh.above += through - count;
      sh.need = need - above_mass;
      sh.base.prefix = prefix | (static_cast<std::uint64_t>(digit) << shift);
      if (count == 1 || shift == 0) sh.result = sh.above + 1;
    } else if (i == 255 && through_mass < need) {
      sh.result = sh.above + through;  // the whole range falls short: take all of it
    }
    mask |= 0xffull << shift;
    __syncthreads();
    if (sh.result >= 0) break;
  }
  const std::int32_t result = sh.result;
  __syncthreads();
  return result;
}

}  // namespace cuda
KVP_NAMESPACE_END
