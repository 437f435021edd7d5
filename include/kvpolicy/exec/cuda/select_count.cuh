// Selector kinds on the device: how many tokens a row keeps. The epilogue asks the
// kind its selector maps to (stage_kinds.cuh), then keeps that many by
// block_kth_largest.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/core/none.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/selector_row.cuh"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"
#include "kvpolicy/select/token2chunk.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

// What a row's count may read.
struct count_inputs {
  const float* s;       // final scores (after protect)
  const float* raw;     // the scorer's scores before aggregation (global memory), or null
  const float* before;  // the final scores before protect, or null (a selector that does not read them)
  std::int32_t T, candidates, protected_tokens, budget;
  head_index head;
  std::int32_t slot;  // the item's query_slot
  std::int32_t live;  // tokens the head holds (cautious update; T without a live view): the most a row keeps
};

// No selector: every token is kept.
struct keep_all_count {
  struct storage {};
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel&, const count_inputs& in, storage&) {
    return in.live;
  }
};

// BudgetSelector: the count from the length and the budget (and the head).
struct budget_count {
  struct storage {};
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel& sel, const count_inputs& in, storage&) {
    const std::int32_t k = budget_keep_count(sel, in.live, in.budget, in.head);
    return k < in.live ? k : in.live;  // a budget past the held tokens
  }
};

// ScoreDependentSelector: the count from the row (block_selector_row), at least the
// protected tokens and at most the tokens the row holds.
struct score_dependent_count {
  using storage = selector_row_storage;
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel& sel, const count_inputs& in, storage& sh) {
    const block_selector_row row(in.s, in.raw, in.before, in.T, in.candidates, in.protected_tokens, in.head, in.slot,
                                 sh);
    const std::int32_t n = sel.row_keep_count(row, in.budget);
    return n < in.protected_tokens ? in.protected_tokens : (n > in.live ? in.live : n);
  }
};

// The sum over the block of one count per thread, for every thread.
__device__ inline std::int32_t block_count(std::int32_t v, radix_select_storage& sh) {
  std::int32_t pos = 0, total = 0;
  digit_scan(sh.scan).ExclusiveSum(v, pos, total);
  __syncthreads();  // the storage is free for the next call
  return total;
}

// Token2Chunk (select/token2chunk.hpp) on the row's block, as the host's keep_pattern:
// the anchors by one radix select, their positions in order by a block scan, the
// chunks by a second select over the anchor pairs, the fill by a third over the
// tokens left. Keys of excluded tokens and of pairs that are not chunks are 0, below
// every rank_bits key (the smallest, -inf at position 0, is 0x007fffff << 32).
struct token2chunk_pattern {
  static constexpr bool pattern = true;
  struct storage {};
  template <class Sel>
  __device__ static std::int32_t keep_count(const Sel& sel, const count_inputs& in, storage&) {
    return in.T - in.candidates + sel.region_keep(in.candidates, in.budget);
  }
  // keep[0, T) of the row; `at`: room for the anchors' positions (candidates entries).
  template <class Sel>
  __device__ static void keep(const Sel& sel, const count_inputs& in, std::uint8_t* keep, std::int32_t* at,
                              radix_select_storage& sh) {
    const float* s = in.s;
    const std::int32_t n = in.candidates, T = in.T, anchors = sel.anchors(n, in.budget);
    const std::uint64_t anchor_cut = block_kth_largest([&](std::int32_t t) { return rank_bits(s[t], t); }, n, anchors, sh);
    // Positions of the anchors, in order; everything else starts dropped (the
    // non-candidates kept).
    std::int32_t offset = 0;
    for (std::int32_t t0 = 0; t0 < n; t0 += blockDim.x) {
      const std::int32_t t = t0 + static_cast<std::int32_t>(threadIdx.x);
      const std::int32_t flag = t < n && rank_bits(s[t], t) >= anchor_cut ? 1 : 0;
      std::int32_t pos = 0, total = 0;
      digit_scan(sh.scan).ExclusiveSum(flag, pos, total);
      if (flag) at[offset + pos] = t;
      offset += total;
      __syncthreads();
    }
    for (std::int32_t t = threadIdx.x; t < T; t += blockDim.x) keep[t] = t >= n || rank_bits(s[t], t) >= anchor_cut;
    __syncthreads();  // before a chunk marks its interior
    const auto chunk_key = [&](std::int32_t j) -> std::uint64_t {
      const std::int32_t lo = at[j], hi = at[j + 1];
      return hi - lo >= 2 && hi - lo < sel.gamma ? rank_bits((s[lo] + s[hi]) * static_cast<float>(hi - lo - 1), j) : 0;
    };
    const std::int32_t pairs = anchors > 0 ? anchors - 1 : 0;
    std::int32_t chunks = 0;
    for (std::int32_t j = threadIdx.x; j < pairs; j += blockDim.x) chunks += chunk_key(j) != 0;
    chunks = block_count(chunks, sh);
    chunks = min(chunks, sel.max_chunks());
    const std::uint64_t chunk_cut = block_kth_largest(chunk_key, pairs, chunks, sh);
    std::int32_t added = 0;
    for (std::int32_t j = threadIdx.x; j < pairs; j += blockDim.x) {
      if (chunks == 0 || chunk_key(j) < chunk_cut) continue;
      for (std::int32_t t = at[j] + 1; t < at[j + 1]; ++t) keep[t] = 1;
      added += at[j + 1] - at[j] - 1;
    }
    added = block_count(added, sh);  // its barrier also publishes the chunks' marks
    const std::int32_t fill = sel.region_keep(n, in.budget) - anchors - added;
    const auto fill_key = [&](std::int32_t t) -> std::uint64_t { return keep[t] ? 0 : rank_bits(s[t], t); };
    const std::uint64_t fill_cut = block_kth_largest(fill_key, n, fill, sh);
    // A thread reads and marks only its own tokens: no barrier between.
    for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x)
      if (fill > 0 && fill_key(t) >= fill_cut) keep[t] = 1;
  }
};

template <class Kind>
inline constexpr bool is_pattern_kind = requires { Kind::pattern; };

// A trait's primary template fails with this: the policy fits no kind.
template <class T>
inline constexpr bool no_kind_for = false;

template <class Sel>
struct select_kind_of {
  static_assert(no_kind_for<Sel>,
                "kvpolicy: this selector fits no GPU selector kind: it must satisfy kvp::BudgetSelector or "
                "kvp::ScoreDependentSelector, or be a pattern selector with a kind of its own (token2chunk) "
                "(docs/extending.md, \"Stage kinds\")");
};
template <>
struct select_kind_of<none> {
  using type = keep_all_count;
};
template <class Sel>
  requires ScoreDependentSelector<Sel>
struct select_kind_of<Sel> {
  using type = score_dependent_count;
};
template <class Sel>
  requires(BudgetSelector<Sel> && !ScoreDependentSelector<Sel>)
struct select_kind_of<Sel> {
  using type = budget_count;
};
template <>
struct select_kind_of<select::token2chunk> {
  using type = token2chunk_pattern;
};
template <class Sel>
using select_kind_t = typename select_kind_of<Sel>::type;

}  // namespace cuda
KVP_NAMESPACE_END
