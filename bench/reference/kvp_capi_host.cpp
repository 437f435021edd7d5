// libkvp_capi_host.so: the C API of kvp_capi.h over kvp::host_executor, on host
// pointers, synchronous (the stream argument is ignored). It lets the references'
// --device cpu (zipage_reference.py, hard_kv_reference.py, kara_reference.py,
// kv_compress_reference.py) check the PyTorch code against the library's semantics on a
// machine without a GPU. The per-head entry points run kvp::host::compress_per_head.
#include "capi_common.hpp"  // first: kvpolicy's error.hpp sets FMT_USE_CONSTEXPR before fmt is seen

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <vector>

namespace {

using namespace kvp_capi;

// One compression; results into the workspace (and the optional masks and scores).
kvp::stage_times compress_host(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                               const std::int32_t* block_table, const std::int32_t* lengths,
                               const std::int32_t* items, void* workspace, std::size_t workspace_bytes,
                               std::uint8_t* keep_masks, float* final_scores,
                               const kvp_capi_calibration* calibration = nullptr) {
  kvp::require(s != nullptr, "shape", "is a null pointer");
  kvp::require(workspace != nullptr, "workspace", "is a null pointer");
  const ws_layout w = layout_of(*s);
  kvp::require(workspace_bytes >= w.executor, "workspace_bytes", "is {}; kvp_capi_workspace_size says {}",
               workspace_bytes, w.executor);
  kvp::require(items != nullptr || s->num_items == 0, "items", "is a null pointer");
  const views v = make_views(*s, kv_cache, queries, f, block_table, lengths);
  const std::vector<kvp::batch_item> batch = host_items(*s, items);
  const std::span<const kvp::batch_item> span(batch);
  auto* status = at<std::int32_t>(workspace, w.status);
  std::fill_n(status, kvp::status_words, 0);
  const kvp::host_executor hx{.record_keep_masks = keep_masks != nullptr, .record_scores = final_scores != nullptr};
  const kvp::host_result r = with_policy(*s, calibration, [&](const auto& p) {
    return hx.compress(p, v.cache, v.queries, v.scores, kvp::compression_batch{span, s->layer_begin, s->layer_count});
  });
  const std::int32_t layers = s->layer_count > 0 ? s->layer_count : s->num_layers - s->layer_begin;
  const std::size_t rows = std::size_t(layers) * s->num_kv_heads, pitch = std::size_t(s->max_tokens);
  const std::int32_t blocks = (s->max_tokens + s->block_size - 1) / s->block_size;
  for (std::int32_t i = 0; i < s->num_items; ++i) {
    at<std::int32_t>(workspace, w.new_lengths)[i] = r.new_lengths[i];
    at<std::int32_t>(workspace, w.released_counts)[i] = static_cast<std::int32_t>(r.released_blocks[i].size());
    std::copy(r.released_blocks[i].begin(), r.released_blocks[i].end(),
              at<std::int32_t>(workspace, w.released_blocks) + std::size_t(i) * blocks);
    // A row covers the tokens the pipeline saw: the window and what follows it (KARA),
    // the whole sequence otherwise (window_begin 0).
    const std::size_t T = static_cast<std::size_t>(lengths[span[i].seq] - span[i].window_begin);
    for (std::size_t row = 0; row < rows; ++row) {
      const std::size_t out = (std::size_t(i) * rows + row) * pitch;
      if (keep_masks) std::copy_n(r.keep_masks[i].begin() + row * T, T, keep_masks + out);
      if (final_scores) std::copy_n(r.scores[i].begin() + row * T, T, final_scores + out);
    }
  }
  return r.times;
}

// KV-Compress on the host: host::compress_per_head, its per_head_result spread into
// the caller's arrays (kvp_capi.h). Returns the wall time of the call in ms.
double compress_per_head_host(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                              std::int32_t* positions, const std::int32_t* tables, const std::int32_t* lengths,
                              const std::int64_t* items, const kvp_capi_per_head_out* out) {
  const auto t0 = std::chrono::steady_clock::now();
  kvp::require(s != nullptr, "shape", "is a null pointer");
  require_per_head_out(out);
  std::fill_n(out->status, kvp::status_words, 0);
  const kvp::select::head_adaptive_blocks sel = per_head_selector(*s);
  const kvp::per_head_kv_view view = make_per_head_view(*s, k_cache, v_cache, metric, positions, tables, lengths);
  const std::vector<kvp::per_head_item> batch = host_per_head_items(*s, items);
  const kvp::per_head_result r = kvp::host::compress_per_head(sel, view, batch);
  const std::size_t rows = std::size_t(s->num_layers) * s->num_kv_heads;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    for (std::size_t row = 0; row < rows; ++row) {
      const std::size_t at_row = i * rows + row;
      const std::vector<std::int32_t>& ids = r.freed_blocks[i][row];
      out->new_lengths[at_row] = r.new_lengths[i][row];
      out->freed_counts[at_row] = static_cast<std::int32_t>(ids.size());
      std::copy(ids.begin(), ids.end(), out->freed_blocks + at_row * std::size_t(s->max_blocks));
      if (out->evicted) out->evicted[at_row] = r.evicted[i][row];
      if (out->moved) out->moved[at_row] = r.moved[i][row];
    }
    if (out->freed) out->freed[i] = r.freed[i];
    if (out->nonfinite) out->nonfinite[i] = r.nonfinite[i];
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

extern "C" {

int kvp_capi_shape_size(void) { return static_cast<int>(sizeof(kvp_capi_shape)); }

int kvp_capi_status_words(void) { return KVP_CAPI_STATUS_WORDS; }

int kvp_capi_workspace_size(const kvp_capi_shape* s, std::size_t* bytes) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && bytes != nullptr, "kvp_capi_workspace_size", "null argument");
    *bytes = layout_of(*s).executor;  // the host executor allocates its own scratch
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                      const std::int32_t* block_table, const std::int32_t* lengths, const std::int32_t* items,
                      void* workspace, std::size_t workspace_bytes, std::uint8_t* keep_masks, float* final_scores,
                      std::uintptr_t /*stream*/) {
  return guarded([&]() -> int {
    compress_host(s, kv_cache, queries, f, block_table, lengths, items, workspace, workspace_bytes, keep_masks,
                  final_scores);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_calibration_size(void) { return static_cast<int>(sizeof(kvp_capi_calibration)); }

int kvp_capi_calibration_defaults(kvp_capi_calibration* out) {
  return guarded([&]() -> int {
    kvp::require(out != nullptr, "out", "is a null pointer");
    *out = calibration_defaults();
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress_calibrated(const kvp_capi_shape* s, const kvp_capi_calibration* calibration, void* kv_cache,
                                 const void* queries, float* f, const std::int32_t* block_table,
                                 const std::int32_t* lengths, const std::int32_t* items, void* workspace,
                                 std::size_t workspace_bytes, std::uint8_t* keep_masks, float* final_scores,
                                 std::uintptr_t /*stream*/) {
  return guarded([&]() -> int {
    compress_host(s, kv_cache, queries, f, block_table, lengths, items, workspace, workspace_bytes, keep_masks,
                  final_scores, calibration);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress_staged(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                             const std::int32_t* block_table, const std::int32_t* lengths, const std::int32_t* items,
                             void* workspace, std::size_t workspace_bytes, float* stage_ms, std::uintptr_t /*stream*/) {
  return guarded([&]() -> int {
    kvp::require(stage_ms != nullptr, "stage_ms", "is a null pointer");
    const kvp::stage_times t = compress_host(s, kv_cache, queries, f, block_table, lengths, items, workspace,
                                             workspace_bytes, nullptr, nullptr);
    // The CUDA library's order: score, redundancy, aggregate + select (its epilogue), layout.
    const double ms[4] = {t.seconds[0], t.seconds[2], t.seconds[1] + t.seconds[3], t.seconds[4]};
    for (int i = 0; i < 4; ++i) stage_ms[i] = static_cast<float>(ms[i] * 1e3);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_status(const kvp_capi_shape* s, const void* workspace, std::int32_t* host_words, std::uintptr_t) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && workspace != nullptr, "kvp_capi_status", "null argument");
    const std::int32_t* words = at<std::int32_t>(workspace, layout_of(*s).status);
    if (host_words) std::copy_n(words, kvp::status_words, host_words);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_new_lengths(const kvp_capi_shape* s, const void* workspace, std::int32_t* host_out, std::uintptr_t) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && workspace != nullptr && host_out != nullptr, "kvp_capi_new_lengths",
                 "null argument");
    std::copy_n(at<std::int32_t>(workspace, layout_of(*s).new_lengths), s->num_items, host_out);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_per_head_shape_size(void) { return static_cast<int>(sizeof(kvp_capi_per_head_shape)); }

int kvp_capi_per_head_workspace_size(const kvp_capi_per_head_shape* s, std::size_t* bytes) {
  return guarded([&]() -> int {
    kvp::require(s != nullptr && bytes != nullptr, "kvp_capi_per_head_workspace_size", "null argument");
    *bytes = 0;  // host::compress_per_head allocates its own scratch
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress_per_head(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                               std::int32_t* positions, const std::int32_t* tables, const std::int32_t* lengths,
                               const std::int64_t* items, void* /*workspace*/, std::size_t /*workspace_bytes*/,
                               const kvp_capi_per_head_out* out, std::uintptr_t /*stream*/) {
  return guarded([&]() -> int {
    compress_per_head_host(s, k_cache, v_cache, metric, positions, tables, lengths, items, out);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_compress_per_head_staged(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache, float* metric,
                                      std::int32_t* positions, const std::int32_t* tables,
                                      const std::int32_t* lengths, const std::int64_t* items, void* /*workspace*/,
                                      std::size_t /*workspace_bytes*/, const kvp_capi_per_head_out* out,
                                      float* stage_ms, std::uintptr_t /*stream*/) {
  return guarded([&]() -> int {
    kvp::require(stage_ms != nullptr, "stage_ms", "is a null pointer");
    const double ms = compress_per_head_host(s, k_cache, v_cache, metric, positions, tables, lengths, items, out);
    // host::compress_per_head does not split its stages (kvp_capi.h).
    stage_ms[0] = static_cast<float>(ms);
    stage_ms[1] = 0.0f;
    stage_ms[2] = static_cast<float>(ms);
    return KVP_CAPI_OK;
  });
}

int kvp_capi_per_head_status(const std::int32_t* status, std::int32_t* host_words, std::uintptr_t) {
  return guarded([&]() -> int {
    kvp::require(status != nullptr, "status", "is a null pointer");
    if (host_words) std::copy_n(status, kvp::status_words, host_words);
    kvp::throw_if_error(status);
    return KVP_CAPI_OK;
  });
}

const char* kvp_capi_last_error(void) { return last_error.c_str(); }

}  // extern "C"
