// What a stage launches (launch_plan), and the one function that launches it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/cuda/common.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

// One kernel launch of a stage, as its plan computes it: validation, workspace sizing
// and the launch itself all read this, so no launch size is computed twice.
struct launch_plan {
  const char* kernel = nullptr;  // the kernel (variant) by name; null: nothing is launched
  unsigned grid_x = 0, grid_y = 1;
  unsigned threads = row_threads;
  std::size_t smem = 0;  // dynamic shared memory, bytes

  bool launches() const noexcept { return kernel != nullptr; }
};

inline std::string describe(const launch_plan& l) {
  if (!l.launches()) return "-";
  return detail::format("{} <<<({}, {}), {}, {} B>>>", l.kernel, l.grid_x, l.grid_y, l.threads, l.smem);
}

// Whether the image of `kernel` that the current device runs was built for sm_90 or
// later (so that a programmatic dependent launch waits where it must). Asked of the
// runtime once per kernel and device: the query costs about as much host time as a
// launch.
template <class Kernel>
bool built_for_sm90(Kernel kernel) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static std::mutex guard;
  static std::map<std::pair<const void*, int>, bool> known;
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
  {
    const std::lock_guard lock(guard);
    if (const auto it = known.find(key); it != known.end()) return it->second;
  }
  cudaFuncAttributes built{};
  const bool sm90 = cudaFuncGetAttributes(&built, kernel) == cudaSuccess && built.ptxVersion >= 90;
  const std::lock_guard lock(guard);
  known.emplace(key, sm90);
  return sm90;
}

// Launches `kernel` as `plan` says on `stream`. `programmatic`: as a programmatic
// dependent launch (the kernel calls cuda::wait_for_prerequisites before it reads what
// the kernel before it wrote), where the kernel was built for sm_90 or later.
template <class Kernel, class... Args>
void launch(const launch_plan& plan, cudaStream_t stream, bool programmatic, Kernel kernel, Args... args) {
  // Dynamic shared memory beyond 48 KB minus the kernel's static shared memory (CUB's
  // scans, say) needs the opt-in; every launch that asks for some opts in, so a
  // request just under 48 KB does not fail on top of static storage.
  if (plan.smem > 0)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem));
  const dim3 grid(plan.grid_x, plan.grid_y);
  if (programmatic && built_for_sm90(kernel)) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(plan.threads);
    config.dynamicSmemBytes = plan.smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
    cudaLaunchKernelEx(&config, kernel, args...);
  } else {
    kernel<<<grid, plan.threads, plan.smem, stream>>>(args...);
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
