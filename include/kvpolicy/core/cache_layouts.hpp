// Constructors of paged_kv_view for the layouts engines use. None copies a byte:
// each computes strides and bases once, on the host (as FlashInfer's paged_kv_t).
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"

KVP_NAMESPACE_BEGIN

// The dimensions shared by every layout.
struct cache_shape {
  std::int32_t num_layers = 0;
  std::int32_t num_blocks = 0;
  std::int32_t block_size = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  dtype type = dtype::bf16;
};

// Which sequences the cache holds: block table rows and lengths.
struct sequence_table {
  block_table_view table;
  const std::int32_t* lengths = nullptr;
  std::int32_t num_seqs = 0;
  block_sharing sharing{};  // optional: blocks other requests read too (core/block_sharing.hpp)
};

namespace layouts {

namespace detail {
constexpr paged_kv_view make(const cache_shape& s, const sequence_table& q) noexcept {
  paged_kv_view v;
  v.num_layers = s.num_layers;
  v.num_blocks = s.num_blocks;
  v.block_size = s.block_size;
  v.num_kv_heads = s.num_kv_heads;
  v.head_dim = s.head_dim;
  v.type = s.type;
  v.table = q.table;
  v.lengths = q.lengths;
  v.num_seqs = q.num_seqs;
  v.sharing = q.sharing;
  return v;
}
// Row-major strides of `[num_blocks, b, h, d]` (NHD) with a given block stride.
constexpr kv_strides nhd_strides(const cache_shape& s, std::int64_t block_stride) noexcept {
  return {block_stride, std::int64_t{s.num_kv_heads} * s.head_dim, s.head_dim, 1};
}
constexpr std::int64_t block_elems(const cache_shape& s) noexcept {
  return std::int64_t{s.block_size} * s.num_kv_heads * s.head_dim;
}
}  // namespace detail

// vLLM flash-attention backend: per layer one tensor `[2, num_blocks, b, h_kv, d]`.
// `layers[l]` is layer l's tensor (readable where the executor runs).
constexpr paged_kv_view vllm_flash(void* const* layers, const cache_shape& s, const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  v.k = {nullptr, 0, layers, 0};
  v.v = {nullptr, 0, layers, std::int64_t{s.num_blocks} * detail::block_elems(s)};
  v.k_stride = v.v_stride = detail::nhd_strides(s, detail::block_elems(s));
  return v;
}

// vLLM with K and V interleaved per block: per layer `[num_blocks, 2, b, h_kv, d]`.
constexpr paged_kv_view vllm_flash_blocks_first(void* const* layers, const cache_shape& s,
                                                const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  v.k = {nullptr, 0, layers, 0};
  v.v = {nullptr, 0, layers, detail::block_elems(s)};
  v.k_stride = v.v_stride = detail::nhd_strides(s, 2 * detail::block_elems(s));
  return v;
}

// Separate K and V tensors per layer, NHD: `[num_blocks, b, h_kv, d]` (FlashInfer NHD, SGLang).
constexpr paged_kv_view nhd(void* const* k_layers, void* const* v_layers, const cache_shape& s,
                            const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  v.k = {nullptr, 0, k_layers, 0};
  v.v = {nullptr, 0, v_layers, 0};
  v.k_stride = v.v_stride = detail::nhd_strides(s, detail::block_elems(s));
  return v;
}

// Separate K and V tensors per layer, HND: `[num_blocks, h_kv, b, d]` (FlashInfer HND).
constexpr paged_kv_view hnd(void* const* k_layers, void* const* v_layers, const cache_shape& s,
                            const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  v.k = {nullptr, 0, k_layers, 0};
  v.v = {nullptr, 0, v_layers, 0};
  const kv_strides st{detail::block_elems(s), s.head_dim, std::int64_t{s.block_size} * s.head_dim, 1};
  v.k_stride = v.v_stride = st;
  return v;
}

// nano-vllm: one tensor for the whole model, `[2, L, num_blocks, b, h_kv, d]`.
constexpr paged_kv_view nano_vllm(void* kv_cache, const cache_shape& s, const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  const std::int64_t layer = std::int64_t{s.num_blocks} * detail::block_elems(s);
  v.k = {kv_cache, layer, nullptr, 0};
  v.v = {kv_cache, layer, nullptr, std::int64_t{s.num_layers} * layer};
  v.k_stride = v.v_stride = detail::nhd_strides(s, detail::block_elems(s));
  return v;
}

}  // namespace layouts

KVP_NAMESPACE_END
