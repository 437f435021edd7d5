// A doctest listener of kvpolicy_gpu_unit_tests: at the end of a run, prints how many
// compressions the CUDA executor was checked against the host executor on, and every
// one it was not (host only, with the reason), from support/agreement_tally.hpp.
#include <doctest/doctest.h>

#include <ostream>

#include "support/agreement_tally.hpp"

namespace {

struct agreement_report : doctest::IReporter {
  std::ostream& out;
  bool ran = false;  // not a query (--list-test-cases, --version, ...)

  explicit agreement_report(const doctest::ContextOptions& options) : out(*options.cout) {}

  void test_run_start() override { ran = true; }
  void test_run_end(const doctest::TestRunStats&) override {
    if (!ran) return;
    const auto& t = kvp_test::tally();
    out << "[CUDA executor vs host executor] " << t.compared << " compressions compared (" << t.zero_padded
        << " on zero-padded rows)";
    if (t.near_tie_masks > 0)
      out << "; " << t.near_tie_masks << " keep-mask entries differed at near-ties of scores, so the bytes of "
          << t.caches_not_compared << " compressions were not compared";
    out << "\n";
    for (const auto& [reason, count] : t.host_only)
      out << "[CUDA executor vs host executor] " << count << " compressions on the host executor only: " << reason
          << "\n";
  }

  void report_query(const doctest::QueryData&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("cuda_agreement", 1, agreement_report);
