// What the CUDA build of the unit tests compared: compressions run on both
// executors, and those left to the host executor alone, with the reason. Counted by
// support/run_on_both_executors.cuh, printed at the end of a run by
// tests/gpu_unit/agreement_report.cpp, so that nothing is skipped silently.
#pragma once

#include <map>
#include <string>

namespace kvp_test {

struct agreement_tally {
  long compared = 0;     // compressions run on both executors and checked
  long zero_padded = 0;  // of which on a zero-padded copy (support/zero_padded_copy.hpp)
  long near_tie_masks = 0;           // keep-mask entries that differed at a near-tie of scores
  long caches_not_compared = 0;      // compressions whose bytes were not compared for that reason
  std::map<std::string, long> host_only;  // reason -> compressions run on the host executor alone
};

inline agreement_tally& tally() {
  static agreement_tally t;
  return t;
}

}  // namespace kvp_test
