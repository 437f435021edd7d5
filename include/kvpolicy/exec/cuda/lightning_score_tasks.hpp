// The order in which cuda::lightning_score_kernel takes its tasks: plain arithmetic,
// so that host code (and the host tests) can enumerate it.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// The order tasks are taken in: each row's `blocks` lightning tasks adjacent, and
// the `splits` score tasks of row r - lag after those of row r, so that a score task
// comes `lag` rows after its lightning (time for them to finish: a score task waits
// for its row's lightning tasks, which all took earlier tickets and so are running or
// done, whatever order the hardware starts blocks in).
struct lightning_score_tasks {
  std::uint32_t rows, blocks, splits, lag;  // lag <= rows

  struct task {
    bool score;
    std::uint32_t row, part;  // part: the cache block (lightning) or the key split (score)
  };

  KVP_HOST_DEVICE constexpr std::uint32_t count() const { return rows * (blocks + splits); }

  KVP_HOST_DEVICE constexpr task operator[](std::uint32_t t) const {
    const std::uint32_t lead = lag * blocks, per = blocks + splits, steady = (rows - lag) * per;
    if (t < lead) return {false, t / blocks, t % blocks};
    t -= lead;
    if (t < steady) {
      const std::uint32_t slot = t / per, within = t % per;
      return within < blocks ? task{false, lag + slot, within} : task{true, slot, within - blocks};
    }
    t -= steady;
    return {true, rows - lag + t / splits, t % splits};
  }
};

}  // namespace cuda
KVP_NAMESPACE_END
