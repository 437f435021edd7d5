// The engine layouts of issue 34 (SGLang's token pool, TensorRT-LLM's block pools)
// against the same cache in another layout: every token's K, V, F and position
// copied across, the same compression, the same results and the same moved rows.
// vLLM's packed layouts (issue 43): every element read where vLLM stores it, and a
// compression over them equal to one over a plain NHD copy, byte for byte.
// docs/views.md, "Layout constructors"; docs/integration.md.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/test_cache.hpp"

using kvp_test::cache_layout;
using kvp_test::kv_kind;
using kvp_test::test_cache;

namespace {

// `to` holds `from`'s tokens: every (layer, seq, token, head)'s K and V rows, F and
// position (the two fixtures share their block tables: same seed, same shape).
void copy_tokens(const test_cache& from, test_cache& to) {
  REQUIRE(from.raw_table() == to.raw_table());
  for (int seq = 0; seq < from.num_seqs(); ++seq)
    for (int l = 0; l < from.num_layers(); ++l)
      for (int t = 0; t < from.length(seq); ++t)
        for (int h = 0; h < from.kv_heads(); ++h) {
          to.set_row(kv_kind::k, l, seq, t, h, from.key(l, seq, t, h));
          to.set_row(kv_kind::v, l, seq, t, h, from.value(l, seq, t, h));
        }
  to.raw_f() = from.raw_f();
  to.raw_positions() = from.raw_positions();
  to.raw_queries() = from.raw_queries();
}

// A compression of `items` over both caches gives the same results, and every token
// each one keeps has the same bytes afterwards.
template <class P>
void check_same_compression(const P& p, test_cache& a, test_cache& b, const std::vector<kvp::batch_item>& items) {
  CAPTURE(a.describe());
  CAPTURE(b.describe());
  const auto ra = kvp_test::run(p, a, items), rb = kvp_test::run(p, b, items);
  CHECK(ra.new_lengths == rb.new_lengths);
  CHECK(ra.kept_counts == rb.kept_counts);
  CHECK(ra.released_blocks == rb.released_blocks);
  CHECK(ra.keep_masks == rb.keep_masks);
  CHECK(ra.scores == rb.scores);
  CHECK(a.raw_f() == b.raw_f());
  CHECK(a.raw_positions() == b.raw_positions());
  for (std::size_t i = 0; i < items.size(); ++i)
    for (int l = 0; l < a.num_layers(); ++l)
      for (int t = 0; t < ra.new_lengths[i]; ++t)
        for (int h = 0; h < a.kv_heads(); ++h)
          for (kv_kind kind : {kv_kind::k, kv_kind::v})
            CHECK(a.token_bytes(kind, l, items[i].seq, t, h) == b.token_bytes(kind, l, items[i].seq, t, h));
}

kvp::presets::zipage small_zipage(int w) {
  kvp::presets::zipage z;
  z.scorer.window = w;
  z.protect.window = w;
  z.redundancy = {.theta = 0.5f, .tau = 0.4f, .lambda = 0.2f};
  return z;
}

}  // namespace

TEST_CASE("engine layouts: SGLang's token pool (blocks of one token) against nano-vllm's") {
  for (auto type : kvp_test::all_dtypes) {
    const kvp_test::cache_config cfg{.layers = 2, .block_size = 1, .kv_heads = 2, .head_dim = 8, .type = type,
                                     .lengths = {23, 17, 30}, .q_heads = 4, .window = 4, .seed = 29};
    kvp_test::cache_config sg = cfg, nano = cfg;
    sg.layout = cache_layout::sglang;
    nano.layout = cache_layout::nano_vllm;
    test_cache a(sg), b(nano);
    copy_tokens(a, b);
    // Lightning's blocks are single tokens here: its redundancy is 0, as any other b 1 cache's.
    check_same_compression(small_zipage(4), a, b, {{.seq = 0, .query_slot = 0, .budget = 12}, {.seq = 2, .query_slot = 2, .budget = 9}});
  }
}

TEST_CASE("engine layouts: TensorRT-LLM's block pools against vLLM's and FlashInfer's") {
  const std::pair<cache_layout, cache_layout> pairs[] = {{cache_layout::trtllm_blocks_first, cache_layout::vllm_flash},
                                                         {cache_layout::trtllm_layers_first, cache_layout::hnd}};
  for (const auto& [trt, other] : pairs)
    for (bool csr : {false, true}) {
      const kvp_test::cache_config cfg{.layers = 3, .block_size = 8, .kv_heads = 2, .head_dim = 8,
                                       .type = kvp::dtype::bf16, .lengths = {37, 50, 24}, .csr = csr, .q_heads = 8,
                                       .window = 4, .seed = 31};
      kvp_test::cache_config x = cfg, y = cfg;
      x.layout = trt;
      y.layout = other;
      test_cache a(x), b(y);
      copy_tokens(a, b);
      check_same_compression(small_zipage(4), a, b,
                             {{.seq = 1, .query_slot = 1, .budget = 20, .history_tokens = 0},
                              {.seq = 2, .query_slot = 2, .budget = 16}});
    }
}

// ---------------------------------------------------------------------------
// vLLM from v0.26: a KV cache group's layers in one allocation, each layer the logical
// [num_blocks, h_kv, b, 2d] (K then V along the last axis), the five axes
// [L, B, H, N, C] in one of six physical orders. The addresses below come from the
// order's name alone (row-major over the named axes, as vLLM packs them), not from
// the library's strides.

namespace {

using kvp::layouts::vllm_layout;

struct vllm_order {
  vllm_layout layout;
  const char* axes;  // physical axes, outermost first
};
constexpr vllm_order vllm_orders[] = {{vllm_layout::lbhnc, "LBHNC"}, {vllm_layout::lbnhc, "LBNHC"},
                                      {vllm_layout::lhbnc, "LHBNC"}, {vllm_layout::blhnc, "BLHNC"},
                                      {vllm_layout::blnhc, "BLNHC"}, {vllm_layout::bhlnc, "BHLNC"}};

// Element index of (layer, block, head, token, content) in a dense buffer whose axes
// run in `axes` order, outermost first: Horner's rule over the named extents.
std::int64_t vllm_index(const char* axes, const kvp::cache_shape& s, int l, int p, int h, int n, int c) {
  std::int64_t i = 0;
  for (const char* a = axes; *a; ++a) switch (*a) {
      case 'L': i = i * s.num_layers + l; break;
      case 'B': i = i * s.num_blocks + p; break;
      case 'H': i = i * s.num_kv_heads + h; break;
      case 'N': i = i * s.block_size + n; break;
      default: i = i * (2 * std::int64_t{s.head_dim}) + c; break;
    }
  return i;
}

std::int64_t vllm_elems(const kvp::cache_shape& s) {
  return std::int64_t{s.num_layers} * s.num_blocks * s.num_kv_heads * s.block_size * 2 * s.head_dim;
}

// A value exact in every dtype, a function of the element's place.
float vllm_value(std::int64_t where) { return static_cast<float>(where % 61 - 30) / 8.0f; }

// Every (layer, block, head, token) row of K and V: where the view finds it against
// `element(l, p, h, n, c)`, and the values read there.
template <class Element>
void check_rows(const kvp::paged_kv_view& v, const kvp::cache_shape& s, std::byte* base, Element element) {
  const int es = kvp::size_of(s.type);
  int wrong_address = 0, wrong_value = 0;
  for (int l = 0; l < s.num_layers; ++l)
    for (int p = 0; p < s.num_blocks; ++p)
      for (int h = 0; h < s.num_kv_heads; ++h)
        for (int n = 0; n < s.block_size; ++n)
          for (int kv = 0; kv < 2; ++kv) {
            const std::int64_t first = element(l, p, h, n, kv * s.head_dim);
            std::byte* row = kv == 0 ? v.k_row_at(l, p, n, h) : v.v_row_at(l, p, n, h);
            wrong_address += row != base + first * es;
            for (int c = 0; c < s.head_dim; ++c)
              wrong_value += kvp::load_as_float(row, s.type, c) != vllm_value(element(l, p, h, n, kv * s.head_dim + c));
          }
  CHECK(wrong_address == 0);
  CHECK(wrong_value == 0);
}

// A buffer whose element e holds vllm_value(e).
std::vector<std::byte> numbered_buffer(std::int64_t elems, kvp::dtype t) {
  std::vector<std::byte> buf(static_cast<std::size_t>(elems) * kvp::size_of(t));
  for (std::int64_t e = 0; e < elems; ++e) kvp::store_from_float(buf.data(), t, e, vllm_value(e));
  return buf;
}

}  // namespace

TEST_CASE("engine layouts: vLLM's packed K|V cache in each of its six orders, read where vLLM stores it") {
  const std::int32_t table[1] = {0}, lengths[1] = {0};
  const kvp::sequence_table none{.table = kvp::block_table_view::dense(table, 1), .lengths = lengths, .num_seqs = 1};
  for (auto type : kvp_test::all_dtypes)
    for (const vllm_order& o : vllm_orders) {
      CAPTURE(std::string(o.axes));
      CAPTURE(kvp::name_of(type));
      // Three heads of four tokens: a head/token swap reads another row.
      const kvp::cache_shape s{.num_layers = 3, .num_blocks = 5, .block_size = 4, .num_kv_heads = 3, .head_dim = 8,
                               .type = type};
      std::vector<std::byte> buf = numbered_buffer(vllm_elems(s), type);
      const kvp::paged_kv_view v = kvp::layouts::vllm(buf.data(), o.layout, s, none);
      CHECK(v.k_stride.dim == 1);
      CHECK(v.v_stride.dim == 1);
      check_rows(v, s, buf.data(),
                 [&](int l, int p, int h, int n, int c) { return vllm_index(o.axes, s, l, p, h, n, c); });
    }
}

TEST_CASE("engine layouts: vLLM's padded pages and packed blocks (KVCacheTensor's layer and block strides)") {
  const std::int32_t table[1] = {0}, lengths[1] = {0};
  const kvp::sequence_table none{.table = kvp::block_table_view::dense(table, 1), .lengths = lengths, .num_seqs = 1};
  for (auto type : kvp_test::all_dtypes) {
    const kvp::cache_shape s{.num_layers = 2, .num_blocks = 4, .block_size = 2, .num_kv_heads = 3, .head_dim = 8,
                             .type = type};
    const int es = kvp::size_of(type);
    const std::int64_t page = std::int64_t{s.num_kv_heads} * s.block_size * 2 * s.head_dim;  // elements
    const std::int64_t pad = 8;
    // Layer outermost with each page padded; block outermost with padding after a
    // block of every layer (vLLM pads only these block-compact orders).
    const struct {
      vllm_order o;
      std::int64_t layer_stride, block_stride;  // elements
    } placements[] = {{{vllm_layout::lbnhc, "LBNHC"}, s.num_blocks * (page + pad), page + pad},
                      {{vllm_layout::lbhnc, "LBHNC"}, s.num_blocks * (page + pad), page + pad},
                      {{vllm_layout::blhnc, "BLHNC"}, page, s.num_layers * page + pad},
                      {{vllm_layout::blnhc, "BLNHC"}, page, s.num_layers * page + pad}};
    for (const auto& pl : placements) {
      CAPTURE(std::string(pl.o.axes));
      CAPTURE(kvp::name_of(type));
      // The page's own axes (the last three of the order) are dense inside it.
      const auto element = [&](int l, int p, int h, int n, int c) {
        const kvp::cache_shape one_page{.num_layers = 1, .num_blocks = 1, .block_size = s.block_size,
                                        .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim, .type = type};
        return l * pl.layer_stride + p * pl.block_stride + vllm_index(pl.o.axes + 2, one_page, 0, 0, h, n, c);
      };
      const std::int64_t elems = element(s.num_layers - 1, s.num_blocks - 1, s.num_kv_heads - 1, s.block_size - 1,
                                         2 * s.head_dim - 1) + pad + 1;
      std::vector<std::byte> buf = numbered_buffer(elems, type);
      const kvp::paged_kv_view v =
          kvp::layouts::vllm(buf.data(), pl.o.layout, s, none, {pl.layer_stride * es, pl.block_stride * es});
      check_rows(v, s, buf.data(), element);
    }
  }
  SUBCASE("a placement that is not whole elements is refused, naming it") {
    const kvp::cache_shape s{.num_layers = 2, .num_blocks = 4, .block_size = 2, .num_kv_heads = 1, .head_dim = 8,
                             .type = kvp::dtype::bf16};
    std::vector<std::byte> buf(1024);
    try {
      (void)kvp::layouts::vllm(buf.data(), vllm_layout::lbnhc, s, none, {.layer_stride = 0, .block_stride = 77});
      FAIL("accepted a block stride of 77 bytes for 2-byte elements");
    } catch (const kvp::error& e) {
      CHECK(e.field() == "placement.block_stride");
      CHECK(std::string(e.what()).find("77") != std::string::npos);
    }
    CHECK_THROWS_AS((void)kvp::layouts::vllm(buf.data(), vllm_layout::lbnhc, s, none, {.layer_stride = -2}),
                    kvp::error);
  }
}

namespace {

// One cache held twice: in a vLLM order (one buffer) and as plain NHD K and V per
// layer, the same tokens, F, positions and block table.
struct vllm_and_nhd {
  kvp::cache_shape s;
  const char* axes;
  std::vector<std::byte> packed;                 // the vLLM buffer
  std::vector<std::vector<std::byte>> k, v;      // NHD per layer [NB, b, h, d]
  std::vector<void*> k_ptrs, v_ptrs;
  std::vector<std::int32_t> table, lengths;
  std::int32_t max_blocks = 0;
  std::vector<std::byte> queries;                // [L, seqs, w, h_q, d]
  std::vector<float> f_packed, f_nhd;            // F [L, NB, b, h]
  std::vector<std::int32_t> pos_packed, pos_nhd;  // positions [L, NB, b, h]
  std::int32_t q_heads = 6, window = 4;  // two query heads per KV head

  std::int64_t nhd_index(int p, int n, int h) const {
    return ((std::int64_t{p} * s.block_size + n) * s.num_kv_heads + h) * s.head_dim;
  }

  vllm_and_nhd(const kvp::cache_shape& shape, const char* order, std::vector<std::int32_t> lens, unsigned seed)
      : s(shape), axes(order), lengths(std::move(lens)) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> val(-32, 31);
    const int es = kvp::size_of(s.type);
    packed.assign(static_cast<std::size_t>(vllm_elems(s)) * es, std::byte{0});
    const std::size_t layer_elems = static_cast<std::size_t>(s.num_blocks) * s.block_size * s.num_kv_heads * s.head_dim;
    k.assign(s.num_layers, std::vector<std::byte>(layer_elems * es));
    v = k;
    for (int l = 0; l < s.num_layers; ++l) {
      k_ptrs.push_back(k[l].data());
      v_ptrs.push_back(v[l].data());
      for (int p = 0; p < s.num_blocks; ++p)
        for (int n = 0; n < s.block_size; ++n)
          for (int h = 0; h < s.num_kv_heads; ++h)
            for (int c = 0; c < 2 * s.head_dim; ++c) {
              const float x = static_cast<float>(val(rng)) / 8.0f;  // exact in every dtype
              kvp::store_from_float(packed.data(), s.type, vllm_index(axes, s, l, p, h, n, c), x);
              auto& nhd = c < s.head_dim ? k[l] : v[l];
              kvp::store_from_float(nhd.data(), s.type, nhd_index(p, n, h) + c % s.head_dim, x);
            }
    }
    // Each sequence's blocks a shuffled choice of the pool; entries past them -1.
    std::vector<std::int32_t> ids(s.num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (std::int32_t n : lengths) max_blocks = std::max(max_blocks, (n + s.block_size - 1) / s.block_size);
    table.assign(lengths.size() * max_blocks, -1);
    std::size_t next = 0;
    for (std::size_t q = 0; q < lengths.size(); ++q)
      for (int i = 0; i < (lengths[q] + s.block_size - 1) / s.block_size; ++i) table[q * max_blocks + i] = ids.at(next++);
    queries.resize(static_cast<std::size_t>(s.num_layers) * lengths.size() * window * q_heads * s.head_dim * es);
    for (std::size_t e = 0; e < queries.size() / es; ++e)
      kvp::store_from_float(queries.data(), s.type, static_cast<std::int64_t>(e), static_cast<float>(val(rng)) / 8.0f);
    const std::size_t slots = static_cast<std::size_t>(s.num_layers) * s.num_blocks * s.block_size * s.num_kv_heads;
    f_packed.assign(slots, 0.0f);
    f_nhd = f_packed;
    pos_packed.assign(slots, -1);
    for (int l = 0; l < s.num_layers; ++l)
      for (std::size_t q = 0; q < lengths.size(); ++q)
        for (int t = 0; t < lengths[q]; ++t)
          for (int h = 0; h < s.num_kv_heads; ++h)
            pos_packed[((static_cast<std::size_t>(l) * s.num_blocks + table[q * max_blocks + t / s.block_size]) *
                            s.block_size + t % s.block_size) * s.num_kv_heads + h] = t;
    pos_nhd = pos_packed;
  }

  kvp::sequence_table seqs() const {
    return {.table = kvp::block_table_view::dense(table.data(), max_blocks), .lengths = lengths.data(),
            .num_seqs = static_cast<std::int32_t>(lengths.size())};
  }
  kvp::paged_kv_view packed_view(vllm_layout layout) {
    kvp::paged_kv_view c = kvp::layouts::vllm(packed.data(), layout, s, seqs());
    c.positions = kvp::position_view::contiguous(pos_packed.data(), s.num_blocks, s.block_size, s.num_kv_heads);
    return c;
  }
  kvp::paged_kv_view nhd_view() {
    kvp::paged_kv_view c = kvp::layouts::nhd(k_ptrs.data(), v_ptrs.data(), s, seqs());
    c.positions = kvp::position_view::contiguous(pos_nhd.data(), s.num_blocks, s.block_size, s.num_kv_heads);
    return c;
  }
  kvp::query_window_view query_view() const {
    return kvp::query_window_view::contiguous(queries.data(), s.num_layers, static_cast<std::int32_t>(lengths.size()),
                                              window, q_heads, s.head_dim, s.type);
  }
  // The NHD copy laid out in the vLLM order: what the vLLM buffer must hold.
  std::vector<std::byte> nhd_as_packed() const {
    std::vector<std::byte> out(packed.size());
    const int es = kvp::size_of(s.type);
    for (int l = 0; l < s.num_layers; ++l)
      for (int p = 0; p < s.num_blocks; ++p)
        for (int n = 0; n < s.block_size; ++n)
          for (int h = 0; h < s.num_kv_heads; ++h)
            for (int c = 0; c < 2 * s.head_dim; ++c) {
              const auto& nhd = c < s.head_dim ? k[l] : v[l];
              std::copy_n(nhd.data() + (nhd_index(p, n, h) + c % s.head_dim) * es, es,
                          out.data() + vllm_index(axes, s, l, p, h, n, c) * es);
            }
    return out;
  }
};

}  // namespace

TEST_CASE("engine layouts: a compression over vLLM's packed cache equals one over its NHD copy, byte for byte") {
  const kvp::presets::zipage p = small_zipage(4);
  const std::vector<kvp::batch_item> items{{.seq = 0, .query_slot = 0, .budget = 8},
                                           {.seq = 1, .query_slot = 1, .budget = 12}};
  const kvp::host_executor ex{.record_keep_masks = true, .record_scores = true};
  for (auto type : kvp_test::all_dtypes)
    for (const vllm_order& o : vllm_orders) {
      CAPTURE(std::string(o.axes));
      CAPTURE(kvp::name_of(type));
      // Sequence 2 is not compressed: its rows must come out as they went in.
      const kvp::cache_shape s{.num_layers = 2, .num_blocks = 16, .block_size = 4, .num_kv_heads = 3, .head_dim = 8,
                               .type = type};
      vllm_and_nhd c(s, o.axes, {21, 26, 9}, 41);
      const kvp::paged_kv_view packed = c.packed_view(o.layout);
      const auto scores_of = [&](std::vector<float>& f) {
        return kvp::score_view::contiguous(f.data(), s.num_blocks, s.block_size, s.num_kv_heads);
      };
      if (o.layout == vllm_layout::lhbnc) {
        // Heads outside blocks (ROCm's order): a block's rows interleave with the next
        // block's, which the executors' row-overlap check does not accept yet.
        try {
          (void)ex.compress(p, packed, c.query_view(), scores_of(c.f_packed), kvp_test::make_batch(items));
          FAIL("LHBNC was accepted");
        } catch (const kvp::error& e) {
          CHECK(e.field() == "cache.k_stride.block");
        }
        continue;
      }
      const kvp::host_result a = ex.compress(p, packed, c.query_view(), scores_of(c.f_packed), kvp_test::make_batch(items));
      const kvp::host_result b = ex.compress(p, c.nhd_view(), c.query_view(), scores_of(c.f_nhd), kvp_test::make_batch(items));
      CHECK(a.new_lengths == b.new_lengths);
      CHECK(a.new_lengths == std::vector<std::int32_t>{8, 12});
      CHECK(a.kept_counts == b.kept_counts);
      CHECK(a.released_blocks == b.released_blocks);
      CHECK(a.keep_masks == b.keep_masks);
      CHECK(a.scores == b.scores);
      CHECK(c.f_packed == c.f_nhd);
      CHECK(c.pos_packed == c.pos_nhd);
      CHECK(c.packed == c.nhd_as_packed());
    }
}
