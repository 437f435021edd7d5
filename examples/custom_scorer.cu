// The CUDA build of the custom-policy example: the same source as the host build,
// compiled by nvcc, which also runs every pipeline on kvp::cuda_executor.
#include "custom_scorer.cpp"
