// Host reference of key redundancy (R-KV sec. 3.3, Zipage C.5 and C.7).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/exec/host/scores.hpp"
#include "kvpolicy/pipeline/concepts.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// R[t] for the n candidates whose fp32 keys are `keys` ([n][d]); `block` is the
// cache block size b, which bounds the pairs of the lightning scope.
template <Redundancy R>
std::vector<float> redundancy_scores(const R& r, std::span<const float> keys, std::int32_t n, std::int32_t d,
                                     std::int32_t block) {
  // C(u, v) = (k_u . k_v) * (inv_u * inv_v) with inv = 1 / (||k|| + eps): symmetric to the
  // bit. The device also takes raw dot products, then scales them in fp32, by inv_v per
  // element and by inv_u once per row (a rounding apart, like its dot products).
  std::vector<float> inv(static_cast<std::size_t>(n));
  for (std::int32_t t = 0; t < n; ++t) {
    float ss = 0.0f;
    for (std::int32_t i = 0; i < d; ++i) ss += keys[std::size_t(t) * d + i] * keys[std::size_t(t) * d + i];
    inv[t] = 1.0f / (std::sqrt(ss) + r.eps);
  }
  const bool lightning = R::pairs == redundancy::scope::block;
  // Pairs (u, v) compared: all, or those of one block.
  auto range_of = [&](std::int32_t u) {
    if (!lightning) return std::pair<std::int32_t, std::int32_t>{0, n};
    const std::int32_t lo = u / block * block;
    return std::pair<std::int32_t, std::int32_t>{lo, std::min(n, lo + block)};
  };
  auto cosine = [&](std::int32_t u, std::int32_t v) {
    float dot = 0.0f;
    for (std::int32_t i = 0; i < d; ++i) dot += keys[std::size_t(u) * d + i] * keys[std::size_t(v) * d + i];
    return dot * (inv[u] * inv[v]);
  };
  // red(t) = sum over u != t, r(u) != t of C(u, t); r(u) = newest v != u with C(u, v) > theta.
  std::vector<float> red(static_cast<std::size_t>(n), 0.0f);
  std::vector<float> col;
  for (std::int32_t u = 0; u < n; ++u) {
    const auto [lo, hi] = range_of(u);
    col.assign(static_cast<std::size_t>(hi - lo), 0.0f);
    std::int32_t newest = -1;
    for (std::int32_t v = lo; v < hi; ++v) {
      if (v == u) continue;
      col[v - lo] = cosine(u, v);
      if (col[v - lo] > r.theta) newest = v;
    }
    for (std::int32_t v = lo; v < hi; ++v)
      if (v != u && v != newest) red[v] += col[v - lo];
  }
  const float inv_n = 1.0f / static_cast<float>(lightning ? block : n);
  for (float& x : red) x = x * inv_n / r.tau;
  softmax(red);
  return red;
}

// Under cautious update (paged_kv_view::live): R of the candidates the head holds as if
// the dropped ones were not in the row (full scope: the held keys, in order, are the
// row, so 1 / n and the softmax count only them); 0 for the dropped, which are never kept.
template <Redundancy R>
std::vector<float> held_redundancy_scores(const R& r, std::span<const float> keys, std::int32_t n, std::int32_t d,
                                          std::span<const std::uint8_t> alive) {
  std::vector<float> held;
  std::vector<std::int32_t> at;
  for (std::int32_t t = 0; t < n; ++t) {
    if (!alive[t]) continue;
    held.insert(held.end(), keys.begin() + std::ptrdiff_t(t) * d, keys.begin() + std::ptrdiff_t(t + 1) * d);
    at.push_back(t);
  }
  const auto m = static_cast<std::int32_t>(at.size());
  const std::vector<float> part = redundancy_scores(r, held, m, d, m);  // full scope: the block size is not read
  std::vector<float> out(static_cast<std::size_t>(n), 0.0f);
  for (std::int32_t i = 0; i < m; ++i) out[at[i]] = part[i];
  return out;
}

}  // namespace host
KVP_NAMESPACE_END
