// kvpolicy._core: the compiled half of the kvpolicy package (src/kvpolicy/__init__.py is
// the API). Each register_* binds one part.
#include <nanobind/nanobind.h>

#include "decode_attention.hpp"
#include "device_binding.hpp"
#include "errors.hpp"
#include "host_compress.hpp"
#include "paged_cache.hpp"
#include "per_head.hpp"
#include "presets.hpp"

NB_MODULE(_core, m) {
  m.doc() = "kvpolicy's compiled core: presets, PagedCache, the host and CUDA executors.";
  kvpy::register_errors(m);
  kvpy::register_presets(m);
  kvpy::register_paged_cache(m);
  kvpy::register_host_compress(m);
  kvpy::register_device(m);
  kvpy::register_per_head(m);
  kvpy::register_decode_attention(m);
}
