// Validation of a per-head block view (per_head_kv_view.hpp): every check names the
// field and the value, and runs before any byte of the cache is written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/per_head_kv_view.hpp"
#include "kvpolicy/exec/validate_dims.hpp"

KVP_NAMESPACE_BEGIN

namespace detail {

// Elements one block's rows span under strides s (the last row's end).
inline std::int64_t per_head_block_extent(const per_head_kv_strides& s, const per_head_kv_view& c) {
  return (std::int64_t{c.block_size} - 1) * s.token + c.head_dim;
}

inline void validate_per_head_strides(const per_head_kv_strides& s, const per_head_kv_view& c, const char* name) {
  const std::int64_t d = c.head_dim;
  require(s.dim == 1, detail::path("cache.{}.dim", name),
          "is {}; rows of {} {} elements must be contiguous (dim stride 1)", s.dim, d, name_of(c.type));
  require(s.token >= d, detail::path("cache.{}.token", name), "is {}; must be at least head_dim {} so rows do not overlap",
          s.token, d);
  const std::int64_t extent = per_head_block_extent(s, c);
  require(s.block >= extent, detail::path("cache.{}.block", name),
          "is {}; a block's {} rows span {} elements (token stride {}), so block p + 1 would start inside block p",
          s.block, c.block_size, extent, s.token);
}

// K or V: a base for every layer, aligned; one pool for all layers when shared_pool,
// layers that do not overlap otherwise. `host_tables`: whether a layer table may be
// read here (not when it lives in device memory).
inline void validate_per_head_bases(const layer_bases& b, const per_head_kv_strides& s, const per_head_kv_view& c,
                                    const char* name, bool host_tables) {
  require(b.valid(), detail::path("cache.{}", name), "has neither a base pointer nor a layer table (null)");
  if (b.table && !host_tables) return;
  const std::int64_t elem = size_of(c.type);
  std::vector<std::pair<std::uintptr_t, std::int32_t>> starts;  // (layer start, layer)
  for (std::int32_t l = 0; l < c.num_layers; ++l) {
    require(!b.table || b.table[l] != nullptr, detail::path("cache.{}.table[{}]", name, l), "is a null pointer");
    const auto addr = reinterpret_cast<std::uintptr_t>(b.layer(l, c.type));
    require(addr % static_cast<std::uintptr_t>(elem) == 0, detail::path("cache.{} layer {}", name, l),
            "address {:#x} is not aligned to the {}-byte {} element", addr, elem, name_of(c.type));
    starts.emplace_back(addr, l);
  }
  if (c.shared_pool) {
    for (const auto& [addr, l] : starts)
      require(addr == starts.front().first, detail::path("cache.{} layer {}", name, l),
              "starts at {:#x}, layer 0 at {:#x}; with shared_pool one pool holds every layer (layer_stride 0)", addr,
              starts.front().first);
    return;
  }
  // Per-layer pools: block p of layer l and block p of layer l' are different blocks.
  const std::uint64_t bytes =
      static_cast<std::uint64_t>((std::int64_t{c.num_blocks} - 1) * s.block + per_head_block_extent(s, c)) *
      static_cast<std::uint64_t>(elem);
  std::sort(starts.begin(), starts.end());
  for (std::size_t i = 1; i < starts.size(); ++i)
    require(starts[i].first >= starts[i - 1].first + bytes, detail::path("cache.{} layer {}", name, starts[i].second),
            "starts {} bytes after layer {}, whose pool of {} blocks spans {} bytes; without shared_pool each layer has "
            "its own pool",
            starts[i].first - starts[i - 1].first, starts[i - 1].second, c.num_blocks, bytes);
}

template <class T>
void validate_per_slot(const per_slot_view<T>& v, const per_head_kv_view& c, const char* name) {
  if (v.empty()) return;
  require(v.token_stride >= 1, detail::path("cache.{}.token_stride", name), "is {}; must be positive", v.token_stride);
  const std::int64_t extent = (std::int64_t{c.block_size} - 1) * v.token_stride + 1;
  require(v.block_stride >= extent, detail::path("cache.{}.block_stride", name),
          "is {}; a block's {} slots span {} entries", v.block_stride, c.block_size, extent);
  if (c.shared_pool) {
    require(v.layer_stride == 0, detail::path("cache.{}.layer_stride", name),
            "is {}; with shared_pool a block id names one block for every layer (layer_stride 0)", v.layer_stride);
  } else if (c.num_layers > 1) {
    const std::int64_t pool = (std::int64_t{c.num_blocks} - 1) * v.block_stride + extent;
    require(v.layer_stride >= pool, detail::path("cache.{}.layer_stride", name),
            "is {}; one layer's pool of {} blocks spans {} entries", v.layer_stride, c.num_blocks, pool);
  }
}

}  // namespace detail

// Shapes, pointers and strides: what does not read the engine's tables or lengths.
// Cheap; a device executor runs it on the host with `host_tables` false.
inline void validate_per_head_shapes(const per_head_kv_view& c, bool host_tables = true) {
  detail::validate_cache_dims(c);
  require(c.max_blocks > 0, "cache.max_blocks", "is {}; must be positive", c.max_blocks);
  require(c.table.valid(), "cache.table", "has neither a base pointer nor a layer table (null)");
  require(c.lengths.valid(), "cache.lengths", "has neither a base pointer nor a layer table (null)");
  if (host_tables) {
    for (std::int32_t l = 0; l < c.num_layers; ++l) {
      require(!c.table.layers || c.table.layers[l] != nullptr, detail::path("cache.table.layers[{}]", l),
              "is a null pointer");
      require(!c.lengths.layers || c.lengths.layers[l] != nullptr, detail::path("cache.lengths.layers[{}]", l),
              "is a null pointer");
    }
  }
  detail::validate_per_head_strides(c.k_stride, c, "k_stride");
  detail::validate_per_head_strides(c.v_stride, c, "v_stride");
  detail::validate_per_head_bases(c.k, c.k_stride, c, "k", host_tables);
  detail::validate_per_head_bases(c.v, c.v_stride, c, "v", host_tables);
  detail::validate_per_slot(c.positions, c, "positions");
  detail::validate_per_slot(c.metric, c, "metric");
}

// The lengths and block tables: every length within its row's capacity, every id a
// head holds in [0, num_blocks), and no id held twice: by two (layer, seq, head) rows
// of one pool, or twice in one row. Only the first ceil(length / b) entries of a row
// are read. Runs where the arrays live (host memory here).
inline void validate_per_head_tables(const per_head_kv_view& c) {
  const std::int32_t b = c.block_size;
  struct holder {
    std::int32_t l = -1, seq = -1, h = -1, index = -1;
  };
  std::vector<holder> owner(static_cast<std::size_t>(c.num_blocks));
  for (std::int32_t l = 0; l < c.num_layers; ++l) {
    if (!c.shared_pool) std::fill(owner.begin(), owner.end(), holder{});
    for (std::int32_t seq = 0; seq < c.num_seqs; ++seq)
      for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
        const std::int32_t T = c.length(l, seq, h);
        const std::int64_t capacity = std::int64_t{c.max_blocks} * b;
        require(T >= 0 && T <= capacity, detail::path("cache.lengths[layer {}][seq {}][head {}]", l, seq, h),
                "is {}; the block table holds room for {} tokens ({} blocks of {})", T, capacity, c.max_blocks, b);
        const std::int32_t blocks = c.blocks_for(T);
        for (std::int32_t i = 0; i < blocks; ++i) {
          const std::int32_t id = c.block(l, seq, h, i);
          const auto field = detail::path("cache.table[layer {}][seq {}][head {}][{}]", l, seq, h, i);
          require(id >= 0 && id < c.num_blocks, field, "is block id {}; valid ids are [0, {})", id, c.num_blocks);
          holder& o = owner[static_cast<std::size_t>(id)];
          require(o.index < 0, field,
                  "is block id {}, already held by layer {} seq {} head {} (its block {}); a block holds one head of "
                  "one layer{}",
                  id, o.l, o.seq, o.h, o.index, c.shared_pool ? " (one pool shared by every layer)" : "");
          o = {l, seq, h, i};
        }
      }
  }
}

// Everything: shapes, then tables. Nothing is written.
inline void validate_per_head(const per_head_kv_view& c) {
  validate_per_head_shapes(c);
  validate_per_head_tables(c);
}

KVP_NAMESPACE_END
