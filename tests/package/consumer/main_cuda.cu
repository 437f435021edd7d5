// A CUDA engine's translation unit, built the way README's "Using kvpolicy from CMake"
// says (CUDA enabled, an architecture the kernels support, kvpolicy::kvpolicy linked,
// no other flag): the two-phase compress call compiled for the GPU. The package test
// builds it and does not run it (CI has no GPU); the GPU tests run the same calls.
#include <kvpolicy/kvpolicy.cuh>

#include <cstddef>

auto compress_streaming_llm(void* workspace, std::size_t& workspace_bytes, const kvp::paged_kv_view& cache,
                            const kvp::device_batch& batch, const kvp::device_result& out, cudaStream_t stream) {
  const kvp::cuda_executor executor{.stream = stream};
  return executor.compress(workspace, workspace_bytes, kvp::presets::streaming_llm{}, cache, kvp::query_window_view{},
                           kvp::score_view{}, batch, out);
}
