// kvpolicy.PagedCache: the caller's cache tensors, block table and lengths, read once
// into a cache_description (shape read off the tensors, layout by name) and kept
// alive as long as the object. No byte is copied.
#pragma once

#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "cache_description.hpp"
#include "tensor_args.hpp"

namespace kvpy {

struct paged_cache {
  std::string layout;
  std::string framework;  // the top-level module of the cache tensors' type: "numpy", "torch", ...
  cache_description desc;
  std::vector<mut_array> written;  // arrays the executors write: K/V, positions
  std::vector<array> read;         // arrays they only read: block table, lengths, sharing
};

void register_paged_cache(nanobind::module_& m);

}  // namespace kvpy
