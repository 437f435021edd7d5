// An owning paged KV cache in host memory for tests: the engine's side of a
// compression call. Plain C++ (no CUDA), so host and GPU tests share it.
//
//   kvp_test::test_cache tc({.layers = 2, .block_size = 4, .kv_heads = 2, .head_dim = 4,
//                            .type = kvp::dtype::bf16, .lengths = {13, 7}});
//   auto before = tc.take_snapshot();
//   kvp::host_executor{}.compress(p, tc.view(), tc.queries(), tc.scores(), batch);
//   CHECK(tc.row_bytes(kvp_test::kv_kind::k, l, tc.block(seq, 0), 0, h) == ...);
//
// Storage follows one of the engines' layouts (nano-vllm, vLLM flash, vLLM blocks
// first, NHD, HND); the views come from `kvp::layouts::*`, but every accessor of
// this fixture computes addresses with its own, independent index math, so a test
// that reads through the fixture checks the library's address math too.
// Blocks are handed to sequences in shuffled order (never the identity), dense or
// CSR; table entries past a sequence's blocks are -1 (never read by a correct
// library). The query window buffer is `[L, slots, w, h_q, d]`, F is `[L, NB, b, h_kv]`.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"

namespace kvp_test {

using i32 = std::int32_t;
using i64 = std::int64_t;

enum class cache_layout : std::uint8_t {
  nano_vllm,
  vllm_flash,
  vllm_flash_blocks_first,
  nhd,
  hnd,
  trtllm_blocks_first,
  trtllm_layers_first,
  sglang,  // nhd with blocks of one token; only with block_size 1, so not in all_layouts
};
inline constexpr std::array<cache_layout, 7> all_layouts{
    cache_layout::nano_vllm,           cache_layout::vllm_flash, cache_layout::vllm_flash_blocks_first,
    cache_layout::nhd,                 cache_layout::hnd,        cache_layout::trtllm_blocks_first,
    cache_layout::trtllm_layers_first};
inline constexpr int layout_count = static_cast<int>(all_layouts.size());
inline constexpr std::array<kvp::dtype, 3> all_dtypes{kvp::dtype::f32, kvp::dtype::f16, kvp::dtype::bf16};

inline const char* layout_name(cache_layout l) noexcept {
  switch (l) {
    case cache_layout::nano_vllm: return "nano_vllm";
    case cache_layout::vllm_flash: return "vllm_flash";
    case cache_layout::vllm_flash_blocks_first: return "vllm_flash_blocks_first";
    case cache_layout::nhd: return "nhd";
    case cache_layout::hnd: return "hnd";
    case cache_layout::trtllm_blocks_first: return "trtllm_blocks_first";
    case cache_layout::trtllm_layers_first: return "trtllm_layers_first";
    case cache_layout::sglang: return "sglang";
  }
  return "?";
}

enum class kv_kind : std::uint8_t { k = 0, v = 1 };

struct cache_config {
  i32 layers = 1;
  i32 num_blocks = 0;    // 0: the blocks the sequences need plus spare_blocks
  i32 spare_blocks = 2;  // blocks owned by no sequence (when num_blocks == 0)
  i32 block_size = 4;
  i32 kv_heads = 1;
  i32 head_dim = 2;
  kvp::dtype type = kvp::dtype::f32;
  std::vector<i32> lengths{8};
  i32 capacity_blocks = 0;  // table room per sequence; 0: what the longest (dense) / each (CSR) needs
  bool csr = false;
  cache_layout layout = cache_layout::nhd;
  i32 q_heads = 0;   // 0: kv_heads (G = 1)
  i32 window = 4;    // w of the query window buffer
  i32 slots = 0;     // 0: one slot per sequence
  std::optional<kvp::dtype> q_type{};  // default: the cache's dtype
  std::uint32_t seed = 1;
  bool shuffle = true;  // shuffled block table (never the identity when there are 2+ blocks)
  bool randomize = true;  // random K, V, queries in [-1, 1) and F in [f_lo, f_hi); else all zero
  float f_lo = -1.0f, f_hi = 1.0f;
  bool live = false;  // the view carries a live view (cautious update): 1 for every held token
};

class test_cache {
 public:
  // Bytes of everything the fixture owns, to compare before and after a call.
  struct snapshot {
    std::vector<std::vector<std::byte>> buffers;
    std::vector<std::byte> queries;
    std::vector<float> f;
    std::vector<i32> table, indptr, lengths;
    std::vector<void*> k_layers, v_layers;
    std::vector<i32> positions;
    std::vector<std::uint8_t> live;
  };

  // Which (layer, physical block, slot) may be written: [L][NB][b].
  struct region {
    i32 blocks = 0, block_size = 0;
    std::vector<std::uint8_t> ok;
    bool operator()(i32 l, i32 block, i32 slot) const {
      return ok[(static_cast<std::size_t>(l) * blocks + block) * block_size + slot] != 0;
    }
  };

  explicit test_cache(cache_config cfg) : cfg_(std::move(cfg)), rng_(cfg_.seed) {
    const i32 b = cfg_.block_size;
    if (cfg_.layers <= 0 || b <= 0 || cfg_.kv_heads <= 0 || cfg_.head_dim <= 0 || cfg_.lengths.empty())
      throw std::invalid_argument("test_cache: bad shape");
    if (cfg_.layout == cache_layout::sglang && b != 1)
      throw std::invalid_argument("test_cache: SGLang's token pool has blocks of one token");
    if (cfg_.q_heads == 0) cfg_.q_heads = cfg_.kv_heads;
    if (cfg_.slots == 0) cfg_.slots = static_cast<i32>(cfg_.lengths.size());
    if (!cfg_.q_type) cfg_.q_type = cfg_.type;
    const i32 S = num_seqs();
    std::vector<i32> needed(static_cast<std::size_t>(S));
    i32 total = 0, longest = 0;
    for (i32 s = 0; s < S; ++s) {
      needed[s] = (cfg_.lengths[s] + b - 1) / b;
      total += needed[s];
      longest = std::max(longest, needed[s]);
    }
    if (cfg_.num_blocks == 0) cfg_.num_blocks = total + cfg_.spare_blocks;
    if (cfg_.num_blocks < total || cfg_.num_blocks <= 0) throw std::invalid_argument("test_cache: too few blocks");

    std::vector<i32> perm(static_cast<std::size_t>(cfg_.num_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    if (cfg_.shuffle && perm.size() > 1) {
      std::shuffle(perm.begin(), perm.end(), rng_);
      bool identity = true;
      for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<i32>(i);
      if (identity) std::rotate(perm.begin(), perm.begin() + 1, perm.end());
    }
    owner_.assign(static_cast<std::size_t>(cfg_.num_blocks), {-1, -1});
    rows_.resize(static_cast<std::size_t>(S));
    std::size_t next = 0;
    for (i32 s = 0; s < S; ++s) {
      for (i32 i = 0; i < needed[s]; ++i) {
        owner_[perm[next]] = {s, i};
        rows_[s].push_back(perm[next++]);
      }
    }
    if (cfg_.csr) {
      indptr_.push_back(0);
      for (i32 s = 0; s < S; ++s) {
        const i32 cap = std::max(needed[s], cfg_.capacity_blocks);
        for (i32 i = 0; i < cap; ++i) table_.push_back(i < needed[s] ? rows_[s][i] : -1);
        indptr_.push_back(static_cast<i32>(table_.size()));
      }
    } else {
      row_stride_ = std::max({longest, cfg_.capacity_blocks, 1});
      table_.assign(static_cast<std::size_t>(S) * row_stride_, -1);
      for (i32 s = 0; s < S; ++s)
        for (i32 i = 0; i < needed[s]; ++i) table_[static_cast<std::size_t>(s) * row_stride_ + i] = rows_[s][i];
    }
    lengths_ = cfg_.lengths;

    // Cache tensors.
    const std::size_t es = static_cast<std::size_t>(kvp::size_of(cfg_.type));
    const std::size_t blk = static_cast<std::size_t>(b) * cfg_.kv_heads * cfg_.head_dim;  // elements of a block
    const std::size_t layer = blk * static_cast<std::size_t>(cfg_.num_blocks);
    const std::size_t L = static_cast<std::size_t>(cfg_.layers);
    switch (cfg_.layout) {
      case cache_layout::nano_vllm:
      case cache_layout::trtllm_blocks_first: buffers_.assign(1, std::vector<std::byte>(2 * L * layer * es)); break;
      case cache_layout::vllm_flash:
      case cache_layout::vllm_flash_blocks_first:
      case cache_layout::trtllm_layers_first: buffers_.assign(L, std::vector<std::byte>(2 * layer * es)); break;
      case cache_layout::nhd:
      case cache_layout::hnd:
      case cache_layout::sglang: buffers_.assign(2 * L, std::vector<std::byte>(layer * es)); break;
    }
    std::vector<std::byte*> bases;
    for (auto& buf : buffers_) bases.push_back(buf.data());
    k_layers_ = layer_table(kv_kind::k, bases);
    v_layers_ = layer_table(kv_kind::v, bases);
    queries_.assign(static_cast<std::size_t>(cfg_.layers) * cfg_.slots * cfg_.window * cfg_.q_heads * cfg_.head_dim *
                        kvp::size_of(*cfg_.q_type),
                    std::byte{0});
    f_.assign(L * cfg_.num_blocks * b * cfg_.kv_heads, 0.0f);
    // Each token's original position in every layer and head; -1 in free slots.
    positions_.assign(f_.size(), -1);
    for (i32 s = 0; s < S; ++s)
      for (i32 t = 0; t < cfg_.lengths[s]; ++t)
        for (i32 l = 0; l < cfg_.layers; ++l)
          for (i32 h = 0; h < cfg_.kv_heads; ++h) position(l, s, t, h) = t;
    // Held by every head: 1 for each token of a sequence, 0 in free slots.
    live_.assign(f_.size(), 0);
    for (std::size_t i = 0; i < positions_.size(); ++i) live_[i] = positions_[i] >= 0;
    if (cfg_.randomize) randomize();
  }

  // Movable (vectors keep their storage, so the layer tables stay valid), not copyable.
  test_cache(test_cache&&) noexcept = default;
  test_cache& operator=(test_cache&&) noexcept = default;
  test_cache(const test_cache&) = delete;
  test_cache& operator=(const test_cache&) = delete;

  // ---- shape ----------------------------------------------------------------
  const cache_config& config() const noexcept { return cfg_; }
  i32 num_layers() const noexcept { return cfg_.layers; }
  i32 num_blocks() const noexcept { return cfg_.num_blocks; }
  i32 block_size() const noexcept { return cfg_.block_size; }
  i32 kv_heads() const noexcept { return cfg_.kv_heads; }
  i32 q_heads() const noexcept { return cfg_.q_heads; }
  i32 head_dim() const noexcept { return cfg_.head_dim; }
  i32 window() const noexcept { return cfg_.window; }
  i32 slots() const noexcept { return cfg_.slots; }
  i32 num_seqs() const noexcept { return static_cast<i32>(cfg_.lengths.size()); }
  kvp::dtype type() const noexcept { return cfg_.type; }
  kvp::dtype query_type() const noexcept { return *cfg_.q_type; }
  std::mt19937& rng() noexcept { return rng_; }

  i32 length(i32 seq) const { return lengths_.at(seq); }
  // The engine's side: after a compression, or to append tokens (up to the blocks
  // the sequence was given at construction).
  void set_length(i32 seq, i32 T) {
    if (T < 0 || T > static_cast<i32>(rows_.at(seq).size()) * cfg_.block_size)
      throw std::invalid_argument("test_cache::set_length: past the sequence's blocks");
    lengths_[seq] = T;
  }
  // Physical block of logical block i of seq (the fixture's own copy of the table).
  i32 block(i32 seq, i32 i) const { return rows_.at(seq).at(i); }
  i32 block_of_token(i32 seq, i32 t) const { return block(seq, t / cfg_.block_size); }
  // Blocks given to seq at construction.
  const std::vector<i32>& blocks(i32 seq) const { return rows_.at(seq); }
  // (seq, logical index) owning a physical block, {-1, -1} for none.
  std::pair<i32, i32> owner(i32 block) const { return owner_.at(block); }
  // Raw table storage (tests that corrupt an entry on purpose restore it after).
  std::vector<i32>& raw_table() noexcept { return table_; }
  std::vector<i32>& raw_indptr() noexcept { return indptr_; }
  std::vector<i32>& raw_lengths() noexcept { return lengths_; }
  std::vector<std::vector<std::byte>>& raw_buffers() noexcept { return buffers_; }
  const std::vector<i32>& raw_table() const noexcept { return table_; }
  const std::vector<i32>& raw_indptr() const noexcept { return indptr_; }
  const std::vector<i32>& raw_lengths() const noexcept { return lengths_; }
  const std::vector<std::vector<std::byte>>& raw_buffers() const noexcept { return buffers_; }
  // Index into raw_table() of logical block i of seq.
  std::size_t table_index(i32 seq, i32 i) const {
    return cfg_.csr ? static_cast<std::size_t>(indptr_[seq] + i) : static_cast<std::size_t>(seq) * row_stride_ + i;
  }

  // ---- views -----------------------------------------------------------------
  kvp::cache_shape shape() const noexcept {
    return {cfg_.layers, cfg_.num_blocks, cfg_.block_size, cfg_.kv_heads, cfg_.head_dim, cfg_.type};
  }
  kvp::sequence_table sequences() const noexcept {
    return sequences_over(table_.data(), indptr_.data(), lengths_.data());
  }
  kvp::paged_kv_view view() {
    return view_over({buffers_[0].data(), k_layers_.data(), v_layers_.data(), table_.data(), indptr_.data(),
                      lengths_.data(), positions_.data(), live_.data()});
  }
  kvp::query_window_view queries() const noexcept { return queries_over(queries_.data()); }
  kvp::score_view scores() noexcept { return scores_over(f_.data()); }

  // The same views over copies of this fixture's arrays held elsewhere (device memory):
  // same shape, same layout, other addresses. `layer_table` gives the per-layer tensor
  // bases of the layouts that take them, from where raw_buffers()[i] was copied to.
  struct array_bases {
    std::byte* buffer0 = nullptr;  // raw_buffers()[0]: nano_vllm's one tensor
    void* const* k_layers = nullptr;
    void* const* v_layers = nullptr;
    const i32* table = nullptr;
    const i32* indptr = nullptr;
    const i32* lengths = nullptr;
    i32* positions = nullptr;  // raw_positions()
    std::uint8_t* live = nullptr;  // raw_live(), taken when the config asks for a live view
  };
  std::vector<void*> layer_table(kv_kind kind, std::span<std::byte* const> buffer_bases) const {
    std::vector<void*> out;
    if (cfg_.layout == cache_layout::nano_vllm || cfg_.layout == cache_layout::trtllm_blocks_first) return out;
    const bool split = cfg_.layout == cache_layout::nhd || cfg_.layout == cache_layout::hnd ||
                       cfg_.layout == cache_layout::sglang;  // K and V apart
    for (std::size_t l = 0; l < static_cast<std::size_t>(cfg_.layers); ++l)
      out.push_back(split ? buffer_bases[2 * l + (kind == kv_kind::v ? 1 : 0)] : buffer_bases[l]);
    return out;
  }
  kvp::sequence_table sequences_over(const i32* table, const i32* indptr, const i32* lengths) const noexcept {
    const auto t =
        cfg_.csr ? kvp::block_table_view::csr(indptr, table) : kvp::block_table_view::dense(table, row_stride_);
    return {t, lengths, num_seqs()};
  }
  kvp::paged_kv_view view_over(const array_bases& a) const {
    kvp::paged_kv_view v = layout_view(a);
    if (a.positions) v.positions = kvp::position_view::contiguous(a.positions, cfg_.num_blocks, cfg_.block_size, cfg_.kv_heads);
    if (a.live && cfg_.live) v.live = kvp::live_view::contiguous(a.live, cfg_.num_blocks, cfg_.block_size, cfg_.kv_heads);
    return v;
  }
  kvp::paged_kv_view layout_view(const array_bases& a) const {
    const auto s = shape();
    const auto q = sequences_over(a.table, a.indptr, a.lengths);
    switch (cfg_.layout) {
      case cache_layout::nano_vllm: return kvp::layouts::nano_vllm(a.buffer0, s, q);
      case cache_layout::vllm_flash: return kvp::layouts::vllm_flash(a.k_layers, s, q);
      case cache_layout::vllm_flash_blocks_first: return kvp::layouts::vllm_flash_blocks_first(a.k_layers, s, q);
      case cache_layout::nhd: return kvp::layouts::nhd(a.k_layers, a.v_layers, s, q);
      case cache_layout::hnd: return kvp::layouts::hnd(a.k_layers, a.v_layers, s, q);
      case cache_layout::trtllm_blocks_first: return kvp::layouts::trtllm_blocks_first(a.buffer0, s, q);
      case cache_layout::trtllm_layers_first: return kvp::layouts::trtllm_layers_first(a.k_layers, s, q);
      case cache_layout::sglang: return kvp::layouts::sglang(a.k_layers, a.v_layers, s, q);
    }
    return {};
  }
  kvp::query_window_view queries_over(const void* base) const noexcept {
    return kvp::query_window_view::contiguous(base, cfg_.layers, cfg_.slots, cfg_.window, cfg_.q_heads, cfg_.head_dim,
                                              *cfg_.q_type);
  }
  kvp::score_view scores_over(float* base) const noexcept {
    return kvp::score_view::contiguous(base, cfg_.num_blocks, cfg_.block_size, cfg_.kv_heads);
  }

  // ---- element access (independent index math) -------------------------------
  // Element offset of (layer, block, slot, head, 0) in its buffer, and the buffer.
  std::pair<std::size_t, std::size_t> locate(kv_kind kind, i32 l, i32 block, i32 slot, i32 h) const {
    const std::size_t L = static_cast<std::size_t>(cfg_.layers), NB = static_cast<std::size_t>(cfg_.num_blocks),
                      b = static_cast<std::size_t>(cfg_.block_size), H = static_cast<std::size_t>(cfg_.kv_heads),
                      d = static_cast<std::size_t>(cfg_.head_dim);
    const std::size_t kv = kind == kv_kind::k ? 0 : 1;
    const std::size_t ul = static_cast<std::size_t>(l), p = static_cast<std::size_t>(block),
                      s = static_cast<std::size_t>(slot), uh = static_cast<std::size_t>(h);
    switch (cfg_.layout) {
      case cache_layout::nano_vllm: return {0, ((((kv * L + ul) * NB + p) * b + s) * H + uh) * d};
      case cache_layout::vllm_flash: return {ul, (((kv * NB + p) * b + s) * H + uh) * d};
      case cache_layout::vllm_flash_blocks_first: return {ul, (((p * 2 + kv) * b + s) * H + uh) * d};
      case cache_layout::nhd:
      case cache_layout::sglang: return {2 * ul + kv, ((p * b + s) * H + uh) * d};
      case cache_layout::hnd: return {2 * ul + kv, ((p * H + uh) * b + s) * d};
      case cache_layout::trtllm_blocks_first: return {0, ((((p * L + ul) * 2 + kv) * H + uh) * b + s) * d};
      case cache_layout::trtllm_layers_first: return {ul, (((p * 2 + kv) * H + uh) * b + s) * d};
    }
    return {0, 0};
  }
  std::byte* row_ptr(kv_kind kind, i32 l, i32 block, i32 slot, i32 h) {
    const auto [buf, off] = locate(kind, l, block, slot, h);
    return buffers_[buf].data() + off * static_cast<std::size_t>(kvp::size_of(cfg_.type));
  }
  const std::byte* row_ptr(kv_kind kind, i32 l, i32 block, i32 slot, i32 h) const {
    return const_cast<test_cache*>(this)->row_ptr(kind, l, block, slot, h);
  }
  std::size_t row_size() const noexcept {
    return static_cast<std::size_t>(cfg_.head_dim) * static_cast<std::size_t>(kvp::size_of(cfg_.type));
  }
  // The bytes of one (token, head) row, now or in a snapshot.
  const std::byte* row_ptr(const snapshot& snap, kv_kind kind, i32 l, i32 block, i32 slot, i32 h) const {
    const auto [buf, off] = locate(kind, l, block, slot, h);
    return snap.buffers[buf].data() + off * static_cast<std::size_t>(kvp::size_of(cfg_.type));
  }
  std::vector<std::byte> row_bytes(kv_kind kind, i32 l, i32 block, i32 slot, i32 h) const {
    return copy_row(row_ptr(kind, l, block, slot, h));
  }
  std::vector<std::byte> row_bytes(const snapshot& snap, kv_kind kind, i32 l, i32 block, i32 slot, i32 h) const {
    return copy_row(row_ptr(snap, kind, l, block, slot, h));
  }
  // Bytes of token t (logical) of seq, through the fixture's table.
  std::vector<std::byte> token_bytes(kv_kind kind, i32 l, i32 seq, i32 t, i32 h) const {
    return row_bytes(kind, l, block_of_token(seq, t), t % cfg_.block_size, h);
  }
  std::vector<std::byte> token_bytes(const snapshot& snap, kv_kind kind, i32 l, i32 seq, i32 t, i32 h) const {
    return row_bytes(snap, kind, l, block_of_token(seq, t), t % cfg_.block_size, h);
  }

  std::vector<float> row(kv_kind kind, i32 l, i32 seq, i32 t, i32 h) const {
    const std::byte* p = row_ptr(kind, l, block_of_token(seq, t), t % cfg_.block_size, h);
    std::vector<float> out(static_cast<std::size_t>(cfg_.head_dim));
    for (i32 i = 0; i < cfg_.head_dim; ++i) out[i] = kvp::load_as_float(p, cfg_.type, i);
    return out;
  }
  void set_row(kv_kind kind, i32 l, i32 seq, i32 t, i32 h, std::span<const float> x) {
    if (static_cast<i32>(x.size()) != cfg_.head_dim) throw std::invalid_argument("test_cache::set_row: size");
    std::byte* p = row_ptr(kind, l, block_of_token(seq, t), t % cfg_.block_size, h);
    for (i32 i = 0; i < cfg_.head_dim; ++i) kvp::store_from_float(p, cfg_.type, i, x[i]);
  }
  std::vector<float> key(i32 l, i32 seq, i32 t, i32 h) const { return row(kv_kind::k, l, seq, t, h); }
  std::vector<float> value(i32 l, i32 seq, i32 t, i32 h) const { return row(kv_kind::v, l, seq, t, h); }
  void set_key(i32 l, i32 seq, i32 t, i32 h, std::initializer_list<float> x) {
    set_row(kv_kind::k, l, seq, t, h, std::span<const float>(x.begin(), x.size()));
  }
  void set_key(i32 l, i32 seq, i32 t, i32 h, std::span<const float> x) { set_row(kv_kind::k, l, seq, t, h, x); }
  void set_value(i32 l, i32 seq, i32 t, i32 h, std::initializer_list<float> x) {
    set_row(kv_kind::v, l, seq, t, h, std::span<const float>(x.begin(), x.size()));
  }
  // Keys of tokens [0, T) of (l, seq, h), widened: [T][d].
  std::vector<float> keys(i32 l, i32 seq, i32 h, i32 T) const {
    std::vector<float> out;
    for (i32 t = 0; t < T; ++t) {
      const auto r = key(l, seq, t, h);
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }
  std::vector<float> keys(i32 l, i32 seq, i32 h) const { return keys(l, seq, h, length(seq)); }

  // Query of (layer, slot, window entry j, query head).
  std::byte* query_ptr(i32 l, i32 slot, i32 j, i32 qh) {
    const std::size_t idx =
        ((static_cast<std::size_t>(l) * cfg_.slots + slot) * cfg_.window + j) * cfg_.q_heads + qh;
    return queries_.data() + idx * cfg_.head_dim * kvp::size_of(*cfg_.q_type);
  }
  std::vector<float> query(i32 l, i32 slot, i32 j, i32 qh) const {
    const std::byte* p = const_cast<test_cache*>(this)->query_ptr(l, slot, j, qh);
    std::vector<float> out(static_cast<std::size_t>(cfg_.head_dim));
    for (i32 i = 0; i < cfg_.head_dim; ++i) out[i] = kvp::load_as_float(p, *cfg_.q_type, i);
    return out;
  }
  void set_query(i32 l, i32 slot, i32 j, i32 qh, std::span<const float> x) {
    if (static_cast<i32>(x.size()) != cfg_.head_dim) throw std::invalid_argument("test_cache::set_query: size");
    std::byte* p = query_ptr(l, slot, j, qh);
    for (i32 i = 0; i < cfg_.head_dim; ++i) kvp::store_from_float(p, *cfg_.q_type, i, x[i]);
  }
  void set_query(i32 l, i32 slot, i32 j, i32 qh, std::initializer_list<float> x) {
    set_query(l, slot, j, qh, std::span<const float>(x.begin(), x.size()));
  }

  // F of (layer, physical block, slot, KV head), and of a token of a sequence.
  float& f_at(i32 l, i32 block, i32 slot, i32 h) {
    return f_[((static_cast<std::size_t>(l) * cfg_.num_blocks + block) * cfg_.block_size + slot) * cfg_.kv_heads + h];
  }
  float f_at(const snapshot& snap, i32 l, i32 block, i32 slot, i32 h) const {
    return snap.f[((static_cast<std::size_t>(l) * cfg_.num_blocks + block) * cfg_.block_size + slot) * cfg_.kv_heads +
                  h];
  }
  float& f(i32 l, i32 seq, i32 t, i32 h) { return f_at(l, block_of_token(seq, t), t % cfg_.block_size, h); }
  float f(const snapshot& snap, i32 l, i32 seq, i32 t, i32 h) const {
    return f_at(snap, l, block_of_token(seq, t), t % cfg_.block_size, h);
  }
  // Positions of (layer, physical block, slot, KV head) ([L, NB, b, h_kv], as F), and of
  // a token of a sequence.
  std::size_t position_index(i32 l, i32 block, i32 slot, i32 h) const {
    return ((static_cast<std::size_t>(l) * cfg_.num_blocks + block) * cfg_.block_size + slot) * cfg_.kv_heads + h;
  }
  i32& position(i32 l, i32 seq, i32 t, i32 h) {
    return positions_[position_index(l, block_of_token(seq, t), t % cfg_.block_size, h)];
  }
  std::vector<i32>& raw_positions() noexcept { return positions_; }
  // The live bytes, indexed as the positions (position_index); view() takes them when
  // the config's `live` is set.
  std::vector<std::uint8_t>& raw_live() noexcept { return live_; }
  const std::vector<std::uint8_t>& raw_live() const noexcept { return live_; }
  std::uint8_t& live(i32 l, i32 seq, i32 t, i32 h) {
    return live_[position_index(l, block_of_token(seq, t), t % cfg_.block_size, h)];
  }
  const std::vector<i32>& raw_positions() const noexcept { return positions_; }
  std::vector<float>& raw_f() noexcept { return f_; }
  const std::vector<float>& raw_f() const noexcept { return f_; }
  const std::vector<std::byte>& raw_queries() const noexcept { return queries_; }
  std::vector<std::byte>& raw_queries() noexcept { return queries_; }

  // ---- contents ----------------------------------------------------------------
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  i32 uniform_int(i32 lo, i32 hi) { return std::uniform_int_distribution<i32>(lo, hi)(rng_); }

  // Random K, V, queries in [-1, 1), F in [f_lo, f_hi).
  void randomize() {
    const auto t = cfg_.type;
    const std::size_t es = static_cast<std::size_t>(kvp::size_of(t));
    for (auto& buf : buffers_)
      for (std::size_t i = 0; i < buf.size() / es; ++i) kvp::store_from_float(buf.data(), t, static_cast<i64>(i), uniform(-1.0f, 1.0f));
    const std::size_t qs = static_cast<std::size_t>(kvp::size_of(*cfg_.q_type));
    for (std::size_t i = 0; i < queries_.size() / qs; ++i)
      kvp::store_from_float(queries_.data(), *cfg_.q_type, static_cast<i64>(i), uniform(-1.0f, 1.0f));
    for (float& x : f_) x = uniform(cfg_.f_lo, cfg_.f_hi);
  }
  // Fresh random K and V for tokens [from, to) of seq in every layer and head (appended tokens).
  void randomize_tokens(i32 seq, i32 from, i32 to) {
    std::vector<float> x(static_cast<std::size_t>(cfg_.head_dim));
    for (i32 l = 0; l < cfg_.layers; ++l)
      for (i32 t = from; t < to; ++t)
        for (i32 h = 0; h < cfg_.kv_heads; ++h)
          for (kv_kind kind : {kv_kind::k, kv_kind::v}) {
            for (float& e : x) e = uniform(-1.0f, 1.0f);
            set_row(kind, l, seq, t, h, x);
          }
  }
  // Every element of K, V and the queries set to v (F untouched).
  void fill(float v) {
    const auto t = cfg_.type;
    const std::size_t es = static_cast<std::size_t>(kvp::size_of(t));
    for (auto& buf : buffers_)
      for (std::size_t i = 0; i < buf.size() / es; ++i) kvp::store_from_float(buf.data(), t, static_cast<i64>(i), v);
    const std::size_t qs = static_cast<std::size_t>(kvp::size_of(*cfg_.q_type));
    for (std::size_t i = 0; i < queries_.size() / qs; ++i)
      kvp::store_from_float(queries_.data(), *cfg_.q_type, static_cast<i64>(i), v);
  }
  void fill_f(float v) { std::fill(f_.begin(), f_.end(), v); }

  // ---- snapshots ---------------------------------------------------------------
  snapshot take_snapshot() const {
    return {buffers_, queries_, f_, table_, indptr_, lengths_, k_layers_, v_layers_, positions_, live_};
  }
  // Every byte the fixture owns equals the snapshot (F compared bit for bit).
  bool unchanged_since(const snapshot& s) const {
    return s.buffers == buffers_ && s.queries == queries_ && s.table == table_ && s.indptr == indptr_ &&
           s.lengths == lengths_ && s.k_layers == k_layers_ && s.v_layers == v_layers_ && s.f.size() == f_.size() &&
           std::memcmp(s.f.data(), f_.data(), f_.size() * sizeof(float)) == 0 && s.positions == positions_ &&
           s.live == live_;
  }
  bool kv_unchanged_since(const snapshot& s) const { return s.buffers == buffers_; }
  bool f_unchanged_since(const snapshot& s) const {
    return s.f.size() == f_.size() && std::memcmp(s.f.data(), f_.data(), f_.size() * sizeof(float)) == 0;
  }

  // Where a compression of `items` over layers [layer_begin, layer_end) may write:
  // tokens [0, length) of the batch's sequences (lengths as they are now).
  region batch_region(std::span<const kvp::batch_item> items, i32 layer_begin, i32 layer_end) const {
    region r = no_region();
    for (const auto& it : items)
      for (i32 l = layer_begin; l < layer_end; ++l)
        for (i32 t = 0; t < lengths_[it.seq]; ++t)
          r.ok[(static_cast<std::size_t>(l) * cfg_.num_blocks + block_of_token(it.seq, t)) * cfg_.block_size +
               t % cfg_.block_size] = 1;
    return r;
  }
  region no_region() const {
    region r;
    r.blocks = cfg_.num_blocks;
    r.block_size = cfg_.block_size;
    r.ok.assign(static_cast<std::size_t>(cfg_.layers) * cfg_.num_blocks * cfg_.block_size, 0);
    return r;
  }

  // Descriptions of every K/V row outside `kv_ok` and every F entry outside `f_ok` that
  // differs from the snapshot; and of any change to the queries, table, lengths.
  std::vector<std::string> writes_outside(const snapshot& s, const region& kv_ok, const region& f_ok) const {
    std::vector<std::string> out;
    auto note = [&](std::string what) {
      if (out.size() < 16) out.push_back(std::move(what));
    };
    for (i32 l = 0; l < cfg_.layers; ++l)
      for (i32 p = 0; p < cfg_.num_blocks; ++p)
        for (i32 slot = 0; slot < cfg_.block_size; ++slot)
          for (i32 h = 0; h < cfg_.kv_heads; ++h) {
            if (!kv_ok(l, p, slot)) {
              for (kv_kind kind : {kv_kind::k, kv_kind::v})
                if (std::memcmp(row_ptr(kind, l, p, slot, h), row_ptr(s, kind, l, p, slot, h), row_size()) != 0)
                  note(std::string(kind == kv_kind::k ? "K" : "V") + " layer " + std::to_string(l) + " block " +
                       std::to_string(p) + " slot " + std::to_string(slot) + " head " + std::to_string(h));
              const std::size_t at = position_index(l, p, slot, h);
              if (positions_[at] != s.positions[at])
                note("position layer " + std::to_string(l) + " block " + std::to_string(p) + " slot " +
                     std::to_string(slot) + " head " + std::to_string(h));
              if (live_[at] != s.live[at])
                note("live layer " + std::to_string(l) + " block " + std::to_string(p) + " slot " +
                     std::to_string(slot) + " head " + std::to_string(h));
            }
            if (!f_ok(l, p, slot)) {
              const float a = const_cast<test_cache*>(this)->f_at(l, p, slot, h), b = f_at(s, l, p, slot, h);
              if (std::memcmp(&a, &b, sizeof a) != 0)
                note("F layer " + std::to_string(l) + " block " + std::to_string(p) + " slot " +
                     std::to_string(slot) + " head " + std::to_string(h));
            }
          }
    if (s.queries != queries_) note("queries");
    if (s.table != table_ || s.indptr != indptr_) note("block table");
    if (s.lengths != lengths_) note("lengths");
    return out;
  }

  std::string describe() const {
    std::string out = std::string("layout ") + layout_name(cfg_.layout) + " dtype " +
                      std::string(kvp::name_of(cfg_.type)) + (cfg_.csr ? " csr" : " dense") + " L " +
                      std::to_string(cfg_.layers) + " NB " + std::to_string(cfg_.num_blocks) + " b " +
                      std::to_string(cfg_.block_size) + " H " + std::to_string(cfg_.kv_heads) + " Hq " +
                      std::to_string(cfg_.q_heads) + " d " + std::to_string(cfg_.head_dim) + " w " +
                      std::to_string(cfg_.window) + " lengths [";
    for (i32 x : lengths_) out += std::to_string(x) + " ";
    return out + "] seed " + std::to_string(cfg_.seed);
  }

 private:
  // (A plain size + memcpy: GCC 12 warns falsely on the range constructor here.)
  std::vector<std::byte> copy_row(const std::byte* p) const {
    std::vector<std::byte> out(row_size());
    std::memcpy(out.data(), p, out.size());
    return out;
  }

  cache_config cfg_;
  std::mt19937 rng_;
  std::vector<std::vector<std::byte>> buffers_;
  std::vector<void*> k_layers_, v_layers_;
  std::vector<std::byte> queries_;
  std::vector<float> f_;
  std::vector<i32> table_, indptr_, lengths_;
  std::vector<i32> positions_;
  std::vector<std::uint8_t> live_;
  i64 row_stride_ = 0;
  std::vector<std::vector<i32>> rows_;
  std::vector<std::pair<i32, i32>> owner_;
};

// Tokens of an item's rows in keep masks and scores: its sequence, or its window for a
// window-only layout (window_begin is 0 for every other layout).
inline i32 result_tokens(const test_cache& tc, const kvp::batch_item& it) { return tc.length(it.seq) - it.window_begin; }

// A compression batch over `items` (kept alive by the caller).
inline kvp::compression_batch make_batch(const std::vector<kvp::batch_item>& items, i32 layer_begin = 0,
                                         i32 layer_count = 0, kvp::prefix_targets targets = {}) {
  return {std::span<const kvp::batch_item>(items.data(), items.size()), layer_begin, layer_count, targets};
}

// The targets of shared prefixes over host vectors (kept alive by the caller): item
// i's are blocks[indptr[i] .. indptr[i + 1]).
inline kvp::prefix_targets prefix_targets_of(const std::vector<i32>& indptr, const std::vector<i32>& blocks) {
  return {indptr.data(), blocks.data()};
}

// Runs a pipeline on the host executor, recording keep masks and final scores.
template <class P>
kvp::host_result run_host(const P& p, test_cache& tc, const std::vector<kvp::batch_item>& items, i32 layer_begin = 0,
                          i32 layer_count = 0, kvp::prefix_targets targets = {}) {
  const kvp::host_executor ex{.record_keep_masks = true, .record_scores = true};
  return ex.compress(p, tc.view(), tc.queries(), tc.scores(), make_batch(items, layer_begin, layer_count, targets));
}

#ifndef KVP_TEST_CUDA_EXECUTOR
// How the unit tests run a pipeline: here, on the host executor. Their CUDA build
// (KVP_TEST_CUDA_EXECUTOR, tests/CMakeLists.txt) includes support/run_on_both_executors.cuh
// first, which defines it instead: the host executor, then the CUDA executor on a device
// copy of the cache, checked to agree.
template <class P>
kvp::host_result run(const P& p, test_cache& tc, const std::vector<kvp::batch_item>& items, i32 layer_begin = 0,
                     i32 layer_count = 0, kvp::prefix_targets targets = {}) {
  return run_host(p, tc, items, layer_begin, layer_count, targets);
}
#endif

// Index of (layer - layer_begin, head, t) in a host_result's keep_masks / scores row.
inline std::size_t result_index(i32 layer_offset, i32 h, i32 t, i32 H, i32 T) {
  return (static_cast<std::size_t>(layer_offset) * H + h) * T + t;
}

}  // namespace kvp_test
