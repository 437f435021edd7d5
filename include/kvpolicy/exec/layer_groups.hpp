// One result for an item whose layers were compressed in several calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include "kvpolicy/config.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/exec/result.hpp"

KVP_NAMESPACE_BEGIN

// An engine that compresses a batch layer group by layer group (one call per range
// of layers, the same items and the same lengths in every call, the engine updating
// its lengths only after the last) holds one block table per sequence for all layers:
// a block is free only once every layer's kept tokens lie below it. Given the groups'
// results in layer order, this returns the batch's: new lengths the largest of the
// groups', released blocks those past it (the shortest of the groups' lists, since
// each lists the table's tail past its own length) and that group's new table, kept
// counts, masks and scores joined in layer order, non-finite counts and times added
// (the unshared blocks are the same in every group: the first group's are kept).
inline host_result merge_layer_groups(std::span<const host_result> groups) {
  require(!groups.empty(), "groups", "is empty; merge the results of at least one call");
  host_result out = groups.front();
  const std::size_t items = out.new_lengths.size();
  for (std::size_t g = 1; g < groups.size(); ++g) {
    const host_result& r = groups[g];
    require(r.new_lengths.size() == items && r.released_blocks.size() == items, detail::path("groups[{}]", g),
            "holds {} items; groups[0] holds {}: every group compresses the same batch", r.new_lengths.size(), items);
    for (std::size_t i = 0; i < items; ++i) {
      if (r.new_lengths[i] > out.new_lengths[i]) {
        out.new_lengths[i] = r.new_lengths[i];
        out.released_blocks[i] = r.released_blocks[i];
        if (i < out.new_tables.size() && i < r.new_tables.size()) out.new_tables[i] = r.new_tables[i];
      }
      const auto join = [&](auto& into, const auto& from) {
        if (i < into.size() && i < from.size()) into[i].insert(into[i].end(), from[i].begin(), from[i].end());
      };
      join(out.kept_counts, r.kept_counts);
      join(out.keep_masks, r.keep_masks);
      join(out.scores, r.scores);
      if (i < out.nonfinite_scores.size() && i < r.nonfinite_scores.size())
        out.nonfinite_scores[i] += r.nonfinite_scores[i];
    }
    for (std::size_t s = 0; s < out.times.seconds.size(); ++s) out.times.seconds[s] += r.times.seconds[s];
  }
  return out;
}

KVP_NAMESPACE_END
