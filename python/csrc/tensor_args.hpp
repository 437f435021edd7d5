// Reading the caller's DLPack arrays (NumPy, PyTorch, CuPy, ...): where they live,
// their element type, shape and strides, each mismatch a kvp::error naming the
// argument. Nothing here copies: an array that would need a conversion is refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <kvpolicy/core/dtype.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace kvpy {

using array = nanobind::ndarray<nanobind::ro>;  // any element type and device, read only
using mut_array = nanobind::ndarray<>;          // the same, written in place

// The array behind `h` (no copy, no conversion); `field` names it in errors.
array readable(nanobind::handle h, const std::string& field);
mut_array writable(nanobind::handle h, const std::string& field);

// Where an array lives.
struct place {
  bool device = false;  // CUDA memory (device or managed); false: host (CPU or pinned)
  int id = 0;           // CUDA device
  bool operator==(const place&) const = default;
};
template <class A>
place place_of(const A& a, const std::string& field);
std::string describe(const place& p);

// The cache's element type (float16, bfloat16, float32).
template <class A>
kvp::dtype cache_dtype(const A& a, const std::string& field);

template <class A>
std::string dtype_name(const A& a);
template <class A>
std::string shape_of(const A& a);  // "(2, 16, 4)"
template <class A>
std::string strides_of(const A& a);

// Checks, each naming `field`:
template <class A>
void require_ndim(const A& a, std::size_t ndim, const std::string& field, const char* axes);
template <class A>
void require_dtype(const A& a, nanobind::dlpack::dtype t, const std::string& field, const char* name);
// A 1-D array whose elements are adjacent (what the executors index as a plain pointer).
template <class A>
void require_vector(const A& a, const std::string& field);
void require_place(const place& p, const place& cache, const std::string& field);

// Element types the executors read.
inline constexpr nanobind::dlpack::dtype int32_type = nanobind::dtype<std::int32_t>();
inline constexpr nanobind::dlpack::dtype uint32_type = nanobind::dtype<std::uint32_t>();
inline constexpr nanobind::dlpack::dtype uint8_type = nanobind::dtype<std::uint8_t>();
inline constexpr nanobind::dlpack::dtype bool_type = nanobind::dtype<bool>();
inline constexpr nanobind::dlpack::dtype float32_type = nanobind::dtype<float>();

}  // namespace kvpy
