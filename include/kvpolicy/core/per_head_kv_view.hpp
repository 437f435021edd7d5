// A non-owning view of a paged cache whose physical blocks each hold one KV head of
// one layer (KV-Compress 4.2.1; SPEC.md "Layouts", Per-head blocks).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"

KVP_NAMESPACE_BEGIN

// An int32 array indexed by (layer, seq, kv_head), each index naming a row of entries
// that sit next to one another: the block tables (`[layer, seq, kv_head, max_blocks]`)
// and the lengths (`[layer, seq, kv_head]`, rows of one entry). Either one tensor with
// element strides (KV-Compress keeps both as one tensor each, layer first) or one
// tensor per layer, `layers[l]` being `[seq, kv_head, ...]` under the seq and head
// strides (layer_stride unused). Read only; where the executor runs.
struct per_head_array {
  const std::int32_t* base = nullptr;
  const std::int32_t* const* layers = nullptr;  // optional: one pointer per layer; base ignored
  std::int64_t layer_stride = 0, seq_stride = 0, head_stride = 0;

  // Contiguous `[num_layers, num_seqs, num_kv_heads, row]`.
  static constexpr per_head_array dense(const std::int32_t* base, std::int32_t num_seqs, std::int32_t num_kv_heads,
                                        std::int64_t row = 1) noexcept {
    const std::int64_t head = row, seq = head * num_kv_heads, layer = seq * num_seqs;
    return {base, nullptr, layer, seq, head};
  }
  // One contiguous `[num_seqs, num_kv_heads, row]` tensor per layer.
  static constexpr per_head_array per_layer(const std::int32_t* const* layers, std::int32_t num_kv_heads,
                                            std::int64_t row = 1) noexcept {
    return {nullptr, layers, 0, row * num_kv_heads, row};
  }

  KVP_HOST_DEVICE constexpr bool valid() const noexcept { return base != nullptr || layers != nullptr; }

  KVP_HOST_DEVICE const std::int32_t* row(std::int32_t l, std::int32_t seq, std::int32_t h) const noexcept {
    const std::int32_t* p = layers ? layers[l] : base + l * layer_stride;
    return p + seq * seq_stride + h * head_stride;
  }
};

// Element strides of one cache tensor (K or V) over (block, token-in-block, dim): a
// block holds b rows of one head, so there is no head stride. Rows are contiguous
// (dim 1); KV-Compress's `[N, b, d]` is {b * d, d, 1}; K and V interleaved in one
// `[N, 2, b, d]` tensor is {2 b d, d, 1} with V's layer_bases::offset b * d.
struct per_head_kv_strides {
  std::int64_t block = 0;
  std::int64_t token = 0;
  std::int64_t dim = 1;

  static constexpr per_head_kv_strides contiguous(std::int32_t block_size, std::int32_t head_dim) noexcept {
    return {std::int64_t{block_size} * head_dim, head_dim, 1};
  }

  KVP_HOST_DEVICE constexpr std::int64_t offset(std::int64_t blk, std::int64_t slot) const noexcept {
    return blk * block + slot * token;
  }
};

// One value per physical (block, slot), beside K and V: KV-Compress's metric (fp32,
// moved with its token) and each token's original position (int32, SPEC.md
// "Positions"). `shared` pools index it `[num_blocks, b]` for every layer
// (layer_stride 0); per-layer pools `[L, num_blocks, b]`.
template <class T>
struct per_slot_view {
  T* base = nullptr;
  std::int64_t layer_stride = 0, block_stride = 0, token_stride = 1;

  static constexpr per_slot_view shared(T* base, std::int32_t block_size) noexcept { return {base, 0, block_size, 1}; }
  static constexpr per_slot_view per_layer(T* base, std::int32_t num_blocks, std::int32_t block_size) noexcept {
    return {base, std::int64_t{num_blocks} * block_size, block_size, 1};
  }

  KVP_HOST_DEVICE constexpr bool empty() const noexcept { return base == nullptr; }

  KVP_HOST_DEVICE T& at(std::int32_t l, std::int32_t block, std::int32_t slot) const noexcept {
    return base[l * layer_stride + block * block_stride + slot * token_stride];
  }
};
using per_slot_metric = per_slot_view<float>;
using per_slot_positions = per_slot_view<std::int32_t>;

// The per-head cache an engine hands to kvpolicy. Trivially copyable; built from the
// engine's tensors without copying them. Token t of head h of sequence seq in layer l
// lives in physical block `table.row(l, seq, h)[t / block_size]` at slot
// `t % block_size`; each head has its own length.
//
// Block pools: with `shared_pool` (KV-Compress's unified cache, one `[N, b, d]`
// allocation for every layer and head) a block id names the same block in every layer:
// K and V resolve to one base for all layers (layer_bases::layer_stride 0), and an id
// is held by at most one (layer, seq, head) of the view. Without it each layer has its
// own pool of num_blocks blocks (vLLM-style per-layer tensors) and ids are unique
// within a layer.
struct per_head_kv_view {
  std::int32_t num_layers = 0;
  std::int32_t num_blocks = 0;    // physical blocks in one pool
  std::int32_t block_size = 0;    // b: tokens per block
  std::int32_t num_kv_heads = 0;  // h_kv
  std::int32_t head_dim = 0;      // d
  std::int32_t num_seqs = 0;
  std::int32_t max_blocks = 0;    // entries per (layer, seq, head) row of the table
  dtype type = dtype::bf16;
  bool shared_pool = true;
  layer_bases k, v;
  per_head_kv_strides k_stride, v_stride;
  per_head_array table;    // [layer, seq, kv_head, max_blocks] physical block ids
  per_head_array lengths;  // [layer, seq, kv_head] tokens held by each head
  per_slot_positions positions{};  // optional: each token's original position, moved with it
  per_slot_metric metric{};        // optional: KV-Compress's eviction metric, moved with its token

  KVP_HOST_DEVICE std::int32_t length(std::int32_t l, std::int32_t seq, std::int32_t h) const noexcept {
    return *lengths.row(l, seq, h);
  }
  // Blocks a head of `length` tokens holds: ceil(length / b).
  KVP_HOST_DEVICE constexpr std::int32_t blocks_for(std::int32_t length) const noexcept {
    return (length + block_size - 1) / block_size;
  }
  KVP_HOST_DEVICE std::int32_t block(std::int32_t l, std::int32_t seq, std::int32_t h, std::int32_t i) const noexcept {
    return table.row(l, seq, h)[i];
  }
  KVP_HOST_DEVICE std::int32_t physical_block(std::int32_t l, std::int32_t seq, std::int32_t h,
                                              std::int32_t t) const noexcept {
    return block(l, seq, h, t / block_size);
  }
  // KV-Compress's flat slot index of token t: physical block * b + slot.
  KVP_HOST_DEVICE std::int64_t physical_slot(std::int32_t l, std::int32_t seq, std::int32_t h,
                                             std::int32_t t) const noexcept {
    return std::int64_t{physical_block(l, seq, h, t)} * block_size + t % block_size;
  }

  // First element of token t (logical index in its head) of head h of sequence seq, layer l.
  KVP_HOST_DEVICE std::byte* k_row(std::int32_t l, std::int32_t seq, std::int32_t h, std::int32_t t) const noexcept {
    return k_row_at(l, physical_block(l, seq, h, t), t % block_size);
  }
  KVP_HOST_DEVICE std::byte* v_row(std::int32_t l, std::int32_t seq, std::int32_t h, std::int32_t t) const noexcept {
    return v_row_at(l, physical_block(l, seq, h, t), t % block_size);
  }
  // The same by physical block and slot.
  KVP_HOST_DEVICE std::byte* k_row_at(std::int32_t l, std::int32_t block, std::int32_t slot) const noexcept {
    return k.layer(l, type) + k_stride.offset(block, slot) * size_of(type);
  }
  KVP_HOST_DEVICE std::byte* v_row_at(std::int32_t l, std::int32_t block, std::int32_t slot) const noexcept {
    return v.layer(l, type) + v_stride.offset(block, slot) * size_of(type);
  }
  // Bytes of one token's row of one head: what a move copies (for K and for V).
  KVP_HOST_DEVICE constexpr std::int64_t row_bytes() const noexcept { return std::int64_t{head_dim} * size_of(type); }
};

KVP_NAMESPACE_END
