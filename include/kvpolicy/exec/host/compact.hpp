// Host reference of the compact layout for one (layer, seq, KV head) row.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/destination_table.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/score_view.hpp"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// Moves the kept tokens of the row to l.destination(i), front to back, into the
// blocks of `to` (the sequence's own table, or fresh targets for a shared prefix),
// with their F when `f` is not empty and their positions when the cache has them;
// writes only slots whose place changes. F of the tokens in a shared prefix comes from
// `prefix_f` (the new F, which the shared block must not take). With a live view (cautious
// update) the row's slots [0, T) of `to` hold 1 where a kept token lands, else 0.
// Returns the kept count.
template <Layout L>
std::int32_t compact_row(const L& l, const paged_kv_view& c, const score_view& f, std::span<const float> prefix_f,
                         const destination_table& to, std::int32_t layer, std::int32_t seq, std::int32_t head,
                         std::span<const std::uint8_t> keep) {
  const auto T = static_cast<std::int32_t>(keep.size());
  const std::int32_t b = c.block_size;
  const std::size_t bytes = static_cast<std::size_t>(c.row_bytes());
  if (!c.live.empty())
    for (std::int32_t t = 0; t < T; ++t) c.live.at(layer, to.block(t / b), t % b, head) = 0;
  std::int32_t kept = 0;
  for (std::int32_t t = 0; t < T; ++t) {
    if (!keep[t]) continue;
    const std::int32_t dst = l.destination(kept++);
    const std::int32_t from_block = c.physical_block(seq, t), to_block = to.block(dst / b);
    if (!c.live.empty()) c.live.at(layer, to_block, dst % b, head) = 1;
    if (from_block == to_block && dst % b == t % b) continue;
    std::memmove(c.k_row_at(layer, to_block, dst % b, head), c.k_row_at(layer, from_block, t % b, head), bytes);
    std::memmove(c.v_row_at(layer, to_block, dst % b, head), c.v_row_at(layer, from_block, t % b, head), bytes);
    if (!f.empty())
      f.at(layer, to_block, dst % b, head) =
          t < to.shared * b ? prefix_f[t] : f.at(layer, from_block, t % b, head);
    if (!c.positions.empty())
      c.positions.at(layer, to_block, dst % b, head) = c.positions.at(layer, from_block, t % b, head);
  }
  return kept;
}

// The row compacted in place in the sequence's own blocks (no shared prefix).
template <Layout L>
std::int32_t compact_row(const L& l, const paged_kv_view& c, const score_view& f, std::int32_t layer,
                         std::int32_t seq, std::int32_t head, std::span<const std::uint8_t> keep) {
  return compact_row(l, c, f, {}, destination_table{c.table, seq}, layer, seq, head, keep);
}

}  // namespace host
KVP_NAMESPACE_END
