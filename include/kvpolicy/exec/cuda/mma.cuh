// Warp-level tensor-core primitives (sm_80+): 16x8x16 MMA with fp32 accumulators on
// f16/bf16 inputs, ldmatrix fragment loads, and asynchronous 16-byte copies.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/exec/cuda/load.cuh"

KVP_NAMESPACE_BEGIN
namespace cuda {

__device__ inline std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the address of one row (see callers).
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row)));
}

// c += a * b for one 16x8 tile, k = 16; a row-major, b column-major (rows of K).
template <dtype T>
__device__ inline void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  static_assert(T == dtype::bf16 || T == dtype::f16);
  if constexpr (T == dtype::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16-byte global -> shared copy that bypasses registers; `bytes` 0 fills zeros.
__device__ inline void cp_async_16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(bytes));
}
// The same, all 16 bytes copied.
__device__ inline void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(dst)), "l"(src));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Lanes that share one row of d 16-bit elements (d / 8 chunks of 16 bytes): the
// largest power of two that divides d / 8, at most 32, so that groups never straddle
// a warp and every lane of a group copies as many chunks (d 128: 16 lanes of one
// chunk each; d 96: 4 lanes of three).
__device__ inline std::int32_t lanes_per_row(std::int32_t d) {
  const std::int32_t vecs = d / 8, pow2 = vecs & -vecs;
  return pow2 < 32 ? pow2 : 32;
}

// Head dims the tensor-core kernels take: MMAs step through d 16 elements at a time.
KVP_HOST_DEVICE constexpr bool mma_head_dim(std::int32_t d) { return d > 0 && d % 16 == 0; }

// Where chunk c (16 bytes, 8 elements) of row r of a tile of 16-bit rows lives in
// shared memory, as an element offset. padded_rows: row-major with a pitch of
// d + 8, so the 8 rows of an ldmatrix fall on distinct banks.
struct padded_rows {
  std::int32_t pitch;
  __device__ std::size_t operator()(std::int32_t r, std::int32_t c) const {
    return std::size_t(r) * pitch + std::size_t(c) * 8;
  }
};
// core_matrices: wgmma's K-major layout without swizzle. A core matrix is 8 rows x 8
// elements in 128 contiguous bytes; those of one row group follow each other along
// d (128 bytes apart), and row groups are d * 16 bytes apart.
struct core_matrices {
  std::int32_t d;
  __device__ std::size_t operator()(std::int32_t r, std::int32_t c) const {
    return std::size_t(r >> 3) * (std::size_t(d) * 8) + std::size_t(c) * 64 + (r & 7) * 8;
  }
};

// Loads `count` rows of d 16-bit elements (row r from row_of(r)) into shared memory
// laid out by `at`, rows [count, rows) zero-filled, asynchronously. A group of lanes
// takes a row, so each row's address (block table lookup) is computed once per
// group, not once per chunk.
template <class Layout, class RowOf>
__device__ inline void copy_rows_async(std::uint16_t* dst, std::int32_t rows, std::int32_t count, std::int32_t d,
                                       Layout at, RowOf row_of) {
  const std::int32_t vecs = d / 8, group = lanes_per_row(d);
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % group;
  const std::int32_t step = static_cast<std::int32_t>(blockDim.x) / group;
  for (std::int32_t r = static_cast<std::int32_t>(threadIdx.x) / group; r < rows; r += step) {
    const bool real = r < count;
    const std::byte* src = row_of(real ? r : 0);
    for (std::int32_t v = lane; v < vecs; v += group) cp_async_16(dst + at(r, v), src + std::size_t(v) * 16, real ? 16 : 0);
  }
}

// Copies tiles of the keys of one (layer, seq, head) row of a paged cache into
// shared memory (laid out by Layout, rows past `count` zero-filled), with cp.async.
// What stays the same from tile to tile (the thread's chunk of a row, the layer's
// base, strides) is computed once. A tile inside one cache block (the usual case:
// block sizes are multiples of the tile) costs one block-table read; each thread
// keeps one chunk column and walks the rows by a fixed stride. Threads are mapped
// so that 8 adjacent ones write 128 contiguous bytes or distinct banks.
template <class Layout>
class key_tile_loader {
 public:
  __device__ key_tile_loader(const paged_kv_view& cache, std::int32_t layer, std::int32_t seq, std::int32_t head,
                             Layout at)
      : at_(at) {
    // Unsigned, and shifts for the usual power-of-two head dims (div_by).
    const auto vecs = static_cast<std::uint32_t>(cache.head_dim / 8), tid = threadIdx.x, threads = blockDim.x;
    step_ = static_cast<std::int32_t>(div_by(threads, vecs));
    if constexpr (std::is_same_v<Layout, core_matrices>) {
      // 8 adjacent threads take one chunk of 8 adjacent rows: one core matrix.
      strided_ = mod_by(threads, 8 * vecs) == 0;
      row0_ = static_cast<std::int32_t>(div_by(tid, 8 * vecs) * 8 + tid % 8);
      chunk_ = static_cast<std::int32_t>(mod_by(tid / 8, vecs));
    } else {
      strided_ = mod_by(threads, vecs) == 0;
      row0_ = static_cast<std::int32_t>(div_by(tid, vecs));
      chunk_ = static_cast<std::int32_t>(mod_by(tid, vecs));
    }
    // Everything in bytes, so that a tile's source address is one table read, one
    // wide multiply and two adds.
    const std::int64_t elem = size_of(cache.type);
    base_ = cache.k.layer(layer, cache.type) + cache.k_stride.head * head * elem;
    token_bytes_ = cache.k_stride.token * elem;
    block_bytes_ = cache.k_stride.block * elem;
    const block_table_view& t = cache.table;
    blocks_ = t.indices + (t.is_csr() ? std::int64_t{t.indptr[seq]} : seq * t.row_stride);
    // The shared-memory step between a thread's rows is constant: step_ rows of a
    // padded tile, or step_ / 8 row groups of core matrices (step_ is a multiple of 8).
    first_out_ = static_cast<std::int32_t>(at_(row0_, chunk_));
    out_step_ = static_cast<std::int32_t>(at_(row0_ + step_, chunk_)) - first_out_;
    first_offset_ = row0_ * token_bytes_ + chunk_ * 16;
    src_step_ = step_ * token_bytes_;
    const std::int32_t b = cache.block_size;
    block_shift_ = (b & (b - 1)) == 0 ? __ffs(b) - 1 : -1;  // power-of-two blocks: no division per tile
  }

  // Keys [pos0, pos0 + rows) into dst rows [0, rows), every row real. Where the
  // threads tile the rows in exactly Passes passes (rows = Passes * blockDim.x /
  // (d / 8)) inside one cache block, each thread makes its Passes copies after one
  // block-table read, with no bound test: copy() spends some 90 instructions a warp
  // on a 64-key tile, most of them on bound tests and address arithmetic. Elsewhere
  // it is copy().
  template <int Passes>
  __device__ void copy_whole(const paged_kv_view& c, std::uint16_t* dst, std::int32_t rows, std::int32_t pos0) const {
    const std::int32_t b = c.block_size, blk = block_of(pos0, b), slot = pos0 - blk * b;
    if (!strided_ || rows != Passes * step_ || slot + rows > b) {
      copy(c, dst, rows, rows, pos0);
      return;
    }
    const std::byte* src = first_source(blk, slot);
    std::uint16_t* out = dst + first_out_;
#pragma unroll
    for (int i = 0; i < Passes; ++i) cp_async_16(out + i * out_step_, src + i * src_step_);
  }

  // A tile of Rows keys from pos0 on, the first `count` of them real: whole tiles of
  // a constant head dim (HeadDim > 0) by copy_whole, the others by copy().
  template <int Rows, int HeadDim>
  __device__ void copy_tile(const paged_kv_view& c, std::uint16_t* dst, std::int32_t count, std::int32_t pos0) const {
    if constexpr (HeadDim > 0) {
      if (count >= Rows) {
        copy_whole<Rows * (HeadDim / 8) / row_threads>(c, dst, Rows, pos0);
        return;
      }
    }
    copy(c, dst, Rows, count < Rows ? count : Rows, pos0);
  }

  // Keys [pos0, pos0 + count) into dst rows [0, count); rows [count, rows) get zeros.
  // `c` is the view the loader was made for (passed again, not stored: a kernel
  // parameter whose address is kept would be copied to local memory).
  __device__ void copy(const paged_kv_view& c, std::uint16_t* dst, std::int32_t rows, std::int32_t count,
                       std::int32_t pos0) const {
    const std::int32_t b = c.block_size, blk = block_of(pos0, b), slot = pos0 - blk * b;
    if (!strided_ || slot + count > b) {
      copy_rows_async(dst, rows, count, c.head_dim, at_, [&](std::int32_t r) { return row(pos0 + r, b); });
      return;
    }
    std::int32_t r = row0_;
    const std::byte* src = first_source(blk, slot);
    std::uint16_t* out = dst + first_out_;
    // Unrolled: one loop test and a few adds per copy instead of a dozen instructions.
#pragma unroll 4
    for (; r < count; r += step_, src += src_step_, out += out_step_) cp_async_16(out, src);
    for (; r < rows; r += step_, out += out_step_) *reinterpret_cast<uint4*>(out) = uint4{0, 0, 0, 0};
  }

 private:
  // The logical cache block of position t (blocks of b tokens).
  __device__ std::int32_t block_of(std::int32_t t, std::int32_t b) const {
    return block_shift_ >= 0 ? t >> block_shift_ : t / b;
  }
  // This thread's first source byte of a strided tile starting at `slot` of block `blk`.
  __device__ const std::byte* first_source(std::int32_t blk, std::int32_t slot) const {
    return base_ + blocks_[blk] * block_bytes_ + slot * token_bytes_ + first_offset_;
  }
  // First byte of the key at logical position t (c.k_row with the layer and head folded in).
  __device__ const std::byte* row(std::int32_t t, std::int32_t b) const {
    const std::int32_t blk = block_of(t, b);
    return base_ + blocks_[blk] * block_bytes_ + (t - blk * b) * token_bytes_;
  }

  Layout at_;
  bool strided_;
  std::int32_t step_, row0_, chunk_, first_out_, out_step_, block_shift_;
  const std::byte* base_;
  const std::int32_t* blocks_;  // this sequence's row of the block table
  std::int64_t token_bytes_, block_bytes_;
  std::int64_t first_offset_, src_step_;  // the thread's first row and chunk, and its row step, in bytes
};

// Eight 16-bit elements of type T widened to fp32.
template <dtype T>
__device__ inline void widen8(const uint4& raw, float (&x)[8]) {
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f;
    if constexpr (T == dtype::bf16) {
      f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    } else {
      f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// 1 / (||k|| + eps) of one key of d 16-bit elements, its 16-byte chunk v being
// chunk(v), summed in element order as the host does (so the bits agree).
// HeadDim: d as a constant (unrolled, offsets folded into the loads), or 0.
template <dtype Elem, int HeadDim = 0, class Chunk>
__device__ inline float inverse_norm_16(Chunk chunk, std::int32_t d, float eps) {
  float ss = 0.0f;
  const auto add_chunk = [&](std::int32_t v) {
    float x[8];
    widen8<Elem>(chunk(v), x);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(x[i], x[i], ss);
  };
  if constexpr (HeadDim > 0) {
#pragma unroll
    for (std::int32_t v = 0; v < HeadDim / 8; ++v) add_chunk(v);
  } else {
    for (std::int32_t v = 0; v < d / 8; ++v) add_chunk(v);
  }
  return 1.0f / (sqrtf(ss) + eps);
}

// Inverse norms of `count` rows of 16-bit keys in shared memory (laid out by `at`),
// a thread per row; rows [count, round16(count)) get 0. 8 adjacent rows' chunks are
// on distinct banks in both layouts.
template <dtype Elem, int HeadDim = 0, class Layout>
__device__ inline void inverse_norms_16(const std::uint16_t* keys, float* inv, std::int32_t count, std::int32_t d,
                                        Layout at, float eps) {
  const std::int32_t rows = (count + 15) / 16 * 16;
  for (auto r = static_cast<std::int32_t>(threadIdx.x); r < rows; r += static_cast<std::int32_t>(blockDim.x)) {
    const auto chunk = [&](std::int32_t v) { return *reinterpret_cast<const uint4*>(keys + at(r, v)); };
    inv[r] = r < count ? inverse_norm_16<Elem, HeadDim>(chunk, d, eps) : 0.0f;
  }
}

}  // namespace cuda
KVP_NAMESPACE_END
