// The order in which the CUDA executor's lightning + score grid takes its tasks
// (cuda::lightning_score_tasks): every task once, each row's lightning tasks
// adjacent, and every score task after all lightning tasks of its row, `lag` rows
// later. The kernel's forward progress rests on that last property: a score task
// waits only for tasks that took earlier tickets.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/exec/cuda/lightning_score_tasks.hpp"

using kvp::cuda::lightning_score_tasks;

namespace {

std::string spell(const lightning_score_tasks& order) {
  std::string s;
  for (std::uint32_t t = 0; t < order.count(); ++t) {
    const auto task = order[t];
    if (!s.empty()) s += ' ';
    s += (task.score ? "S" : "L") + std::to_string(task.row) + "." + std::to_string(task.part);
  }
  return s;
}

}  // namespace

TEST_CASE("lightning_score_tasks: hand cases") {
  // Three rows of two cache blocks, one score task each, lag 1.
  CHECK(spell({3, 2, 1, 1}) == "L0.0 L0.1 L1.0 L1.1 S0.0 L2.0 L2.1 S1.0 S2.0");
  // Lag 0: a row's score right after its own lightning tasks.
  CHECK(spell({2, 2, 1, 0}) == "L0.0 L0.1 S0.0 L1.0 L1.1 S1.0");
  // Lag = rows: every lightning task first (the two kernels' order).
  CHECK(spell({2, 1, 2, 2}) == "L0.0 L1.0 S0.0 S0.1 S1.0 S1.1");
  // Two key splits, lag 1.
  CHECK(spell({2, 1, 2, 1}) == "L0.0 L1.0 S0.0 S0.1 S1.0 S1.1");
  CHECK(spell({3, 1, 2, 1}) == "L0.0 L1.0 S0.0 S0.1 L2.0 S1.0 S1.1 S2.0 S2.1");
}

TEST_CASE("lightning_score_tasks: every task once, scores after their row's lightning") {
  for (std::uint32_t rows : {1u, 2u, 7u, 64u})
    for (std::uint32_t blocks : {1u, 3u, 9u})
      for (std::uint32_t splits : {1u, 2u, 8u})
        for (std::uint32_t lag : {0u, 1u, 5u, 64u}) {
          if (lag > rows) continue;
          const lightning_score_tasks order{rows, blocks, splits, lag};
          CAPTURE(rows);
          CAPTURE(blocks);
          CAPTURE(splits);
          CAPTURE(lag);
          REQUIRE(order.count() == rows * (blocks + splits));
          std::vector<std::int64_t> lightning_at(std::size_t{rows} * blocks, -1), score_at(std::size_t{rows} * splits, -1);
          for (std::uint32_t t = 0; t < order.count(); ++t) {
            const auto task = order[t];
            REQUIRE(task.row < rows);
            REQUIRE(task.part < (task.score ? splits : blocks));
            auto& at = task.score ? score_at[task.row * splits + task.part] : lightning_at[task.row * blocks + task.part];
            REQUIRE(at == -1);  // once
            at = t;
          }
          for (std::uint32_t r = 0; r < rows; ++r) {
            // A row's lightning tasks adjacent, in block order, and rows in order.
            for (std::uint32_t b = 1; b < blocks; ++b)
              CHECK(lightning_at[r * blocks + b] == lightning_at[r * blocks + b - 1] + 1);
            if (r > 0) CHECK(lightning_at[r * blocks] > lightning_at[(r - 1) * blocks]);
            for (std::uint32_t s = 0; s < splits; ++s) {
              const std::int64_t at = score_at[r * splits + s];
              CHECK(at > lightning_at[r * blocks + blocks - 1]);
              // `lag` rows later: after the lightning of row r + lag, where there is one.
              if (r + lag < rows) CHECK(at > lightning_at[(r + lag) * blocks + blocks - 1]);
              if (r + lag + 1 < rows) CHECK(at < lightning_at[(r + lag + 1) * blocks]);
            }
          }
        }
}
