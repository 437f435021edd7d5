// The host executor's view of each item's window (window-only layouts): the cache
// with every batch row shifted to its window, and the results shifted back.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/batch.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/exec/result.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// Owns the shifted rows' starts and lengths; the view it returns reads them.
class window_rows {
 public:
  // `items` checked by validate_windows.
  window_rows(const paged_kv_view& cache, std::span<const batch_item> items)
      : first_(static_cast<std::size_t>(cache.num_seqs), 0),
        lengths_(cache.lengths, cache.lengths + cache.num_seqs),
        view_(cache) {
    for (const batch_item& it : items) {
      first_[it.seq] = it.window_begin / cache.block_size;
      lengths_[it.seq] -= it.window_begin;
    }
    view_.table.first = first_.data();
    view_.lengths = lengths_.data();
  }
  window_rows(const window_rows&) = delete;
  window_rows& operator=(const window_rows&) = delete;

  const paged_kv_view& view() const noexcept { return view_; }

  // From window to sequence: lengths and counts from the sequence's start, tables
  // with the blocks before the window. Masks and scores stay over the window.
  void restore(host_result& out, const paged_kv_view& cache, std::span<const batch_item> items) const {
    for (std::size_t i = 0; i < items.size(); ++i) {
      const batch_item& it = items[i];
      out.new_lengths[i] += it.window_begin;
      for (std::int32_t& c : out.kept_counts[i]) c += it.window_begin;
      std::vector<std::int32_t> table;
      for (std::int32_t b = 0; b < it.window_begin / cache.block_size; ++b) table.push_back(cache.table.block(it.seq, b));
      table.insert(table.end(), out.new_tables[i].begin(), out.new_tables[i].end());
      out.new_tables[i] = std::move(table);
    }
  }

 private:
  std::vector<std::int32_t> first_, lengths_;
  paged_kv_view view_;
};

}  // namespace host
KVP_NAMESPACE_END
