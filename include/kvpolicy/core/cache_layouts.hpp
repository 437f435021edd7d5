// Constructors of paged_kv_view for the layouts engines use. None copies a byte:
// each computes strides and bases once, on the host (as FlashInfer's paged_kv_t).
#pragma once

#include <array>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
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

// vLLM's flash-attention backend up to v0.22: per layer one tensor
// `[2, num_blocks, b, h_kv, d]` (NHD; from v0.23 vLLM stores other shapes:
// vllm_flash_blocks_first, then vllm below). `layers[l]` is layer l's tensor (readable
// where the executor runs).
constexpr paged_kv_view vllm_flash(void* const* layers, const cache_shape& s, const sequence_table& q) noexcept {
  paged_kv_view v = detail::make(s, q);
  v.k = {nullptr, 0, layers, 0};
  v.v = {nullptr, 0, layers, std::int64_t{s.num_blocks} * detail::block_elems(s)};
  v.k_stride = v.v_stride = detail::nhd_strides(s, detail::block_elems(s));
  return v;
}

// vLLM with K and V interleaved per block: per layer `[num_blocks, 2, b, h_kv, d]`
// (FlashInfer's backend up to v0.25, flash-attention's in v0.23 to v0.25, both NHD).
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

// vLLM from v0.26 (the layout refactor of its RFC #42082; read in v0.33.0,
// vllm/v1/kv_cache_layout.py and kv_cache_interface.py). Every layer's cache is the
// logical `[num_blocks, h_kv, b, C]` with `C = 2 d`: K and V of one (block, head,
// token) side by side, K in `[0, d)`, V in `[d, 2 d)` (vLLM's attention backends split
// it with `kv_cache.transpose(1, 2).split(head_size, -1)`). The layers of a KV cache
// group share one allocation, and the physical order of the five axes
// `[L, B, H, N, C]` (layer, block, head, token, content) is one of vLLM's
// `KVCacheLayout` members, outermost axis first:
enum class vllm_layout : std::uint8_t {
  lbhnc,  // [L, B, H, N, C]: HND per layer (FlashInfer on SM100, VLLM_KV_CACHE_LAYOUT=HND)
  lbnhc,  // [L, B, N, H, C]: NHD per layer, the default on CUDA (flash-attention, Triton)
  lhbnc,  // [L, H, B, N, C]: heads outside blocks (ROCm backends)
  blhnc,  // [B, L, H, N, C]: a block of every layer together (the offloading KV connector's)
  blnhc,  // [B, L, N, H, C]
  bhlnc,  // [B, H, L, N, C]
};

// Where one vLLM `KVCacheTensor` puts its layers, in bytes: layer `l`'s block `p`
// starts at `l * layer_stride + p * block_stride` from the base. 0 means the dense
// packing of the layout over `s.num_layers` layers (vLLM's own when no page is padded
// and no other layer group shares the blocks); a padded page or a hybrid model's
// shared blocks give other values, which vLLM's `KVCacheTensor.layer_stride` and
// `.block_stride` hold.
struct vllm_placement {
  std::int64_t layer_stride = 0;
  std::int64_t block_stride = 0;
};

namespace detail {
// Element strides of the logical axes [L, B, H, N, C] of a vLLM layout, as vLLM's
// compute_layout_strides: the innermost axis of `order` has stride 1, each axis
// outside it the extent of the one inside, unless the placement fixes L's or B's.
inline std::array<std::int64_t, 5> vllm_strides(vllm_layout order, const cache_shape& s, std::int64_t layer_stride,
                                                std::int64_t block_stride) {
  // Physical order of each layout, outermost first, as indices of [L, B, H, N, C].
  constexpr std::array<std::array<int, 5>, 6> orders{{{0, 1, 2, 3, 4},
                                                      {0, 1, 3, 2, 4},
                                                      {0, 2, 1, 3, 4},
                                                      {1, 0, 2, 3, 4},
                                                      {1, 0, 3, 2, 4},
                                                      {1, 2, 0, 3, 4}}};
  const auto which = static_cast<std::size_t>(order);
  require(which < orders.size(), "layout", "is {}; not a vllm_layout", static_cast<int>(which));
  const std::array<std::int64_t, 5> size{s.num_layers, s.num_blocks, s.num_kv_heads, s.block_size,
                                         2 * std::int64_t{s.head_dim}};
  const std::array<std::int64_t, 5> fixed{layer_stride, block_stride, 0, 0, 0};
  std::array<std::int64_t, 5> stride{};
  std::int64_t extent = 1;
  for (int i = 4; i >= 0; --i) {
    const int axis = orders[which][static_cast<std::size_t>(i)];
    stride[axis] = fixed[axis] != 0 ? fixed[axis] : extent;
    extent = stride[axis] * size[axis];
  }
  return stride;
}

// Bytes to elements of type t, refusing a negative or misaligned step.
inline std::int64_t vllm_placement_elems(std::int64_t bytes, dtype t, const char* field) {
  const std::int64_t e = size_of(t);
  require(bytes >= 0 && bytes % e == 0, field, "is {} bytes; must be a non-negative multiple of the {}-byte {} element",
          bytes, e, name_of(t));
  return bytes / e;
}
}  // namespace detail

// `base` is where the tensor's layer 0, block 0 starts (vLLM's backing allocation plus
// `KVCacheTensor.offset`; the per-layer view of the first layer, `kv_caches[name]`,
// starts there too), readable where the executor runs. Shapes count in vLLM's blocks
// as the layers see them: where vLLM splits its blocks into smaller kernel blocks
// (`kernel_block_size`), the view it binds to the layers and the block table its
// kernels read (`map_to_kernel_block_table`) count kernel blocks, and so must `s` and
// `q`. K and V must have one head size (`head_size_v == head_size`). Throws kvp::error
// for a placement that is not whole elements.
inline paged_kv_view vllm(void* base, vllm_layout order, const cache_shape& s, const sequence_table& q,
                          vllm_placement placement = {}) {
  const std::int64_t layer = detail::vllm_placement_elems(placement.layer_stride, s.type, "placement.layer_stride");
  const std::int64_t block = detail::vllm_placement_elems(placement.block_stride, s.type, "placement.block_stride");
  const std::array<std::int64_t, 5> st = detail::vllm_strides(order, s, layer, block);
  paged_kv_view v = detail::make(s, q);
  v.k = {base, st[0], nullptr, 0};
  v.v = {base, st[0], nullptr, std::int64_t{s.head_dim} * st[4]};
  v.k_stride = v.v_stride = kv_strides{st[1], st[3], st[2], st[4]};
  return v;
}

}  // namespace layouts

KVP_NAMESPACE_END
