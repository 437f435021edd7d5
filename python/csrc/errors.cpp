#include "errors.hpp"

#include <exception>

#include <kvpolicy/core/error.hpp>
#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace kvpy {

void register_errors(nb::module_& m) {
  // The class lives in Python (a ValueError subclass with a docstring and .field);
  // src/kvpolicy/__init__.py imports kvpolicy.errors before this module.
  nb::object cls = nb::module_::import_("kvpolicy.errors").attr("Error");
  m.attr("Error") = cls;
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* payload) {
        try {
          std::rethrow_exception(p);
        } catch (const kvp::error& e) {
          PyObject* type = static_cast<PyObject*>(payload);
          nb::object value = nb::borrow(type)(e.what(), e.field());
          PyErr_SetObject(type, value.ptr());
        }
      },
      cls.release().ptr());  // a reference held for as long as the translator lives
}

}  // namespace kvpy
