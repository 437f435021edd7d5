// The one exception type: every rejected input names its field and its value.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
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

// A field's path made of a pattern and values ("cache.{}.table[{}]"), formatted only
// when its check fails: validation runs on every call, and formatting the paths
// eagerly was a large share of the CUDA executor's host time per compression.
template <class... Args>
struct field_path {
  std::string_view pattern;
  std::tuple<Args...> args;
  std::string str() const {
    return std::apply([&](const Args&... a) { return format(pattern, a...); }, args);
  }
};
template <class... Args>
field_path<std::decay_t<Args>...> path(std::string_view pattern, Args&&... args) {
  return {pattern, {std::forward<Args>(args)...}};
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
template <class... Path, class... Args>
void require(bool ok, const detail::field_path<Path...>& field, std::string_view message, const Args&... args) {
  if (!ok) throw error(field.str(), detail::format(message, args...));
}

KVP_NAMESPACE_END
