// The CUDA build of the decode loop: the same source as the host build, compiled by
// nvcc, with the GPU backend (decode_loop_gpu.cuh) and --device cuda, the default
// when a GPU is present. examples/CMakeLists.txt builds kvpolicy_decode_loop from
// this file when CUDA is enabled.
#include "decode_loop.cpp"
