// kvpolicy with the CUDA executor. Include from .cu files compiled by nvcc.
#pragma once

#include "kvpolicy/kvpolicy.hpp"
#include "kvpolicy/attention/decode_attention.cuh"
#include "kvpolicy/exec/cuda_executor.cuh"
#include "kvpolicy/exec/cuda_per_head_executor.cuh"
#include "kvpolicy/exec/cuda_per_head_metric.cuh"
