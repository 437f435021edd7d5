// Independent, straightforward reference formulas of SPEC.md, in double precision.
// They share no code with the library's host executor: tests compare the library's
// fp32 results against these within a tolerance. Plain C++ (GPU tests reuse it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace kvp_test::ref {

using i32 = std::int32_t;
using vec = std::vector<double>;

inline constexpr double inf = std::numeric_limits<double>::infinity();

// softmax over all entries; -inf entries get 0.
inline vec softmax(const vec& x) {
  double m = -inf;
  for (double v : x) m = std::max(m, v);
  vec out(x.size(), 0.0);
  if (m == -inf) return out;
  double sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) sum += (out[i] = std::exp(x[i] - m));
  for (double& v : out) v /= sum;
  return out;
}

enum class group_op { max, mean, sum, max_logits };
enum class window_op { mean, sum };

struct attention_params {
  i32 window = 1;
  group_op group = group_op::max;
  window_op reduce = window_op::mean;
  bool causal = true;
  bool keys_before_window = false;
  bool squared = false;
  i32 excluded_distance = 0;  // squared attention's v: a query at p_j adds nothing to keys with p_j - t < v
};

// keys: [T][d]; queries: [w][G][d] (entry j is the query of position T - w + j).
// Returns score[t] for the candidates t < n (n = T - w with keys_before_window, else T).
inline vec window_scores(const std::vector<float>& keys, const std::vector<float>& queries, i32 T, i32 d, i32 G,
                         const attention_params& p) {
  const i32 w = p.window;
  const i32 n = p.keys_before_window ? T - w : T;
  vec score(static_cast<std::size_t>(n), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (i32 j = 0; j < w; ++j) {
    const i32 pj = T - w + j;
    std::vector<vec> logits(static_cast<std::size_t>(G), vec(static_cast<std::size_t>(n)));
    for (i32 g = 0; g < G; ++g)
      for (i32 t = 0; t < n; ++t) {
        if (p.causal && t > pj) {
          logits[g][t] = -inf;
          continue;
        }
        double dot = 0;
        for (i32 i = 0; i < d; ++i)
          dot += static_cast<double>(queries[(static_cast<std::size_t>(j) * G + g) * d + i]) *
                 keys[static_cast<std::size_t>(t) * d + i];
        logits[g][t] = dot * scale;
      }
    vec per_key(static_cast<std::size_t>(n), 0.0);
    auto tr = [&](double x) { return p.squared ? x * x : x; };
    if (p.group == group_op::max_logits) {
      vec m(static_cast<std::size_t>(n), -inf);
      for (i32 g = 0; g < G; ++g)
        for (i32 t = 0; t < n; ++t) m[t] = std::max(m[t], logits[g][t]);
      const vec prob = softmax(m);
      for (i32 t = 0; t < n; ++t) per_key[t] = tr(prob[t]);
    } else {
      for (i32 g = 0; g < G; ++g) {
        const vec prob = softmax(logits[g]);
        for (i32 t = 0; t < n; ++t) {
          const double x = tr(prob[t]);
          if (p.group == group_op::max)
            per_key[t] = g == 0 ? x : std::max(per_key[t], x);
          else
            per_key[t] += x;
        }
      }
      if (p.group == group_op::mean)
        for (double& x : per_key) x /= G;
    }
    for (i32 t = 0; t < n; ++t)
      if (!p.squared || pj - t >= p.excluded_distance) score[t] += per_key[t];
  }
  if (p.reduce == window_op::mean)
    for (double& x : score) x /= w;
  return score;
}

enum class global_op { max, sum, mean };

// Global score: S <- combine(F, S) for t < history, F <- S. Returns {S, F}.
inline std::pair<vec, vec> global_score(vec s, const vec& f, i32 history, global_op mode, double alpha,
                                        bool max_norm) {
  if (max_norm) {
    double m = 0;
    for (double x : s) m = std::max(m, x);
    if (m > 0)
      for (double& x : s) x /= m;
  }
  for (i32 t = 0; t < std::min<i32>(history, static_cast<i32>(s.size())); ++t) {
    switch (mode) {
      case global_op::max: s[t] = std::max(alpha * f[t], s[t]); break;
      case global_op::sum: s[t] = alpha * f[t] + s[t]; break;
      case global_op::mean: s[t] = alpha * f[t] + (1 - alpha) * s[t]; break;
    }
  }
  return {s, s};
}

// Pooling along the tokens, kernel k, stride 1, windows clipped at the ends.
inline vec pool(const vec& s, i32 kernel, bool max_mode) {
  const i32 n = static_cast<i32>(s.size()), r = kernel / 2;
  vec out(s.size());
  for (i32 t = 0; t < n; ++t) {
    const i32 lo = std::max(0, t - r), hi = std::min(n - 1, t + r);
    double acc = max_mode ? -inf : 0.0;
    for (i32 u = lo; u <= hi; ++u) acc = max_mode ? std::max(acc, s[u]) : acc + s[u];
    out[t] = max_mode ? acc : acc / (hi - lo + 1);
  }
  return out;
}

struct redundancy_params {
  double theta = 0.5, tau = 1.0, eps = 1e-8;
  i32 block = 0;  // 0: full (all pairs, n = candidates); b: lightning (pairs within blocks of b, n = b)
};

// Cosine similarity matrix of normalised keys k / (||k|| + eps), diagonal 0.
inline std::vector<vec> cosine_matrix(const std::vector<float>& keys, i32 n, i32 d, double eps) {
  std::vector<vec> kn(static_cast<std::size_t>(n), vec(static_cast<std::size_t>(d)));
  for (i32 t = 0; t < n; ++t) {
    double ss = 0;
    for (i32 i = 0; i < d; ++i) ss += static_cast<double>(keys[static_cast<std::size_t>(t) * d + i]) * keys[static_cast<std::size_t>(t) * d + i];
    for (i32 i = 0; i < d; ++i) kn[t][i] = keys[static_cast<std::size_t>(t) * d + i] / (std::sqrt(ss) + eps);
  }
  std::vector<vec> c(static_cast<std::size_t>(n), vec(static_cast<std::size_t>(n), 0.0));
  for (i32 u = 0; u < n; ++u)
    for (i32 v = 0; v < n; ++v)
      if (u != v)
        for (i32 i = 0; i < d; ++i) c[u][v] += kn[u][i] * kn[v][i];
  return c;
}

// red(t) before the softmax: (1/n) sum_u C(u, t), leaving out every u whose newest
// similar token r(u) is t; pairs restricted to one block for lightning.
inline vec redundancy_raw(const std::vector<float>& keys, i32 n, i32 d, const redundancy_params& p) {
  const auto c = cosine_matrix(keys, n, d, p.eps);
  auto same_scope = [&](i32 u, i32 v) { return p.block == 0 || u / p.block == v / p.block; };
  std::vector<i32> r(static_cast<std::size_t>(n), -1);
  for (i32 u = 0; u < n; ++u)
    for (i32 v = 0; v < n; ++v)
      if (v != u && same_scope(u, v) && c[u][v] > p.theta) r[u] = v;  // the largest index wins
  vec red(static_cast<std::size_t>(n), 0.0);
  for (i32 t = 0; t < n; ++t)
    for (i32 u = 0; u < n; ++u)
      if (u != t && same_scope(u, t) && r[u] != t) red[t] += c[u][t];
  const double norm = p.block == 0 ? n : p.block;
  for (double& x : red) x /= norm;
  return red;
}

// R = softmax(red / tau).
inline vec redundancy(const std::vector<float>& keys, i32 n, i32 d, const redundancy_params& p) {
  vec red = redundancy_raw(keys, n, d, p);
  for (double& x : red) x /= p.tau;
  return softmax(red);
}

// The smallest |C(u, v) - theta| over the compared pairs: tests skip inputs that sit
// on the threshold, where fp32 and double may pick a different r(u).
inline double theta_margin(const std::vector<float>& keys, i32 n, i32 d, const redundancy_params& p) {
  const auto c = cosine_matrix(keys, n, d, p.eps);
  double m = inf;
  for (i32 u = 0; u < n; ++u)
    for (i32 v = 0; v < n; ++v)
      if (u != v && (p.block == 0 || u / p.block == v / p.block)) m = std::min(m, std::abs(c[u][v] - p.theta));
  return m;
}

// Indices of the k highest scores; equal scores go to the larger index. Sorted ascending.
inline std::vector<i32> top_k(const std::vector<float>& s, i32 k) {
  std::vector<i32> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](i32 t) { return std::isnan(s[t]) ? -std::numeric_limits<float>::infinity() : s[t]; };
  std::stable_sort(idx.begin(), idx.end(), [&](i32 a, i32 b) {
    if (key(a) != key(b)) return key(a) > key(b);
    return a > b;
  });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace kvp_test::ref
