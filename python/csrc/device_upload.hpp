// Host values written into device memory by a kernel that takes them as arguments:
// stream-ordered, no host buffer to outlive the call, and recorded by value when the
// stream is captured into a CUDA graph (a cudaMemcpyAsync from pageable memory
// would be neither). Used for the layer tables and host-side batch items.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace kvpy {

// Copies `bytes` from host `src` to device `dst` on `stream`, in whole 8-byte words:
// `dst` has room for `bytes` rounded up to 8 (the tail past `bytes` is written 0).
// Batch items are 20 bytes, so an odd count ends in half a word.
cudaError_t upload_by_arguments(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

}  // namespace kvpy
