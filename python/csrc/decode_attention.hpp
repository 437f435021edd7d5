// Decode attention (kvpolicy.decode_attention_per_head, kvpolicy.decode_attention): one
// new query token per sequence over one layer of a per-head block cache or of a
// kvpolicy.PagedCache (heads' own counts, cautious update's live bytes), optionally
// adding each attended token's probabilities to a metric in the same pass. Host
// arrays run kvp::host::decode_attention (the reference), CUDA arrays
// kvp::cuda_decode_attention.
#pragma once

#include <nanobind/nanobind.h>

namespace kvpy {

void register_decode_attention(nanobind::module_& m);

}  // namespace kvpy
