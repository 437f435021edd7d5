#include "tensor_args.hpp"

#include <kvpolicy/core/error.hpp>
#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace kvpy {

namespace {
std::string type_of(nb::handle h) { return nb::cast<std::string>(nb::type_name(h.type())); }
}  // namespace

array readable(nb::handle h, const std::string& field) {
  array a;
  kvp::require(!h.is_none(), field, "is None; an array is needed");
  if (!nb::try_cast(h, a, false))
    kvp::require(false, field, "is a {}; expected an array (NumPy, PyTorch, CuPy or another DLPack array)", type_of(h));
  return a;
}

mut_array writable(nb::handle h, const std::string& field) {
  mut_array a;
  if (nb::try_cast(h, a, false)) return a;
  array ro;
  kvp::require(!nb::try_cast(h, ro, false), field, "is a read-only array; it is compressed in place");
  readable(h, field);  // raises what readable() raises for a non-array
  return a;
}

template <class A>
place place_of(const A& a, const std::string& field) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value: return {false, 0};
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: return {true, a.device_id()};
  }
  kvp::require(false, field, "lives on DLPack device type {}; kvpolicy runs on host and CUDA memory", a.device_type());
  return {};
}
template place place_of(const array&, const std::string&);
template place place_of(const mut_array&, const std::string&);

std::string describe(const place& p) { return p.device ? kvp::detail::format("CUDA device {}", p.id) : "the host"; }

template <class A>
std::string dtype_name(const A& a) {
  const auto t = a.dtype();
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: return kvp::detail::format("DLPack type code {} of {} bits", t.code, t.bits);
  }
  return kvp::detail::format("{}{}", kind, t.bits);
}
template std::string dtype_name(const array&);
template std::string dtype_name(const mut_array&);

template <class A>
kvp::dtype cache_dtype(const A& a, const std::string& field) {
  const auto t = a.dtype();
  if (t.lanes == 1 && t.bits == 16 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float))
    return kvp::dtype::f16;
  if (t.lanes == 1 && t.bits == 16 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat))
    return kvp::dtype::bf16;
  if (t.lanes == 1 && t == float32_type) return kvp::dtype::f32;
  kvp::require(false, field, "has element type {}; expected float16, bfloat16 or float32", dtype_name(a));
  return {};
}
template kvp::dtype cache_dtype(const array&, const std::string&);
template kvp::dtype cache_dtype(const mut_array&, const std::string&);

template <class A>
std::string shape_of(const A& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += kvp::detail::format(i ? ", {}" : "{}", a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}
template std::string shape_of(const array&);
template std::string shape_of(const mut_array&);

template <class A>
std::string strides_of(const A& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += kvp::detail::format(i ? ", {}" : "{}", a.stride(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}
template std::string strides_of(const array&);
template std::string strides_of(const mut_array&);

template <class A>
void require_ndim(const A& a, std::size_t ndim, const std::string& field, const char* axes) {
  kvp::require(a.ndim() == ndim, field, "has shape {}; expected {} axes {}", shape_of(a), ndim, axes);
}
template void require_ndim(const array&, std::size_t, const std::string&, const char*);
template void require_ndim(const mut_array&, std::size_t, const std::string&, const char*);

template <class A>
void require_dtype(const A& a, nb::dlpack::dtype t, const std::string& field, const char* name) {
  kvp::require(a.dtype() == t, field, "has element type {}; expected {}", dtype_name(a), name);
}
template void require_dtype(const array&, nb::dlpack::dtype, const std::string&, const char*);
template void require_dtype(const mut_array&, nb::dlpack::dtype, const std::string&, const char*);

template <class A>
void require_vector(const A& a, const std::string& field) {
  require_ndim(a, 1, field, "(a vector)");
  kvp::require(a.shape(0) <= 1 || a.stride(0) == 1, field,
               "has stride {}; its elements must be adjacent (a contiguous array)", a.stride(0));
}
template void require_vector(const array&, const std::string&);
template void require_vector(const mut_array&, const std::string&);

void require_place(const place& p, const place& cache, const std::string& field) {
  kvp::require(p == cache, field, "lives on {}; the cache lives on {}", describe(p), describe(cache));
}

}  // namespace kvpy
