// The temperatures a calibrated top-p selector solves, kept by the engine between
// compressions: one per (request slot, layer, KV head), with how each search ended.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"

KVP_NAMESPACE_BEGIN

// How a row's temperature search ended. Written beside the temperature so that a
// search that hit a bound is seen, not hidden behind a clamped value.
enum class calibration_outcome : std::uint8_t {
  unsolved = 0,       // no search yet: the engine zeroes a slot's entries when a request takes it
  converged = 1,      // the calibrated top-n_p mass lies within tolerance of p
  lower_bound = 2,    // even t_min spreads the mass too thinly: T = t_min
  upper_bound = 3,    // even t_max concentrates it too much: T = t_max
  not_converged = 4,  // the iterations ran out inside the bounds: the last T
  no_mass = 5,        // the raw scores of the selectable tokens sum to 0: nothing to calibrate
};

// Non-owning, trivially copyable: host pointers for the host executor, device
// pointers for the CUDA executor. Entry (slot, layer, kv_head) is at
// (slot * num_layers + layer) * num_kv_heads + kv_head. A slot is the batch item's
// query_slot: the request's own slot, which outlives the sequence index a batch
// gives it (an engine's block-table row may change from step to step).
struct calibration_state {
  float* temperature = nullptr;
  calibration_outcome* outcome = nullptr;
  std::int32_t num_slots = 0;
  std::int32_t num_layers = 0;
  std::int32_t num_kv_heads = 0;

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return temperature == nullptr; }
  KVP_HOST_DEVICE constexpr std::int64_t index(std::int32_t slot, head_index h) const noexcept {
    return (std::int64_t{slot} * num_layers + h.layer) * num_kv_heads + h.kv_head;
  }
};

KVP_NAMESPACE_END
