// Host form of the row a score-dependent selector sees (select/selector_row.hpp):
// plain loops, sums in position order, rank orders by sorting.
#pragma once

#include <algorithm>
#include <functional>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/head_index.hpp"
#include "kvpolicy/select/rank_order.hpp"
#include "kvpolicy/select/selector_row.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// Its operations are KVP_HOST_DEVICE only so that a selector's KVP_HOST_DEVICE
// row_keep_count may call them when nvcc compiles the host executor; they run on the
// host alone (a device build traps).
class selector_row {
 public:
  // `before_protect`: the final scores before protect (row_token::before_protect);
  // empty: the final scores, so that protected tokens have none of their own.
  selector_row(std::span<const float> score, std::span<const float> raw, std::int32_t candidates,
               std::int32_t protected_tokens, head_index head, std::int32_t slot = 0,
               std::span<const float> before_protect = {})
      : score_(score),
        raw_(raw),
        before_(before_protect),
        size_(static_cast<std::int32_t>(score.size())),
        candidates_(candidates),
        protected_(protected_tokens),
        head_(head),
        slot_(slot) {}

  KVP_HOST_DEVICE std::int32_t size() const { return size_; }
  KVP_HOST_DEVICE std::int32_t candidates() const { return candidates_; }
  KVP_HOST_DEVICE std::int32_t protected_count() const { return protected_; }
  KVP_HOST_DEVICE head_index head() const { return head_; }
  KVP_HOST_DEVICE std::int32_t slot() const { return slot_; }
  template <class F>
  KVP_HOST_DEVICE void once(F&& f) const {
#if defined(__CUDA_ARCH__)
    (void)f, __trap();
#else
    f();
#endif
  }

  template <class F>
  KVP_HOST_DEVICE float sum(F&& f) const {
#if defined(__CUDA_ARCH__)
    return (void)f, __trap(), 0.0f;
#else
    float acc = 0.0f;
    for (std::int32_t t = 0; t < size(); ++t) acc += static_cast<float>(f(token(t)));
    return acc;
#endif
  }
  template <class F>
  KVP_HOST_DEVICE float max(F&& f) const {
#if defined(__CUDA_ARCH__)
    return (void)f, __trap(), 0.0f;
#else
    float acc = -std::numeric_limits<float>::infinity();
    for (std::int32_t t = 0; t < size(); ++t) acc = std::max(acc, static_cast<float>(f(token(t))));
    return acc;
#endif
  }
  // The n tokens of largest key: the cut at the n-th largest rank_bits (none for n <= 0).
  template <class Key>
  KVP_HOST_DEVICE rank_cut top(Key&& key, std::int32_t n) const {
#if defined(__CUDA_ARCH__)
    return (void)key, (void)n, __trap(), rank_cut{};
#else
    if (n <= 0) return {};
    const std::vector<std::uint64_t> bits = ranked(key);
    return {bits[static_cast<std::size_t>(std::min(n, size())) - 1]};
#endif
  }
  template <class Key, class Weight>
  KVP_HOST_DEVICE std::int32_t fewest_reaching(Key&& key, Weight&& weight, float mass) const {
#if defined(__CUDA_ARCH__)
    return (void)key, (void)weight, (void)mass, __trap(), 0;
#else
    if (!(mass > 0.0f)) return 0;
    const std::vector<std::uint64_t> bits = ranked(key);
    float acc = 0.0f;
    for (std::int32_t i = 0; i < size(); ++i) {
      const auto t = static_cast<std::int32_t>(static_cast<std::uint32_t>(bits[static_cast<std::size_t>(i)]));
      acc += static_cast<float>(weight(token(t)));
      if (acc >= mass) return i + 1;
    }
    return size();
#endif
  }

 private:
  row_token token(std::int32_t t) const {
    return {score_[t], raw_.empty() ? 0.0f : raw_[t], t, before_.empty() ? score_[t] : before_[t]};
  }
  // Every token's rank_bits under key, largest first.
  template <class Key>
  std::vector<std::uint64_t> ranked(Key&& key) const {
    std::vector<std::uint64_t> bits(static_cast<std::size_t>(size()));
    for (std::int32_t t = 0; t < size(); ++t) bits[t] = rank_bits(static_cast<float>(key(token(t))), t);
    std::sort(bits.begin(), bits.end(), std::greater<>());
    return bits;
  }

  std::span<const float> score_, raw_, before_;
  std::int32_t size_, candidates_, protected_;
  head_index head_;
  std::int32_t slot_;
};

}  // namespace host
KVP_NAMESPACE_END
