// Kara 4.2: Token2Chunk, discrete tokens widened into short chunks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/select/rank_order.hpp"

KVP_NAMESPACE_BEGIN
namespace select {

// Over the n candidates of a row (the compressible region W \ U) with scores A and
// the item's budget k, keeps exactly min(k, n) tokens:
//   1. I = the top max(k - alpha, 0) tokens by A, in position order;
//   2. consecutive I[j] < I[j+1] with 2 <= I[j+1] - I[j] < gamma enclose a chunk of
//      I[j+1] - I[j] - 1 tokens, scored R_j = (A[I[j]] + A[I[j+1]]) (I[j+1] - I[j] - 1);
//      the interiors of the top floor(alpha / (gamma - 2)) chunks are kept (Kara eq. 6-8);
//   3. the rest of the budget goes to the best remaining single tokens (Kara C.3).
// Every ranking (tokens by A, chunks by R) is the library's rank order: larger first,
// NaN as -inf, ties to the later token or the later chunk. Adjacent candidates
// (gap 1) enclose nothing and are not chunks; Kara's filter keeps gap < gamma.
struct token2chunk {
  std::int32_t gamma = 8;   // longest chunk, both endpoints included (>= 3)
  std::int32_t alpha = 16;  // tokens the chunks and the fill may add

  // Chunks Token2Chunk keeps at most.
  KVP_HOST_DEVICE constexpr std::int32_t max_chunks() const noexcept { return alpha / (gamma - 2); }
  // Candidates I of a region of n tokens and budget k.
  KVP_HOST_DEVICE constexpr std::int32_t anchors(std::int32_t n, std::int32_t k) const noexcept {
    const std::int32_t c = k - alpha;
    return c < 0 ? 0 : (c > n ? n : c);
  }
  // Tokens kept of the region.
  KVP_HOST_DEVICE constexpr std::int32_t region_keep(std::int32_t n, std::int32_t k) const noexcept {
    return k < n ? k : n;
  }
  // The executors' check of the parameters (docs/extending.md, "A policy's own checks").
  template <class Cache, class Queries>
  void validate(const Cache&, const Queries&) const {
    require(gamma >= 3, "pipeline.select.gamma", "is {}; a chunk holds both endpoints and a token between (>= 3)",
            gamma);
    require(alpha >= 0, "pipeline.select.alpha", "is {}; must not be negative", alpha);
  }
  KVP_HOST_DEVICE constexpr float rank_key(float score, std::int32_t, std::int32_t) const noexcept { return score; }

  // Host form: keep[t] for t in [0, a.size()), and what each step chose (for the
  // demo and tests: anchors, chunk interiors, fill).
  struct choice {
    std::vector<std::int32_t> anchors;                        // I, in position order
    std::vector<std::pair<std::int32_t, std::int32_t>> chunks;  // (I[j], I[j+1]) of the kept chunks
    std::vector<std::int32_t> fill;                           // single tokens of step 3
  };
  choice keep_pattern(std::span<const float> a, std::int32_t k, std::span<std::uint8_t> keep) const {
    const auto n = static_cast<std::int32_t>(a.size());
    choice out;
    std::fill(keep.begin(), keep.begin() + n, std::uint8_t{0});
    const auto top = [](std::vector<std::uint64_t>& keys, std::int32_t count) {
      count = std::min<std::int32_t>(count, static_cast<std::int32_t>(keys.size()));
      std::nth_element(keys.begin(), keys.begin() + count, keys.end(), std::greater<>());
      keys.resize(static_cast<std::size_t>(count));
    };
    std::vector<std::uint64_t> keys(static_cast<std::size_t>(n));
    for (std::int32_t t = 0; t < n; ++t) keys[t] = rank_bits(a[t], t);
    top(keys, anchors(n, k));
    for (std::uint64_t key : keys) out.anchors.push_back(static_cast<std::int32_t>(key & 0xffffffffu));
    std::sort(out.anchors.begin(), out.anchors.end());
    for (std::int32_t t : out.anchors) keep[t] = 1;

    std::vector<std::uint64_t> chunk_keys;
    for (std::size_t j = 0; j + 1 < out.anchors.size(); ++j) {
      const std::int32_t lo = out.anchors[j], hi = out.anchors[j + 1];
      if (hi - lo >= 2 && hi - lo < gamma)
        chunk_keys.push_back(rank_bits((a[lo] + a[hi]) * static_cast<float>(hi - lo - 1), static_cast<std::int32_t>(j)));
    }
    top(chunk_keys, max_chunks());
    std::int32_t added = 0;
    for (std::uint64_t key : chunk_keys) {
      const auto j = static_cast<std::size_t>(key & 0xffffffffu);
      const std::int32_t lo = out.anchors[j], hi = out.anchors[j + 1];
      out.chunks.emplace_back(lo, hi);
      for (std::int32_t t = lo + 1; t < hi; ++t) keep[t] = 1;
      added += hi - lo - 1;
    }
    std::sort(out.chunks.begin(), out.chunks.end());

    keys.clear();
    for (std::int32_t t = 0; t < n; ++t)
      if (!keep[t]) keys.push_back(rank_bits(a[t], t));
    top(keys, region_keep(n, k) - anchors(n, k) - added);
    for (std::uint64_t key : keys) {
      const auto t = static_cast<std::int32_t>(key & 0xffffffffu);
      keep[t] = 1;
      out.fill.push_back(t);
    }
    std::sort(out.fill.begin(), out.fill.end());
    return out;
  }
};

}  // namespace select
KVP_NAMESPACE_END
