// A decode loop that compresses as it goes: the engine side of kvpolicy in one file.
//
// The loop plays a small serving engine over synthetic K/V: a pool of cache blocks
// and an allocator, requests admitted while a slot (their peak blocks) is free, one
// token appended per running request per step, and the threshold trigger (Zipage
// 4.1, engine/triggers.hpp) compressing every sequence that reaches N_max full blocks
// with zipage. It runs twice, without and with compression, and prints what
// compression buys: requests running at once, blocks in use, steps and tokens per
// second.
//
// The engine (engine<Backend> below) is the host's bookkeeping: allocator, requests,
// trigger. The backend holds the cache and runs the compression. With a GPU (built
// from decode_loop.cu) it is gpu_backend (decode_loop_gpu.cuh): the whole step stays
// on the device and the host never waits for it; without one, host_backend runs the
// same loop on the host executor. The engine knows each compressed sequence's new
// length and released blocks without reading results back: uniform top-k keeps
// exactly the budget of a sequence longer than it, so the length is the budget and
// the blocks past it are released. Both backends check that the executor agrees
// (the GPU one as soon as the results arrive, without waiting for them).
//
//   kvpolicy_decode_loop [--device cuda|host] [--requests N] [--pool-blocks N]
//                        [--generate N] [--prompt N] [--n-max N] [--steps N]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "kvpolicy/kvpolicy.cuh"  // first: kvpolicy before fmt under nvcc
#else
#include "kvpolicy/kvpolicy.hpp"
#endif

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace {

using i32 = std::int32_t;

struct options {
  bool gpu = false;
  i32 layers = 4, kv_heads = 4, q_heads = 16, head_dim = 128, block = 64, window = 16;
  i32 n_max = 6;        // Zipage's N_max: a compressed sequence holds at most this many blocks
  i32 prompt = 128;     // tokens of each request's prompt
  i32 generate = 1024;  // tokens each request generates
  i32 requests = 64;    // requests to serve
  i32 pool_blocks = 256;
  i32 max_steps = 1 << 30;
};

// The compression: zipage with the example's window.
kvp::presets::zipage policy_for(const options& o) {
  kvp::presets::zipage p;
  p.scorer.window = o.window;
  p.protect.window = o.window;
  return p;
}

// What one run measured.
struct report {
  i32 finished = 0;
  std::int64_t steps = 0, tokens = 0, compressions = 0, compressed_sequences = 0, graph_replays = 0, host_waits = 0;
  double seconds = 0, running_sum = 0, blocks_sum = 0;
  i32 running_max = 0, blocks_max = 0;
};

// The cache's shape and the engine's tables, as both backends size them.
struct geometry {
  options o;
  i32 max_blocks = 0;  // width of the block table: a sequence's peak blocks
  i32 slots = 0;       // rows of the block table and query windows: requests at once
  kvp::cache_shape shape() const {
    return {o.layers, o.pool_blocks, o.block, o.kv_heads, o.head_dim, kvp::dtype::bf16};
  }
  std::size_t kv_elements() const {
    return 2 * std::size_t(o.layers) * o.pool_blocks * o.block * o.kv_heads * o.head_dim;
  }
  std::size_t token_slots() const { return std::size_t(o.layers) * o.pool_blocks * o.block * o.kv_heads; }
  std::size_t query_row() const { return std::size_t(o.q_heads) * o.head_dim; }
  std::size_t query_elements() const { return std::size_t(o.layers) * slots * o.window * query_row(); }
  // The cache over the backend's memory (host or device): nano-vllm's layout, with
  // each token's position.
  kvp::paged_kv_view cache(std::uint16_t* kv, const i32* table, const i32* lengths, i32* positions) const {
    kvp::paged_kv_view v = kvp::layouts::nano_vllm(
        kv, shape(), {.table = kvp::block_table_view::dense(table, max_blocks), .lengths = lengths, .num_seqs = slots});
    v.positions = kvp::position_view::contiguous(positions, o.pool_blocks, o.block, o.kv_heads);
    return v;
  }
};

// One token to write: request `request`'s token at `position`, stored at index t of
// its cache row `seq`, in physical block `block`. The newest query goes to row
// `query_row` of the slot's window (-1: none), after shifting the window down one row
// when `shift_queries`; `last` marks the row's last token of a write batch, which
// sets its length.
struct token_write {
  i32 seq, t, position, block, request, query_row;
  std::uint8_t shift_queries, last;
};

// Deterministic synthetic bf16 bits for element i of stream s (0 key, 1 value,
// 2 query) of request r at position p: either sign, magnitudes in [2^-7, 2).
KVP_HOST_DEVICE constexpr std::uint16_t synthetic(std::uint32_t s, std::uint32_t r, std::uint32_t p,
                                                  std::uint32_t i) {
  std::uint32_t x = (r * 0x9E3779B1u) ^ (p * 0x85EBCA77u) ^ (i * 0xC2B2AE3Du) ^ (s * 0x27D4EB2Fu);
  x ^= x >> 15, x *= 0x2C1B3C6Du, x ^= x >> 12, x *= 0x297A2D39u, x ^= x >> 15;
  return static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | ((120u + ((x >> 8) & 7u)) << 7) | (x & 0x7fu));
}

// The pieces of a token write, shared by the host backend's loops and the GPU
// kernel (one thread each). Element e of the token's K and V rows in layer l (e in
// [0, h_kv * d)), and its position with the first element of each head.
KVP_HOST_DEVICE inline void write_kv_element(const kvp::paged_kv_view& c, const token_write& w, i32 l, i32 e) {
  const i32 h = e / c.head_dim, i = e % c.head_dim, slot = w.t % c.block_size;
  const std::uint32_t at = static_cast<std::uint32_t>(l * c.num_kv_heads * c.head_dim + e);
  reinterpret_cast<std::uint16_t*>(c.k_row_at(l, w.block, slot, h))[i] = synthetic(0, w.request, w.position, at);
  reinterpret_cast<std::uint16_t*>(c.v_row_at(l, w.block, slot, h))[i] = synthetic(1, w.request, w.position, at);
  if (i == 0) c.positions.at(l, w.block, slot, h) = w.position;
}
// Column `col` of the slot's query window in layer l (`window` rows of `row`
// elements): shifted down one row, then the new query's element written.
KVP_HOST_DEVICE inline void write_query_column(std::uint16_t* window_base, i32 window, i32 row, const token_write& w,
                                               i32 l, i32 col) {
  if (w.query_row < 0) return;
  if (w.shift_queries)
    for (i32 j = 0; j + 1 < window; ++j) window_base[j * row + col] = window_base[(j + 1) * row + col];
  window_base[w.query_row * row + col] = synthetic(2, w.request, w.position, static_cast<std::uint32_t>(l * row + col));
}
// The block table entry of a token that opens a block, the length after a row's last token.
KVP_HOST_DEVICE inline void write_table_entry(i32* table, i32 max_blocks, i32* lengths, i32 block_size,
                                              const token_write& w) {
  if (w.t % block_size == 0) table[w.seq * max_blocks + w.t / block_size] = w.block;
  if (w.last) lengths[w.seq] = w.t + 1;
}

// What the engine expects of a compression: each item's new length and the blocks it
// releases (in table order).
struct expected_outcome {
  std::vector<i32> new_lengths;
  std::vector<std::vector<i32>> released;
};

// Throws unless an executor's result for item i matches what the engine expected.
void check_outcome(const expected_outcome& want, std::size_t i, i32 seq, i32 new_length,
                   std::vector<i32> released) {
  std::vector<i32> expect = want.released[i];
  std::ranges::sort(expect), std::ranges::sort(released);
  if (new_length != want.new_lengths[i] || released != expect)
    throw std::runtime_error(fmt::format(
        "seq {}: the executor left length {} and released blocks {}; the engine expected {} and {}", seq,
        new_length, released, want.new_lengths[i], expect));
}

// The memory both backends keep, in host or device vectors alike: K/V, the query
// windows, F, positions, the block table and the lengths.
template <template <class...> class Vec>
struct cache_storage {
  explicit cache_storage(const geometry& g)
      : kv(g.kv_elements(), 0),
        queries(g.query_elements(), 0),
        f(g.token_slots(), 0.0f),
        positions(g.token_slots(), -1),
        table(std::size_t(g.slots) * g.max_blocks, 0),
        lengths(g.slots, 0) {}
  Vec<std::uint16_t> kv, queries;
  Vec<float> f;
  Vec<i32> positions, table, lengths;
};

// The host backend: the cache in host memory, compressed by kvp::host_executor.
class host_backend {
 public:
  host_backend(const geometry& g, bool /*compress*/)
      : g_(g),
        policy_(policy_for(g.o)),
        mem_(g) {}

  void write(const token_write& w) {
    const kvp::paged_kv_view c = cache();
    const i32 row = static_cast<i32>(g_.query_row());
    for (i32 l = 0; l < g_.o.layers; ++l) {
      for (i32 e = 0; e < g_.o.kv_heads * g_.o.head_dim; ++e) write_kv_element(c, w, l, e);
      std::uint16_t* window = mem_.queries.data() + (std::size_t(l) * g_.slots + w.seq) * g_.o.window * row;
      for (i32 col = 0; col < row; ++col) write_query_column(window, g_.o.window, row, w, l, col);
    }
    write_table_entry(mem_.table.data(), g_.max_blocks, mem_.lengths.data(), g_.o.block, w);
  }
  void end_step(report&) {}
  void release(i32 seq) { mem_.lengths[seq] = 0; }
  // Compresses the items and checks the result against the engine's expectation.
  void compress(std::span<const kvp::batch_item> items, const expected_outcome& want, report&) {
    const auto queries = kvp::query_window_view::contiguous(mem_.queries.data(), g_.o.layers, g_.slots, g_.o.window,
                                                            g_.o.q_heads, g_.o.head_dim, kvp::dtype::bf16);
    const auto scores = kvp::score_view::contiguous(mem_.f.data(), g_.o.pool_blocks, g_.o.block, g_.o.kv_heads);
    const kvp::host_result r = kvp::host_executor{}.compress(policy_, cache(), queries, scores, {.items = items});
    for (std::size_t i = 0; i < items.size(); ++i) {
      check_outcome(want, i, items[i].seq, r.new_lengths[i], r.released_blocks[i]);
      mem_.lengths[items[i].seq] = r.new_lengths[i];
    }
  }
  void drain(report&) {}

 private:
  kvp::paged_kv_view cache() { return g_.cache(mem_.kv.data(), mem_.table.data(), mem_.lengths.data(), mem_.positions.data()); }

  geometry g_;
  kvp::presets::zipage policy_;
  cache_storage<std::vector> mem_;
};

}  // namespace

#if defined(__CUDACC__)
#include "decode_loop_gpu.cuh"
#endif

namespace {

// One request as the engine tracks it.
struct request {
  i32 id = 0;
  kvp::sequence_state state;  // seq: its slot (cache row and query window)
  std::vector<i32> blocks;    // its block table row
  i32 generated = 0;
};

// The engine: the allocator, the running requests, the trigger, and the loop.
template <class Backend>
class engine {
 public:
  engine(const options& o, bool compress) : g_(geometry_of(o, compress)), compress_(compress), backend_(g_, compress) {
    trigger_ = {.block_size = o.block, .max_blocks = o.n_max};
    for (i32 id = o.pool_blocks - 1; id >= 0; --id) free_.push_back(id);
    for (i32 s = g_.slots - 1; s >= 0; --s) free_slots_.push_back(s);
    for (i32 r = 0; r < o.requests; ++r) waiting_.push_back(r);
  }

  report run() {
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t step = 0;
    while ((!running_.empty() || !waiting_.empty()) && step < g_.o.max_steps) {
      while (admit()) {
      }
      ++step;
      append_all();
      backend_.end_step(rep_);
      if (compress_) compress_due(step);
      record();
      finish_done();
    }
    backend_.drain(rep_);
    rep_.steps = step;
    rep_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep_;
  }

 private:
  // Without compression a request's table holds every token it will have; with it,
  // N_max blocks (the trigger fires when the N_max-th fills). Slots are what the
  // pool holds of those peaks: admission reserves a request's peak.
  static geometry geometry_of(const options& o, bool compress) {
    const i32 peak = compress ? o.n_max : (o.prompt + o.generate + o.block - 1) / o.block;
    return {o, peak, o.pool_blocks / peak};
  }

  // Admits the next waiting request if a slot is free; its prompt is written (a
  // prefill that leaves the last `window` queries in its query window).
  bool admit() {
    if (waiting_.empty() || free_slots_.empty()) return false;
    request q;
    q.id = waiting_.front();
    q.state.seq = q.state.query_slot = free_slots_.back();
    const i32 p = g_.o.prompt, w = g_.o.window;
    for (i32 t = 0; t < p; ++t) {
      if (t % g_.o.block == 0) q.blocks.push_back(allocate());
      backend_.write({.seq = q.state.seq, .t = t, .position = t, .block = q.blocks.back(), .request = q.id,
                      .query_row = t >= p - w ? t - (p - w) : -1, .shift_queries = 0, .last = t + 1 == p});
    }
    q.state.length = p;
    waiting_.pop_front();
    free_slots_.pop_back();
    running_.push_back(std::move(q));
    return true;
  }

  // One generated token per running request, a new block when the last one is full.
  void append_all() {
    for (request& q : running_) {
      const i32 t = q.state.length;
      if (t % g_.o.block == 0) q.blocks.push_back(allocate());
      backend_.write({.seq = q.state.seq, .t = t, .position = g_.o.prompt + q.generated, .block = q.blocks.back(),
                      .request = q.id, .query_row = g_.o.window - 1, .shift_queries = 1, .last = 1});
      q.state.append();
      ++q.generated;
      ++rep_.tokens;
    }
  }

  // The threshold trigger's batch: compressed by the backend, the blocks past each
  // new length back to the allocator at once.
  void compress_due(std::int64_t step) {
    states_.clear();
    for (const request& q : running_) states_.push_back(q.state);
    kvp::due_items(trigger_, states_, step, items_);
    if (items_.empty()) return;
    expected_outcome want;
    for (const kvp::batch_item& it : items_) {
      const request& q = by_seq(it.seq);
      const i32 length = std::min(it.budget, q.state.length);
      const auto kept_blocks = static_cast<std::size_t>((length + g_.o.block - 1) / g_.o.block);
      want.new_lengths.push_back(length);
      want.released.emplace_back(q.blocks.begin() + static_cast<std::ptrdiff_t>(kept_blocks), q.blocks.end());
    }
    backend_.compress(items_, want, rep_);
    kvp::record_compression(states_, items_, want.new_lengths, step);
    for (std::size_t i = 0; i < items_.size(); ++i) {
      request& q = by_seq(items_[i].seq);
      q.state = *std::ranges::find(states_, q.state.seq, &kvp::sequence_state::seq);
      for (i32 id : want.released[i]) free_.push_back(id);
      q.blocks.resize(q.blocks.size() - want.released[i].size());
    }
    ++rep_.compressions;
    rep_.compressed_sequences += static_cast<std::int64_t>(items_.size());
  }

  // Requests that generated all their tokens leave, their blocks and slot freed.
  void finish_done() {
    for (std::size_t i = 0; i < running_.size();) {
      if (running_[i].generated < g_.o.generate) {
        ++i;
        continue;
      }
      for (i32 id : running_[i].blocks) free_.push_back(id);
      free_slots_.push_back(running_[i].state.seq);
      backend_.release(running_[i].state.seq);
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
      ++rep_.finished;
    }
  }

  void record() {
    const i32 blocks = g_.o.pool_blocks - static_cast<i32>(free_.size());
    rep_.running_sum += static_cast<double>(running_.size());
    rep_.blocks_sum += blocks;
    rep_.running_max = std::max(rep_.running_max, static_cast<i32>(running_.size()));
    rep_.blocks_max = std::max(rep_.blocks_max, blocks);
  }

  // A slot's reservation keeps its peak free, so the pool never runs dry.
  i32 allocate() {
    if (free_.empty()) throw std::logic_error("the block pool ran dry despite the reservations");
    const i32 id = free_.back();
    free_.pop_back();
    return id;
  }
  request& by_seq(i32 seq) { return *std::ranges::find(running_, seq, [](const request& q) { return q.state.seq; }); }

  geometry g_;
  bool compress_;
  Backend backend_;
  kvp::trigger::threshold trigger_;
  std::vector<i32> free_, free_slots_;
  std::deque<i32> waiting_;
  std::vector<request> running_;
  std::vector<kvp::sequence_state> states_;
  std::vector<kvp::batch_item> items_;
  report rep_;
};

void print(const char* title, const report& r) {
  const double steps = static_cast<double>(std::max<std::int64_t>(r.steps, 1));
  fmt::print(
      "{}: {} requests done in {} steps, {:.1f} running on average ({} at most), blocks in use {:.0f} on average "
      "({} at most), {:.0f} steps/s, {:.0f} tokens/s",
      title, r.finished, r.steps, r.running_sum / steps, r.running_max, r.blocks_sum / steps, r.blocks_max,
      static_cast<double>(r.steps) / r.seconds, static_cast<double>(r.tokens) / r.seconds);
  if (r.compressions > 0) fmt::print(", {} compressions of {} sequences", r.compressions, r.compressed_sequences);
  if (r.graph_replays > 0) fmt::print(" ({} graph replays, {} host waits)", r.graph_replays, r.host_waits);
  fmt::print("\n");
}

options parse(int argc, char** argv) {
  options o;
#if defined(__CUDACC__)
  int devices = 0;
  o.gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#endif
  bool sized = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{} needs a value", a));
    const std::string_view v = argv[++i];
    const auto number = [&] {
      std::size_t used = 0;
      const int n = std::stoi(std::string(v), &used);
      if (used != v.size() || n <= 0) throw std::invalid_argument(fmt::format("{} is {}; a positive integer", a, v));
      sized = true;
      return n;
    };
    if (a == "--device") {
      if (v != "cuda" && v != "host") throw std::invalid_argument(fmt::format("--device is {}; cuda or host", v));
      o.gpu = v == "cuda";
    } else if (a == "--requests") {
      o.requests = number();
    } else if (a == "--pool-blocks") {
      o.pool_blocks = number();
    } else if (a == "--generate") {
      o.generate = number();
    } else if (a == "--prompt") {
      o.prompt = number();
    } else if (a == "--n-max") {
      o.n_max = number();
    } else if (a == "--steps") {
      o.max_steps = number();
    } else {
      throw std::invalid_argument(fmt::format("unknown argument {} (see the comment at the top)", a));
    }
  }
#if !defined(__CUDACC__)
  if (o.gpu) throw std::invalid_argument("--device cuda needs the CUDA build (decode_loop.cu)");
#endif
  if (!o.gpu && !sized) {
    // The host executor is far slower: a smaller load, unless sizes were given.
    o.layers = 2, o.kv_heads = 2, o.q_heads = 8, o.requests = 12, o.generate = 512, o.pool_blocks = 64, o.n_max = 4;
  }
  if (o.n_max < 2) throw std::invalid_argument(fmt::format("--n-max is {}; at least 2", o.n_max));
  if (o.prompt < o.window)
    throw std::invalid_argument(fmt::format("--prompt is {}; at least the window, {}", o.prompt, o.window));
  if (o.prompt + o.generate <= o.n_max * o.block)
    throw std::invalid_argument(fmt::format("--prompt + --generate is {}; requests must outgrow N_max * b = {}",
                                            o.prompt + o.generate, o.n_max * o.block));
  if (o.prompt >= o.n_max * o.block)
    throw std::invalid_argument(
        fmt::format("--prompt is {}; less than N_max * b = {}, where compression starts", o.prompt, o.n_max * o.block));
  if (o.pool_blocks < (o.prompt + o.generate + o.block - 1) / o.block)
    throw std::invalid_argument(fmt::format("--pool-blocks is {}; too few for one request without compression ({})",
                                            o.pool_blocks, (o.prompt + o.generate + o.block - 1) / o.block));
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    fmt::print(
        "decode loop on {}: {} requests of {} + {} tokens; a pool of {} blocks of {} tokens; L {}, h_kv {}, h_q {}, d "
        "{}, bf16; zipage at N_max {} (budget {})\n",
        o.gpu ? "the GPU" : "the host", o.requests, o.prompt, o.generate, o.pool_blocks, o.block, o.layers, o.kv_heads,
        o.q_heads, o.head_dim, o.n_max, (o.n_max - 1) * o.block);
    for (bool compress : {false, true}) {
      report r;
#if defined(__CUDACC__)
      if (o.gpu)
        r = engine<gpu_backend>(o, compress).run();
      else
#endif
        r = engine<host_backend>(o, compress).run();
      print(compress ? "with compression   " : "without compression", r);
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
