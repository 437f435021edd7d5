// kvp::error (which names the offending field) raised in Python as kvpolicy.Error.
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

// Binds kvpolicy.Error (defined in src/kvpolicy/errors.py) as `m.Error` and translates
// every kvp::error thrown below a binding into it, its field as `.field`.
void register_errors(nanobind::module_& m);

}  // namespace kvpy
