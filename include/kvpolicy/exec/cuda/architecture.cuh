// The oldest GPU the CUDA executor's kernels build for: compute capability 8.0. They
// use cp.async and bf16 mma.sync, which ptxas rejects below sm_80 with thousands of
// errors; one line that names the fix comes first instead.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kvpolicy's CUDA kernels need compute capability 8.0 or newer: build for sm_80 or above (nvcc -arch=sm_90a for Hopper, -arch=sm_80 for Ampere; CMake: CMAKE_CUDA_ARCHITECTURES 90a)"
#endif
