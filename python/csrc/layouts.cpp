#include "layouts.hpp"

#include <kvpolicy/core/error.hpp>

namespace kvpy {

const layout_spec& find_layout(std::string_view name, const std::string& field) {
  std::string names;
  for (const layout_spec& s : layout_specs) {
    if (s.name == name) return s;
    names += (names.empty() ? "'" : ", '") + std::string(s.name) + "'";
  }
  kvp::require(false, field, "is '{}'; expected one of {}", name, names);
  return layout_specs[0];
}

}  // namespace kvpy
