#include "device_upload.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvpy {
namespace {

// 2 KiB of words per launch: within the 4 KiB of kernel parameters every
// architecture and driver accepts.
constexpr int chunk_words = 256;
struct word_chunk {
  std::uint64_t words[chunk_words];
};

__global__ void write_words(word_chunk chunk, std::uint64_t* dst, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = chunk.words[i];
}

}  // namespace

cudaError_t upload_by_arguments(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  const std::size_t words = (bytes + sizeof(std::uint64_t) - 1) / sizeof(std::uint64_t);
  auto* out = static_cast<std::uint64_t*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  for (std::size_t first = 0; first < words; first += chunk_words) {
    const int count = static_cast<int>(words - first < chunk_words ? words - first : chunk_words);
    word_chunk chunk{};  // a last partial word is read up to `bytes` and zero-padded
    const std::size_t at = first * sizeof(std::uint64_t);
    std::memcpy(chunk.words, in + at, std::min(bytes - at, count * sizeof(std::uint64_t)));
    write_words<<<1, chunk_words, 0, stream>>>(chunk, out + first, count);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace kvpy
