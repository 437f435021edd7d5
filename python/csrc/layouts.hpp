// The engines' cache layouts by name: which axis of the caller's tensor(s) is which.
// The strides are then read off the tensors themselves, so a strided view (a slice,
// a permuted stride order) needs no copy; for contiguous tensors the view equals
// what kvp::layouts::* builds (docs/views.md's table; python/tests/test_layouts.py).
#pragma once

#include <string>
#include <string_view>

namespace kvpy {

// Axis letters: L layer, 2 K-or-V, B block, T token in block, H KV head, D head dim,
// C K and V side by side (2 * head dim: K's d elements, then V's; vLLM from v0.26).
struct layout_spec {
  std::string_view name;
  bool split_kv;   // K and V are separate tensors (arguments k and v), else one (kv)
  bool per_layer;  // one tensor per layer (a list, or one tensor with a leading L axis)
  std::string_view axes;  // the axes of one tensor (of one layer when per_layer)
  std::string_view engine;
};

inline constexpr layout_spec layout_specs[] = {
    {"vllm", false, true, "BHTC",
     "vLLM from v0.26: per layer [num_blocks, h_kv, b, 2 * d], K then V in the last axis, in any of its memory "
     "orders (the layer views its allocator hands out)"},
    {"vllm_flash", false, true, "2BTHD", "vLLM flash-attention backend to v0.22: per layer [2, num_blocks, b, h_kv, d]"},
    {"vllm_flash_blocks_first", false, true, "B2THD",
     "vLLM v0.23 to v0.25, K and V per block: per layer [num_blocks, 2, b, h_kv, d]"},
    {"nhd", true, true, "BTHD", "FlashInfer NHD: per layer K and V [num_blocks, b, h_kv, d]"},
    {"hnd", true, true, "BHTD", "FlashInfer HND: per layer K and V [num_blocks, h_kv, b, d]"},
    {"nano_vllm", false, false, "2LBTHD", "nano-vllm: one tensor [2, L, num_blocks, b, h_kv, d]"},
    {"sglang", true, true, "BHD", "SGLang token pool: per layer K and V [pool_size, h_kv, d] (blocks of one token)"},
    {"trtllm_blocks_first", false, false, "BL2HTD", "TensorRT-LLM block pool: one tensor [num_blocks, L, 2, h_kv, b, d]"},
    {"trtllm_layers_first", false, true, "B2HTD", "TensorRT-LLM, layers first: per layer [num_blocks, 2, h_kv, b, d]"},
};

// The spec called `name`; throws kvp::error naming `field` when there is none.
const layout_spec& find_layout(std::string_view name, const std::string& field);

}  // namespace kvpy
