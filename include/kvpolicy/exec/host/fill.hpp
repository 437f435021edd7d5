// Host reference of the fill layout for one (layer, seq, KV head) row.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// The i-th evicted slot below the kept count k (ascending) takes the i-th kept token
// at k or after (descending), with its F when `f` is not empty and its position when
// the cache has them. Sources (>= k) and destinations (< k) never meet. Returns k.
inline std::int32_t fill_row(const paged_kv_view& c, const score_view& f, std::int32_t layer, std::int32_t seq,
                             std::int32_t head, std::span<const std::uint8_t> keep) {
  const auto T = static_cast<std::int32_t>(keep.size());
  const std::int32_t b = c.block_size;
  std::int32_t k = 0;
  for (std::uint8_t x : keep) k += x != 0;
  std::vector<std::int32_t> holes, movers;
  for (std::int32_t t = 0; t < k; ++t)
    if (!keep[t]) holes.push_back(t);
  for (std::int32_t t = T - 1; t >= k; --t)
    if (keep[t]) movers.push_back(t);
  // Cautious update: the row is dense in [0, k) after the moves.
  if (!c.live.empty())
    for (std::int32_t t = 0; t < T; ++t) c.live.at(layer, c.physical_block(seq, t), t % b, head) = t < k;
  const std::size_t bytes = static_cast<std::size_t>(c.row_bytes());
  for (std::size_t i = 0; i < holes.size(); ++i) {
    const std::int32_t to = holes[i], from = movers[i];
    const std::int32_t to_block = c.physical_block(seq, to), from_block = c.physical_block(seq, from);
    std::memcpy(c.k_row_at(layer, to_block, to % b, head), c.k_row_at(layer, from_block, from % b, head), bytes);
    std::memcpy(c.v_row_at(layer, to_block, to % b, head), c.v_row_at(layer, from_block, from % b, head), bytes);
    if (!f.empty()) f.at(layer, to_block, to % b, head) = f.at(layer, from_block, from % b, head);
    if (!c.positions.empty())
      c.positions.at(layer, to_block, to % b, head) = c.positions.at(layer, from_block, from % b, head);
  }
  return k;
}

}  // namespace host
KVP_NAMESPACE_END
