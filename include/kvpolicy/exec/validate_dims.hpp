// The checks every cache view starts with, paged or per-head: its dimensions are
// positive and its dtype is one the library reads. One place, so that the compress
// executors and decode attention name the same fields the same way.
#pragma once

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN
namespace detail {

// `View` is paged_kv_view or per_head_kv_view: both carry these members.
template <class View>
void validate_cache_dims(const View& c) {
  require(c.num_layers > 0, "cache.num_layers", "is {}; must be positive", c.num_layers);
  require(c.num_blocks > 0, "cache.num_blocks", "is {}; must be positive", c.num_blocks);
  require(c.block_size > 0, "cache.block_size", "is {}; must be positive", c.block_size);
  require(c.num_kv_heads > 0, "cache.num_kv_heads", "is {}; must be positive", c.num_kv_heads);
  require(c.head_dim > 0, "cache.head_dim", "is {}; must be positive", c.head_dim);
  require(c.num_seqs > 0, "cache.num_seqs", "is {}; must be positive", c.num_seqs);
  require(is_known(c.type), "cache.type", "is {}; must be f16 ({}), bf16 ({}) or f32 ({})", static_cast<int>(c.type),
          static_cast<int>(dtype::f16), static_cast<int>(dtype::bf16), static_cast<int>(dtype::f32));
}

}  // namespace detail
KVP_NAMESPACE_END
