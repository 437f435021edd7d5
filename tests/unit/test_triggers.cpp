// Triggers (SPEC.md, "Triggers"; engine/triggers.hpp) over scripted decode traces:
// sequences of different lengths gain one token per step, the trigger picks the step's
// items, a uniform top-k "executor" leaves each item at its budget, and
// record_compression updates the states. Every expected trace is computed by hand in
// the comments beside it. Also: sequence_state's counters and the errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kvpolicy/kvpolicy.hpp"

using kvp::sequence_state;

namespace {

constexpr std::int32_t no_slot = sequence_state::no_query_slot;

// What a uniform top-k "executor" leaves of an item: its budget.
struct keep_budget {
  std::int32_t operator()(const kvp::batch_item& it, std::int32_t /*length*/) const { return it.budget; }
};

// What Kara's window-only compression leaves of a sequence of `length` tokens: the
// tokens before the window, `budget` of W \ U, and everything after W \ U (the
// buffer and the last block).
struct keep_window {
  const kvp::trigger::periodic& t;
  std::int32_t operator()(const kvp::batch_item& it, std::int32_t length) const {
    return length - (t.window - t.buffer) + it.budget;
  }
};

// Runs `steps` decode steps: each appends one token to every running sequence, then
// asks the trigger for the step's items and "compresses" them to new_length(item,
// length). Returns one line per step with items:
// "step: seq/query_slot/budget/history_tokens ...", with "@window_begin" after each
// item for a trigger that has window_begin_of, in the order due_items gives.
template <kvp::Trigger T, class Keep = keep_budget>
std::string run_trace(const T& trigger, std::vector<sequence_state>& running, std::int64_t steps,
                      Keep new_length = {}) {
  constexpr bool windowed = requires(const sequence_state& s) { trigger.window_begin_of(s); };
  std::string trace;
  std::vector<kvp::batch_item> items;
  for (std::int64_t step = 1; step <= steps; ++step) {
    for (sequence_state& s : running) s.append();
    kvp::due_items(trigger, running, step, items);
    if (items.empty()) continue;
    std::vector<std::int32_t> new_lengths;
    trace += fmt::format("{}:", step);
    for (const kvp::batch_item& it : items) {
      trace += fmt::format(" {}/{}/{}/{}", it.seq, it.query_slot, it.budget, it.history_tokens);
      if (windowed) trace += fmt::format("@{}", it.window_begin);
      if (!windowed) CHECK(it.window_begin == 0);
      std::int32_t length = 0;
      for (const sequence_state& s : running)
        if (s.seq == it.seq) length = s.length;
      new_lengths.push_back(new_length(it, length));
    }
    trace += "\n";
    kvp::record_compression(running, items, new_lengths, step);
  }
  return trace;
}

// Calls f and expects a kvp::error naming `field` whose message holds `value`.
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

// A trigger written outside the library: every sequence longer than `budget`, each step.
struct over_budget {
  std::int32_t budget = 0;
  bool due(const sequence_state& s, std::int64_t) const { return s.length > budget; }
  std::int32_t budget_of(const sequence_state&) const { return budget; }
};

// A window trigger written outside the library: every sequence, over [begin, length),
// to `budget` tokens of it.
struct fixed_window {
  std::int32_t begin = 0;
  std::int32_t budget = 0;
  bool due(const sequence_state&, std::int64_t) const { return true; }
  std::int32_t budget_of(const sequence_state&) const { return budget; }
  std::int32_t window_begin_of(const sequence_state&) const { return begin; }
};

// Not a trigger: no budget_of.
struct due_only {
  bool due(const sequence_state&, std::int64_t) const { return true; }
};

}  // namespace

static_assert(kvp::Trigger<kvp::trigger::threshold>);
static_assert(kvp::Trigger<kvp::trigger::buffer>);
static_assert(kvp::Trigger<kvp::trigger::periodic>);
static_assert(kvp::Trigger<kvp::trigger::interval>);
static_assert(kvp::Trigger<over_budget>);
static_assert(kvp::Trigger<fixed_window>);
static_assert(!kvp::Trigger<due_only>);

TEST_CASE("sequence_state: append, uncompressed tail, record_compression") {
  sequence_state s{.seq = 7, .query_slot = 2, .length = 10};  // after a 10-token prefill
  CHECK_FALSE(s.compressed_before());
  CHECK(s.uncompressed_tail() == 10);  // never compressed: the prompt counts
  s.append();
  s.append(3);
  CHECK(s.length == 14);
  CHECK(s.generated_since_compression == 4);
  CHECK(s.uncompressed_tail() == 14);

  std::vector<sequence_state> running{{.seq = 3, .query_slot = 0, .length = 20}, s};
  const std::vector<kvp::batch_item> items{{.seq = 7, .query_slot = 2, .budget = 8, .history_tokens = 0}};
  const std::vector<std::int32_t> new_lengths{8};
  kvp::record_compression(running, items, new_lengths, 42);
  const sequence_state& r = running[1];
  CHECK(r.length == 8);
  CHECK(r.history_tokens == 8);
  CHECK(r.generated_since_compression == 0);
  CHECK(r.compressions == 1);
  CHECK(r.last_compression_step == 42);
  CHECK(r.compressed_before());
  CHECK(r.uncompressed_tail() == 0);
  CHECK(running[0].length == 20);  // not in the batch: untouched
  CHECK(running[0].compressions == 0);

  running[1].append(5);
  CHECK(running[1].uncompressed_tail() == 5);  // compressed: only what came since
  CHECK(running[1].length == 13);
  CHECK(running[1].history_tokens == 8);
}

TEST_CASE("trigger::threshold (Zipage 4.1): N >= N_max blocks with a full last block") {
  // b = 4, N_max = 3: due at lengths 12, 16, 20, ... ; budget (3 - 1) * 4 = 8.
  const kvp::trigger::threshold t{.block_size = 4, .max_blocks = 3};
  CHECK(t.due({.length = 12}, 0));   // exactly N_max full blocks
  CHECK(t.due({.length = 16}, 0));   // more blocks than N_max (a long prefill), last full
  CHECK_FALSE(t.due({.length = 11}, 0));
  CHECK_FALSE(t.due({.length = 13}, 0));  // N = 4 >= N_max, but the last block is partial
  CHECK_FALSE(t.due({.length = 8}, 0));   // full, but 2 blocks < N_max
  CHECK_FALSE(t.due({.length = 0}, 0));
  CHECK(t.budget_of({.length = 16}) == 8);

  std::vector<sequence_state> running{
      {.seq = 0, .query_slot = 0, .length = 5},   // A: 5 + k after step k; 12 at step 7, then 8 -> 12 every 4
      {.seq = 1, .query_slot = 1, .length = 11},  // B: 12 at step 1 (reaches the threshold exactly)
      {.seq = 2, .query_slot = 2, .length = 22},  // C: prefill of 6 blocks, last partial: 23 no, 24 at step 2
      {.seq = 3, .query_slot = no_slot, .length = 11},  // D: would be due at step 1, holds no query slot
      {.seq = 5, .query_slot = 3, .length = 2},   // E: 12 at step 10
      // F: compressed before (to 8) and 1 token since: 12 at step 3, history 8.
      {.seq = 4, .query_slot = 4, .length = 9, .generated_since_compression = 1, .history_tokens = 8,
       .compressions = 1, .last_compression_step = 0},
  };
  // Lengths after each step (X: due, compressed to 8):
  //   step  1: A  6  B 12X  C 23  E  3  F 10
  //   step  2: A  7  B  9   C 24X E  4  F 11
  //   step  3: A  8  B 10   C  9  E  5  F 12X
  //   step  4: A  9  B 11   C 10  E  6  F  9
  //   step  5: A 10  B 12X  C 11  E  7  F 10
  //   step  6: A 11  B  9   C 12X E  8  F 11
  //   step  7: A 12X B 10   C  9  E  9  F 12X
  //   step  8: A  9  B 11   C 10  E 10  F  9
  //   step  9: A 10  B 12X  C 11  E 11  F 10
  //   step 10: A 11  B  9   C 12X E 12X F 11
  //   step 11: A 12X B 10   C  9  E  9  F 12X
  //   step 12: A  9  B 11   C 10  E 10  F  9
  // History: 0 for the first compression of A, B, C, E; 8 after (and for F throughout).
  CHECK(run_trace(t, running, 12) ==
        "1: 1/1/8/0\n"
        "2: 2/2/8/0\n"
        "3: 4/4/8/8\n"
        "5: 1/1/8/8\n"
        "6: 2/2/8/8\n"
        "7: 0/0/8/0 4/4/8/8\n"
        "9: 1/1/8/8\n"
        "10: 2/2/8/8 5/3/8/0\n"
        "11: 0/0/8/8 4/4/8/8\n");
  CHECK(running[0].length == 9);  // A: compressed at 7 and 11, one token since
  CHECK(running[0].compressions == 2);
  CHECK(running[0].last_compression_step == 11);
  CHECK(running[0].history_tokens == 8);
  CHECK(running[0].generated_since_compression == 1);
  CHECK(running[3].length == 23);  // D: never compressed
  CHECK(running[3].compressions == 0);
  CHECK(running[5].compressions == 4);  // F: 1 before, then steps 3, 7, 11
}

TEST_CASE("trigger::buffer (R-KV 3.1): every B_buffer generated tokens once over the budget") {
  // B_buffer = 4, B_budget = 10: due when generated_since_compression is 4, 8, 12, ...
  // and length > 10.
  const kvp::trigger::buffer t{.size = 4, .budget = 10};
  std::vector<sequence_state> running{
      // A: gen 4 -> length 9 <= 10 no; over the budget from gen 6 (11), due only at gen 8 (13).
      {.seq = 0, .query_slot = 0, .length = 5},
      // B: gen 4 -> length 10, equal to the budget: no; gen 8 -> 14.
      {.seq = 1, .query_slot = 1, .length = 6},
      // C: a prompt over the budget: due at its first full buffer, gen 4 -> 24.
      {.seq = 2, .query_slot = 2, .length = 20},
      // D: compressed before (to 10), 2 generated since: its buffer fills at step 2.
      {.seq = 3, .query_slot = 3, .length = 12, .generated_since_compression = 2, .history_tokens = 10,
       .compressions = 1, .last_compression_step = 0},
      // E: no query slot.
      {.seq = 4, .query_slot = no_slot, .length = 40},
  };
  // Step (generated since the last compression, length) of each, X: due:
  //   step  2: D (4, 14)X                                          -> 3/3/10/10
  //   step  4: A (4, 9)  B (4, 10)  C (4, 24)X  D (2, 12)          -> 2/2/10/0
  //   step  6: D (4, 14)X                                          -> 3/3/10/10
  //   step  8: A (8, 13)X B (8, 14)X C (4, 14)X D (2, 12)          -> A, B history 0; C 10
  //   step 10: D (4, 14)X
  //   step 12: A (4, 14)X B (4, 14)X C (4, 14)X D (2, 12)           -> history 10 each
  // Odd steps: no buffer is full.
  CHECK(run_trace(t, running, 12) ==
        "2: 3/3/10/10\n"
        "4: 2/2/10/0\n"
        "6: 3/3/10/10\n"
        "8: 0/0/10/0 1/1/10/0 2/2/10/10\n"
        "10: 3/3/10/10\n"
        "12: 0/0/10/10 1/1/10/10 2/2/10/10\n");
  CHECK(running[4].length == 52);  // E grew, never compressed
  CHECK(running[4].compressions == 0);

  // Step 0, before any decode step: nothing generated, nothing due, even over the budget.
  const std::vector<sequence_state> fresh{{.seq = 0, .query_slot = 0, .length = 50}};
  CHECK(kvp::due_items(t, fresh, 0).empty());
}

TEST_CASE("trigger::periodic (Kara C.4): KvLLM's setting, windows before the last block, by hand") {
  // b 256, |W| 768, |U| 32, 257 of each window kept: budget 257 - 32 = 225 (kara_budget).
  const kvp::trigger::periodic t{.block_size = 256};
  CHECK(t.period == 128);
  CHECK(t.window == 768);
  CHECK(t.buffer == 32);
  CHECK(t.window_keep == 257);
  CHECK(t.max_items == 30);
  CHECK(t.budget_of({.length = 5000}) == kvp::presets::kara::kara_budget);
  const kvp::presets::kara kara;
  CHECK(t.window == kara.scorer.window);
  CHECK(t.buffer == kara.scorer.buffer);

  // window_begin = ((T - 1) / 256) * 256 - 768:
  CHECK(t.window_begin_of({.length = 1100}) == 256);   // last block [1024, 1100), window [256, 1024)
  CHECK(t.window_begin_of({.length = 1280}) == 256);   // last block [1024, 1280) full: still excluded
  CHECK(t.window_begin_of({.length = 1281}) == 512);   // last block [1280, 1281)
  CHECK(t.window_begin_of({.length = 1024}) == 0);     // last block [768, 1024), window [0, 768)
  CHECK(t.window_begin_of({.length = 769}) == 0);      // last block [768, 769)
  CHECK(t.window_begin_of({.length = 768}) == -256);   // last block [512, 768): no whole window before it
  CHECK(t.window_begin_of({.length = 0}) < 0);

  // Events: steps past 768 that are multiples of 128, the first at 896 (768 = 6 * 128
  // is not past the window).
  const sequence_state fresh{.seq = 0, .query_slot = 0, .length = 1100};  // never compressed: tail 1100
  CHECK_FALSE(t.due(fresh, 768));
  CHECK_FALSE(t.due(fresh, 800));
  CHECK_FALSE(t.due(fresh, 895));
  CHECK(t.due(fresh, 896));
  CHECK(t.due(fresh, 1024));
  CHECK_FALSE(t.due(fresh, 1025));
  CHECK_FALSE(t.due({.seq = 0, .query_slot = 0, .length = 768}, 896));  // no window before the last block
  CHECK(t.due({.seq = 0, .query_slot = 0, .length = 769}, 896));        // window [0, 768), tail 769

  // Compressed before: due when the tail covers the window and the last block,
  // T - window_begin (1100 - 256 = 844), i.e. the window starts at or after the length
  // the last compression left (1100 - tail). A tail of |W| alone is not enough.
  const auto compressed = [](std::int32_t length, std::int32_t tail) {
    return sequence_state{.seq = 0, .query_slot = 0, .length = length, .generated_since_compression = tail,
                          .history_tokens = length - tail, .compressions = 1, .last_compression_step = 0};
  };
  CHECK(t.due(compressed(1100, 844), 896));
  CHECK_FALSE(t.due(compressed(1100, 843), 896));  // the window would start on a kept token (257)
  CHECK_FALSE(t.due(compressed(1100, 768), 896));
  CHECK(t.due(compressed(1280, 1024), 896));  // full last block: 1280 - 256
  CHECK_FALSE(t.due(compressed(1280, 1023), 896));

  // Two sequences over 1920 steps; Kara leaves T - 768 + 257 = T - 511 of each.
  // A: prompt 204: 1100 at step 896 -> window_begin 256, 589 after.
  //    Step 896 + 128 j: 589 + 128 j tokens, tail 128 j. j = 7 (1792): 1485, last block
  //    1280, window_begin 512, needs 973 > 896. j = 8 (1920): 1613, last block 1536,
  //    window_begin 768 (>= 589), needs 845 <= 1024: due.
  // B: prompt 384: 1280 at step 896 (full last block) -> window_begin 256, 769 after.
  //    j = 7 (1792): 1665, last block 1536, window_begin 768, needs 897, one more than
  //    the tail of 896 (token 768 was kept at step 896). j = 8 (1920): 1793, last block
  //    1792, window_begin 1024, needs 769 <= 1024: due.
  // History within the window: 0 (a due window holds no kept token).
  std::vector<sequence_state> running{{.seq = 0, .query_slot = 0, .length = 204},
                                      {.seq = 1, .query_slot = 1, .length = 384}};
  CHECK(run_trace(t, running, 1920, keep_window{t}) ==
        "896: 0/0/225/0@256 1/1/225/0@256\n"
        "1920: 0/0/225/0@768 1/1/225/0@1024\n");
  CHECK(running[0].length == 1613 - 511);
  CHECK(running[1].length == 1793 - 511);
  CHECK(running[1].history_tokens == 1282);
  CHECK(running[1].uncompressed_tail() == 0);  // reset at the compression, as Kara's counter
  running[1].append(3);
  CHECK(running[1].uncompressed_tail() == 3);  // then counts new tokens
}

TEST_CASE("trigger::periodic (Kara C.4): a scripted decode trace") {
  // b 4, |W| 8, |U| 2, 5 of the window kept (budget 3), delta 2: events at the even
  // steps past 8 (10, 12, ...). window_begin = ((T - 1) / 4) * 4 - 8; due when
  // tail >= T - window_begin (9 to 12: the window and a last block of 1 to 4 tokens).
  // The "executor" leaves T - (8 - 2) + 3 = T - 3.
  const kvp::trigger::periodic t{.period = 2, .block_size = 4, .window = 8, .buffer = 2, .window_keep = 5};
  std::vector<sequence_state> running{
      // A: never compressed, prompt 2: 2 + k after step k. Step 8: 10, window_begin 0,
      // tail 10 would do, but 8 is not past the window. Step 10: 12 (full last block
      // [8, 12)), window_begin 0 -> 9. Then 9 + (k - 10), tail k - 10: step 20: 19,
      // window_begin 8, needs 11 > 10 (a tail of |W| and more, still not enough);
      // step 22: 21, window_begin 12, needs 9 <= 12 -> 18.
      {.seq = 0, .query_slot = 0, .length = 2},
      // B: prompt 4: step 10: 14, last block [12, 14), window_begin 4 -> 11. Step 20:
      // 21, last block [20, 21), window_begin 12, needs 9 <= 10 -> 18.
      {.seq = 1, .query_slot = 1, .length = 4},
      // C: compressed before (to 27), 3 since: step 10: 40, tail 13, window_begin 28,
      // needs 12 -> 37; history 27 - 28 < 0 -> 0 within the window. Step 20: 47,
      // window_begin 36, needs 11 > 10; step 22: 49, window_begin 40, needs 9 <= 12 -> 46.
      {.seq = 2, .query_slot = 2, .length = 30, .generated_since_compression = 3, .history_tokens = 27,
       .compressions = 1, .last_compression_step = 0},
      // D: no query slot.
      {.seq = 3, .query_slot = no_slot, .length = 30},
      // F: just compressed (to 22): step 10: 32, tail 10 >= |W|, but window_begin 20 < 22
      // (needs 12); step 12: 34, window_begin 24, needs 10 <= 12 -> 31. Step 20: 39,
      // tail 8; step 22: 41, window_begin 32, needs 9 <= 10 -> 38.
      {.seq = 5, .query_slot = 3, .length = 22, .history_tokens = 22, .compressions = 1,
       .last_compression_step = 0},
  };
  CHECK(run_trace(t, running, 24, keep_window{t}) ==
        "10: 0/0/3/0@0 1/1/3/0@4 2/2/3/0@28\n"
        "12: 5/3/3/0@24\n"
        "20: 1/1/3/0@12\n"
        "22: 0/0/3/0@12 2/2/3/0@40 5/3/3/0@32\n");
  CHECK(running[0].length == 20);  // A: 18 at step 22, two tokens since
  CHECK(running[0].compressions == 2);
  CHECK(running[0].last_compression_step == 22);
  CHECK(running[0].uncompressed_tail() == 2);
  CHECK(running[3].length == 54);  // D: never compressed
  CHECK(running[3].compressions == 0);
  CHECK(running[4].compressions == 3);  // F: 1 before, then steps 12 and 22

  // Step 0 and the steps up to the window are no events, however long the tails.
  const std::vector<sequence_state> long_tail{{.seq = 0, .query_slot = 0, .length = 100}};
  CHECK(kvp::due_items(t, long_tail, 0).empty());
  CHECK(kvp::due_items(t, long_tail, 8).empty());
  CHECK(kvp::due_items(t, long_tail, 11).empty());
  const std::vector<kvp::batch_item> items = kvp::due_items(t, long_tail, 12);
  REQUIRE(items.size() == 1);
  CHECK(items[0].budget == 3);
  CHECK(items[0].window_begin == 88);  // last block [96, 100)
  CHECK(items[0].history_tokens == 0);
}

TEST_CASE("trigger::periodic: max_items keeps the first due items in running order") {
  // As above (b 4, |W| 8, |U| 2, budget 3, delta 2), at most 2 items per event.
  // Step 10: S0..S3 hold 10..13 tokens, all due (window_begin 0, 0, 0, 4); the cap
  // keeps S0 and S1 (E, first and due by its tail, holds no slot and takes no place).
  // Step 12: S0 9, S1 10, tails 2; S2 14 and S3 15, window_begin 4, still due -> 11, 12.
  // Step 20: S0 17 and S1 18, window_begin 8, need 9 and 10 <= tail 10. S2 19 and S3 20
  // have tails of 8. Step 22: S2 21, S3 22, window_begin 12, need 9 and 10 <= 10.
  const kvp::trigger::periodic t{
      .period = 2, .block_size = 4, .window = 8, .buffer = 2, .window_keep = 5, .max_items = 2};
  std::vector<sequence_state> running{
      {.seq = 9, .query_slot = no_slot, .length = 40},  // E
      {.seq = 0, .query_slot = 0, .length = 0},         // S0
      {.seq = 1, .query_slot = 1, .length = 1},         // S1
      {.seq = 2, .query_slot = 2, .length = 2},         // S2
      {.seq = 3, .query_slot = 3, .length = 3},         // S3
  };
  std::vector<sequence_state> at_10 = running;
  for (sequence_state& s : at_10) s.append(10);
  kvp::trigger::periodic uncapped = t;
  uncapped.max_items = 0;
  const std::vector<kvp::batch_item> all = kvp::due_items(uncapped, at_10, 10);
  REQUIRE(all.size() == 4);
  CHECK(all[3].seq == 3);
  CHECK(all[3].window_begin == 4);
  CHECK(kvp::due_items(t, at_10, 10).size() == 2);

  CHECK(run_trace(t, running, 22, keep_window{t}) ==
        "10: 0/0/3/0@0 1/1/3/0@0\n"
        "12: 2/2/3/0@4 3/3/3/0@4\n"
        "20: 0/0/3/0@8 1/1/3/0@8\n"
        "22: 2/2/3/0@12 3/3/3/0@12\n");
}

TEST_CASE("trigger::interval (Hard-KV): every 128 steps, every sequence over L_lower, to at most L_upper") {
  // period 4, budget (L_upper) 10, min_length (L_lower) 6: at steps 4, 8, 12 every
  // sequence longer than 6, to min(10, length).
  const kvp::trigger::interval t{.period = 4, .budget = 10, .min_length = 6};
  std::vector<sequence_state> running{
      // A: step 4: 5, no; step 8: 9 -> budget 9, its length; step 12: 13 -> 10, history 9.
      {.seq = 0, .query_slot = 0, .length = 1},
      // B: step 4: 24 -> 10; step 8: 14 -> 10, history 10; step 12: the same.
      {.seq = 1, .query_slot = 1, .length = 20},
      // C: step 4: 7 -> 7; step 8: 11 -> 10, history 7; step 12: 14 -> 10, history 10.
      {.seq = 2, .query_slot = 2, .length = 3},
      // D: step 4: 6, equal to min_length, no; step 8: 10 -> 10 (budget equal to the
      // length); step 12: 14 -> 10, history 10.
      {.seq = 3, .query_slot = 3, .length = 2},
      // E: no query slot.
      {.seq = 4, .query_slot = no_slot, .length = 50},
  };
  CHECK(run_trace(t, running, 12) ==
        "4: 1/1/10/0 2/2/7/0\n"
        "8: 0/0/9/0 1/1/10/10 2/2/10/7 3/3/10/0\n"
        "12: 0/0/10/9 1/1/10/10 2/2/10/10 3/3/10/10\n");

  // Step 0 (before any decode step) is not an event; min_length 0 takes every sequence.
  const std::vector<sequence_state> one{{.seq = 0, .query_slot = 0, .length = 3}};
  CHECK(kvp::due_items(t, running, 0).empty());
  const kvp::trigger::interval all{.period = 4, .budget = 10};
  CHECK(kvp::due_items(all, one, 3).empty());
  const std::vector<kvp::batch_item> items = kvp::due_items(all, one, 128);
  REQUIRE(items.size() == 1);
  CHECK(items[0].budget == 3);
}

TEST_CASE("due_items: a trigger written outside the library; the output vector is reused") {
  const over_budget t{.budget = 5};
  const std::vector<sequence_state> running{{.seq = 0, .query_slot = 0, .length = 6},
                                            {.seq = 1, .query_slot = 1, .length = 5},
                                            {.seq = 2, .query_slot = 2, .length = 9, .history_tokens = 5,
                                             .compressions = 1}};
  std::vector<kvp::batch_item> items{{.seq = 99}};  // stale: cleared
  kvp::due_items(t, running, 1, items);
  REQUIRE(items.size() == 2);
  CHECK(items[0].seq == 0);
  CHECK(items[0].budget == 5);
  CHECK(items[0].history_tokens == 0);
  CHECK(items[1].seq == 2);
  CHECK(items[1].query_slot == 2);
  CHECK(items[1].history_tokens == 5);
}

TEST_CASE("due_items: window_begin from the trigger; history counts within the window") {
  const std::vector<sequence_state> running{
      {.seq = 0, .query_slot = 0, .length = 40},                        // never compressed
      {.seq = 1, .query_slot = 1, .length = 40, .history_tokens = 20},  // 20 - 16 = 4 in the window
      {.seq = 2, .query_slot = 2, .length = 40, .history_tokens = 16},  // the window starts at it: 0
  };
  const std::vector<kvp::batch_item> items = kvp::due_items(fixed_window{.begin = 16, .budget = 24}, running, 1);
  REQUIRE(items.size() == 3);
  for (const kvp::batch_item& it : items) {
    CHECK(it.window_begin == 16);
    CHECK(it.budget == 24);  // all of [16, 40): allowed
  }
  CHECK(items[0].history_tokens == 0);
  CHECK(items[1].history_tokens == 4);
  CHECK(items[2].history_tokens == 0);
  // The other triggers leave the window at 0.
  CHECK(kvp::due_items(over_budget{.budget = 5}, running, 1)[0].window_begin == 0);
}

TEST_CASE("triggers: errors name the field and the value") {
  const std::vector<sequence_state> ok{{.seq = 0, .query_slot = 0, .length = 16}};
  using namespace kvp::trigger;
  expect_error([&] { (void)kvp::due_items(threshold{.block_size = 0, .max_blocks = 3}, ok, 1); },
               "threshold.block_size", "is 0");
  expect_error([&] { (void)kvp::due_items(threshold{.block_size = 4, .max_blocks = 1}, ok, 1); },
               "threshold.max_blocks", "is 1");
  expect_error([&] { (void)kvp::due_items(threshold{.block_size = 1 << 16, .max_blocks = 1 << 16}, ok, 1); },
               "threshold.max_blocks", "overflows int32");
  expect_error([&] { (void)kvp::due_items(buffer{.size = 0, .budget = 8}, ok, 1); }, "buffer.size", "is 0");
  expect_error([&] { (void)kvp::due_items(buffer{.size = 4, .budget = -1}, ok, 1); }, "buffer.budget", "is -1");
  const periodic kvllm{.block_size = 256};
  const auto with = [&](auto change) {
    periodic p = kvllm;
    change(p);
    return p;
  };
  CHECK_NOTHROW((void)kvp::due_items(kvllm, ok, 1));
  expect_error([&] { (void)kvp::due_items(periodic{}, ok, 1); }, "periodic.block_size", "is 0");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.period = 0; }), ok, 1); }, "periodic.period",
               "is 0");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.window = 700; }), ok, 1); }, "periodic.window",
               "is 700; must be a positive multiple of block_size 256");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.window = 0; }), ok, 1); }, "periodic.window",
               "is 0");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.buffer = -1; }), ok, 1); }, "periodic.buffer",
               "is -1");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.buffer = 768; }), ok, 1); }, "periodic.buffer",
               "is 768; must lie in [0, window 768)");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.window_keep = 32; }), ok, 1); },
               "periodic.window_keep", "is 32; must lie in [buffer + 1 = 33, window 768]");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.window_keep = 769; }), ok, 1); },
               "periodic.window_keep", "is 769");
  expect_error([&] { (void)kvp::due_items(with([](periodic& p) { p.max_items = -1; }), ok, 1); },
               "periodic.max_items", "is -1");
  expect_error([&] { (void)kvp::due_items(interval{.period = 0, .budget = 8}, ok, 1); }, "interval.period", "is 0");
  expect_error([&] { (void)kvp::due_items(interval{.period = 4, .budget = 8, .min_length = -2}, ok, 1); },
               "interval.min_length", "is -2");

  const threshold t{.block_size = 4, .max_blocks = 3};
  expect_error([&] { (void)kvp::due_items(t, ok, -1); }, "step", "is -1");
  const std::vector<sequence_state> bad_history{{.seq = 0, .query_slot = 0, .length = 16},
                                                {.seq = 1, .query_slot = 1, .length = 8, .history_tokens = 9}};
  expect_error([&] { (void)kvp::due_items(t, bad_history, 1); }, "running[1].history_tokens", "is 9");
  const std::vector<sequence_state> bad_length{{.seq = 0, .query_slot = 0, .length = -3}};
  expect_error([&] { (void)kvp::due_items(t, bad_length, 1); }, "running[0].length", "is -3");
  const std::vector<sequence_state> bad_generated{
      {.seq = 0, .query_slot = 0, .length = 4, .generated_since_compression = 5}};
  expect_error([&] { (void)kvp::due_items(t, bad_generated, 1); }, "running[0].generated_since_compression", "is 5");
  // A user trigger whose budget exceeds the length: the item would be refused by the
  // executor; due_items says so first.
  const std::vector<sequence_state> short_one{{.seq = 0, .query_slot = 0, .length = 3}};
  expect_error([&] { (void)kvp::due_items(over_budget{.budget = -1}, short_one, 1); }, "running[0]",
               "gets budget -1");
  // A window trigger: window_begin inside the sequence, the budget inside the window.
  const std::vector<sequence_state> forty{{.seq = 0, .query_slot = 0, .length = 40}};
  expect_error([&] { (void)kvp::due_items(fixed_window{.begin = 40, .budget = 1}, forty, 1); }, "running[0]",
               "gets window_begin 40");
  expect_error([&] { (void)kvp::due_items(fixed_window{.begin = -4, .budget = 1}, forty, 1); }, "running[0]",
               "gets window_begin -4");
  expect_error([&] { (void)kvp::due_items(fixed_window{.begin = 16, .budget = 25}, forty, 1); }, "running[0]",
               "gets budget 25 from the trigger; must lie in [1, 24] (length 40 - window_begin 16)");

  sequence_state s{.seq = 0, .length = 4};
  expect_error([&] { s.append(-1); }, "tokens", "is -1");
  CHECK(s.length == 4);
  sequence_state full{.seq = 0, .length = std::numeric_limits<std::int32_t>::max() - 1};
  full.append();
  expect_error([&] { full.append(); }, "tokens", "would overflow int32");
  CHECK(full.length == std::numeric_limits<std::int32_t>::max());
}

TEST_CASE("record_compression: errors name the field, and leave every state as it was") {
  std::vector<sequence_state> running{{.seq = 0, .query_slot = 0, .length = 12},
                                      {.seq = 1, .query_slot = 1, .length = 16}};
  const std::vector<sequence_state> before = running;
  const auto unchanged = [&] {
    for (std::size_t i = 0; i < running.size(); ++i) {
      CHECK(running[i].length == before[i].length);
      CHECK(running[i].history_tokens == before[i].history_tokens);
      CHECK(running[i].compressions == before[i].compressions);
    }
  };
  const std::vector<kvp::batch_item> two{{.seq = 0, .query_slot = 0, .budget = 8},
                                         {.seq = 1, .query_slot = 1, .budget = 8}};

  expect_error([&] { kvp::record_compression(running, two, std::vector<std::int32_t>{8}, 1); }, "new_lengths",
               "holds 1 lengths");
  // Item 0 is valid, item 1 is not: nothing is written, item 0 included.
  expect_error([&] { kvp::record_compression(running, two, std::vector<std::int32_t>{8, 17}, 1); }, "new_lengths[1]",
               "is 17");
  expect_error([&] { kvp::record_compression(running, two, std::vector<std::int32_t>{8, 0}, 1); }, "new_lengths[1]",
               "is 0");
  const std::vector<kvp::batch_item> unknown{{.seq = 0, .budget = 8}, {.seq = 5, .budget = 8}};
  expect_error([&] { kvp::record_compression(running, unknown, std::vector<std::int32_t>{8, 8}, 1); },
               "items[1].seq", "is 5");
  const std::vector<kvp::batch_item> twice{{.seq = 1, .budget = 8}, {.seq = 1, .budget = 8}};
  expect_error([&] { kvp::record_compression(running, twice, std::vector<std::int32_t>{8, 8}, 1); }, "items[1].seq",
               "as is items[0].seq");
  expect_error([&] { kvp::record_compression(running, two, std::vector<std::int32_t>{8, 8}, -5); }, "step", "is -5");
  unchanged();

  std::vector<sequence_state> duplicated{{.seq = 2, .length = 8}, {.seq = 2, .length = 8}};
  const std::vector<kvp::batch_item> one{{.seq = 2, .budget = 4}};
  expect_error([&] { kvp::record_compression(duplicated, one, std::vector<std::int32_t>{4}, 1); }, "running[1].seq",
               "as is running[0].seq");
  CHECK(duplicated[0].length == 8);
}
