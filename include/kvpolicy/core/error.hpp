// The one exception type: every rejected input names its field and its value.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

class error : public std::invalid_argument {
 public:
  error(std::string field, const std::string& message)
      : std::invalid_argument(fmt::format("kvpolicy: {}: {}", field, message)), field_(std::move(field)) {}

  // The offending field, as a path into the arguments: "batch[2].budget", "cache.k_stride.dim".
  const std::string& field() const noexcept { return field_; }

 private:
  std::string field_;
};

// Throws kvp::error naming `field` when `ok` is false; the message is formatted lazily.
template <class... Args>
void require(bool ok, std::string_view field, fmt::format_string<Args...> fmt_str, Args&&... args) {
  if (!ok) throw error(std::string(field), fmt::format(fmt_str, std::forward<Args>(args)...));
}

KVP_NAMESPACE_END
