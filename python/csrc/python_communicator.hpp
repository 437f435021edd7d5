// A Python object with all_reduce(array, op) as the host executors' communicator
// (tensor parallelism, kvpolicy/core/communicator.hpp).
#pragma once

#include <cstddef>
#include <span>

#include <kvpolicy/core/communicator.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace kvpy {

// Called with the GIL held, on a NumPy array over the executor's own values, which the
// object reduces in place over every rank ("max" or "sum").
struct python_communicator {
  nanobind::handle object;
  template <class T>
  void all_reduce(std::span<T> values, kvp::reduce_op op) const {
    namespace nb = nanobind;
    nb::gil_scoped_acquire held;
    const std::size_t shape[1] = {values.size()};
    nb::ndarray<nb::numpy, T, nb::ndim<1>> view(values.data(), 1, shape, nb::handle());
    // A reference, not a copy: the reduction lands in the executor's buffer.
    object.attr("all_reduce")(nb::cast(view, nb::rv_policy::reference), op == kvp::reduce_op::max ? "max" : "sum");
  }
};
static_assert(kvp::HostCommunicator<python_communicator>);

}  // namespace kvpy
