// Host reference of the compact layout for one (layer, seq, KV head) row.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// Moves the kept tokens of the row to l.destination(i), front to back, with their F
// when `f` is not empty and their positions when the cache has them; writes only
// slots whose content changes. Returns the kept count.
template <Layout L>
std::int32_t compact_row(const L& l, const paged_kv_view& c, const score_view& f, std::int32_t layer,
                         std::int32_t seq, std::int32_t head, std::span<const std::uint8_t> keep) {
  const auto T = static_cast<std::int32_t>(keep.size());
  const std::size_t bytes = static_cast<std::size_t>(c.row_bytes());
  std::int32_t kept = 0;
  for (std::int32_t t = 0; t < T; ++t) {
    if (!keep[t]) continue;
    const std::int32_t dst = l.destination(kept++);
    if (dst == t) continue;
    std::memmove(c.k_row(layer, seq, dst, head), c.k_row(layer, seq, t, head), bytes);
    std::memmove(c.v_row(layer, seq, dst, head), c.v_row(layer, seq, t, head), bytes);
    const std::int32_t to_block = c.physical_block(seq, dst), from_block = c.physical_block(seq, t);
    if (!f.empty())
      f.at(layer, to_block, dst % c.block_size, head) = f.at(layer, from_block, t % c.block_size, head);
    if (!c.positions.empty())
      c.positions.at(layer, to_block, dst % c.block_size, head) = c.positions.at(layer, from_block, t % c.block_size, head);
  }
  return kept;
}

}  // namespace host
KVP_NAMESPACE_END
