// A read-only reference to one (token, head) row of d elements, any dtype.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"

KVP_NAMESPACE_BEGIN

// What a key scorer sees of a key. Element reads widen to fp32 exactly, so the
// same hook gives the same float on host and device.
struct row_ref {
  const void* data = nullptr;
  dtype type = dtype::f32;
  std::int32_t dim = 0;

  KVP_HOST_DEVICE float operator[](std::int32_t i) const noexcept { return load_as_float(data, type, i); }
  KVP_HOST_DEVICE std::int32_t size() const noexcept { return dim; }
};

KVP_NAMESPACE_END
