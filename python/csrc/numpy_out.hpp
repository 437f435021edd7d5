// Hands a std::vector to Python as a NumPy array that owns it (no copy).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace kvpy {

template <class T>
nanobind::ndarray<nanobind::numpy, T> to_numpy(std::vector<T>&& values, std::vector<std::size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nanobind::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nanobind::ndarray<nanobind::numpy, T>(owned->data(), shape.size(), shape.data(), owner);
}

}  // namespace kvpy
