// A non-owning view of an engine's paged K and V cache, all layers of it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/block_sharing.hpp"
#include "kvpolicy/core/block_table.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/live_view.hpp"
#include "kvpolicy/core/position_view.hpp"

KVP_NAMESPACE_BEGIN

// Element strides of one cache tensor (K or V) over (block, token-in-block, head, dim).
// Separate for K and V because engines lay them out differently (vLLM's
// `[num_blocks, 2, b, h, d]` interleaves them per block).
struct kv_strides {
  std::int64_t block = 0;
  std::int64_t token = 0;
  std::int64_t head = 0;
  std::int64_t dim = 1;

  KVP_HOST_DEVICE constexpr std::int64_t offset(std::int64_t blk, std::int64_t slot, std::int64_t h) const noexcept {
    return blk * block + slot * token + h * head;
  }
};

// Where layer l of one tensor starts: either `base + l * layer_stride` (one tensor
// for all layers, nano-vllm) or `table[l]` (one tensor per layer, vLLM), plus a
// fixed `offset` (V inside a `[2, ...]` tensor). Offsets are in elements. `table`
// must be readable where the executor runs: host memory for the host executor,
// device memory for the CUDA executor.
struct layer_bases {
  void* base = nullptr;
  std::int64_t layer_stride = 0;
  void* const* table = nullptr;
  std::int64_t offset = 0;

  KVP_HOST_DEVICE constexpr bool valid() const noexcept { return base != nullptr || table != nullptr; }

  KVP_HOST_DEVICE std::byte* layer(std::int32_t l, dtype t) const noexcept {
    auto* p = static_cast<std::byte*>(table ? table[l] : base);
    const std::int64_t elems = (table ? 0 : l * layer_stride) + offset;
    return p + elems * size_of(t);
  }
};

// The cache an engine hands to kvpolicy. Trivially copyable; passed by value to kernels.
// Token `t` of sequence `seq` lives in physical block `table.block(seq, t / block_size)`
// at slot `t % block_size`.
struct paged_kv_view {
  std::int32_t num_layers = 0;
  std::int32_t num_blocks = 0;    // physical blocks per layer
  std::int32_t block_size = 0;    // b: tokens per block
  std::int32_t num_kv_heads = 0;  // h_kv
  std::int32_t head_dim = 0;      // d
  std::int32_t num_seqs = 0;      // rows of the block table and of lengths
  dtype type = dtype::bf16;
  layer_bases k, v;
  kv_strides k_stride, v_stride;
  block_table_view table;
  const std::int32_t* lengths = nullptr;  // [num_seqs] tokens held by each sequence
  block_sharing sharing{};                // optional: blocks other requests read too
  position_view positions{};              // optional: each token's original position, moved with it
  live_view live{};                       // optional: cautious update, the tokens each head still holds

  KVP_HOST_DEVICE std::int32_t physical_block(std::int32_t seq, std::int32_t t) const noexcept {
    return table.block(seq, t / block_size);
  }

  // Whether token t (logical position) of seq is still held by head h of layer l:
  // always without a live view.
  KVP_HOST_DEVICE bool alive(std::int32_t l, std::int32_t seq, std::int32_t t, std::int32_t h) const noexcept {
    return live.empty() || live.at(l, physical_block(seq, t), t % block_size, h) != 0;
  }

  // First element of head h of token t (logical position) of sequence seq, in layer l.
  KVP_HOST_DEVICE std::byte* k_row(std::int32_t l, std::int32_t seq, std::int32_t t, std::int32_t h) const noexcept {
    return k_row_at(l, physical_block(seq, t), t % block_size, h);
  }
  KVP_HOST_DEVICE std::byte* v_row(std::int32_t l, std::int32_t seq, std::int32_t t, std::int32_t h) const noexcept {
    return v_row_at(l, physical_block(seq, t), t % block_size, h);
  }
  // The same by physical block and slot.
  KVP_HOST_DEVICE std::byte* k_row_at(std::int32_t l, std::int32_t block, std::int32_t slot,
                                      std::int32_t h) const noexcept {
    return k.layer(l, type) + k_stride.offset(block, slot, h) * size_of(type);
  }
  KVP_HOST_DEVICE std::byte* v_row_at(std::int32_t l, std::int32_t block, std::int32_t slot,
                                      std::int32_t h) const noexcept {
    return v.layer(l, type) + v_stride.offset(block, slot, h) * size_of(type);
  }
  // Bytes of one (token, head) row: what a layout move copies.
  KVP_HOST_DEVICE constexpr std::int64_t row_bytes() const noexcept { return std::int64_t{head_dim} * size_of(type); }
};

KVP_NAMESPACE_END
