// How many compressible requests and cache blocks fit in a memory size (Zipage
// eq. 1 and 2; SPEC.md, "Memory plan"). Host only.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN

// The memory to plan and what lives in it: K and V of the cache blocks, the global
// score F beside them (optional), and one query slot per compressible request.
struct memory_plan_inputs {
  std::int64_t available_bytes = 0;  // m: for K/V, F and the query slots
  std::int32_t num_layers = 0;       // L
  std::int32_t num_kv_heads = 0;     // h_kv
  std::int32_t num_q_heads = 0;      // h_q, a multiple of h_kv
  std::int32_t head_dim = 0;         // d
  std::int32_t block_size = 0;       // b
  dtype kv_type = dtype::bf16;       // K and V elements
  std::int32_t max_blocks = 0;       // N_max: blocks a compressible request may hold
  std::int32_t query_window = 0;     // w: queries per slot; 0 when the pipeline reads none
  dtype query_type = dtype::bf16;    // query slot elements
  // F's elements: f32 is kvpolicy's score_view; nullopt when the pipeline keeps no
  // F (no temporal aggregator). A 16-bit F is accepted for engines that keep their own.
  std::optional<dtype> score_type = dtype::f32;
};

// Bytes per unit and Zipage's two answers. Per block, F holds one score per (layer,
// slot, KV head) (core/score_view.hpp) beside K and V's 2 * d elements per (layer,
// slot, KV head), so F adds size(score) / (2 d size(kv)) to m_kv. Zipage eq. 2's
// (1 + 1/(2d)) is that ratio when F has K/V's element size; kvpolicy's F is fp32,
// which with 16-bit K/V makes it (1 + 1/d). The plan uses these exact bytes.
struct memory_plan {
  std::int64_t kv_block_bytes = 0;     // m_kv = 2 L b h_kv d size(kv): K and V of one block, all layers
  std::int64_t score_block_bytes = 0;  // L b h_kv size(score): F of one block, all layers; 0 without F
  std::int64_t query_slot_bytes = 0;   // m_q = L w h_q d size(q): one request's query slot
  std::int64_t max_requests = 0;       // M = floor(m / (m_block N_max + m_q))
  std::int64_t total_blocks = 0;       // N_total = floor(m / (m_block + m_q / N_max))

  // What one block costs: K, V and F (Zipage eq. 2's (1 + 1/(2d)) m_kv, exactly).
  std::int64_t block_bytes() const noexcept { return kv_block_bytes + score_block_bytes; }
  // Bytes the plan's N_total blocks and M query slots take; at most m.
  std::int64_t used_bytes() const noexcept { return total_blocks * block_bytes() + max_requests * query_slot_bytes; }
};

namespace detail {
// a * b for non-negative int64 a and b, or a kvp::error naming `what`.
inline std::int64_t plan_product(std::int64_t a, std::int64_t b, std::string_view what) {
  require(b == 0 || a <= std::numeric_limits<std::int64_t>::max() / b, "memory_plan_inputs",
          "{} overflow int64", what);
  return a * b;
}
}  // namespace detail

// Zipage eq. 1 and 2: the largest M (requests holding N_max blocks and a query slot)
// and N_total (blocks) with m_block N_total + M m_q <= m and M <= N_total / N_max:
//   M       = floor(m / (m_block N_max + m_q))
//   N_total = floor(m / (m_block + m_q / N_max)) = floor(m N_max / (m_block N_max + m_q)),
// computed in integers, exactly, where m_block = m_kv + F's bytes per block. N_total
// may exceed M N_max by up to N_max - 1 blocks (the floors), for requests without a
// query slot (Zipage 4.3). m = 0 plans nothing (M = N_total = 0); M = 0 with m > 0
// means not one compressible request fits. Throws kvp::error naming the field for a
// negative m, a non-positive shape or N_max, h_q not a multiple of h_kv, a negative
// window, or sizes that overflow int64.
inline memory_plan plan_memory(const memory_plan_inputs& in) {
  require(in.available_bytes >= 0, "memory_plan_inputs.available_bytes", "is {}; negative", in.available_bytes);
  const auto positive = [](std::int32_t v, std::string_view field) {
    require(v > 0, field, "is {}; must be positive", v);
  };
  positive(in.num_layers, "memory_plan_inputs.num_layers");
  positive(in.num_kv_heads, "memory_plan_inputs.num_kv_heads");
  positive(in.num_q_heads, "memory_plan_inputs.num_q_heads");
  positive(in.head_dim, "memory_plan_inputs.head_dim");
  positive(in.block_size, "memory_plan_inputs.block_size");
  positive(in.max_blocks, "memory_plan_inputs.max_blocks");
  require(in.num_q_heads % in.num_kv_heads == 0, "memory_plan_inputs.num_q_heads",
          "is {}; not a multiple of num_kv_heads {}", in.num_q_heads, in.num_kv_heads);
  require(in.query_window >= 0, "memory_plan_inputs.query_window", "is {}; negative", in.query_window);

  using detail::plan_product;
  // Elements per block and layer of one of K, V or F: b * h_kv (each K or V element
  // has d of them).
  const std::int64_t slots = plan_product(std::int64_t{in.num_layers} * in.block_size, in.num_kv_heads,
                                          "L * b * h_kv");
  memory_plan p;
  p.kv_block_bytes = plan_product(plan_product(slots, in.head_dim, "K/V bytes per block"),
                                  2 * std::int64_t{size_of(in.kv_type)}, "K/V bytes per block");
  p.score_block_bytes = in.score_type ? plan_product(slots, size_of(*in.score_type), "F bytes per block") : 0;
  p.query_slot_bytes =
      plan_product(plan_product(std::int64_t{in.num_layers} * in.query_window, in.num_q_heads, "query slot bytes"),
                   std::int64_t{in.head_dim} * size_of(in.query_type), "query slot bytes");
  require(p.score_block_bytes <= std::numeric_limits<std::int64_t>::max() - p.kv_block_bytes, "memory_plan_inputs",
          "bytes per block overflow int64");
  const std::int64_t block = p.block_bytes();
  const std::int64_t request = plan_product(block, in.max_blocks, "bytes per request (m_block * N_max + m_q)");
  require(request <= std::numeric_limits<std::int64_t>::max() - p.query_slot_bytes, "memory_plan_inputs",
          "bytes per request (m_block * N_max + m_q) overflow int64");
  const std::int64_t per_request = request + p.query_slot_bytes;  // m_block N_max + m_q > 0

  const std::int64_t m = in.available_bytes;
  p.max_requests = m / per_request;
  // floor(m N_max / D) = floor(m / D) N_max + floor((m mod D) N_max / D), without m N_max.
  p.total_blocks = plan_product(p.max_requests, in.max_blocks, "N_total") +
                   plan_product(m % per_request, in.max_blocks, "N_total") / per_request;
  return p;
}

KVP_NAMESPACE_END
