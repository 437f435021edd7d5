// The few CUDA runtime calls the bindings make outside a compression.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include <kvpolicy/exec/cuda_executor.cuh>

#include "device_compress.hpp"

namespace kvpy {

namespace {
void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("kvpolicy: ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace

bool stream_is_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ok(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

void check_status(const std::int32_t* status, void* stream) {
  std::int32_t host[kvp::status_words] = {};
  const auto s = static_cast<cudaStream_t>(stream);
  ok(cudaMemcpyAsync(host, status, sizeof host, cudaMemcpyDeviceToHost, s), "reading the status");
  ok(cudaStreamSynchronize(s), "waiting for the compression");
  kvp::check(host);
}

void* device_alloc(std::size_t bytes, void* stream) {
  void* p = nullptr;
  ok(cudaMallocAsync(&p, bytes ? bytes : 1, static_cast<cudaStream_t>(stream)), "cudaMallocAsync");
  return p;
}

void device_free(void* p, void* stream) noexcept { cudaFreeAsync(p, static_cast<cudaStream_t>(stream)); }

device_scope::device_scope(int device) {
  ok(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    ok(cudaSetDevice(device), "cudaSetDevice");
  } else {
    previous_ = -1;  // nothing to restore
  }
}

device_scope::~device_scope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace kvpy
