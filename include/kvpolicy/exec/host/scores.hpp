// Host reference of the Scorer stage for one (sequence, layer, KV head) row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/query_window_view.hpp"
#include "kvpolicy/core/row_ref.hpp"
#include "kvpolicy/pipeline/concepts.hpp"
#include "kvpolicy/pipeline/traits.hpp"

KVP_NAMESPACE_BEGIN
namespace host {

// The keys of one (layer, seq, head) row widened to fp32: `[T][d]`.
inline std::vector<float> gather_keys(const paged_kv_view& c, std::int32_t layer, std::int32_t seq,
                                      std::int32_t head, std::int32_t T) {
  std::vector<float> keys(static_cast<std::size_t>(T) * c.head_dim);
  for (std::int32_t t = 0; t < T; ++t) {
    const void* row = c.k_row(layer, seq, t, head);
    for (std::int32_t i = 0; i < c.head_dim; ++i) keys[std::size_t(t) * c.head_dim + i] = load_as_float(row, c.type, i);
  }
  return keys;
}

// In place: x <- softmax(x) over all entries; -inf entries get 0. fp32 throughout.
inline void softmax(std::span<float> x) {
  float m = -std::numeric_limits<float>::infinity();
  for (float v : x) m = std::max(m, v);
  if (m == -std::numeric_limits<float>::infinity()) {
    std::fill(x.begin(), x.end(), 0.0f);
    return;
  }
  float sum = 0.0f;
  for (float& v : x) {
    v = std::exp(v - m);
    sum += v;
  }
  const float inv = 1.0f / sum;
  for (float& v : x) v *= inv;
}

// score[t] for t in [0, n) with n = s.key_end(T), from the queries of one slot.
// `keys` is gather_keys of the row; `alive` (empty: every token) the tokens the head
// still holds (cautious update): the others are masked like keys no query sees.
template <AttentionScorer S>
void attention_scores(const S& s, const query_window_view& q, std::int32_t layer, std::int32_t slot,
                      std::int32_t kv_head, std::int32_t num_kv_heads, std::span<const float> keys, std::int32_t T,
                      std::int32_t d, std::span<float> out, std::span<const std::uint8_t> alive = {}) {
  const std::int32_t n = s.key_end(T);
  const std::int32_t G = q.num_q_heads / num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(out.begin(), out.begin() + n, 0.0f);
  std::vector<float> qv(static_cast<std::size_t>(d)), logits(static_cast<std::size_t>(n) * G), group(n);
  for (std::int32_t j = 0; j < s.window; ++j) {
    const std::int32_t pj = T - s.window + j;
    const std::int32_t entry = q.window - s.window + j;  // the slot holds the newest q.window queries
    for (std::int32_t g = 0; g < G; ++g) {
      const void* row = q.row(layer, slot, entry, kv_head * G + g);
      for (std::int32_t i = 0; i < d; ++i) qv[i] = load_as_float(row, q.type, i);
      float* z = logits.data() + std::size_t(g) * n;
      for (std::int32_t t = 0; t < n; ++t) {
        if (!s.visible(pj, t) || (!alive.empty() && !alive[t])) {
          z[t] = ninf;
          continue;
        }
        float dot = 0.0f;
        const float* k = &keys[std::size_t(t) * d];
        for (std::int32_t i = 0; i < d; ++i) dot += qv[i] * k[i];
        z[t] = dot * scale;
      }
    }
    if (s.group == group_reduce::max_logits) {
      for (std::int32_t t = 0; t < n; ++t) {
        float m = ninf;
        for (std::int32_t g = 0; g < G; ++g) m = std::max(m, logits[std::size_t(g) * n + t]);
        group[t] = m;
      }
      softmax(group);
      for (std::int32_t t = 0; t < n; ++t) group[t] = s.contributes(pj, t) ? s.transform(group[t]) : 0.0f;
    } else {
      for (std::int32_t g = 0; g < G; ++g) softmax(std::span<float>(logits.data() + std::size_t(g) * n, n));
      for (std::int32_t t = 0; t < n; ++t) {
        if (!s.contributes(pj, t)) {
          group[t] = 0.0f;
          continue;
        }
        float acc = s.group == group_reduce::max ? ninf : 0.0f;
        for (std::int32_t g = 0; g < G; ++g) {
          const float p = s.transform(logits[std::size_t(g) * n + t]);
          acc = s.group == group_reduce::max ? std::max(acc, p) : acc + p;
        }
        group[t] = s.group == group_reduce::mean ? acc / static_cast<float>(G) : acc;
      }
    }
    for (std::int32_t t = 0; t < n; ++t) out[t] += group[t];
  }
  if (s.reduce == window_reduce::mean) {
    const float inv = 1.0f / static_cast<float>(s.window);
    for (std::int32_t t = 0; t < n; ++t) out[t] *= inv;
  }
}

// score[t] = s.key_score(k_t, t, T[, (layer, head)]) for every token.
template <KeyScorer S>
void key_scores(const S& s, const paged_kv_view& c, std::int32_t layer, std::int32_t seq, std::int32_t head,
                std::int32_t T, std::span<float> out) {
  for (std::int32_t t = 0; t < T; ++t)
    out[t] = key_score_of(s, row_ref{c.k_row(layer, seq, t, head), c.type, c.head_dim}, t, T, {layer, head});
}

}  // namespace host
KVP_NAMESPACE_END
