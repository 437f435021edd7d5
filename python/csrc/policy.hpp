// The policies the package exposes: the nine presets, as one value type (KV-Compress,
// kvp::presets::kv_compress, runs over a per-head cache instead: csrc/per_head.cpp). Plain C++
// (no nanobind), so the nvcc-compiled device path and the bindings share it.
#pragma once

#include <cstddef>
#include <string_view>
#include <type_traits>
#include <variant>

#include <kvpolicy/pipeline/kv_compress_preset.hpp>
#include <kvpolicy/pipeline/presets.hpp>

namespace kvpy {

using policy = std::variant<kvp::presets::zipage, kvp::presets::rkv, kvp::presets::gkv, kvp::presets::snapkv,
                            kvp::presets::h2o, kvp::presets::streaming_llm, kvp::presets::hard_kv,
                            kvp::presets::hard_kv_rkv, kvp::presets::kara>;

// The preset's name as kvp::presets spells it ("zipage", "streaming_llm").
template <class P>
constexpr std::string_view preset_name() noexcept {
  if constexpr (std::is_same_v<P, kvp::presets::zipage>) return "zipage";
  else if constexpr (std::is_same_v<P, kvp::presets::rkv>) return "rkv";
  else if constexpr (std::is_same_v<P, kvp::presets::gkv>) return "gkv";
  else if constexpr (std::is_same_v<P, kvp::presets::snapkv>) return "snapkv";
  else if constexpr (std::is_same_v<P, kvp::presets::h2o>) return "h2o";
  else if constexpr (std::is_same_v<P, kvp::presets::hard_kv>) return "hard_kv";
  else if constexpr (std::is_same_v<P, kvp::presets::hard_kv_rkv>) return "hard_kv_rkv";
  else if constexpr (std::is_same_v<P, kvp::presets::kara>) return "kara";
  else if constexpr (std::is_same_v<P, kvp::presets::kv_compress>) return "kv_compress";
  else return "streaming_llm";
}

}  // namespace kvpy
