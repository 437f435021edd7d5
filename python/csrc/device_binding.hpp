// The device path's bindings: workspace size, compress on a stream, status check,
// and a fallback allocator. Registered only in a build with CUDA; `has_cuda` always.
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

void register_device(nanobind::module_& m);

}  // namespace kvpy
