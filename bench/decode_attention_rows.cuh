// Decode-attention rows of kvpolicy_bench (included by compress_bench.cu, inside its
// anonymous namespace, after its CUDA plumbing): kvp::cuda_decode_attention, one new
// token per sequence attending one layer.
//
//   decode[_staged]/<cache>/<shape>[_metric]    (_staged: cuda_decode_attention::staged)
//     cache   per_head   a per-head block cache (KV-Compress's: [N, b, d] for K and V,
//                        each (seq, KV head) its own shuffled blocks and length)
//             counts     a paged cache (nano-vllm's [N, b, h_kv, d], one shuffled table per
//                        sequence), each head attending its own count (Hard-KV after a
//                        compaction): counts uniform in [T / 2, T]
//             live       the same, every head the sequence's length with a live mask
//                        dropping 30% of the slots (cautious update)
//             paged      the same, every head the sequence's length: the plain baseline
//     shape   B          configuration B's sizes (per_head_rows.cuh) for one layer: 16
//                        sequences x 8192 tokens, h_kv 8, h_q 32, d 128, bf16, b 16
//             B_ragged   the same with per-head lengths (counts) uniform in [512, 3584]:
//                        a cache after KV-Compress at 25% (per_head, counts only)
//             64x4096, 256x2048  sequences x tokens, h_q 32, h_kv 8, d 128, bf16, b 16
//     _metric the epilogue in the same call: KV-Compress's squared probabilities into the
//             metric (per_head), H2O's probabilities into F (paged caches); the row also
//             times the call without it (attention_ms) and reports metric_overhead, the
//             ratio minus one
//
// Byte model: K and V of every attended token read once (2 * d * es per token, tokens
// summed over the heads: the live mask's dropped slots not counted, though the kernel
// reads them), queries read and outputs written (negligible). GB/s = bytes / time;
// copy_fraction = GB/s / (best measured copy GB/s, read + write).

struct decode_shape {
  std::int32_t seqs = 16, tokens = 8192, kv_heads = 8, q_heads = 32, head_dim = 128, block_size = 16;
  bool ragged = false;
  kvp::dtype type = kvp::dtype::bf16;
};

enum class decode_cache { per_head, counts, live, paged };

class decode_bench_case {
 public:
  decode_bench_case(const decode_shape& s, decode_cache kind, bool metric, bool staged, cudaStream_t stream)
      : s_(s), kind_(kind), staged_(staged), stream_(stream) {
    const std::int64_t b = s.block_size, d = s.head_dim, H = s.kv_heads, per_seq = (s.tokens + b - 1) / b;
    std::mt19937 rng(41);
    // Each head's attended length.
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(s.seqs * H), s.tokens);
    if (s.ragged)
      for (auto& x : lengths) x = std::uniform_int_distribution<std::int32_t>(512, 3584)(rng);
    else if (kind == decode_cache::counts)
      for (auto& x : lengths) x = std::uniform_int_distribution<std::int32_t>(s.tokens / 2, s.tokens)(rng);
    for (auto x : lengths) attended_ += x;
    dbuf q(static_cast<std::size_t>(s.seqs) * s.q_heads * d * es());
    fill_uniform(q.get(), q.bytes() / es(), s.type, 51, -1.0f, 1.0f, stream);
    q_ = std::move(q);
    out_ = dbuf(q_.bytes());
    status_ = dbuf(kvp::status_words * 4);
    std::vector<std::int32_t> seqs(static_cast<std::size_t>(s.seqs));
    std::iota(seqs.begin(), seqs.end(), 0);
    if (kind == decode_cache::per_head) {
      const std::int64_t N = s.seqs * H * per_seq;
      k_ = dbuf(static_cast<std::size_t>(N * b * d * es())), v_ = dbuf(k_.bytes());
      metric_buf_ = dbuf(static_cast<std::size_t>(N * b * 4));
      std::vector<std::int32_t> ids(static_cast<std::size_t>(N));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      table_ = upload(ids), lengths_ = upload(lengths);
      ph_.num_layers = 1, ph_.num_blocks = static_cast<std::int32_t>(N), ph_.block_size = s.block_size;
      ph_.num_kv_heads = s.kv_heads, ph_.head_dim = s.head_dim, ph_.num_seqs = s.seqs;
      ph_.max_blocks = static_cast<std::int32_t>(per_seq), ph_.type = s.type, ph_.shared_pool = true;
      ph_.k = {k_.get(), 0, nullptr, 0};
      ph_.v = {v_.get(), 0, nullptr, 0};
      ph_.k_stride = ph_.v_stride = kvp::per_head_kv_strides::contiguous(s.block_size, s.head_dim);
      ph_.table = kvp::per_head_array::dense(table_.get<std::int32_t>(), s.seqs, s.kv_heads, per_seq);
      ph_.lengths = kvp::per_head_array::dense(lengths_.get<std::int32_t>(), s.seqs, s.kv_heads);
      ph_.metric = kvp::per_slot_metric::shared(metric_buf_.get<float>(), s.block_size);
    } else {
      const std::int64_t N = s.seqs * per_seq;
      k_ = dbuf(static_cast<std::size_t>(N * b * H * d * es())), v_ = dbuf(k_.bytes());
      metric_buf_ = dbuf(static_cast<std::size_t>(N * b * H * 4));
      std::vector<std::int32_t> ids(static_cast<std::size_t>(N));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      table_ = upload(ids);
      lengths_ = upload(std::vector<std::int32_t>(static_cast<std::size_t>(s.seqs), s.tokens));
      counts_ = upload(lengths);
      pg_.num_layers = 1, pg_.num_blocks = static_cast<std::int32_t>(N), pg_.block_size = s.block_size;
      pg_.num_kv_heads = s.kv_heads, pg_.head_dim = s.head_dim, pg_.num_seqs = s.seqs, pg_.type = s.type;
      const std::int64_t token = H * d, block = token * b;
      pg_.k = {k_.get(), block * N, nullptr, 0};
      pg_.v = {v_.get(), block * N, nullptr, 0};
      pg_.k_stride = pg_.v_stride = {block, token, d, 1};
      pg_.table = kvp::block_table_view::dense(table_.get<std::int32_t>(), per_seq);
      pg_.lengths = lengths_.get<std::int32_t>();
      if (kind == decode_cache::live) {
        std::vector<std::uint8_t> live(static_cast<std::size_t>(N * b * H));
        std::bernoulli_distribution keep(0.7);
        attended_ = 0;
        for (std::int64_t blk = 0; blk < N; ++blk)
          for (std::int64_t i = 0; i < b * H; ++i) live[static_cast<std::size_t>(blk * b * H + i)] = keep(rng);
        // Attended: live slots in [0, tokens) of the sequences' blocks (every block is one's).
        for (auto x : live) attended_ += x;
        live_ = dbuf(live.size());
        KVP_BENCH_CHECK(cudaMemcpy(live_.get(), live.data(), live.size(), cudaMemcpyHostToDevice));
        pg_.live = kvp::live_view::contiguous(live_.get<std::uint8_t>(), pg_.num_blocks, s.block_size, s.kv_heads);
      }
    }
    fill_uniform(k_.get(), k_.bytes() / es(), s.type, 52, -1.0f, 1.0f, stream);
    fill_uniform(v_.get(), v_.bytes() / es(), s.type, 53, -1.0f, 1.0f, stream);
    fill_uniform(metric_buf_.get(), metric_buf_.bytes() / 4, kvp::dtype::f32, 54, 0.0f, 1.0f, stream);
    std::size_t bytes = 0;
    KVP_BENCH_CHECK(attend(nullptr, bytes, metric));
    temp_ = dbuf(bytes);
    temp_bytes_ = bytes;
  }

  std::int64_t es() const { return kvp::size_of(s_.type); }
  double kv_bytes() const { return double(attended_) * 2.0 * s_.head_dim * double(es()); }
  std::int64_t attended() const { return attended_; }

  kvp::decode_batch batch() const {
    return {.num_items = s_.seqs, .layer = 0, .max_tokens = s_.tokens, .status = status_.get<std::int32_t>()};
  }
  kvp::decode_rows rows(const dbuf& b) const {
    return kvp::decode_rows::contiguous(b.get(), s_.q_heads, s_.head_dim, s_.type);
  }
  kvp::decode_epilogue epilogue(bool metric) const {
    if (!metric) return {};
    if (kind_ == decode_cache::per_head) return {.kind = kvp::decode_metric::squared};
    return {
        .kind = kvp::decode_metric::probability,
        .scores = kvp::score_view::contiguous(metric_buf_.get<float>(), pg_.num_blocks, s_.block_size, s_.kv_heads)};
  }
  cudaError_t attend(void* temp, std::size_t& bytes, bool metric) const {
    const kvp::cuda_decode_attention a{.stream = stream_, .staged = staged_};
    const float scale = 1.0f / std::sqrt(float(s_.head_dim));
    if (kind_ == decode_cache::per_head)
      return a.attend(temp, bytes, ph_, rows(q_), rows(out_), scale, batch(), epilogue(metric));
    const kvp::decode_head_counts c =
        kind_ == decode_cache::counts
            ? kvp::decode_head_counts{kvp::per_head_array::dense(counts_.get<std::int32_t>(), s_.seqs, s_.kv_heads)}
            : kvp::decode_head_counts{};
    return a.attend(temp, bytes, pg_, c, rows(q_), rows(out_), scale, batch(), epilogue(metric));
  }
  cudaError_t run(bool metric) {
    std::size_t bytes = temp_bytes_;
    return attend(temp_.get(), bytes, metric);
  }
  kvp::cuda::decode_attention_plan plan(bool metric) const {
    const kvp::cuda_decode_attention a{.stream = stream_, .staged = staged_};
    const float scale = 1.0f / std::sqrt(float(s_.head_dim));
    if (kind_ == decode_cache::per_head) return a.plan(ph_, rows(q_), rows(out_), scale, batch(), epilogue(metric));
    return a.plan(pg_, {}, rows(q_), rows(out_), scale, batch(), epilogue(metric));
  }
  void check_status() const {
    std::array<std::int32_t, kvp::status_words> st{};
    KVP_BENCH_CHECK(cudaMemcpy(st.data(), status_.get(), sizeof st, cudaMemcpyDeviceToHost));
    kvp::throw_if_error(st.data());
  }

 private:
  static dbuf upload(const std::vector<std::int32_t>& v) {
    dbuf d(v.size() * 4);
    KVP_BENCH_CHECK(cudaMemcpy(d.get(), v.data(), d.bytes(), cudaMemcpyHostToDevice));
    return d;
  }

  decode_shape s_;
  decode_cache kind_;
  bool staged_;
  cudaStream_t stream_;
  dbuf q_, out_, status_, k_, v_, metric_buf_, table_, lengths_, counts_, live_, temp_;
  std::size_t temp_bytes_ = 0;
  std::int64_t attended_ = 0;
  kvp::per_head_kv_view ph_{};
  kvp::paged_kv_view pg_{};
};

// Times one call (median of the iterations' event times is Google Benchmark's
// business; the mean is reported as *_ms).
double time_decode(decode_bench_case& bc, bool metric, int reps, cudaStream_t stream) {
  event start, stop;
  double total = 0.0;
  for (int i = 0; i < reps; ++i) {
    KVP_BENCH_CHECK(cudaEventRecord(start, stream));
    KVP_BENCH_CHECK(bc.run(metric));
    KVP_BENCH_CHECK(cudaEventRecord(stop, stream));
    KVP_BENCH_CHECK(cudaEventSynchronize(stop));
    total += elapsed_ms(start, stop) * 1e-3;
  }
  return total / reps;
}

void bench_decode(benchmark::State& state, const std::string& name, decode_shape s, decode_cache kind, bool metric,
                  bool staged) {
  try {
    stream_guard stream;
    decode_bench_case bc(s, kind, metric, staged, stream);
    KVP_BENCH_CHECK(bc.run(metric));  // warm-up
    KVP_BENCH_CHECK(cudaStreamSynchronize(stream));
    bc.check_status();
    const kvp::cuda::decode_attention_plan plan = bc.plan(metric);
    std::fprintf(stderr, "%s\n%s\n", name.c_str(), kvp::cuda::describe(plan).c_str());
    state.counters["splits"] = plan.splits;
    state.counters["split_tokens"] = plan.split_tokens;
    event start, stop;
    double total = 0.0;
    for (auto _ : state) {
      KVP_BENCH_CHECK(cudaEventRecord(start, stream));
      KVP_BENCH_CHECK(bc.run(metric));
      KVP_BENCH_CHECK(cudaEventRecord(stop, stream));
      KVP_BENCH_CHECK(cudaEventSynchronize(stop));
      const double sec = elapsed_ms(start, stop) * 1e-3;
      total += sec;
      state.SetIterationTime(sec);
    }
    bc.check_status();
    const double mean = total / static_cast<double>(state.iterations());
    state.counters["tokens_attended"] = double(bc.attended());
    state.counters["ms"] = mean * 1e3;
    set_rate(state, "", bc.kv_bytes(), mean);
    if (metric) {
      // Attention alone on the same cache, interleaved with the epilogue's calls so that
      // both see the same clocks.
      const double alone = time_decode(bc, false, static_cast<int>(state.iterations()), stream);
      state.counters["attention_ms"] = alone * 1e3;
      state.counters["metric_overhead"] = mean / alone - 1.0;
    }
  } catch (const std::exception& e) {
    ++g_failed_rows;
    state.SkipWithError(e.what());
  }
}

void register_decode_attention_rows() {
  const auto add = [](const std::string& name, decode_shape s, decode_cache kind, bool metric, bool staged = false) {
    const std::string full = (staged ? "decode_staged/" : "decode/") + name;
    benchmark::RegisterBenchmark(
        full.c_str(),
        [full, s, kind, metric, staged](benchmark::State& st) { bench_decode(st, full, s, kind, metric, staged); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(30);
  };
  const std::pair<decode_cache, const char*> kinds[] = {{decode_cache::per_head, "per_head"},
                                                        {decode_cache::counts, "counts"},
                                                        {decode_cache::live, "live"},
                                                        {decode_cache::paged, "paged"}};
  decode_shape b{}, ragged{};
  ragged.ragged = true;
  decode_shape s64{}, s256{};
  s64.seqs = 64, s64.tokens = 4096;
  s256.seqs = 256, s256.tokens = 2048;
  for (const auto& [kind, name] : kinds) {
    add(std::string(name) + "/B", b, kind, false);
    add(std::string(name) + "/B_metric", b, kind, true);
    if (kind == decode_cache::per_head || kind == decode_cache::counts) {
      add(std::string(name) + "/B_ragged", ragged, kind, false);
      add(std::string(name) + "/B_ragged_metric", ragged, kind, true);
    }
    add(std::string(name) + "/64x4096", s64, kind, false);
    add(std::string(name) + "/256x2048", s256, kind, false);
  }
  for (const auto& [kind, name] : kinds) {
    add(std::string(name) + "/B", b, kind, false, true);
    add(std::string(name) + "/B_metric", b, kind, true, true);
    if (kind == decode_cache::per_head) add(std::string(name) + "/B_ragged", ragged, kind, false, true);
    add(std::string(name) + "/64x4096", s64, kind, false, true);
    add(std::string(name) + "/256x2048", s256, kind, false, true);
  }
}
