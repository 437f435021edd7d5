// The one exception type: every rejected input names its field and its value.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

// fmt 9 turns its constexpr support off under nvcc, and then its own constexpr
// functions fail to compile as C++20 in nvcc's host pass; with it on, they compile.
// (The kvpolicy CMake target also sets this for CUDA sources, whatever the include order.)
#if defined(__NVCC__) && !defined(FMT_USE_CONSTEXPR)
#define FMT_USE_CONSTEXPR 1
#endif
#include <fmt/core.h>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {
// Runtime-checked formatting: fmt's compile-time format strings are consteval,
// which nvcc's front end rejects, and these headers must compile under nvcc too.
template <class... Args>
std::string format(std::string_view f, const Args&... args) {
  return fmt::vformat(f, fmt::make_format_args(args...));
}
}  // namespace detail

class error : public std::invalid_argument {
 public:
  error(std::string field, const std::string& message)
      : std::invalid_argument(detail::format("kvpolicy: {}: {}", field, message)), field_(std::move(field)) {}

  // The offending field, as a path into the arguments: "batch[2].budget", "cache.k_stride.dim".
  const std::string& field() const noexcept { return field_; }

 private:
  std::string field_;
};

// Throws kvp::error naming `field` when `ok` is false; the message is formatted lazily.
template <class... Args>
void require(bool ok, std::string_view field, std::string_view message, const Args&... args) {
  if (!ok) throw error(std::string(field), detail::format(message, args...));
}

KVP_NAMESPACE_END
