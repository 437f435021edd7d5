// KV-Compress's metric (sec. 4.3, eq. 20) as the authors' code computes it
// (IsaacRe/vllm-kvcompress; SPEC.md "Squared attention", option pool_before_group):
// host reference over plain arrays for one (layer, KV head) of one sequence.
//
// How it differs from scorer::squared_attention with aggregate::pool: that pipeline
// reduces the group first and pools the KV head's row after,
//     S(t) = max_{|u - t| <= k/2} sum_g sum_j p_{g,j}(u)^2,
// while the authors pool each query head's row before the group sum,
//     M(t) = sum_g max_{|u - t| <= k/2} sum_j p_{g,j}(u)^2,
// so M >= S, equal where the group's maxima fall on the same token (always for G = 1
// or no pooling). Here every key of the row gets a metric, the window's own keys too
// (protect covers them when selecting), and decode adds to it (accumulate through F).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"

KVP_NAMESPACE_BEGIN
namespace scorer {

struct squared_attention_metric {
  std::int32_t window = 32;            // w: the prefill's last w queries (fewer when T < w)
  std::int32_t pool_kernel = 7;        // max-pool per query head: odd, stride 1, padding k / 2,
                                       // windows clipped at the row's ends; 1 pools nothing
  std::int32_t excluded_distance = 0;  // v: a query at p adds nothing to keys t with p - t < v
                                       // (they still take part in its softmax)

  // After a prefill of T tokens: queries [n][G][d] row-major, the last n = min(window, T)
  // positions T - n .. T - 1 (query j at position T - n + j); keys [T][d], key t at
  // position t. Causal softmax (fp32) per query head over keys t <= p_j with logits
  // q . k / sqrt(d); each probability squared, summed over the n queries, max-pooled
  // per query head, summed over the G heads of the group into out[t] (overwritten).
  void prefill(std::span<const float> queries, std::span<const float> keys, std::int32_t G, std::int32_t d,
               std::span<float> out) const {
    check(G, d);
    require(keys.size() % static_cast<std::size_t>(d) == 0, "keys", "has {} floats; must be T x d (d {})",
            keys.size(), d);
    const auto T = static_cast<std::int32_t>(keys.size() / static_cast<std::size_t>(d));
    const std::int32_t n = std::min(window, T);
    require(queries.size() == static_cast<std::size_t>(n) * G * d, "queries",
            "has {} floats; must be min(window {}, T {}) x G {} x d {}", queries.size(), window, T, G, d);
    require(out.size() == static_cast<std::size_t>(T), "out", "has {} floats for {} keys", out.size(), T);

    std::fill(out.begin(), out.end(), 0.0f);
    std::vector<float> head(static_cast<std::size_t>(T)), p(static_cast<std::size_t>(T));
    for (std::int32_t g = 0; g < G; ++g) {
      std::fill(head.begin(), head.end(), 0.0f);
      for (std::int32_t j = 0; j < n; ++j) {
        const std::int32_t pj = T - n + j;
        softmax(queries.subspan((static_cast<std::size_t>(j) * G + g) * d, d), keys, d, pj + 1, p);
        for (std::int32_t t = 0; t <= pj; ++t)
          if (pj - t >= excluded_distance) head[t] += p[t] * p[t];
      }
      const std::int32_t half = pool_kernel / 2;
      for (std::int32_t t = 0; t < T; ++t) {
        float m = head[t];
        for (std::int32_t u = std::max(0, t - half); u <= std::min(T - 1, t + half); ++u) m = std::max(m, head[u]);
        out[t] += m;
      }
    }
  }

  // One decode step: the new token's G queries [G][d] against the row's T keys [T][d]
  // (its own key included) at `query_position` (-1: T - 1). Each probability squared,
  // summed over the group, is added to metric[t]. `positions` gives each key's position
  // for the excluded distance (empty: key t at position t).
  void decode(std::span<const float> query, std::span<const float> keys, std::int32_t G, std::int32_t d,
              std::span<float> metric, std::int32_t query_position = -1,
              std::span<const std::int32_t> positions = {}) const {
    check(G, d);
    require(keys.size() % static_cast<std::size_t>(d) == 0, "keys", "has {} floats; must be T x d (d {})",
            keys.size(), d);
    const auto T = static_cast<std::int32_t>(keys.size() / static_cast<std::size_t>(d));
    require(query.size() == static_cast<std::size_t>(G) * d, "query", "has {} floats; must be G {} x d {}",
            query.size(), G, d);
    require(metric.size() == static_cast<std::size_t>(T), "metric", "has {} floats for {} keys", metric.size(), T);
    require(positions.empty() || positions.size() == static_cast<std::size_t>(T), "positions",
            "has {} entries for {} keys", positions.size(), T);
    const std::int32_t pq = query_position >= 0 ? query_position : T - 1;
    std::vector<float> p(static_cast<std::size_t>(T));
    for (std::int32_t g = 0; g < G; ++g) {
      softmax(query.subspan(static_cast<std::size_t>(g) * d, d), keys, d, T, p);
      for (std::int32_t t = 0; t < T; ++t) {
        const std::int32_t pt = positions.empty() ? t : positions[t];
        if (pq - pt >= excluded_distance) metric[t] += p[t] * p[t];
      }
    }
  }

 private:
  void check(std::int32_t G, std::int32_t d) const {
    require(window >= 1, "pipeline.scorer.window", "is {}; must be at least 1", window);
    require(pool_kernel >= 1 && pool_kernel % 2 == 1, "pipeline.scorer.pool_kernel", "is {}; must be odd and >= 1",
            pool_kernel);
    require(excluded_distance >= 0, "pipeline.scorer.excluded_distance", "is {}; must not be negative",
            excluded_distance);
    require(G >= 1, "G", "is {}; must be at least 1", G);
    require(d >= 1, "d", "is {}; must be at least 1", d);
  }
  // p[t] for t < visible: the fp32 softmax of q . k_t / sqrt(d); p[t] = 0 past it.
  static void softmax(std::span<const float> q, std::span<const float> keys, std::int32_t d, std::int32_t visible,
                      std::span<float> p) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float m = -__builtin_huge_valf();
    for (std::int32_t t = 0; t < visible; ++t) {
      float z = 0.0f;
      for (std::int32_t i = 0; i < d; ++i) z += q[i] * keys[static_cast<std::size_t>(t) * d + i];
      p[t] = z * scale;
      m = std::max(m, p[t]);
    }
    float sum = 0.0f;
    for (std::int32_t t = 0; t < visible; ++t) sum += (p[t] = std::exp(p[t] - m));
    for (std::int32_t t = 0; t < visible; ++t) p[t] /= sum;
    std::fill(p.begin() + visible, p.end(), 0.0f);
  }
};

}  // namespace scorer
KVP_NAMESPACE_END
