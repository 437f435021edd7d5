// A test_cache's arrays copied to device memory (K/V buffers, queries, F, block
// table, lengths, positions, live bytes), the views over the copies, built by the fixture's
// own layout code, and the way back for what an executor writes: K, V, F, positions, live.
#pragma once

#include <cstddef>
#include <vector>

#include <thrust/copy.h>
#include <thrust/device_vector.h>

#include "kvpolicy/kvpolicy.cuh"
#include "support/test_cache.hpp"

namespace kvp_test {

class device_copy {
 public:
  explicit device_copy(const test_cache& tc)
      : queries_(tc.raw_queries().begin(), tc.raw_queries().end()),
        f_(tc.raw_f().begin(), tc.raw_f().end()),
        table_(tc.raw_table().begin(), tc.raw_table().end()),
        indptr_(tc.raw_indptr().begin(), tc.raw_indptr().end()),
        lengths_(tc.raw_lengths().begin(), tc.raw_lengths().end()),
        positions_(tc.raw_positions().begin(), tc.raw_positions().end()),
        live_(tc.raw_live().begin(), tc.raw_live().end()) {
    std::vector<std::byte*> bases;
    buffers_.reserve(tc.raw_buffers().size());
    for (const auto& buf : tc.raw_buffers()) {
      buffers_.emplace_back(buf.begin(), buf.end());
      bases.push_back(raw(buffers_.back()));
    }
    const auto k_layers = tc.layer_table(kv_kind::k, bases), v_layers = tc.layer_table(kv_kind::v, bases);
    k_layers_.assign(k_layers.begin(), k_layers.end());
    v_layers_.assign(v_layers.begin(), v_layers.end());
    cache_ = tc.view_over(
        {bases[0], raw(k_layers_), raw(v_layers_), raw(table_), raw(indptr_), raw(lengths_), raw(positions_), raw(live_)});
    queries_view_ = tc.queries_over(raw(queries_));
    scores_view_ = tc.scores_over(raw(f_));
  }
  device_copy(const device_copy&) = delete;  // the views point into this object's vectors
  device_copy& operator=(const device_copy&) = delete;

  const kvp::paged_kv_view& cache() const noexcept { return cache_; }
  const kvp::query_window_view& queries() const noexcept { return queries_view_; }
  const kvp::score_view& scores() const noexcept { return scores_view_; }

  // K, V, F and the positions as they are on the device now, into `tc` (the fixture
  // this was copied from).
  void copy_back(test_cache& tc) const {
    for (std::size_t i = 0; i < buffers_.size(); ++i)
      thrust::copy(buffers_[i].begin(), buffers_[i].end(), tc.raw_buffers()[i].begin());
    thrust::copy(f_.begin(), f_.end(), tc.raw_f().begin());
    thrust::copy(positions_.begin(), positions_.end(), tc.raw_positions().begin());
    thrust::copy(live_.begin(), live_.end(), tc.raw_live().begin());
  }

 private:
  template <class T>
  static T* raw(thrust::device_vector<T>& v) {
    return thrust::raw_pointer_cast(v.data());
  }

  std::vector<thrust::device_vector<std::byte>> buffers_;
  thrust::device_vector<std::byte> queries_;
  thrust::device_vector<float> f_;
  thrust::device_vector<i32> table_, indptr_, lengths_, positions_;
  thrust::device_vector<std::uint8_t> live_;
  thrust::device_vector<void*> k_layers_, v_layers_;
  kvp::paged_kv_view cache_{};
  kvp::query_window_view queries_view_{};
  kvp::score_view scores_view_{};
};

}  // namespace kvp_test
