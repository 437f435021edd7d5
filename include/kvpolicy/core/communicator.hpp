// Tensor parallelism: each rank holds a slice of the KV heads of every layer and the
// same block tables. What couples the heads (the block a sequence may release is past
// the largest length over all heads, so over all ranks) goes through the engine's own
// communicator, wrapped in a type that models HostCommunicator. kvpolicy brings none:
// NCCL through torch.distributed, MPI or the engine's own all fit the two calls.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

enum class reduce_op : std::uint8_t { sum, max };

// Reduces `values` element-wise over every rank in place, before returning: each rank
// passes the same number of values and gets the same result. The host executor calls it
// once per compression (the items' new lengths, max) between its layout and the
// release of blocks, so every rank must make the same call.
template <class C>
concept HostCommunicator = requires(const C& c, std::span<std::int32_t> ints, std::span<float> floats) {
  { c.all_reduce(ints, reduce_op::max) } -> std::same_as<void>;
  { c.all_reduce(floats, reduce_op::sum) } -> std::same_as<void>;
};

// One rank holding every head: nothing to reduce (the executors' default).
struct single_rank {
  template <class T>
  constexpr void all_reduce(std::span<T>, reduce_op) const noexcept {}
};

static_assert(HostCommunicator<single_rank>);

KVP_NAMESPACE_END
