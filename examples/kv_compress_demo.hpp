// `kvpolicy_demo --preset kv_compress` (compress_demo.cpp includes this file, and this
// file uses its helpers: options, str/say, direction; device_buffer and stage_events in
// the CUDA build):
// KV-Compress over a per-head block cache, where each physical block holds one KV head
// of one layer and every (layer, KV head) of a sequence has its own block table row
// and length (KV-Compress 4.2; presets::kv_compress).
//
// The demo plays the engine. It owns one pool of blocks for every layer (the authors'
// unified cache), handed out shuffled, with per-slot positions and the metric.
// Sequence 0 is a fresh prefill: every head holds every position. The others were
// thinned by an earlier compression: their heads hold different numbers of tokens
// (ragged), each its last `protected_window` positions and a random subset of the
// older ones, in position order. A few heavy hitters per sequence have keys along the
// direction the queries favour. The metric each slot holds is the preset's prefill
// metric over the head's held tokens (squared attention of the newest `window`
// queries, max-pooled per query head, summed over the group): a stand-in for what a
// sequence carries from its prefill and decode steps. Each sequence's budget is the
// preset's (`--cache-tokens`, the authors' max_cache_tokens, 128 by default; or
// `--rate`), turned into blocks to free by presets::kv_compress::item; one compression
// runs, on the host (host::compress_per_head) or the GPU (cuda_per_head_executor,
// kv_compress_demo_gpu.cuh, in the CUDA build), or both, compared.
//
// It prints each sequence's tokens and blocks before and after, the blocks asked and
// freed, per (layer, KV head) lengths for the first layers, and checks: each head
// dense (its new length's slots hold distinct tokens of its own, K, V, metric and
// position intact), on a block boundary with its tail blocks freed, evicted =
// (blocks - 1) b + hanging, the protected window kept, the blocks freed as asked.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

// The engine's per-head cache, in host memory.
struct kvc_cache {
  i32 L = 0, S = 0, H = 0, G = 0, b = 0, d = 0;
  kvp::dtype type = kvp::dtype::bf16;
  i32 max_blocks = 0, num_blocks = 0;
  std::vector<i32> logical;      // [S]: each sequence's position count
  std::vector<i32> lengths;      // [L, S, H]: tokens each head holds
  std::vector<i32> table;        // [L, S, H, max_blocks], -1 where unused
  std::vector<std::byte> k, v;   // [N, b, d] each, of `type`
  std::vector<float> metric;     // [N, b]
  std::vector<i32> positions;    // [N, b]; -1 in free slots
  std::vector<i32> free_blocks;  // the engine's free list
  std::vector<std::vector<std::uint8_t>> heavy;  // [S][position]: planted heavy hitters

  std::size_t row(i32 l, i32 s, i32 h) const { return (static_cast<std::size_t>(l) * S + s) * H + h; }
  i32 blocks_for(i32 T) const { return (T + b - 1) / b; }
  // Physical slot (block * b + offset) of token t of a row, from the demo's own table.
  std::size_t slot(std::size_t r, i32 t) const {
    return static_cast<std::size_t>(table[r * max_blocks + t / b]) * b + t % b;
  }
  std::size_t row_bytes() const { return static_cast<std::size_t>(d) * kvp::size_of(type); }
};

// The view over one copy of the cache's buffers, host or device: K and V `[N, b, d]`
// each, one pool for every layer.
kvp::per_head_kv_view kvc_view(const kvc_cache& c, std::byte* k, std::byte* v, float* metric, i32* positions,
                               const i32* table, const i32* lengths) {
  kvp::per_head_kv_view view;
  view.num_layers = c.L, view.num_blocks = c.num_blocks, view.block_size = c.b, view.num_kv_heads = c.H;
  view.head_dim = c.d, view.num_seqs = c.S, view.max_blocks = c.max_blocks, view.type = c.type;
  view.shared_pool = true;
  view.k = {k, 0, nullptr, 0};
  view.v = {v, 0, nullptr, 0};
  view.k_stride = view.v_stride = kvp::per_head_kv_strides::contiguous(c.b, c.d);
  view.table = kvp::per_head_array::dense(table, c.S, c.H, c.max_blocks);
  view.lengths = kvp::per_head_array::dense(lengths, c.S, c.H);
  view.metric = kvp::per_slot_metric::shared(metric, c.b);
  view.positions = kvp::per_slot_positions::shared(positions, c.b);
  return view;
}

kvp::per_head_kv_view kvc_view(kvc_cache& c) {
  return kvc_view(c, c.k.data(), c.v.data(), c.metric.data(), c.positions.data(), c.table.data(), c.lengths.data());
}

// The cache as described at the top, its metric written with the preset's.
kvc_cache make_kvc_cache(const options& o, const kvp::presets::kv_compress& p) {
  std::mt19937_64 rng(o.seed);
  kvc_cache c;
  c.L = o.layers, c.S = o.seqs, c.H = o.kv_heads, c.G = o.q_heads / o.kv_heads, c.b = o.block_size;
  c.d = o.head_dim, c.type = o.type;
  const i32 window = p.select.protected_window;

  // Positions per sequence, and per head the positions it holds.
  std::vector<std::vector<i32>> held(static_cast<std::size_t>(c.L) * c.S * c.H);
  for (i32 s = 0; s < c.S; ++s) {
    const i32 P = std::uniform_int_distribution<i32>(256, 448)(rng) + window;
    c.logical.push_back(P);
    auto& heavy = c.heavy.emplace_back(static_cast<std::size_t>(P), 0);
    for (i32 t = 4; t < P - window; ++t) heavy[t] = std::uniform_int_distribution<i32>(0, 31)(rng) == 0;
    for (i32 l = 0; l < c.L; ++l)
      for (i32 h = 0; h < c.H; ++h) {
        const i32 lo = std::min(P, std::max(P / 3, 2 * window));
        const i32 T = s == 0 ? P : std::uniform_int_distribution<i32>(lo, P)(rng);
        std::vector<i32> older(static_cast<std::size_t>(P - window));
        std::iota(older.begin(), older.end(), 0);
        std::shuffle(older.begin(), older.end(), rng);
        older.resize(static_cast<std::size_t>(T - window));
        for (i32 t = P - window; t < P; ++t) older.push_back(t);
        std::sort(older.begin(), older.end());
        held[c.row(l, s, h)] = std::move(older);
      }
  }

  // Blocks: one pool, shuffled, a few to spare.
  i32 need = 0;
  for (const auto& r : held) {
    c.lengths.push_back(static_cast<i32>(r.size()));
    c.max_blocks = std::max(c.max_blocks, c.blocks_for(c.lengths.back()));
    need += c.blocks_for(c.lengths.back());
  }
  c.num_blocks = need + 8;
  c.free_blocks.resize(static_cast<std::size_t>(c.num_blocks));
  std::iota(c.free_blocks.begin(), c.free_blocks.end(), 0);
  std::shuffle(c.free_blocks.begin(), c.free_blocks.end(), rng);
  c.table.assign(held.size() * c.max_blocks, -1);
  for (std::size_t r = 0; r < held.size(); ++r)
    for (i32 i = 0; i < c.blocks_for(c.lengths[r]); ++i) {
      c.table[r * c.max_blocks + i] = c.free_blocks.back();
      c.free_blocks.pop_back();
    }

  // K, V and positions. Per (layer, KV head) a direction the queries favour; heavy
  // hitters' keys lie along it.
  const std::size_t slots = static_cast<std::size_t>(c.num_blocks) * c.b;
  c.k.assign(slots * c.row_bytes(), std::byte{0});
  c.v.assign(c.k.size(), std::byte{0});
  c.metric.assign(slots, 0.0f);
  c.positions.assign(slots, -1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> dirs;
  for (i32 i = 0; i < c.L * c.H; ++i) dirs.push_back(direction(rng, c.d, {}));
  for (i32 l = 0; l < c.L; ++l)
    for (i32 s = 0; s < c.S; ++s)
      for (i32 h = 0; h < c.H; ++h) {
        const std::size_t r = c.row(l, s, h);
        const auto& dir = dirs[static_cast<std::size_t>(l) * c.H + h];
        for (i32 t = 0; t < c.lengths[r]; ++t) {
          const i32 pos = held[r][t];
          const std::size_t at = c.slot(r, t);
          c.positions[at] = pos;
          const bool hh = c.heavy[s][pos] != 0;
          for (i32 i = 0; i < c.d; ++i) {
            kvp::store_from_float(c.k.data() + at * c.row_bytes(), c.type, i, (hh ? 12.0f * dir[i] : 0.0f) + nd(rng));
            kvp::store_from_float(c.v.data() + at * c.row_bytes(), c.type, i, nd(rng));
          }
        }
      }

  // The metric: each row's newest min(window, T) queries, G per KV head, toward the
  // head's direction; heads differ in how sharply they attend. A row's slots are in
  // position order, so the prefill's causal mask by slot is the mask by position.
  for (i32 l = 0; l < c.L; ++l)
    for (i32 s = 0; s < c.S; ++s)
      for (i32 h = 0; h < c.H; ++h) {
        const std::size_t r = c.row(l, s, h);
        const i32 T = c.lengths[r], n = std::min(p.metric.window, T);
        const auto& dir = dirs[static_cast<std::size_t>(l) * c.H + h];
        const float sharp = 0.5f + 0.5f * static_cast<float>(h % 4);
        std::vector<float> keys(static_cast<std::size_t>(T) * c.d), queries(static_cast<std::size_t>(n) * c.G * c.d);
        std::vector<float> out(static_cast<std::size_t>(T));
        for (i32 t = 0; t < T; ++t)
          for (i32 i = 0; i < c.d; ++i)
            keys[static_cast<std::size_t>(t) * c.d + i] =
                kvp::load_as_float(c.k.data() + c.slot(r, t) * c.row_bytes(), c.type, i);
        for (std::size_t i = 0; i < queries.size(); ++i)
          queries[i] = sharp * (3.0f * dir[i % static_cast<std::size_t>(c.d)] + nd(rng));
        p.metric.prefill(queries, keys, c.G, c.d, out);
        for (i32 t = 0; t < T; ++t) c.metric[c.slot(r, t)] = out[t];
      }
  return c;
}

// Host and GPU results of one compression, compared (--device both).
struct kvc_agreement {
  long rows = 0, rows_differ = 0;      // (item, layer, head): new length, evicted, freed block ids
  long items_differ = 0;               // blocks freed per item
  long kv_rows = 0, kv_rows_differ = 0;  // K and V rows below the new lengths, with metric and position
};

struct kvc_outcome {
  kvp::per_head_result res;  // the GPU's when it ran
  std::optional<double> host_ms;
  std::optional<std::pair<double, double>> gpu_ms;  // schedule, moves
  std::optional<kvc_agreement> diff;
};

}  // namespace

#if defined(__CUDACC__)
#include "kv_compress_demo_gpu.cuh"
#endif

namespace {

kvc_outcome kvc_compress_on(device dev, const kvp::presets::kv_compress& p, kvc_cache& c,
                            const std::vector<kvp::per_head_item>& items) {
  kvc_outcome out;
  auto on_host = [&](kvc_cache& copy) {
    const auto t0 = std::chrono::steady_clock::now();
    kvp::per_head_result r = kvp::host::compress_per_head(p.select, kvc_view(copy), items);
    out.host_ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  if (dev == device::host) {
    out.res = on_host(c);
    return out;
  }
#if defined(__CUDACC__)
  if (dev == device::cuda) {
    out.res = kvc_compress_cuda(p, c, items, out.gpu_ms.emplace());
    return out;
  }
  // both: the host on a copy, the GPU's result into the demo's own buffers.
  kvc_cache host_copy = c;
  const kvp::per_head_result h = on_host(host_copy);
  out.res = kvc_compress_cuda(p, c, items, out.gpu_ms.emplace());
  kvc_agreement a;
  for (std::size_t i = 0; i < items.size(); ++i) {
    a.items_differ += h.freed[i] != out.res.freed[i];
    for (i32 l = 0; l < c.L; ++l)
      for (i32 hd = 0; hd < c.H; ++hd) {
        const auto j = static_cast<std::size_t>(l * c.H + hd);
        const i32 n = out.res.new_lengths[i][j];
        const bool same = h.new_lengths[i][j] == n && h.evicted[i][j] == out.res.evicted[i][j] &&
                          h.freed_blocks[i][j] == out.res.freed_blocks[i][j];
        ++a.rows;
        a.rows_differ += !same;
        if (!same) continue;
        const std::size_t r = c.row(l, items[i].seq, hd);
        for (i32 t = 0; t < n; ++t) {
          const std::size_t at = c.slot(r, t), bytes = c.row_bytes();
          a.kv_rows += 2;
          a.kv_rows_differ += std::memcmp(&host_copy.k[at * bytes], &c.k[at * bytes], bytes) != 0 ||
                              host_copy.metric[at] != c.metric[at] || host_copy.positions[at] != c.positions[at];
          a.kv_rows_differ += std::memcmp(&host_copy.v[at * bytes], &c.v[at * bytes], bytes) != 0;
        }
      }
  }
  out.diff = a;
  return out;
#else
  throw std::logic_error(str("--device {} in a build without CUDA", name_of(dev)));
#endif
}

// The invariants of one compression, from the cache before and after and the result.
// Prints what fails (the first few) and returns the count.
long kvc_check(const kvc_cache& before, const kvc_cache& after, const kvp::presets::kv_compress& p,
               const std::vector<kvp::per_head_item>& items, const kvp::per_head_result& r) {
  long bad = 0;
  auto fail = [&](const std::string& what) {
    if (++bad <= 8) say("  CHECK FAILED: {}\n", what);
  };
  const i32 b = before.b;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const i32 s = items[i].seq, P = before.logical[s];
    std::int64_t freed = 0, possible = 0;  // blocks freed; blocks the heads' unprotected tokens cover
    for (i32 l = 0; l < before.L; ++l)
      for (i32 h = 0; h < before.H; ++h) {
        const std::size_t row = before.row(l, s, h), j = static_cast<std::size_t>(l * before.H + h);
        const i32 T = before.lengths[row], n = r.new_lengths[i][j], e = r.evicted[i][j];
        const auto& ids = r.freed_blocks[i][j];
        const auto blocks = static_cast<i32>(ids.size());
        const std::string where = str("seq {} layer {} head {}", s, l, h);
        freed += blocks;
        i32 evictable = 0;
        for (i32 t = 0; t < T; ++t) evictable += !p.select.protects(before.positions[before.slot(row, t)], P);
        possible += kvp::select::head_adaptive_blocks::max_blocks(evictable, T, b);
        // Block granular: evicted = (blocks - 1) b + hanging, the head ends on a block
        // boundary, and the blocks it gives up are its table's tail.
        if (n != T - e) fail(str("{}: new length {} of {} tokens after evicting {}", where, n, T, e));
        if (e != kvp::select::head_adaptive_blocks::evicted_tokens(blocks, T, b))
          fail(str("{}: {} tokens evicted with {} blocks freed of {} tokens", where, e, blocks, T));
        for (i32 k = 0; k < blocks; ++k)
          if (k + before.blocks_for(n) >= before.max_blocks ||
              ids[k] != before.table[row * before.max_blocks + before.blocks_for(n) + k])
            fail(str("{}: freed block {} is not the table's entry {}", where, ids[k], before.blocks_for(n) + k));
        // Dense: the first n slots hold n distinct tokens the head held, intact; the
        // protected window among them.
        std::map<i32, std::size_t> was;  // position -> its slot before
        for (i32 t = 0; t < T; ++t) was[before.positions[before.slot(row, t)]] = before.slot(row, t);
        std::set<i32> kept;
        const std::size_t bytes = before.row_bytes();
        for (i32 t = 0; t < n; ++t) {
          const std::size_t at = before.slot(row, t);
          const i32 pos = after.positions[at];
          const auto it = was.find(pos);
          if (it == was.end() || !kept.insert(pos).second) {
            fail(str("{}: slot {} holds position {}, not one of the head's own once", where, t, pos));
            continue;
          }
          const std::size_t from = it->second;
          if (std::memcmp(&after.k[at * bytes], &before.k[from * bytes], bytes) != 0 ||
              std::memcmp(&after.v[at * bytes], &before.v[from * bytes], bytes) != 0 ||
              after.metric[at] != before.metric[from])
            fail(str("{}: position {} moved to slot {} with other K, V or metric bytes", where, pos, t));
        }
        for (i32 pos = std::max(0, P - p.select.protected_window); pos < P; ++pos)
          if (!kept.count(pos)) fail(str("{}: protected position {} evicted", where, pos));
      }
    // The schedule frees what was asked, or every block it can without a protected token.
    const std::int64_t expected = std::min(items[i].blocks_to_free, possible);
    if (freed != r.freed[i] || freed != expected)
      fail(str("seq {}: {} blocks freed (result says {}), {} asked, {} possible", s, freed, r.freed[i],
               items[i].blocks_to_free, possible));
    else if (possible < items[i].blocks_to_free)
      say("  seq {}: {} of the {} blocks asked freed, all that the tokens outside the protected positions cover\n", s,
          freed, items[i].blocks_to_free);
  }
  return bad;
}

// The engine's part after a compression: lengths, tables, free list.
void kvc_apply(kvc_cache& c, const std::vector<kvp::per_head_item>& items, const kvp::per_head_result& r) {
  for (std::size_t i = 0; i < items.size(); ++i)
    for (i32 l = 0; l < c.L; ++l)
      for (i32 h = 0; h < c.H; ++h) {
        const std::size_t row = c.row(l, items[i].seq, h), j = static_cast<std::size_t>(l * c.H + h);
        c.lengths[row] = r.new_lengths[i][j];
        for (i32 blk : r.freed_blocks[i][j]) c.free_blocks.push_back(blk);
        for (i32 e = c.blocks_for(c.lengths[row]); e < c.max_blocks; ++e) c.table[row * c.max_blocks + e] = -1;
      }
}

int run_kv_compress(options o, device dev, const gpu_info& gpu, const std::string& dev_note) {
  const auto wall0 = std::chrono::steady_clock::now();
  if (o.n_max_given || o.append_given || o.rounds_given || o.kara_sizes_given || o.show_mask ||
      o.layout != "nano_vllm")
    throw usage_error(
        "kv_compress takes neither --n-max, --append, --rounds, --window, --buffer, --keep, --show-mask nor "
        "--layout: one compression of a per-head cache (one pool of blocks, each one KV head of one layer)");
  kvp::presets::kv_compress p;
  if (o.rate_given) p.compression_rate = o.rate;
  if (o.cache_tokens_given || !o.rate_given) p.max_cache_tokens = o.cache_tokens;
  p.check();  // both budgets given: refused, naming the field

  kvc_cache c = make_kvc_cache(o, p);
  const kvc_cache before = c;
  const i32 b = c.b;

  const std::string executor = dev == device::host   ? std::string("host (host::compress_per_head)")
                               : dev == device::cuda ? str("cuda_per_head_executor on {}", gpu.name)
                                                     : str("host and cuda_per_head_executor (cuda on {})", gpu.name);
  say("kvpolicy {}.{}.{} demo: preset kv_compress, {}{}, {}\n", KVPOLICY_VERSION_MAJOR, KVPOLICY_VERSION_MINOR,
      KVPOLICY_VERSION_PATCH, executor, dev_note, kvp::name_of(c.type));
  say("cache: {} seqs, {} layers, h_kv {}, h_q {}, d {}, b {}; one pool of {} blocks for every layer, handed out "
      "shuffled, each holding one KV head of one layer\n",
      c.S, c.L, c.H, c.H * c.G, c.d, b, c.num_blocks);
  say("preset: metric w {}, max pool {}, v {} (squared attention of the prefill's last queries, pooled per query head, "
      "summed over the group of {});\n  protected window {}, sinks {}, one block count per sequence over its {} (layer, "
      "KV head) rows; budget {}\n",
      p.metric.window, p.metric.pool_kernel, p.metric.excluded_distance, c.G, p.select.protected_window,
      p.select.sinks, c.L * c.H,
      p.max_cache_tokens >= 0
          ? str("{} tokens per (layer, KV head) (max_cache_tokens), {} blocks a row", p.max_cache_tokens,
                (p.max_cache_tokens + b - 1) / b)
          : str("compression rate {} of the positions past the window (compression_rate)", p.compression_rate));
  say("sequences: seq 0 a fresh prefill (every head holds every position); the others thinned by an earlier\n"
      "  compression (ragged heads, each holding its last {} positions and a subset of the older ones)\n",
      p.select.protected_window);

  // The engine's items: each sequence's blocks to free, from its heads' lengths.
  std::vector<kvp::per_head_item> items;
  for (i32 s = 0; s < c.S; ++s) items.push_back(p.item(kvc_view(c), s, c.logical[s]));
  const kvc_outcome oc = kvc_compress_on(dev, p, c, items);
  const kvp::per_head_result& r = oc.res;

  say("\n  {:>3}  {:>9}  {:>13}  {:>11}  {:>5}  {:>5}  {:>7}  {:>10}\n", "seq", "positions", "tokens held",
      "blocks held", "asked", "freed", "evicted", "heavy kept");
  for (std::size_t i = 0; i < items.size(); ++i) {
    const i32 s = items[i].seq;
    long tokens = 0, kept_tokens = 0, blocks = 0, kept_blocks = 0, heavy = 0, heavy_kept = 0, evicted = 0;
    for (i32 l = 0; l < c.L; ++l)
      for (i32 h = 0; h < c.H; ++h) {
        const std::size_t row = c.row(l, s, h), j = static_cast<std::size_t>(l * c.H + h);
        const i32 T = before.lengths[row], n = r.new_lengths[i][j];
        tokens += T, kept_tokens += n, evicted += r.evicted[i][j];
        blocks += c.blocks_for(T), kept_blocks += c.blocks_for(n);
        for (i32 t = 0; t < T; ++t) heavy += before.heavy[s][before.positions[before.slot(row, t)]];
        for (i32 t = 0; t < n; ++t) heavy_kept += c.heavy[s][c.positions[c.slot(row, t)]];
      }
    say("  {:>3}  {:>9}  {:>13}  {:>11}  {:>5}  {:>5}  {:>7}  {:>10}\n", s, c.logical[s],
        str("{} -> {}", tokens, kept_tokens), str("{} -> {}", blocks, kept_blocks), items[i].blocks_to_free,
        r.freed[i], evicted, heavy == 0 ? std::string("-") : str("{:.0f}%", 100.0 * double(heavy_kept) / double(heavy)));
  }

  const i32 shown = std::min(c.L, 3);
  say("\ntokens per (layer, KV head), before -> after{}:\n",
      shown < c.L ? str(" (layers 0 to {} of {})", shown - 1, c.L) : std::string());
  for (std::size_t i = 0; i < items.size(); ++i)
    for (i32 l = 0; l < shown; ++l) {
      std::string line = l == 0 ? str("  seq {:<3} layer {:>2}:", items[i].seq, l) : str("          layer {:>2}:", l);
      for (i32 h = 0; h < c.H; ++h)
        line += str("  {:>4} -> {:<4}", before.lengths[c.row(l, items[i].seq, h)],
                    r.new_lengths[i][static_cast<std::size_t>(l * c.H + h)]);
      while (line.back() == ' ') line.pop_back();
      say("{}\n", line);
    }

  say("\n");
  const long bad = kvc_check(before, c, p, items, r);
  say("each head dense, on a block boundary, its tail blocks freed, K/V/metric/position intact, the protected window "
      "kept, blocks freed as asked (or all it could): {}\n",
      bad == 0 ? std::string("yes") : str("NO, {} checks failed", bad));
  if (oc.diff) {
    const kvc_agreement& a = *oc.diff;
    say("host vs cuda: new lengths, evicted counts and freed blocks {}; blocks freed per sequence {}; kept K/V rows "
        "{}\n",
        a.rows_differ == 0 ? str("identical in all {} (seq, layer, KV head) rows", a.rows)
                           : str("DIFFER in {} of {} rows", a.rows_differ, a.rows),
        a.items_differ == 0 ? std::string("identical") : str("DIFFER in {} sequences", a.items_differ),
        a.kv_rows_differ == 0 ? str("byte-identical ({} rows of K and V, with metric and position)", a.kv_rows)
                              : str("DIFFER: {} of {} rows", a.kv_rows_differ, a.kv_rows));
  }
  if (oc.host_ms) say("host compression: {:.3f} ms\n", *oc.host_ms);
  if (oc.gpu_ms)
    say("gpu compression: schedule {:.3f} ms, moves {:.3f} ms (CUDA events on {}, second run; copies excluded)\n",
        oc.gpu_ms->first, oc.gpu_ms->second, gpu.name);
  kvc_apply(c, items, r);
  say("free list after: {} blocks (was {})\n", c.free_blocks.size(), before.free_blocks.size());
  say("wall time {:.1f} ms\n", 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count());
  const bool agree = !oc.diff || (oc.diff->rows_differ == 0 && oc.diff->items_differ == 0 && oc.diff->kv_rows_differ == 0);
  return bad == 0 && agree ? 0 : 1;
}

}  // namespace
