// Whether two runs of one pipeline on the same input agree, as doctest checks: the
// same results (new lengths, released blocks, keep masks, final scores) and the same
// cache bytes (K, V, F). `want` ran on a test_cache, `got` on a copy of it as it was
// before: a zero-padded copy on the host, or a device copy whose bytes were brought
// back. Plain C++.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "support/test_cache.hpp"

namespace kvp_test {

// Two floats agree: to the bit (or both NaN) with tolerance 0; else also when equal, or
// within tolerance * max(1, |a|, |b|) when finite.
inline bool scores_agree(float a, float b, float tolerance) {
  if (std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b))) return true;
  if (tolerance == 0.0f || std::isnan(a) || std::isnan(b)) return false;
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return a == b || std::fabs(a - b) <= tolerance * std::max({1.0f, std::fabs(a), std::fabs(b)});
}

// The selector's rank key of a pipeline (the score itself without a selector): masks
// are the top of it, so a near-tie is a near-tie of rank keys.
template <class P>
auto rank_key_of(const P& p) {
  return [sel = p.select](float score, i32 t, i32 T) {
    if constexpr (std::same_as<typename P::select_type, kvp::none>)
      return score;
    else
      return sel.rank_key(score, t, T);
  };
}

namespace detail {
inline std::string at(std::size_t item, i32 row, i32 H, i32 t) {
  std::ostringstream s;
  s << "item " << item << " layer offset " << row / H << " head " << row % H << " token " << t;
  return s.str();
}
inline std::string floats(float a, float b) {
  std::ostringstream s;
  s.precision(9);
  s << a << " vs " << b;
  return s.str();
}
}  // namespace detail

// Checks `got` against `want` for the batch `items` of `tc` (lengths as they were:
// executors do not change them). With a tolerance, a keep mask may differ where the
// token's rank key agrees with its row's boundary (the lowest rank key `want` kept):
// a near-tie that rounding decides either way (docs/cuda.md). Returns how many such
// differences it let through; with tolerance 0 it lets none through.
template <class Rank>
long check_same_results(const kvp::host_result& want, const kvp::host_result& got, const test_cache& tc,
                        const std::vector<kvp::batch_item>& items, float tolerance, Rank rank) {
  CHECK(got.new_lengths == want.new_lengths);
  CHECK(got.kept_counts == want.kept_counts);
  CHECK(got.released_blocks == want.released_blocks);
  CHECK(got.new_tables == want.new_tables);
  CHECK(got.unshared_blocks == want.unshared_blocks);
  CHECK(got.nonfinite_scores == want.nonfinite_scores);
  REQUIRE(want.keep_masks.size() == items.size());
  REQUIRE(want.scores.size() == items.size());
  REQUIRE(got.keep_masks.size() == items.size());
  REQUIRE(got.scores.size() == items.size());
  const i32 H = tc.kv_heads();
  long near_ties = 0, masks_differ = 0, scores_differ = 0;
  std::string first_mask, first_score;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const i32 T = result_tokens(tc, items[i]);
    REQUIRE(want.keep_masks[i].size() % (static_cast<std::size_t>(H) * T) == 0);
    REQUIRE(got.keep_masks[i].size() == want.keep_masks[i].size());
    REQUIRE(got.scores[i].size() == want.scores[i].size());
    const i32 rows = static_cast<i32>(want.keep_masks[i].size() / (static_cast<std::size_t>(H) * T));
    for (i32 r = 0; r < rows * H; ++r) {
      const std::size_t at = static_cast<std::size_t>(r) * T;
      const float* ws = &want.scores[i][at];
      const float* gs = &got.scores[i][at];
      float boundary = std::numeric_limits<float>::infinity();
      for (i32 t = 0; t < T; ++t)
        if (want.keep_masks[i][at + t]) boundary = std::min(boundary, rank(ws[t], t, T));
      for (i32 t = 0; t < T; ++t) {
        if (!scores_agree(ws[t], gs[t], tolerance) && scores_differ++ == 0)
          first_score = detail::at(i, r, H, t) + ": " + detail::floats(ws[t], gs[t]);
        if (want.keep_masks[i][at + t] == got.keep_masks[i][at + t]) continue;
        if (tolerance > 0.0f && scores_agree(rank(ws[t], t, T), boundary, tolerance))
          ++near_ties;
        else if (masks_differ++ == 0)
          first_mask = detail::at(i, r, H, t) + " (rank key " + detail::floats(rank(ws[t], t, T), boundary) +
                       " at the boundary)";
      }
    }
  }
  CHECK_MESSAGE(scores_differ == 0, scores_differ, " final scores differ, first at ", first_score);
  CHECK_MESSAGE(masks_differ == 0, masks_differ, " keep-mask entries differ away from a near-tie, first at ",
                first_mask);
  return near_ties;
}

// Every K and V byte of every physical row of `want` against `got` (whose rows may be
// zero-padded: the padding must still be zero), every F entry (to the bit where
// `want`'s run left it as it was, `f_before`, else within the tolerance) and every
// position.
inline void check_same_cache(const test_cache& want, const test_cache& got, const std::vector<float>& f_before,
                             float tolerance) {
  REQUIRE(got.num_layers() == want.num_layers());
  REQUIRE(got.num_blocks() == want.num_blocks());
  REQUIRE(got.block_size() == want.block_size());
  REQUIRE(got.kv_heads() == want.kv_heads());
  REQUIRE(got.type() == want.type());
  REQUIRE(got.row_size() >= want.row_size());
  long rows_differ = 0, f_differ = 0;
  std::string first_row, first_f;
  const std::vector<std::byte> zeros(got.row_size() - want.row_size());
  for (i32 l = 0; l < want.num_layers(); ++l)
    for (i32 p = 0; p < want.num_blocks(); ++p)
      for (i32 slot = 0; slot < want.block_size(); ++slot)
        for (i32 h = 0; h < want.kv_heads(); ++h) {
          const auto where = [&] {
            return "layer " + std::to_string(l) + " block " + std::to_string(p) + " slot " + std::to_string(slot) +
                   " head " + std::to_string(h);
          };
          for (kv_kind kind : {kv_kind::k, kv_kind::v}) {
            const std::byte* g = got.row_ptr(kind, l, p, slot, h);
            if ((std::memcmp(want.row_ptr(kind, l, p, slot, h), g, want.row_size()) != 0 ||
                 (!zeros.empty() && std::memcmp(g + want.row_size(), zeros.data(), zeros.size()) != 0)) &&
                rows_differ++ == 0)
              first_row = std::string(kind == kv_kind::k ? "K " : "V ") + where();
          }
          const std::size_t f = ((static_cast<std::size_t>(l) * want.num_blocks() + p) * want.block_size() + slot) *
                                    want.kv_heads() + h;
          const float w = want.raw_f()[f], g = got.raw_f()[f];
          const bool untouched = std::memcmp(&w, &f_before[f], sizeof w) == 0;
          if (!scores_agree(w, g, untouched ? 0.0f : tolerance) && f_differ++ == 0)
            first_f = where() + ": " + detail::floats(w, g) + (untouched ? " (left as it was by the first run)" : "");
        }
  CHECK_MESSAGE(rows_differ == 0, rows_differ, " K/V rows differ, first at ", first_row);
  CHECK_MESSAGE(f_differ == 0, f_differ, " F entries differ, first at ", first_f);
  // The positions move with their tokens: the same integers everywhere.
  CHECK(got.raw_positions() == want.raw_positions());
  CHECK(got.raw_live() == want.raw_live());  // written from the same counts (cautious update)
}

}  // namespace kvp_test
