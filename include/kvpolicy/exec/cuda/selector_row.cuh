// Device form of the row a score-dependent selector sees (select/selector_row.hpp):
// one thread block per row, every operation collective over the block.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/exec/cuda/block_radix_select.cuh"
#include "kvpolicy/exec/cuda/common.cuh"
#include "kvpolicy/select/rank_order.hpp"
#include "kvpolicy/select/selector_row.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda {

struct selector_row_storage {
  typename block_reduce::TempStorage reduce;
  float broadcast;
  weighted_select_storage select;
};

// The row's final scores `s` (shared or global memory), the scorer's `raw` ones
// (global memory, written for the candidates only; null without a scorer) and the
// final scores before protect `before` (beside `s`; null unless the selector sees
// protected scores: then the final scores stand in). Its members are __host__ __device__ so that
// a selector's KVP_HOST_DEVICE row_keep_count compiles for either side; they run on
// the device only, where the epilogue calls them.
class block_selector_row {
 public:
  __device__ block_selector_row(const float* s, const float* raw, const float* before, std::int32_t T,
                                std::int32_t candidates, std::int32_t protected_tokens, head_index head,
                                std::int32_t slot, selector_row_storage& sh)
      : s_(s),
        raw_(raw),
        before_(before),
        T_(T),
        candidates_(candidates),
        protected_(protected_tokens),
        head_(head),
        slot_(slot),
        sh_(&sh) {}

  KVP_HOST_DEVICE std::int32_t size() const { return T_; }
  KVP_HOST_DEVICE std::int32_t candidates() const { return candidates_; }
  KVP_HOST_DEVICE std::int32_t protected_count() const { return protected_; }
  KVP_HOST_DEVICE head_index head() const { return head_; }
  KVP_HOST_DEVICE std::int32_t slot() const { return slot_; }
  // No barrier: nothing the row computes later reads what f writes.
  template <class F>
  KVP_HOST_DEVICE void once(F&& f) const {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x == 0) f();
#else
    (void)f;
#endif
  }

  template <class F>
  KVP_HOST_DEVICE float sum(F&& f) const {
#if defined(__CUDA_ARCH__)
    float acc = 0.0f;
    for (std::int32_t t = threadIdx.x; t < T_; t += blockDim.x) acc += static_cast<float>(f(token(t)));
    return block_sum(acc, sh_->reduce, sh_->broadcast);
#else
    return (void)f, 0.0f;
#endif
  }
  template <class F>
  KVP_HOST_DEVICE float max(F&& f) const {
#if defined(__CUDA_ARCH__)
    float acc = -__builtin_huge_valf();
    for (std::int32_t t = threadIdx.x; t < T_; t += blockDim.x) acc = fmaxf(acc, static_cast<float>(f(token(t))));
    return block_max(acc, sh_->reduce, sh_->broadcast);
#else
    return (void)f, 0.0f;
#endif
  }
  template <class Key>
  KVP_HOST_DEVICE rank_cut top(Key&& key, std::int32_t n) const {
#if defined(__CUDA_ARCH__)
    if (n <= 0) return {};
    const auto bits = [&](std::int32_t t) { return rank_bits(static_cast<float>(key(token(t))), t); };
    return {block_kth_largest(bits, T_, n < T_ ? n : T_, sh_->select.base)};
#else
    return (void)key, (void)n, rank_cut{};
#endif
  }
  template <class Key, class Weight>
  KVP_HOST_DEVICE std::int32_t fewest_reaching(Key&& key, Weight&& weight, float mass) const {
#if defined(__CUDA_ARCH__)
    const auto bits = [&](std::int32_t t) { return rank_bits(static_cast<float>(key(token(t))), t); };
    const auto weight_of = [&](std::int32_t t) { return static_cast<float>(weight(token(t))); };
    return block_fewest_reaching(bits, weight_of, T_, mass, sh_->select);
#else
    return (void)key, (void)weight, (void)mass, 0;
#endif
  }

 private:
  // Past the candidates the scorer wrote nothing: raw is 0 there, as on the host.
  KVP_HOST_DEVICE row_token token(std::int32_t t) const {
    return {s_[t], raw_ != nullptr && t < candidates_ ? raw_[t] : 0.0f, t, before_ != nullptr ? before_[t] : s_[t]};
  }

  const float* s_;
  const float* raw_;
  const float* before_;
  std::int32_t T_, candidates_, protected_;
  head_index head_;
  std::int32_t slot_;
  selector_row_storage* sh_;
};

}  // namespace cuda
KVP_NAMESPACE_END
