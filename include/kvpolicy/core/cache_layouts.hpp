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

// SGLang's token pool (MHATokenToKVPool): per layer a K and a V tensor
// `[pool_size, h_kv, d]`, a request's tokens found through `req_to_token`
// `[max_requests, max_context_len]` (its slot indices). That is a paged cache of
// blocks of one token: `s.block_size` must be 1 (the executors check it as any
// shape), the pool's slots are its blocks (`s.num_blocks` = pool size) and
// `req_to_token` is the dense block table (`block_table_view::dense(req_to_token,
// max_context_len)`), the request's row its sequence.
constexpr paged_kv_view sglang(void* const* k_layers, void* const* v_layers, const cache_shape& s,
                               const sequence_table& q) noexcept {
  return nhd(k_layers, v_layers, s, q);
}

// TensorRT-LLM's block pool, blocks first (its default): one tensor
// `[num_blocks, L, 2, h_kv, b, d]`, every block of every layer, K then V, each in HND
// order (kvCacheUtils.h: `[numHeads, tokensPerBlock, hiddenSizePerHead]`). The table
// holds the pool's block indices (the KVCacheManager's block ids; its K/V offsets
// table, `[B, 2, M]`, holds 2 L id + 2 layer + kv for them).
constexpr paged_kv_view trtllm_blocks_first(void* pool, const cache_shape& s, const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  const std::int64_t blk = detail::block_elems(s);
  v.k = {pool, 2 * blk, nullptr, 0};
  v.v = {pool, 2 * blk, nullptr, blk};
  const kv_strides st{2 * std::int64_t{s.num_layers} * blk, s.head_dim, std::int64_t{s.block_size} * s.head_dim, 1};
  v.k_stride = v.v_stride = st;
  return v;
}

// TensorRT-LLM's block pool, layers first: per layer `[num_blocks, 2, h_kv, b, d]`
// (`layer_pools[l]`, or one tensor `[L, num_blocks, 2, h_kv, b, d]` whose layer
// bases the engine lists), K then V in each block, HND. The table as above.
constexpr paged_kv_view trtllm_layers_first(void* const* layer_pools, const cache_shape& s,
                                            const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  const std::int64_t blk = detail::block_elems(s);
  v.k = {nullptr, 0, layer_pools, 0};
  v.v = {nullptr, 0, layer_pools, blk};
  const kv_strides st{2 * blk, s.head_dim, std::int64_t{s.block_size} * s.head_dim, 1};
  v.k_stride = v.v_stride = st;
  return v;
}

}  // namespace layouts

KVP_NAMESPACE_END
