// Must not compile: a redundancy whose pairs scope no GPU stage kind runs. The CUDA
// executor stops at the static_assert of cuda::redundancy_stage_of, which names the
// concept to satisfy and the docs section to read (tests/CMakeLists.txt checks the text).
#include "kvpolicy/kvpolicy.cuh"

using odd_scope = kvp::redundancy::key_redundancy<static_cast<kvp::redundancy::scope>(7)>;
using odd_pipeline = kvp::pipeline<kvp::scorer::window_attention, kvp::none, odd_scope, kvp::select::top_k,
                                   kvp::layout::compact>;

int main() {
  std::size_t bytes = 0;
  return static_cast<int>(kvp::cuda_executor{}.compress(nullptr, bytes, odd_pipeline{}, kvp::paged_kv_view{},
                                                        kvp::query_window_view{}, kvp::score_view{},
                                                        kvp::device_batch{}, kvp::device_result{}));
}
