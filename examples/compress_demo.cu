// The CUDA build of the demo: the same source as the host build, compiled by nvcc,
// which adds `--device cuda` (kvp::cuda_executor; kvp::cuda_per_head_executor for
// `--preset kv_compress`) and `--device both`.
// examples/CMakeLists.txt builds kvpolicy_demo from this file when CUDA is enabled.
#include "compress_demo.cpp"
