// Memory plan (Zipage eq. 1 and 2; SPEC.md, "Memory plan"; engine/memory_plan.hpp)
// against values computed by hand in the comments, and its errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "kvpolicy/kvpolicy.hpp"

using kvp::dtype;

namespace {

// A small shape: L 2, h_kv 1, h_q 2, d 8, b 4, f16 K/V and queries, w 2, N_max 3.
//   m_kv = 2 (K, V) * L 2 * b 4 * h_kv 1 * d 8 * 2 B = 256
//   F    = L 2 * b 4 * h_kv 1 * 4 B (f32)          =  32   (m_kv / d: f32 beside f16)
//   m_q  = L 2 * w 2 * h_q 2 * d 8 * 2 B            = 128
//   per request: (256 + 32) * N_max 3 + 128         = 992
kvp::memory_plan_inputs small(std::int64_t m) {
  return {.available_bytes = m, .num_layers = 2, .num_kv_heads = 1, .num_q_heads = 2, .head_dim = 8,
          .block_size = 4, .kv_type = dtype::f16, .max_blocks = 3, .query_window = 2, .query_type = dtype::f16,
          .score_type = dtype::f32};
}

// Eq. 1's constraints hold and M is the largest that does: m_block N_total + M m_q <= m,
// M <= N_total / N_max, and M + 1 requests (each N_max blocks and a slot) do not fit.
void check_constraints(const kvp::memory_plan_inputs& in, const kvp::memory_plan& p) {
  const std::int64_t per_request = p.block_bytes() * in.max_blocks + p.query_slot_bytes;
  CHECK(p.used_bytes() <= in.available_bytes);
  CHECK(p.max_requests * in.max_blocks <= p.total_blocks);
  CHECK((p.max_requests + 1) * per_request > in.available_bytes);
  // N_total is the largest block count whose blocks and M slots fit, by eq. 1's
  // vertex: one block more would exceed m / (m_block + m_q / N_max).
  CHECK((p.total_blocks + 1) * per_request > in.available_bytes * in.max_blocks);
}

template <class F>
void expect_error(F&& f, const std::string& field, const std::string& value) {
  bool thrown = false;
  try {
    f();
  } catch (const kvp::error& e) {
    thrown = true;
    CHECK(e.field() == field);
    CHECK_MESSAGE(std::string(e.what()).find(value) != std::string::npos, e.what());
  }
  CHECK_MESSAGE(thrown, "no kvp::error for " << field);
}

}  // namespace

TEST_CASE("memory plan: Zipage's setting (Qwen3 8B, b 256, w 16, budget 2048) in 40 GiB") {
  // Zipage gives no worked example of eq. 1; this is its experimental setting (section 5:
  // b = 256, w = 16, budget k = 2048 = (N_max - 1) b, so N_max = 9) on Qwen3 8B
  // (L 36, h_q 32, h_kv 8, d 128, bf16), with 40 GiB for the cache.
  //   m_kv = 2 * 36 * 256 * 8 * 128 * 2 B = 37,748,736 (36 MiB)
  //   F    = 36 * 256 * 8 * 4 B (f32)     =    294,912 (m_kv / 128 = m_kv / d)
  //   m_q  = 36 * 16 * 32 * 128 * 2 B     =  4,718,592 (4.5 MiB)
  //   per request: 38,043,648 * 9 + 4,718,592 = 347,111,424
  //   m = 40 * 2^30 = 42,949,672,960; 123 * 347,111,424 = 42,694,705,152 <= m < 124 * ... = 43,041,816,576
  //   M = 123; N_total = floor(9 m / 347,111,424) = 123 * 9 + floor(9 * 254,967,808 / 347,111,424)
  //                    = 1107 + floor(2,294,710,272 / 347,111,424) = 1107 + 6 = 1113
  kvp::memory_plan_inputs in{.available_bytes = std::int64_t{40} << 30, .num_layers = 36, .num_kv_heads = 8,
                             .num_q_heads = 32, .head_dim = 128, .block_size = 256, .kv_type = dtype::bf16,
                             .max_blocks = 9, .query_window = 16, .query_type = dtype::bf16,
                             .score_type = dtype::f32};
  kvp::memory_plan p = kvp::plan_memory(in);
  CHECK(p.kv_block_bytes == 37'748'736);
  CHECK(p.score_block_bytes == 294'912);
  CHECK(p.query_slot_bytes == 4'718'592);
  CHECK(p.block_bytes() == 38'043'648);
  CHECK(p.max_requests == 123);
  CHECK(p.total_blocks == 1113);
  CHECK(p.used_bytes() == 1113 * std::int64_t{38'043'648} + 123 * std::int64_t{4'718'592});  // 42,922,967,040
  check_constraints(in, p);

  // With a bf16 F, eq. 2's factor exactly: m_kv (1 + 1/(2d)) = 37,748,736 + 147,456.
  //   per request 37,896,192 * 9 + 4,718,592 = 345,784,320; 124 of them = 42,877,255,680 <= m
  //   M = 124; remainder 72,417,280; 9 * 72,417,280 = 651,755,520 = 1 * 345,784,320 + ...
  //   N_total = 124 * 9 + 1 = 1117
  in.score_type = dtype::bf16;
  p = kvp::plan_memory(in);
  CHECK(p.block_bytes() == 37'748'736 + 37'748'736 / (2 * 128));
  CHECK(p.max_requests == 124);
  CHECK(p.total_blocks == 1117);
  check_constraints(in, p);

  // Without F (eq. 1): per request 37,748,736 * 9 + 4,718,592 = 344,457,216; M = 124
  // (42,712,694,784); remainder 236,978,176, * 9 = 2,132,803,584 = 6 * 344,457,216 + ...
  //   N_total = 1116 + 6 = 1122
  in.score_type = std::nullopt;
  p = kvp::plan_memory(in);
  CHECK(p.score_block_bytes == 0);
  CHECK(p.max_requests == 124);
  CHECK(p.total_blocks == 1122);
  check_constraints(in, p);
}

TEST_CASE("memory plan: a small shape, by hand") {
  // m = 10,000: M = floor(10,000 / 992) = 10 (9,920); N_total = floor(30,000 / 992) = 30
  // (10,000 / (288 + 128 / 3) = 30.2).
  kvp::memory_plan p = kvp::plan_memory(small(10'000));
  CHECK(p.kv_block_bytes == 256);
  CHECK(p.score_block_bytes == 32);
  CHECK(p.query_slot_bytes == 128);
  CHECK(p.max_requests == 10);
  CHECK(p.total_blocks == 30);
  CHECK(p.used_bytes() == 30 * 288 + 10 * 128);  // 9,920
  check_constraints(small(10'000), p);

  // m = 10,820: M still 10 (10,912 > m), remainder 900: N_total = 30 + floor(2,700 / 992)
  // = 32, two blocks more than M N_max, for requests without a query slot.
  p = kvp::plan_memory(small(10'820));
  CHECK(p.max_requests == 10);
  CHECK(p.total_blocks == 32);
  CHECK(p.used_bytes() == 32 * 288 + 10 * 128);  // 10,496 <= 10,820
  check_constraints(small(10'820), p);

  // One byte short of a request: no compressible request fits, 2 blocks do
  // (floor(991 * 3 / 992) = 2); exactly one request: 1 and 3.
  p = kvp::plan_memory(small(991));
  CHECK(p.max_requests == 0);
  CHECK(p.total_blocks == 2);
  p = kvp::plan_memory(small(992));
  CHECK(p.max_requests == 1);
  CHECK(p.total_blocks == 3);
  CHECK(p.used_bytes() == 992);

  // No query slots (w = 0, a pipeline that reads no queries): M = floor(10,000 / 864) = 11,
  // N_total = floor(10,000 / 288) = 34.
  kvp::memory_plan_inputs no_queries = small(10'000);
  no_queries.query_window = 0;
  p = kvp::plan_memory(no_queries);
  CHECK(p.query_slot_bytes == 0);
  CHECK(p.max_requests == 11);
  CHECK(p.total_blocks == 34);
  check_constraints(no_queries, p);
}

TEST_CASE("memory plan: the score cache's dtype") {
  // The small shape with m = 10,000, F as f32, a 16-bit F, and none:
  //   f32 F beside f16 K/V: 256 + 32 = 288 per block (1 + 1/d);      per request 992: M 10, N_total 30
  //   f16 F beside f16 K/V: 256 + 16 = 272 per block (1 + 1/(2d));   per request 944: M 10 (9,440),
  //                         N_total floor(30,000 / 944) = 31
  //   no F:                 256 per block;                           per request 896: M 11 (9,856),
  //                         N_total floor(30,000 / 896) = 33
  kvp::memory_plan_inputs in = small(10'000);
  kvp::memory_plan p = kvp::plan_memory(in);
  CHECK(p.block_bytes() == 288);
  CHECK(p.max_requests == 10);
  CHECK(p.total_blocks == 30);
  in.score_type = dtype::f16;
  p = kvp::plan_memory(in);
  CHECK(p.block_bytes() == 272);
  CHECK(p.max_requests == 10);
  CHECK(p.total_blocks == 31);
  in.score_type = std::nullopt;
  p = kvp::plan_memory(in);
  CHECK(p.block_bytes() == 256);
  CHECK(p.max_requests == 11);
  CHECK(p.total_blocks == 33);

  // f32 K/V with kvpolicy's f32 F: F is m_kv / (2d), eq. 2's factor exactly.
  //   m_kv = 2 * 2 * 4 * 1 * 8 * 4 B = 512; F = 32 = 512 / 16; per block 544.
  //   per request 544 * 3 + 128 = 1,760: M = 5 (8,800), N_total = floor(30,000 / 1,760) = 17
  in = small(10'000);
  in.kv_type = dtype::f32;
  p = kvp::plan_memory(in);
  CHECK(p.kv_block_bytes == 512);
  CHECK(p.score_block_bytes == 512 / (2 * 8));
  CHECK(p.max_requests == 5);
  CHECK(p.total_blocks == 17);
  check_constraints(in, p);
}

TEST_CASE("memory plan: N_max = 1 and zero memory") {
  // N_max = 1: per request 288 + 128 = 416; M = N_total = floor(10,000 / 416) = 24.
  kvp::memory_plan_inputs in = small(10'000);
  in.max_blocks = 1;
  kvp::memory_plan p = kvp::plan_memory(in);
  CHECK(p.max_requests == 24);
  CHECK(p.total_blocks == 24);
  check_constraints(in, p);

  // Zero memory plans nothing; it is not an error.
  p = kvp::plan_memory(small(0));
  CHECK(p.max_requests == 0);
  CHECK(p.total_blocks == 0);
  CHECK(p.used_bytes() == 0);
  CHECK(p.kv_block_bytes == 256);  // the per-unit sizes are still reported
}

TEST_CASE("memory plan: the constraints hold for every m") {
  const kvp::memory_plan_inputs base = small(0);
  for (std::int64_t m = 0; m <= 5'000; m += 7) {
    kvp::memory_plan_inputs in = base;
    in.available_bytes = m;
    check_constraints(in, kvp::plan_memory(in));
  }
}

TEST_CASE("memory plan: errors name the field and the value") {
  auto with = [](auto change) {
    kvp::memory_plan_inputs in = small(10'000);
    change(in);
    return [in] { (void)kvp::plan_memory(in); };
  };
  using in_t = kvp::memory_plan_inputs;
  expect_error(with([](in_t& in) { in.available_bytes = -1; }), "memory_plan_inputs.available_bytes", "is -1");
  expect_error(with([](in_t& in) { in.num_layers = 0; }), "memory_plan_inputs.num_layers", "is 0");
  expect_error(with([](in_t& in) { in.num_kv_heads = -2; }), "memory_plan_inputs.num_kv_heads", "is -2");
  expect_error(with([](in_t& in) { in.num_q_heads = 0; }), "memory_plan_inputs.num_q_heads", "is 0");
  expect_error(with([](in_t& in) { in.num_q_heads = 3; in.num_kv_heads = 2; }), "memory_plan_inputs.num_q_heads",
               "not a multiple of num_kv_heads 2");
  expect_error(with([](in_t& in) { in.head_dim = 0; }), "memory_plan_inputs.head_dim", "is 0");
  expect_error(with([](in_t& in) { in.block_size = 0; }), "memory_plan_inputs.block_size", "is 0");
  expect_error(with([](in_t& in) { in.max_blocks = 0; }), "memory_plan_inputs.max_blocks", "is 0");
  expect_error(with([](in_t& in) { in.query_window = -1; }), "memory_plan_inputs.query_window", "is -1");
  constexpr std::int32_t big = std::numeric_limits<std::int32_t>::max();
  expect_error(with([](in_t& in) {
                 in.num_layers = big;
                 in.block_size = big;
                 in.num_kv_heads = big;
                 in.num_q_heads = big;
               }),
               "memory_plan_inputs", "L * b * h_kv overflow int64");
}
