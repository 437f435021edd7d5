// The presets as Python classes: kvpolicy.Zipage(window=8, alpha=0.9), ...
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

// Binds Zipage, RKV, GKV, SnapKV, H2O, StreamingLLM, HardKV, HardKVRKV and Kara: keyword arguments mapped onto
// the preset's fields, each also a read-write property; `params()` returns them all.
void register_presets(nanobind::module_& m);

}  // namespace kvpy
