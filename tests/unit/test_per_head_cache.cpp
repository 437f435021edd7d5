// Per-head block caches (SPEC.md "Layouts", Per-head blocks; KV-Compress 4.2 and alg. 1):
// the view, its validation, and the host MoveCache. Host only: no executor runs here.
// The fixture below owns a per-head cache and computes every address with its own
// index math; the expected cache after a MoveCache is built from a snapshot by an
// independent reference (evicted slots below the kept count, ascending, take the kept
// tokens at or past it, descending) and compared byte for byte with the real one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;
using kvp::host::cache_move;

struct ph_config {
  i32 layers = 2, seqs = 2, heads = 2, block_size = 4, head_dim = 4;
  kvp::dtype type = kvp::dtype::f32;
  bool shared_pool = true;        // one pool for every layer (KV-Compress); else one per layer
  bool per_layer_tables = false;  // table and lengths as lists of per-layer tensors
  bool interleaved = false;       // K and V in one [N, 2, b, d] tensor; else separate, V rows padded
  std::vector<i32> lengths{};     // [L, S, H]; empty: random in [0, max_len]
  i32 max_len = 20;
  i32 spare_blocks = 3;
  std::uint32_t seed = 1;
};

class ph_cache {
 public:
  struct snapshot {
    std::vector<std::byte> k, v;
    std::vector<i32> positions, table, lengths;
    std::vector<float> metric;
    bool operator==(const snapshot&) const = default;
  };

  explicit ph_cache(ph_config cfg) : cfg_(std::move(cfg)), rng_(cfg_.seed) {
    const i32 L = cfg_.layers, S = cfg_.seqs, H = cfg_.heads, b = cfg_.block_size, d = cfg_.head_dim;
    rows_ = L * S * H;
    if (cfg_.lengths.empty()) {
      std::uniform_int_distribution<i32> len(0, cfg_.max_len);
      for (i32 i = 0; i < rows_; ++i) cfg_.lengths.push_back(len(rng_));
    }
    REQUIRE(static_cast<i32>(cfg_.lengths.size()) == rows_);
    lens_ = cfg_.lengths;
    i32 longest = 1;
    for (i32 T : lens_) longest = std::max(longest, (T + b - 1) / b);
    max_blocks_ = longest + 1;  // one entry of room past the longest head
    // Blocks: shared pool, every head of every layer draws from one pool; else each
    // layer's heads from their layer's pool. Shuffled ids.
    pools_ = cfg_.shared_pool ? 1 : L;
    i32 need = 0;
    for (i32 p = 0; p < pools_; ++p) {
      i32 n = 0;
      for (i32 l = 0; l < L; ++l)
        if (cfg_.shared_pool || l == p)
          for (i32 r = 0; r < S * H; ++r) n += (lens_[l * S * H + r] + b - 1) / b;
      need = std::max(need, n);
    }
    nb_ = need + cfg_.spare_blocks;
    table_.assign(static_cast<std::size_t>(rows_) * max_blocks_, -1);
    std::vector<i32> ids(static_cast<std::size_t>(nb_));
    for (i32 p = 0; p < pools_; ++p) {
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng_);
      std::size_t next = 0;
      for (i32 l = 0; l < L; ++l) {
        if (!cfg_.shared_pool && l != p) continue;
        for (i32 r = 0; r < S * H; ++r) {
          const i32 row = l * S * H + r;
          for (i32 i = 0; i < (lens_[row] + b - 1) / b; ++i) table_[static_cast<std::size_t>(row) * max_blocks_ + i] = ids[next++];
        }
      }
    }
    // K and V element strides (independent of the library's).
    es_ = kvp::size_of(cfg_.type);
    if (cfg_.interleaved) {
      k_token_ = v_token_ = d;
      k_block_ = v_block_ = 2 * i64{b} * d;
      v_offset_ = i64{b} * d;
    } else {
      k_token_ = d;
      k_block_ = i64{b} * d;
      v_token_ = d + 3;
      v_block_ = i64{b} * (d + 3) + 1;
      v_offset_ = 0;
    }
    pool_k_ = nb_ * k_block_;
    pool_v_ = nb_ * v_block_ + (cfg_.interleaved ? 0 : 5);
    k_.resize(static_cast<std::size_t>(pools_ * pool_k_ * es_));
    if (!cfg_.interleaved) v_.resize(static_cast<std::size_t>(pools_ * pool_v_ * es_));
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& x : k_) x = static_cast<std::byte>(byte(rng_));
    for (auto& x : v_) x = static_cast<std::byte>(byte(rng_));
    // Positions: free slots hold -1, each head's tokens their logical index; metric random.
    positions_.assign(static_cast<std::size_t>(pools_) * nb_ * b, -1);
    metric_.resize(positions_.size());
    std::uniform_real_distribution<float> m(0.0f, 1.0f);
    for (auto& x : metric_) x = m(rng_);
    for (i32 l = 0; l < L; ++l)
      for (i32 s = 0; s < S; ++s)
        for (i32 h = 0; h < H; ++h)
          for (i32 t = 0; t < length(l, s, h); ++t) positions_[slot_index(l, block(l, s, h, t / b), t % b)] = t;
    for (i32 l = 0; l < L; ++l) {
      table_layers_.push_back(table_.data() + static_cast<std::size_t>(l) * S * H * max_blocks_);
      length_layers_.push_back(lens_.data() + static_cast<std::size_t>(l) * S * H);
      k_layers_.push_back(k_.data() + (cfg_.shared_pool ? 0 : l * pool_k_ * es_));
    }
  }

  kvp::per_head_kv_view view() {
    kvp::per_head_kv_view c;
    c.num_layers = cfg_.layers;
    c.num_blocks = nb_;
    c.block_size = cfg_.block_size;
    c.num_kv_heads = cfg_.heads;
    c.head_dim = cfg_.head_dim;
    c.num_seqs = cfg_.seqs;
    c.max_blocks = max_blocks_;
    c.type = cfg_.type;
    c.shared_pool = cfg_.shared_pool;
    // K: shared pool by base; per-layer pools by a list of layer pointers (vLLM's tensor list).
    if (cfg_.shared_pool) c.k = {k_.data(), 0, nullptr, 0};
    else c.k = {nullptr, 0, k_layers_.data(), 0};
    std::byte* vbase = cfg_.interleaved ? k_.data() : v_.data();
    const i64 v_layer = cfg_.shared_pool ? 0 : (cfg_.interleaved ? pool_k_ : pool_v_);
    c.v = {vbase, v_layer, nullptr, v_offset_};
    c.k_stride = {k_block_, k_token_, 1};
    c.v_stride = {v_block_, v_token_, 1};
    if (cfg_.per_layer_tables) {
      c.table = kvp::per_head_array::per_layer(table_layers_.data(), cfg_.heads, max_blocks_);
      c.lengths = kvp::per_head_array::per_layer(length_layers_.data(), cfg_.heads);
    } else {
      c.table = kvp::per_head_array::dense(table_.data(), cfg_.seqs, cfg_.heads, max_blocks_);
      c.lengths = kvp::per_head_array::dense(lens_.data(), cfg_.seqs, cfg_.heads);
    }
    if (cfg_.shared_pool) {
      c.positions = kvp::per_slot_positions::shared(positions_.data(), cfg_.block_size);
      c.metric = kvp::per_slot_metric::shared(metric_.data(), cfg_.block_size);
    } else {
      c.positions = kvp::per_slot_positions::per_layer(positions_.data(), nb_, cfg_.block_size);
      c.metric = kvp::per_slot_metric::per_layer(metric_.data(), nb_, cfg_.block_size);
    }
    return c;
  }

  snapshot take() const { return {k_, v_, positions_, table_, lens_, metric_}; }

  const ph_config& cfg() const { return cfg_; }
  i32 num_blocks() const { return nb_; }
  i32 max_blocks() const { return max_blocks_; }
  i32 row(i32 l, i32 s, i32 h) const { return (l * cfg_.seqs + s) * cfg_.heads + h; }
  i32 length(i32 l, i32 s, i32 h) const { return lens_[row(l, s, h)]; }
  i32& length_ref(i32 l, i32 s, i32 h) { return lens_[row(l, s, h)]; }
  i32& table_ref(i32 l, i32 s, i32 h, i32 i) { return table_[static_cast<std::size_t>(row(l, s, h)) * max_blocks_ + i]; }
  i32 block(i32 l, i32 s, i32 h, i32 i) const { return table_[static_cast<std::size_t>(row(l, s, h)) * max_blocks_ + i]; }
  i32 blocks(i32 l, i32 s, i32 h) const { return (length(l, s, h) + cfg_.block_size - 1) / cfg_.block_size; }
  i32 pool(i32 l) const { return cfg_.shared_pool ? 0 : l; }

  // Indices into the owned arrays, from the fixture's own layout.
  std::size_t slot_index(i32 l, i32 blk, i32 slot) const {
    return (static_cast<std::size_t>(pool(l)) * nb_ + blk) * cfg_.block_size + slot;
  }
  std::size_t k_byte(i32 l, i32 blk, i32 slot) const {
    return static_cast<std::size_t>((pool(l) * pool_k_ + blk * k_block_ + slot * k_token_) * es_);
  }
  std::size_t v_byte(i32 l, i32 blk, i32 slot) const {
    const i64 pool_elems = cfg_.interleaved ? pool_k_ : pool_v_;
    return static_cast<std::size_t>((pool(l) * pool_elems + v_offset_ + blk * v_block_ + slot * v_token_) * es_);
  }
  std::vector<std::byte>& v_buffer(snapshot& s) const { return cfg_.interleaved ? s.k : s.v; }
  std::size_t row_bytes() const { return static_cast<std::size_t>(cfg_.head_dim * es_); }

  // Bytes of K (or V) of token t of a head, as a snapshot holds them.
  std::vector<std::byte> k_bytes(const snapshot& s, i32 l, i32 seq, i32 h, i32 t) const {
    const std::size_t at = k_byte(l, block(l, seq, h, t / cfg_.block_size), t % cfg_.block_size);
    return {s.k.begin() + static_cast<std::ptrdiff_t>(at), s.k.begin() + static_cast<std::ptrdiff_t>(at + row_bytes())};
  }
  std::vector<std::byte> v_bytes(const snapshot& s, i32 l, i32 seq, i32 h, i32 t) const {
    const auto& buf = cfg_.interleaved ? s.k : s.v;
    const std::size_t at = v_byte(l, block(l, seq, h, t / cfg_.block_size), t % cfg_.block_size);
    return {buf.begin() + static_cast<std::ptrdiff_t>(at), buf.begin() + static_cast<std::ptrdiff_t>(at + row_bytes())};
  }
  i32 position(const snapshot& s, i32 l, i32 seq, i32 h, i32 t) const {
    return s.positions[slot_index(l, block(l, seq, h, t / cfg_.block_size), t % cfg_.block_size)];
  }
  float metric(const snapshot& s, i32 l, i32 seq, i32 h, i32 t) const {
    return s.metric[slot_index(l, block(l, seq, h, t / cfg_.block_size), t % cfg_.block_size)];
  }
  void set_metric(i32 l, i32 seq, i32 h, i32 t, float m) {
    metric_[slot_index(l, block(l, seq, h, t / cfg_.block_size), t % cfg_.block_size)] = m;
  }

  // The reference: `before` with token src's K, V, metric and position copied over
  // token dst's, for every (src, dst).
  snapshot expected_after(const snapshot& before, i32 l, i32 seq, i32 h, const std::vector<cache_move>& moves) const {
    snapshot e = before;
    const i32 b = cfg_.block_size;
    for (const cache_move& m : moves) {
      const i32 fb = block(l, seq, h, m.src / b), fs = m.src % b, tb = block(l, seq, h, m.dst / b), ts = m.dst % b;
      std::memcpy(e.k.data() + k_byte(l, tb, ts), before.k.data() + k_byte(l, fb, fs), row_bytes());
      auto& ev = v_buffer(e);
      const auto& bv = cfg_.interleaved ? before.k : before.v;
      std::memcpy(ev.data() + v_byte(l, tb, ts), bv.data() + v_byte(l, fb, fs), row_bytes());
      e.metric[slot_index(l, tb, ts)] = before.metric[slot_index(l, fb, fs)];
      e.positions[slot_index(l, tb, ts)] = before.positions[slot_index(l, fb, fs)];
    }
    return e;
  }

 private:
  ph_config cfg_;
  std::mt19937 rng_;
  i32 rows_ = 0, pools_ = 1, nb_ = 0, max_blocks_ = 0;
  i64 es_ = 4, k_token_ = 0, k_block_ = 0, v_token_ = 0, v_block_ = 0, v_offset_ = 0, pool_k_ = 0, pool_v_ = 0;
  std::vector<std::byte> k_, v_;
  std::vector<i32> table_, lens_, positions_;
  std::vector<float> metric_;
  std::vector<const i32*> table_layers_, length_layers_;
  std::vector<void*> k_layers_;
};

std::vector<std::uint8_t> mask(std::initializer_list<int> bits) {
  std::vector<std::uint8_t> m;
  for (int x : bits) m.push_back(static_cast<std::uint8_t>(x));
  return m;
}

// The independent reference of the moves: the i-th evicted slot below the kept count
// (ascending) takes the i-th kept token at or past it (descending).
std::vector<cache_move> reference_moves(const std::vector<std::uint8_t>& keep) {
  const auto T = static_cast<i32>(keep.size());
  const i32 k = static_cast<i32>(std::count(keep.begin(), keep.end(), std::uint8_t{1}));
  std::vector<i32> holes, movers;
  for (i32 t = 0; t < k; ++t)
    if (!keep[t]) holes.push_back(t);
  for (i32 t = T - 1; t >= k; --t)
    if (keep[t]) movers.push_back(t);
  REQUIRE(holes.size() == movers.size());
  std::vector<cache_move> out;
  for (std::size_t i = 0; i < holes.size(); ++i) out.push_back({movers[i], holes[i]});
  return out;
}

// Runs MoveCache on one head and checks everything a call promises: the plan is the
// reference's, every byte of the cache after it is the reference's (so nothing outside
// the head's destination slots is written, tables and lengths included), the kept
// tokens fill [0, new_length) once each with their own bytes, and the freed blocks are
// the head's table entries past ceil(new_length / b).
void check_move_cache(ph_cache& pc, i32 l, i32 seq, i32 h, const std::vector<std::uint8_t>& keep) {
  CAPTURE(l);
  CAPTURE(seq);
  CAPTURE(h);
  const i32 b = pc.cfg().block_size, T = pc.length(l, seq, h);
  const auto before = pc.take();
  const auto plan = kvp::host::plan_move_cache(keep, b);
  const auto want = reference_moves(keep);
  CHECK(plan.moves == want);
  const i32 k = static_cast<i32>(std::count(keep.begin(), keep.end(), std::uint8_t{1}));
  CHECK(plan.length == T);
  CHECK(plan.new_length == k);
  CHECK(plan.evicted_count() == T - k);
  CHECK(plan.move_count() == static_cast<i32>(want.size()));
  for (i32 i = 0; i < plan.evicted_count(); ++i) {
    CHECK(!keep[plan.evicted[i]]);
    if (i > 0) CHECK(plan.evicted[i - 1] < plan.evicted[i]);
  }
  CHECK(plan.freed_blocks == (T + b - 1) / b - (k + b - 1) / b);
  const auto view = pc.view();
  const auto phys = kvp::host::physical_moves(view, l, seq, h, plan);
  for (std::size_t i = 0; i < phys.size(); ++i) {
    CHECK(phys[i].src == i64{pc.block(l, seq, h, want[i].src / b)} * b + want[i].src % b);
    CHECK(phys[i].dst == i64{pc.block(l, seq, h, want[i].dst / b)} * b + want[i].dst % b);
  }

  const auto res = kvp::host::move_cache(view, l, seq, h, keep);
  CHECK(res.new_length == k);
  CHECK(res.moved == static_cast<i32>(want.size()));
  std::vector<i32> freed;
  for (i32 i = (k + b - 1) / b; i < (T + b - 1) / b; ++i) freed.push_back(pc.block(l, seq, h, i));
  CHECK(res.freed_blocks == freed);

  const auto after = pc.take();
  CHECK(after == pc.expected_after(before, l, seq, h, want));
  // Dense: [0, k) holds every kept token once, with its own bytes; a kept token below k never moved.
  std::vector<i32> got;
  for (i32 t = 0; t < k; ++t) {
    const i32 from = pc.position(after, l, seq, h, t);
    got.push_back(from);
    REQUIRE(from >= 0);
    REQUIRE(from < T);
    CHECK(keep[from]);
    if (keep[t]) CHECK(from == t);
    CHECK(pc.k_bytes(after, l, seq, h, t) == pc.k_bytes(before, l, seq, h, from));
    CHECK(pc.v_bytes(after, l, seq, h, t) == pc.v_bytes(before, l, seq, h, from));
    CHECK(pc.metric(after, l, seq, h, t) == pc.metric(before, l, seq, h, from));
  }
  std::sort(got.begin(), got.end());
  std::vector<i32> kept;
  for (i32 t = 0; t < T; ++t)
    if (keep[t]) kept.push_back(t);
  CHECK(got == kept);
}

// The field of the kvp::error f throws, or "<accepted>".
std::string field_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvp::error& e) {
    return e.field();
  }
  return "<accepted>";
}

}  // namespace

TEST_CASE("per-head view: addresses, lengths and blocks read the engine's tensors in place") {
  for (bool shared : {true, false})
    for (bool per_layer : {false, true})
      for (bool inter : {false, true}) {
        CAPTURE(shared);
        CAPTURE(per_layer);
        CAPTURE(inter);
        ph_cache pc({.layers = 3, .seqs = 2, .heads = 3, .block_size = 3, .head_dim = 5, .type = kvp::dtype::bf16,
                     .shared_pool = shared, .per_layer_tables = per_layer, .interleaved = inter, .seed = 3});
        const auto c = pc.view();
        static_assert(std::is_trivially_copyable_v<kvp::per_head_kv_view>);
        CHECK_NOTHROW(kvp::validate_per_head(c));
        const auto s = pc.take();
        CHECK(c.row_bytes() == 10);
        for (i32 l = 0; l < 3; ++l)
          for (i32 seq = 0; seq < 2; ++seq)
            for (i32 h = 0; h < 3; ++h) {
              CHECK(c.length(l, seq, h) == pc.length(l, seq, h));
              for (i32 t = 0; t < pc.length(l, seq, h); ++t) {
                CHECK(c.physical_block(l, seq, h, t) == pc.block(l, seq, h, t / 3));
                CHECK(c.physical_slot(l, seq, h, t) == i64{pc.block(l, seq, h, t / 3)} * 3 + t % 3);
                CHECK(std::memcmp(c.k_row(l, seq, h, t), pc.k_bytes(s, l, seq, h, t).data(), 10) == 0);
                CHECK(std::memcmp(c.v_row(l, seq, h, t), pc.v_bytes(s, l, seq, h, t).data(), 10) == 0);
                CHECK(c.positions.at(l, c.physical_block(l, seq, h, t), t % 3) == t);
                CHECK(c.metric.at(l, c.physical_block(l, seq, h, t), t % 3) == pc.metric(s, l, seq, h, t));
              }
            }
      }
}

TEST_CASE("move_cache plan by hand: lowest evicted slot first, newest survivor first, partial last block") {
  // T 10, b 4 (last block holds 2). Evicted 1 4 6 -> new length 7: 9 -> 1, 8 -> 4, 7 -> 6.
  auto p = kvp::host::plan_move_cache(mask({1, 0, 1, 1, 0, 1, 0, 1, 1, 1}), 4);
  CHECK(p.evicted == std::vector<i32>{1, 4, 6});
  CHECK(p.moves == std::vector<cache_move>{{9, 1}, {8, 4}, {7, 6}});
  CHECK(p.new_length == 7);
  CHECK(p.freed_blocks == 1);  // 3 blocks -> 2
  // Evicted 1 6 8: 8 is in the tail and is dropped, not moved: 9 -> 1, 7 -> 6.
  p = kvp::host::plan_move_cache(mask({1, 0, 1, 1, 1, 1, 0, 1, 0, 1}), 4);
  CHECK(p.evicted == std::vector<i32>{1, 6, 8});
  CHECK(p.moves == std::vector<cache_move>{{9, 1}, {7, 6}});
  CHECK(p.new_length == 7);
  // KV-Compress's block-granular count: hanging 2 + one whole block = 6 evicted of 10 -> 4, 2 blocks freed.
  p = kvp::host::plan_move_cache(mask({0, 1, 0, 0, 1, 0, 1, 0, 1, 0}), 4);
  CHECK(p.new_length == 4);
  CHECK(p.moves == std::vector<cache_move>{{8, 0}, {6, 2}, {4, 3}});  // 4 is kept but past the new length
  CHECK(p.freed_blocks == 2);
  // Nothing to move: all kept, or the evicted tokens all in the tail.
  p = kvp::host::plan_move_cache(mask({1, 1, 1, 1, 1}), 2);
  CHECK(p.moves.empty());
  CHECK(p.evicted.empty());
  CHECK(p.freed_blocks == 0);
  p = kvp::host::plan_move_cache(mask({1, 1, 1, 0, 0}), 2);
  CHECK(p.moves.empty());
  CHECK(p.new_length == 3);
  CHECK(p.freed_blocks == 1);
  // Everything evicted; and an empty head.
  p = kvp::host::plan_move_cache(mask({0, 0, 0, 0, 0}), 2);
  CHECK(p.moves.empty());
  CHECK(p.new_length == 0);
  CHECK(p.freed_blocks == 3);
  p = kvp::host::plan_move_cache({}, 2);
  CHECK(p.new_length == 0);
  CHECK(p.freed_blocks == 0);
}

TEST_CASE("move_cache by hand: K, V, metric and position move together; the head is dense after") {
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    // Layer 1, seq 0, head 1 (row 5) holds 10 tokens in blocks of 4.
    ph_cache pc({.layers = 2, .seqs = 2, .heads = 2, .block_size = 4, .head_dim = 3, .shared_pool = shared,
                 .lengths = {6, 6, 6, 6, 6, 10, 6, 6}});
    REQUIRE(pc.length(1, 0, 1) == 10);
    for (i32 t = 0; t < 10; ++t) pc.set_metric(1, 0, 1, t, 100.0f + t);
    const auto before = pc.take();
    const auto r = kvp::host::move_cache(pc.view(), 1, 0, 1, mask({1, 0, 1, 1, 0, 1, 0, 1, 1, 1}));
    CHECK(r.new_length == 7);
    CHECK(r.moved == 3);
    CHECK(r.freed_blocks == std::vector<i32>{pc.block(1, 0, 1, 2)});
    const auto after = pc.take();
    const std::vector<i32> from{0, 9, 2, 3, 8, 5, 7};  // what each slot holds after
    for (i32 t = 0; t < 7; ++t) {
      CAPTURE(t);
      CHECK(pc.position(after, 1, 0, 1, t) == from[t]);
      CHECK(pc.metric(after, 1, 0, 1, t) == 100.0f + from[t]);
      CHECK(pc.k_bytes(after, 1, 0, 1, t) == pc.k_bytes(before, 1, 0, 1, from[t]));
      CHECK(pc.v_bytes(after, 1, 0, 1, t) == pc.v_bytes(before, 1, 0, 1, from[t]));
    }
    // The tail past the new length and every other head: untouched.
    CHECK(after == pc.expected_after(before, 1, 0, 1, {{9, 1}, {8, 4}, {7, 6}}));
  }
}

TEST_CASE("move_cache by hand: nothing to move writes nothing; everything evicted but the protected tokens") {
  ph_cache pc({.layers = 1, .seqs = 1, .heads = 2, .block_size = 4, .head_dim = 2, .lengths = {13, 9}});
  auto before = pc.take();
  auto r = kvp::host::move_cache(pc.view(), 0, 0, 0, std::vector<std::uint8_t>(13, 1));
  CHECK(r.new_length == 13);
  CHECK(r.moved == 0);
  CHECK(r.freed_blocks.empty());
  CHECK(pc.take() == before);
  // Evicted only in the tail: no move, the tail's blocks freed.
  r = kvp::host::move_cache(pc.view(), 0, 0, 1, mask({1, 1, 1, 1, 0, 0, 0, 0, 0}));
  CHECK(r.new_length == 4);
  CHECK(r.moved == 0);
  CHECK(r.freed_blocks == std::vector<i32>{pc.block(0, 0, 1, 1), pc.block(0, 0, 1, 2)});
  CHECK(pc.take() == before);
  // Sinks 2 and window 3 of 13 kept, the rest evicted: 12 -> 2, 11 -> 3, 10 -> 4; 4 blocks -> 2.
  std::vector<std::uint8_t> keep(13, 0);
  keep[0] = keep[1] = keep[10] = keep[11] = keep[12] = 1;
  const auto p = kvp::host::plan_move_cache(keep, 4);
  CHECK(p.moves == std::vector<cache_move>{{12, 2}, {11, 3}, {10, 4}});
  CHECK(p.freed_blocks == 2);
  check_move_cache(pc, 0, 0, 0, keep);
  const auto after = pc.take();
  for (i32 t = 0; t < 5; ++t) CHECK(pc.position(after, 0, 0, 0, t) == std::vector<i32>{0, 1, 12, 11, 10}[t]);
}

TEST_CASE("move_cache: random per-head caches, every layout form, dtype and block size") {
  std::mt19937 rng(11);
  int calls = 0;
  for (i32 b : {1, 3, 16})
    for (auto type : {kvp::dtype::f32, kvp::dtype::f16, kvp::dtype::bf16})
      for (bool shared : {true, false})
        for (bool per_layer : {false, true})
          for (bool inter : {false, true}) {
            CAPTURE(b);
            CAPTURE(kvp::name_of(type));
            CAPTURE(shared);
            CAPTURE(per_layer);
            CAPTURE(inter);
            ph_cache pc({.layers = 2, .seqs = 3, .heads = 2, .block_size = b, .head_dim = 8, .type = type,
                         .shared_pool = shared, .per_layer_tables = per_layer, .interleaved = inter,
                         .max_len = 3 * b + 7, .seed = static_cast<std::uint32_t>(rng())});
            REQUIRE_NOTHROW(kvp::validate_per_head(pc.view()));
            // Some heads, not all, one call each; masks random (any rate) or block-granular
            // (KV-Compress: evict hanging + whole blocks).
            for (i32 l = 0; l < 2; ++l)
              for (i32 seq = 0; seq < 3; ++seq)
                for (i32 h = 0; h < 2; ++h) {
                  if (rng() % 4 == 0) continue;
                  const i32 T = pc.length(l, seq, h);
                  std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 1);
                  if (rng() % 2) {
                    const double rate = std::vector<double>{0.0, 0.3, 0.7, 1.0}[rng() % 4];
                    for (auto& x : keep) x = std::uniform_real_distribution<double>(0, 1)(rng) >= rate;
                  } else if (T > 0) {
                    const i32 hanging = T % b == 0 ? b : T % b;
                    const i32 whole = static_cast<i32>(rng() % static_cast<unsigned>((T - hanging) / b + 1));
                    std::vector<i32> order(static_cast<std::size_t>(T));
                    std::iota(order.begin(), order.end(), 0);
                    std::shuffle(order.begin(), order.end(), rng);
                    for (i32 i = 0; i < std::min(T, hanging + whole * b); ++i) keep[order[i]] = 0;
                  }
                  check_move_cache(pc, l, seq, h, keep);
                  ++calls;
                }
            // Still a well-formed cache (tables and lengths are the engine's to change).
            CHECK_NOTHROW(kvp::validate_per_head(pc.view()));
          }
  CHECK(calls > 300);
}

TEST_CASE("per-head validation: each malformed field is named, with its value") {
  const ph_config base{.layers = 2, .seqs = 2, .heads = 2, .block_size = 4, .head_dim = 4,
                       .lengths = {5, 8, 0, 3, 9, 1, 4, 12}};
  auto expect = [](const kvp::per_head_kv_view& c, const std::string& field, const std::string& value) {
    try {
      kvp::validate_per_head(c);
      FAIL("accepted; expected an error naming " << field);
    } catch (const kvp::error& e) {
      CHECK(e.field() == field);
      CHECK_MESSAGE(std::string(e.what()).find(value) != std::string::npos, e.what());
    }
  };
  SUBCASE("shapes") {
    ph_cache pc(base);
    auto c = pc.view();
    c.num_layers = 0;
    expect(c, "cache.num_layers", "is 0");
    c = pc.view();
    c.block_size = -4;
    expect(c, "cache.block_size", "is -4");
    c = pc.view();
    c.head_dim = 0;
    expect(c, "cache.head_dim", "is 0");
    c = pc.view();
    c.num_kv_heads = 0;
    expect(c, "cache.num_kv_heads", "is 0");
    c = pc.view();
    c.max_blocks = 0;
    expect(c, "cache.max_blocks", "is 0");
    c = pc.view();
    c.table = {};
    expect(c, "cache.table", "null");
    c = pc.view();
    c.lengths = {};
    expect(c, "cache.lengths", "null");
    c = pc.view();
    c.k = {};
    expect(c, "cache.k", "null");
    c = pc.view();
    c.k_stride.token = 3;
    expect(c, "cache.k_stride.token", "is 3");
    c = pc.view();
    c.v_stride.block = c.v_stride.token * 3;
    expect(c, "cache.v_stride.block", "is");
    c = pc.view();
    c.k_stride.dim = 2;
    expect(c, "cache.k_stride.dim", "is 2");
    c = pc.view();
    c.metric.layer_stride = 1000;  // a shared pool's metric is one array for every layer
    expect(c, "cache.metric.layer_stride", "is 1000");
    c = pc.view();
    c.v.layer_stride = 64;  // a shared pool but layers at different addresses
    expect(c, "cache.v layer 1", "shared_pool");
  }
  SUBCASE("per-layer pools must not overlap") {
    ph_config cfg = base;
    cfg.shared_pool = false;
    ph_cache pc(cfg);
    auto c = pc.view();
    CHECK_NOTHROW(kvp::validate_per_head(c));
    c.v.layer_stride = 4;
    expect(c, "cache.v layer 1", "own pool");
    c = pc.view();
    c.positions.layer_stride = 0;
    expect(c, "cache.positions.layer_stride", "is 0");
  }
  SUBCASE("lengths within the table") {
    ph_cache pc(base);
    const i32 cap = pc.max_blocks() * 4;
    pc.length_ref(1, 0, 1) = cap + 1;
    expect(pc.view(), "cache.lengths[layer 1][seq 0][head 1]", std::to_string(cap + 1));
    pc.length_ref(1, 0, 1) = -1;
    expect(pc.view(), "cache.lengths[layer 1][seq 0][head 1]", "is -1");
  }
  SUBCASE("ids in range") {
    ph_cache pc(base);
    pc.table_ref(1, 1, 1, 2) = pc.num_blocks();
    expect(pc.view(), "cache.table[layer 1][seq 1][head 1][2]", std::to_string(pc.num_blocks()));
    pc.table_ref(1, 1, 1, 2) = -1;
    expect(pc.view(), "cache.table[layer 1][seq 1][head 1][2]", "is block id -1");
  }
  SUBCASE("an entry past a head's length is never read") {
    ph_cache pc(base);
    pc.table_ref(0, 0, 0, 3) = 12345;  // head (0, 0, 0) holds 5 tokens: 2 blocks
    CHECK_NOTHROW(kvp::validate_per_head(pc.view()));
  }
  SUBCASE("no id twice: across layers of a shared pool, within a layer's pool, within a head") {
    ph_cache pc(base);
    pc.table_ref(1, 1, 1, 0) = pc.block(0, 0, 1, 1);  // layer 1 takes a block of layer 0: one pool
    expect(pc.view(), "cache.table[layer 1][seq 1][head 1][0]", "already held by layer 0 seq 0 head 1");
    ph_config cfg = base;
    cfg.shared_pool = false;
    ph_cache pl(cfg);
    // Per-layer pools: each layer's heads draw from their own pool, so ids repeat across layers.
    std::vector<int> used(static_cast<std::size_t>(pl.num_blocks()), 0);
    for (i32 l = 0; l < 2; ++l)
      for (i32 s = 0; s < 2; ++s)
        for (i32 h = 0; h < 2; ++h)
          for (i32 i = 0; i < pl.blocks(l, s, h); ++i) used[static_cast<std::size_t>(pl.block(l, s, h, i))] |= 1 << l;
    CHECK(std::count(used.begin(), used.end(), 3) > 0);
    CHECK_NOTHROW(kvp::validate_per_head(pl.view()));
    ph_cache p2(cfg);
    p2.table_ref(1, 1, 0, 0) = p2.block(1, 0, 0, 0);
    expect(p2.view(), "cache.table[layer 1][seq 1][head 0][0]", "already held by layer 1 seq 0 head 0");
    ph_cache p3(base);
    p3.table_ref(1, 1, 1, 2) = p3.block(1, 1, 1, 0);  // 12 tokens: 3 blocks
    expect(p3.view(), "cache.table[layer 1][seq 1][head 1][2]", "already held by layer 1 seq 1 head 1 (its block 0)");
  }
}

TEST_CASE("move_cache refuses malformed arguments, naming the field, before writing") {
  ph_cache pc({.layers = 2, .seqs = 2, .heads = 2, .block_size = 4, .head_dim = 4,
               .lengths = {5, 8, 0, 3, 9, 1, 4, 12}});
  const auto before = pc.take();
  const auto keep9 = std::vector<std::uint8_t>{0, 1, 0, 1, 0, 1, 0, 1, 1};  // fits head (1, 0, 0)
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 2, 0, 0, keep9); }) == "layer");
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, -1, 0, keep9); }) == "seq");
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 2, keep9); }) == "head");
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 1, keep9); }) == "keep");  // head (1, 0, 1) holds 1
  pc.table_ref(1, 0, 0, 2) = -7;
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 0, keep9); }) == "cache.table[layer 1][seq 0][head 0][2]");
  pc.table_ref(1, 0, 0, 2) = pc.block(1, 0, 0, 0);
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 0, keep9); }) == "cache.table[layer 1][seq 0][head 0][2]");
  pc.table_ref(1, 0, 0, 2) = before.table[static_cast<std::size_t>(pc.row(1, 0, 0)) * pc.max_blocks() + 2];
  pc.length_ref(1, 0, 0) = pc.max_blocks() * 4 + 1;
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 0, keep9); }) == "cache.lengths[layer 1][seq 0][head 0]");
  pc.length_ref(1, 0, 0) = 9;
  CHECK(pc.take() == before);
  CHECK(field_of([&] { kvp::host::move_cache(pc.view(), 1, 0, 0, keep9); }) == "<accepted>");
}
