#include "host_compress.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include <kvpolicy/core/error.hpp>
#include <kvpolicy/exec/host_executor.hpp>
#include <nanobind/stl/variant.h>

#include "items.hpp"
#include "numpy_out.hpp"
#include "paged_cache.hpp"
#include "policy.hpp"
#include "python_communicator.hpp"
#include "side_views.hpp"

namespace nb = nanobind;
using kvp::require;

namespace kvpy {
namespace {

nb::dict host_compress(const policy& pol, const paged_cache& cache, nb::handle items_arg, nb::handle queries_arg,
                       nb::handle scores_arg, std::int32_t layer_begin, std::int32_t layer_count,
                       std::int32_t max_tokens, bool return_masks, bool return_scores, nb::handle communicator) {
  const cache_description& c = cache.desc;
  require(!c.on_device, "cache", "lives on CUDA device {}; host_compress runs on host memory", c.device_id);
  const array items = readable(items_arg, "items");
  const kvp::batch_item* item_data = item_rows(items);
  require(!place_of(items, "items").device, "items", "lives on CUDA memory; the host path reads host memory");
  const std::span<const kvp::batch_item> batch_items(item_data, items.shape(0));

  array queries_keep;
  mut_array scores_keep;
  const kvp::query_window_view queries = queries_view(queries_arg, c, queries_keep);
  const kvp::score_view scores = scores_view(scores_arg, c, scores_keep);
  const kvp::paged_kv_view view = c.view(c.k_layers.data(), c.v_layers.data());
  const kvp::compression_batch batch{.items = batch_items, .layer_begin = layer_begin, .layer_count = layer_count};

  kvp::host_result r;
  {
    nb::gil_scoped_release quiet;  // the executor touches no Python object
    const kvp::host_executor ex{.record_keep_masks = return_masks, .record_scores = return_scores};
    if (communicator.is_none())
      r = std::visit([&](const auto& p) { return ex.compress(p, view, queries, scores, batch); }, pol);
    else
      r = std::visit(
          [&](const auto& p) {
            return ex.compress(p, view, queries, scores, batch, python_communicator{communicator});
          },
          pol);
  }

  // Per-item results padded to one width: the longest batch sequence, or max_tokens. A
  // window-only preset's masks and scores cover the item's window, [window_begin, T):
  // entry t is token window_begin + t, and the row holds T - window_begin entries.
  const std::size_t n = batch_items.size();
  std::int32_t longest = 0;
  for (const kvp::batch_item& it : batch_items) longest = std::max(longest, c.seqs.lengths[it.seq]);
  require(max_tokens == 0 || max_tokens >= longest, "max_tokens", "is {}; a batch sequence holds {} tokens", max_tokens,
          longest);
  const std::size_t width = static_cast<std::size_t>(max_tokens ? max_tokens : longest);
  const std::size_t max_blocks = (width + c.shape.block_size - 1) / c.shape.block_size;
  const kvp::layer_range range = kvp::resolve_layers(batch, view);
  const std::size_t layers = static_cast<std::size_t>(range.end - range.begin);
  const std::size_t rows = layers * c.shape.num_kv_heads;

  std::vector<std::int32_t> released(n * max_blocks, -1), released_counts(n), kept(n * rows);
  std::vector<std::uint8_t> masks(return_masks ? n * rows * width : 0, 0);
  std::vector<float> final_scores(return_scores ? n * rows * width : 0, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    released_counts[i] = static_cast<std::int32_t>(r.released_blocks[i].size());
    std::copy(r.released_blocks[i].begin(), r.released_blocks[i].end(), released.begin() + i * max_blocks);
    std::copy(r.kept_counts[i].begin(), r.kept_counts[i].end(), kept.begin() + i * rows);
    const std::size_t T =
        static_cast<std::size_t>(c.seqs.lengths[batch_items[i].seq] - batch_items[i].window_begin);
    for (std::size_t row = 0; row < rows; ++row) {
      if (return_masks)
        std::copy_n(r.keep_masks[i].begin() + row * T, T, masks.begin() + (i * rows + row) * width);
      if (return_scores)
        std::copy_n(r.scores[i].begin() + row * T, T, final_scores.begin() + (i * rows + row) * width);
    }
  }
  const std::size_t h = static_cast<std::size_t>(c.shape.num_kv_heads);
  nb::dict out;
  out["new_lengths"] = to_numpy(std::move(r.new_lengths), {n});
  out["released_counts"] = to_numpy(std::move(released_counts), {n});
  out["released_blocks"] = to_numpy(std::move(released), {n, max_blocks});
  out["kept_counts"] = to_numpy(std::move(kept), {n, layers, h});
  out["nonfinite_scores"] = to_numpy(std::move(r.nonfinite_scores), {n});
  if (return_masks) out["keep_masks"] = to_numpy(std::move(masks), {n, layers, h, width});
  if (return_scores) out["scores"] = to_numpy(std::move(final_scores), {n, layers, h, width});
  return out;
}

}  // namespace

void register_host_compress(nb::module_& m) {
  m.def("host_compress", &host_compress, nb::arg("policy"), nb::arg("cache"), nb::arg("items"),
        nb::arg("queries").none(), nb::arg("scores").none(), nb::arg("layer_begin"), nb::arg("layer_count"),
        nb::arg("max_tokens"), nb::arg("return_masks"), nb::arg("return_scores"), nb::arg("communicator").none(),
        "kvp::host_executor over host arrays (kvpolicy.compress is the API).");
}

}  // namespace kvpy
