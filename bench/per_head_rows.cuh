// Per-head rows of kvpolicy_bench (included by compress_bench.cu, inside its
// anonymous namespace, after its CUDA plumbing): KV-Compress over a per-head block
// cache with kvp::cuda_per_head_executor.
//
//   e2e|stage/kv_compress/B            configuration B, positions not carried (slots are positions)
//   e2e|stage/kv_compress/B_positions  the same with a positions array moved with the tokens
//   metric/kv_compress/B_prefill|B_decode  cuda_per_head_metric on configuration B (h_q 32): the
//                                      prefill metric of every slot from the last 32 queries, or
//                                      one decode step's update; metric_TFLOP counts QK^T (2 d
//                                      flops a query-key pair, twice for the prefill's two passes)
//
// Configuration B (KV-Compress's setting): b 16, 32 layers, h_kv 8, d 128, bf16, 16
// sequences of 8192 tokens in every head, one pool of blocks shared by every layer
// (KV-Compress's unified cache, [N, b, d] for K and for V), block ids shuffled; the
// metric uniform random in [0, 1); budget 25%: each sequence keeps 2048 tokens per
// head on average over its 256 heads, i.e. frees blocks_to_free_for_tokens(held, 2048,
// 256, 16) = 98304 of its 131072 blocks; protected window 64, no sinks.
//
// Byte model (what an ideal implementation must touch, counted once):
//   schedule  the metric (and positions) of every token read once    rows * T * (4 [+ 4])
//   moves     K and V of every moved token read and written,
//             its metric (and position) read and written             moved * (2 * 2 * d * es + 2 * (4 [+ 4]))
// `moved` is the executor's own count (device_per_head_result::moved) of an untimed
// run. The schedule reads the metric four times in fact (one radix pass each) and
// each evicting head's once more per select pass (from L2 mostly); the model does
// not count those, so its copy_fraction is what the useful bytes achieve.

struct per_head_shape {
  std::int32_t seqs = 16, tokens = 8192, layers = 32, kv_heads = 8, head_dim = 128, block_size = 16;
  double keep = 0.25;  // tokens kept per head, as a fraction of `tokens`
  std::int32_t protected_window = 64;
  bool positions = false;
  kvp::dtype type = kvp::dtype::bf16;

  std::int32_t blocks_per_head() const { return (tokens + block_size - 1) / block_size; }
  std::int32_t heads_per_seq() const { return layers * kv_heads; }
  std::int64_t rows() const { return std::int64_t{seqs} * heads_per_seq(); }
  std::int32_t num_blocks() const { return static_cast<std::int32_t>(rows() * blocks_per_head()); }
  std::int64_t es() const { return kvp::size_of(type); }
};

class per_head_bench_case {
 public:
  per_head_bench_case(const per_head_shape& s, cudaStream_t stream) : s_(s), stream_(stream) {
    const std::int64_t N = s.num_blocks(), b = s.block_size, d = s.head_dim;
    const std::size_t kv_bytes = static_cast<std::size_t>(N * b * d * s.es());
    const std::size_t slots = static_cast<std::size_t>(N * b);
    k_ = dbuf(kv_bytes), v_ = dbuf(kv_bytes), k0_ = dbuf(kv_bytes), v0_ = dbuf(kv_bytes);
    metric_ = dbuf(slots * 4), metric0_ = dbuf(slots * 4);
    fill_uniform(k0_.get(), static_cast<std::size_t>(N * b * d), s.type, 21, -1.0f, 1.0f, stream);
    fill_uniform(v0_.get(), static_cast<std::size_t>(N * b * d), s.type, 22, -1.0f, 1.0f, stream);
    fill_uniform(metric0_.get(), slots, kvp::dtype::f32, 23, 0.0f, 1.0f, stream);
    // Tables [L, S, H, blocks]: every block id once, shuffled; every head full.
    std::vector<std::int32_t> ids(static_cast<std::size_t>(N));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(24));
    table_ = dbuf(ids.size() * 4);
    KVP_BENCH_CHECK(cudaMemcpy(table_.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    const std::vector<std::int32_t> lengths(static_cast<std::size_t>(s.rows()), s.tokens);
    lengths_ = dbuf(lengths.size() * 4);
    KVP_BENCH_CHECK(cudaMemcpy(lengths_.get(), lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice));
    if (s.positions) {
      // Each head's slot t holds position t: the cost of carrying positions, not of a shuffle.
      std::vector<std::int32_t> pos(slots);
      for (std::size_t i = 0; i < ids.size(); ++i)
        for (std::int64_t t = 0; t < b; ++t)
          pos[static_cast<std::size_t>(ids[i] * b + t)] =
              static_cast<std::int32_t>((static_cast<std::int64_t>(i) % s.blocks_per_head()) * b + t);
      positions_ = dbuf(slots * 4), positions0_ = dbuf(slots * 4);
      KVP_BENCH_CHECK(cudaMemcpy(positions0_.get(), pos.data(), slots * 4, cudaMemcpyHostToDevice));
    }
    // Items: every sequence, the 25% budget as blocks.
    std::vector<kvp::per_head_item> items;
    for (std::int32_t q = 0; q < s.seqs; ++q) {
      const std::int64_t held = std::int64_t{s.heads_per_seq()} * s.blocks_per_head();
      const auto keep = static_cast<std::int64_t>(s.keep * s.tokens);
      items.push_back({.seq = q,
                       .blocks_to_free = kvp::select::blocks_to_free_for_tokens(held, keep, s.heads_per_seq(), s.block_size),
                       .per_layer = nullptr,
                       .logical_length = s.positions ? s.tokens : -1});
    }
    items_ = dbuf(items.size() * sizeof(kvp::per_head_item));
    KVP_BENCH_CHECK(cudaMemcpy(items_.get(), items.data(), items_.bytes(), cudaMemcpyHostToDevice));
    asked_ = items.front().blocks_to_free * s.seqs;

    view_.num_layers = s.layers, view_.num_blocks = static_cast<std::int32_t>(N), view_.block_size = s.block_size;
    view_.num_kv_heads = s.kv_heads, view_.head_dim = s.head_dim, view_.num_seqs = s.seqs;
    view_.max_blocks = s.blocks_per_head(), view_.type = s.type, view_.shared_pool = true;
    view_.k = {k_.get(), 0, nullptr, 0};
    view_.v = {v_.get(), 0, nullptr, 0};
    view_.k_stride = view_.v_stride = kvp::per_head_kv_strides::contiguous(s.block_size, s.head_dim);
    view_.table = kvp::per_head_array::dense(table_.get<std::int32_t>(), s.seqs, s.kv_heads, s.blocks_per_head());
    view_.lengths = kvp::per_head_array::dense(lengths_.get<std::int32_t>(), s.seqs, s.kv_heads);
    view_.metric = kvp::per_slot_metric::shared(metric_.get<float>(), s.block_size);
    if (s.positions) view_.positions = kvp::per_slot_positions::shared(positions_.get<std::int32_t>(), s.block_size);

    const auto rows = static_cast<std::size_t>(s.rows());
    status_ = dbuf(kvp::status_words * 4), new_lengths_ = dbuf(rows * 4), freed_counts_ = dbuf(rows * 4);
    freed_blocks_ = dbuf(rows * static_cast<std::size_t>(s.blocks_per_head()) * 4), moved_ = dbuf(rows * 4);
    freed_ = dbuf(static_cast<std::size_t>(s.seqs) * 8);
    out_ = {status_.get<std::int32_t>(),       new_lengths_.get<std::int32_t>(), freed_counts_.get<std::int32_t>(),
            freed_blocks_.get<std::int32_t>(), nullptr,                          moved_.get<std::int32_t>(),
            freed_.get<std::int64_t>(),        nullptr};
    std::size_t bytes = 0;
    KVP_BENCH_CHECK(ex().compress(nullptr, bytes, sel(), view_, batch(), out_));
    temp_ = dbuf(bytes);
    temp_bytes_ = bytes;
  }

  const kvp::per_head_kv_view& view() const { return view_; }
  kvp::select::head_adaptive_blocks sel() const { return {.protected_window = s_.protected_window, .sinks = 0}; }
  kvp::device_per_head_batch batch() const { return {items_.get<kvp::per_head_item>(), s_.seqs}; }
  kvp::cuda_per_head_executor ex(cudaEvent_t* marks = nullptr) const { return {.stream = stream_, .stage_marks = marks}; }

  void restore() {
    KVP_BENCH_CHECK(cudaMemcpyAsync(k_.get(), k0_.get(), k_.bytes(), cudaMemcpyDeviceToDevice, stream_));
    KVP_BENCH_CHECK(cudaMemcpyAsync(v_.get(), v0_.get(), v_.bytes(), cudaMemcpyDeviceToDevice, stream_));
    KVP_BENCH_CHECK(cudaMemcpyAsync(metric_.get(), metric0_.get(), metric_.bytes(), cudaMemcpyDeviceToDevice, stream_));
    if (s_.positions)
      KVP_BENCH_CHECK(
          cudaMemcpyAsync(positions_.get(), positions0_.get(), positions_.bytes(), cudaMemcpyDeviceToDevice, stream_));
  }
  cudaError_t compress(cudaEvent_t* marks) {
    std::size_t bytes = temp_bytes_;
    return ex(marks).compress(temp_.get(), bytes, sel(), view_, batch(), out_);
  }
  // After a run: the device status checked, tokens moved and blocks freed summed.
  std::pair<std::int64_t, std::int64_t> outcome() const {
    std::array<std::int32_t, kvp::status_words> st{};
    KVP_BENCH_CHECK(cudaMemcpy(st.data(), status_.get(), sizeof st, cudaMemcpyDeviceToHost));
    kvp::check(st.data());
    std::vector<std::int32_t> moved(static_cast<std::size_t>(s_.rows()));
    std::vector<std::int64_t> freed(static_cast<std::size_t>(s_.seqs));
    KVP_BENCH_CHECK(cudaMemcpy(moved.data(), moved_.get(), moved.size() * 4, cudaMemcpyDeviceToHost));
    KVP_BENCH_CHECK(cudaMemcpy(freed.data(), freed_.get(), freed.size() * 8, cudaMemcpyDeviceToHost));
    return {std::accumulate(moved.begin(), moved.end(), std::int64_t{0}),
            std::accumulate(freed.begin(), freed.end(), std::int64_t{0})};
  }
  std::int64_t asked() const { return asked_; }
  std::size_t temp_bytes() const { return temp_bytes_; }

 private:
  per_head_shape s_;
  cudaStream_t stream_;
  dbuf k_, v_, k0_, v0_, metric_, metric0_, positions_, positions0_, table_, lengths_, items_;
  dbuf status_, new_lengths_, freed_counts_, freed_blocks_, moved_, freed_, temp_;
  std::size_t temp_bytes_ = 0;
  std::int64_t asked_ = 0;
  kvp::per_head_kv_view view_{};
  kvp::device_per_head_result out_{};
};

void bench_per_head(benchmark::State& state, per_head_shape s, bool stages) {
  try {
    stream_guard stream;
    per_head_bench_case bc(s, stream);
    bc.restore();
    KVP_BENCH_CHECK(bc.compress(nullptr));  // untimed: warm-up and the moved count
    KVP_BENCH_CHECK(cudaStreamSynchronize(stream));
    const auto [moved, freed] = bc.outcome();
    event start, stop;
    std::array<event, 3> mark_events;
    std::array<cudaEvent_t, 3> marks{mark_events[0], mark_events[1], mark_events[2]};
    double e2e_s = 0.0, schedule_s = 0.0, moves_s = 0.0;
    for (auto _ : state) {
      bc.restore();
      KVP_BENCH_CHECK(cudaEventRecord(start, stream));
      KVP_BENCH_CHECK(bc.compress(stages ? marks.data() : nullptr));
      KVP_BENCH_CHECK(cudaEventRecord(stop, stream));
      KVP_BENCH_CHECK(cudaEventSynchronize(stop));
      const double e2e = elapsed_ms(start, stop) * 1e-3;
      e2e_s += e2e;
      if (stages) {
        schedule_s += elapsed_ms(marks[0], marks[1]) * 1e-3;
        moves_s += elapsed_ms(marks[1], marks[2]) * 1e-3;
      }
      state.SetIterationTime(e2e);
    }
    bc.outcome();  // the last timed run's status
    const double iters = static_cast<double>(state.iterations());
    const double tokens = double(s.rows()) * s.tokens, slot_bytes = s.positions ? 8.0 : 4.0;
    const double schedule_bytes = tokens * slot_bytes;
    const double moves_bytes = double(moved) * (2.0 * 2.0 * s.head_dim * double(s.es()) + 2.0 * slot_bytes);
    state.counters["rows"] = double(s.rows());
    state.counters["tokens"] = s.tokens;
    state.counters["asked_blocks"] = double(bc.asked());
    state.counters["freed_blocks"] = double(freed);
    state.counters["moved_tokens"] = double(moved);
    state.counters["workspace_MiB"] = double(bc.temp_bytes()) / double(1 << 20);
    state.counters["e2e_ms"] = e2e_s / iters * 1e3;
    state.counters["bytes"] = schedule_bytes + moves_bytes;
    set_rate(state, "", schedule_bytes + moves_bytes, e2e_s / iters);
    if (stages) {
      state.counters["schedule_ms"] = schedule_s / iters * 1e3;
      state.counters["moves_ms"] = moves_s / iters * 1e3;
      set_rate(state, "schedule_", schedule_bytes, schedule_s / iters);
      set_rate(state, "moves_", moves_bytes, moves_s / iters);
    }
  } catch (const std::exception& e) {
    ++g_failed_rows;
    state.SkipWithError(e.what());
  }
}

void bench_per_head_metric(benchmark::State& state, per_head_shape s, bool prefill) {
  try {
    stream_guard stream;
    per_head_bench_case bc(s, stream);
    constexpr std::int32_t q_heads = 32, window = 32;
    const kvp::scorer::squared_attention_metric m{};
    dbuf q(static_cast<std::size_t>(s.layers) * s.seqs * window * q_heads * s.head_dim * s.es());
    fill_uniform(q.get(), q.bytes() / s.es(), s.type, 31, -1.0f, 1.0f, stream);
    const auto qv = kvp::query_window_view::contiguous(q.get(), s.layers, s.seqs, window, q_heads, s.head_dim, s.type);
    std::vector<std::int32_t> seq_ids(static_cast<std::size_t>(s.seqs));
    std::iota(seq_ids.begin(), seq_ids.end(), 0);
    dbuf seqs(seq_ids.size() * 4), status(kvp::status_words * 4);
    KVP_BENCH_CHECK(cudaMemcpy(seqs.get(), seq_ids.data(), seqs.bytes(), cudaMemcpyHostToDevice));
    const kvp::device_metric_batch batch{seqs.get<std::int32_t>(), seqs.get<std::int32_t>(), s.seqs, nullptr,
                                         status.get<std::int32_t>()};
    const kvp::cuda_per_head_metric run{.stream = stream};
    std::size_t bytes = 0;
    KVP_BENCH_CHECK(run.prefill(nullptr, bytes, m, bc.view(), qv, batch));
    dbuf temp(bytes);
    auto once = [&] {
      return prefill ? run.prefill(temp.get(), bytes, m, bc.view(), qv, batch) : run.decode(m, bc.view(), qv, batch);
    };
    KVP_BENCH_CHECK(once());  // warm-up
    event start, stop;
    double total = 0.0;
    for (auto _ : state) {
      KVP_BENCH_CHECK(cudaEventRecord(start, stream));
      KVP_BENCH_CHECK(once());
      KVP_BENCH_CHECK(cudaEventRecord(stop, stream));
      KVP_BENCH_CHECK(cudaEventSynchronize(stop));
      const double sec = elapsed_ms(start, stop) * 1e-3;
      total += sec;
      state.SetIterationTime(sec);
    }
    std::array<std::int32_t, kvp::status_words> st{};
    KVP_BENCH_CHECK(cudaMemcpy(st.data(), status.get(), sizeof st, cudaMemcpyDeviceToHost));
    kvp::check(st.data());
    const double mean = total / static_cast<double>(state.iterations());
    const double pairs = double(s.rows()) * (q_heads / s.kv_heads) * (prefill ? window : 1) * s.tokens;
    const double flops = pairs * 2.0 * s.head_dim * 2.0;  // two passes: statistics, then probabilities
    state.counters["metric_ms"] = mean * 1e3;
    state.counters["metric_TFLOP"] = flops / 1e12;
    state.counters["metric_TFLOP_per_s"] = flops / mean / 1e12;
    // Keys read once per pass and query head, the metric written (prefill) or read and written (decode).
    set_rate(state, "", double(s.rows()) * s.tokens * (s.head_dim * double(s.es()) + (prefill ? 4.0 : 8.0)), mean);
  } catch (const std::exception& e) {
    ++g_failed_rows;
    state.SkipWithError(e.what());
  }
}

void register_per_head_rows() {
  for (bool prefill : {true, false})
    benchmark::RegisterBenchmark(prefill ? "metric/kv_compress/B_prefill" : "metric/kv_compress/B_decode",
                                 [prefill](benchmark::State& st) { bench_per_head_metric(st, per_head_shape{}, prefill); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(prefill ? 2 : 10);
  for (bool positions : {false, true})
    for (bool stages : {false, true}) {
      per_head_shape s;
      s.positions = positions;
      const std::string name = std::string(stages ? "stage" : "e2e") + "/kv_compress/B" + (positions ? "_positions" : "");
      benchmark::RegisterBenchmark(name.c_str(), [s, stages](benchmark::State& st) { bench_per_head(st, s, stages); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(10);
    }
}
