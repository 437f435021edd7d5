// Copies between std::vector and thrust::device_vector, for the GPU tests.
#pragma once

#include <vector>

#include <thrust/copy.h>
#include <thrust/device_vector.h>

namespace kvp_test {

template <class T>
thrust::device_vector<T> to_device(const std::vector<T>& v) {
  return thrust::device_vector<T>(v.begin(), v.end());
}
template <class T>
std::vector<T> to_host(const thrust::device_vector<T>& v) {
  std::vector<T> h(v.size());
  thrust::copy(v.begin(), v.end(), h.begin());
  return h;
}

}  // namespace kvp_test
