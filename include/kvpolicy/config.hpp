// kvpolicy configuration: one host/device macro and the versioned namespace.
#pragma once

// Concepts, std::span and designated initialisers are everywhere: say what is missing
// before the first error about one of them (nvcc defaults to C++17).
#if __cplusplus < 202002L
#error "kvpolicy needs C++20: compile with -std=c++20 (nvcc too: CMake 3.25 gives nvcc no standard flag of its own; README, 'Using kvpolicy from CMake')"
#endif

#define KVPOLICY_VERSION_MAJOR 0
#define KVPOLICY_VERSION_MINOR 1
#define KVPOLICY_VERSION_PATCH 0

// KVP_HOST_DEVICE marks the address math and policy hooks that run both in the
// host reference loops and inside kernels. Under plain g++ it expands to nothing.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVP_HOST_DEVICE __host__ __device__
#define KVP_DEVICE __device__
#define KVP_FORCEINLINE __forceinline__
#else
#define KVP_HOST_DEVICE
#define KVP_DEVICE
#define KVP_FORCEINLINE inline __attribute__((always_inline))
#endif

// The inline namespace carries the ABI version: two versions of the library can
// coexist in one binary, and a mismatch shows up as a link error, not a crash.
#define KVP_NAMESPACE_BEGIN \
  namespace kvp {           \
  inline namespace v0_1 {
#define KVP_NAMESPACE_END \
  }                       \
  }
