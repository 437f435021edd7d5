// The decode loop's GPU backend (decode_loop.cpp, built from decode_loop.cu).
//
// The host never waits for the device in the steady state:
// - a step's token writes travel as kernel arguments (no staging buffer to recycle);
//   one kernel writes K, V, positions, the newest queries, the block table and lengths;
// - a compression goes to a second stream: it waits for the step's writes (an event),
//   fills the batch items (a kernel, its arguments again) and replays a CUDA graph
//   captured once per batch size at construction; the main stream waits for it by an
//   event, so the blocks the engine gave back at once are written again only after
//   the compression read them;
// - each compression's status, new lengths and released blocks are copied to a ring
//   of pinned buffers, and checked when its event has completed (polled each step).
//   Only a full ring makes the host wait; the report counts those waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string_view>
#include <vector>

#include <cuda_runtime.h>
#include <thrust/device_vector.h>

namespace {

void cuda_check(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Kernel argument lists. Each stays under the 4 KiB of arguments every architecture
// takes, with the cache view beside it.
constexpr int writes_per_launch = 120;
struct write_list {
  i32 count = 0;
  token_write w[writes_per_launch];
};
constexpr int releases_per_launch = 256;
struct release_list {
  i32 count = 0;
  i32 seq[releases_per_launch];
};
constexpr int items_per_graph = 64;  // larger batches replay the graphs in chunks
struct item_list {
  i32 count = 0;
  kvp::batch_item items[items_per_graph];
};

// Block (write, layer): the token's K and V rows and positions, its query column by
// column (a thread owns a column, so the window shifts without a race), and, once,
// its block table entry and length.
__global__ void write_tokens(kvp::paged_kv_view c, std::uint16_t* queries, i32 slots, i32 window, i32 query_row,
                             i32* table, i32 max_blocks, i32* lengths, write_list list) {
  const token_write w = list.w[blockIdx.x];
  const auto l = static_cast<i32>(blockIdx.y);
  const auto first = static_cast<i32>(threadIdx.x), stride = static_cast<i32>(blockDim.x);
  for (i32 e = first; e < c.num_kv_heads * c.head_dim; e += stride) write_kv_element(c, w, l, e);
  std::uint16_t* base = queries + (std::size_t(l) * slots + w.seq) * window * query_row;
  for (i32 col = first; col < query_row; col += stride) write_query_column(base, window, query_row, w, l, col);
  if (l == 0 && first == 0) write_table_entry(table, max_blocks, lengths, c.block_size, w);
}

// Finished requests' rows hold no tokens: their stale table entries must not look
// like blocks shared with the rows that reuse them.
__global__ void clear_lengths(i32* lengths, release_list list) {
  if (const auto i = static_cast<i32>(threadIdx.x); i < list.count) lengths[list.seq[i]] = 0;
}

__global__ void set_items(kvp::batch_item* items, item_list list) {
  if (const auto i = static_cast<i32>(threadIdx.x); i < list.count) items[i] = list.items[i];
}

template <class T>
T* raw(thrust::device_vector<T>& v) {
  return thrust::raw_pointer_cast(v.data());
}

class gpu_backend {
 public:
  gpu_backend(const geometry& g, bool compress)
      : g_(g),
        policy_(policy_for(g.o)),
        mem_(g),
        items_(items_per_graph),
        closed_in_(g.slots, -1) {
    cuda_check(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (cudaEvent_t* e : {&appended_, &compressed_})
      cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
    // The released-block lists' stride: the executor's max_blocks(batch, cache).
    mb_ = kvp::max_blocks(batch_of(1), cache());
    words_ = kvp::status_words + items_per_graph * (2 + mb_);
    results_.resize(words_);
    cuda_check(cudaMallocHost(&pinned_, sizeof(i32) * words_ * ring_depth), "cudaMallocHost");
    for (slot& s : ring_) cuda_check(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "cudaEventCreate");
    if (compress) capture_graphs();
    cuda_check(cudaDeviceSynchronize(), "setting up the GPU backend");
  }
  gpu_backend(const gpu_backend&) = delete;
  gpu_backend& operator=(const gpu_backend&) = delete;
  ~gpu_backend() {
    cudaDeviceSynchronize();
    for (cudaGraphExec_t e : graphs_) cudaGraphExecDestroy(e);
    for (slot& s : ring_) cudaEventDestroy(s.done);
    cudaFreeHost(pinned_);
    cudaEventDestroy(appended_);
    cudaEventDestroy(compressed_);
    cudaStreamDestroy(side_);
    cudaStreamDestroy(main_);
  }

  // Queued; a row's writes after its `last` one go to the next launch.
  void write(const token_write& w) {
    if (closed_in_[w.seq] == launch_) flush();
    writes_.w[writes_.count++] = w;
    if (w.last) closed_in_[w.seq] = launch_;
    if (writes_.count == writes_per_launch) flush();
  }
  void release(i32 seq) {
    if (releases_.count == releases_per_launch) flush();
    releases_.seq[releases_.count++] = seq;
  }
  void end_step(report& rep) {
    flush();
    poll(rep);
  }

  void compress(std::span<const kvp::batch_item> items, const expected_outcome& want, report& rep) {
    flush();
    for (std::size_t start = 0; start < items.size(); start += items_per_graph) {
      const auto n = static_cast<i32>(std::min<std::size_t>(items_per_graph, items.size() - start));
      item_list list;
      list.count = n;
      slot& s = ring_[next_slot_];
      if (pending_.size() == ring_depth) {  // the ring is full: its oldest must be read first
        if (cudaEventQuery(ring_[pending_.front()].done) == cudaErrorNotReady) ++rep.host_waits;
        cuda_check(cudaEventSynchronize(ring_[pending_.front()].done), "waiting for a compression");
        check_oldest();
      }
      s.want = {};
      s.seqs.clear();
      for (i32 i = 0; i < n; ++i) {
        list.items[i] = items[start + i];
        s.seqs.push_back(items[start + i].seq);
        s.want.new_lengths.push_back(want.new_lengths[start + i]);
        s.want.released.push_back(want.released[start + i]);
      }
      cuda_check(cudaEventRecord(appended_, main_), "cudaEventRecord");
      cuda_check(cudaStreamWaitEvent(side_, appended_, 0), "cudaStreamWaitEvent");
      set_items<<<1, items_per_graph, 0, side_>>>(raw(items_), list);
      cuda_check(cudaGetLastError(), "set_items");
      cuda_check(cudaGraphLaunch(graphs_[n - 1], side_), "cudaGraphLaunch");
      ++rep.graph_replays;
      cuda_check(cudaMemcpyAsync(pinned_ + next_slot_ * words_, raw(results_), sizeof(i32) * words_,
                                 cudaMemcpyDeviceToHost, side_),
                 "cudaMemcpyAsync");
      cuda_check(cudaEventRecord(s.done, side_), "cudaEventRecord");
      cuda_check(cudaEventRecord(compressed_, side_), "cudaEventRecord");
      cuda_check(cudaStreamWaitEvent(main_, compressed_, 0), "cudaStreamWaitEvent");
      pending_.push_back(next_slot_);
      next_slot_ = (next_slot_ + 1) % ring_depth;
    }
  }

  // End of a run: everything done, every compression checked.
  void drain(report&) {
    flush();
    cuda_check(cudaStreamSynchronize(main_), "the decode loop's stream");
    cuda_check(cudaStreamSynchronize(side_), "the compression stream");
    while (!pending_.empty()) check_oldest();
  }

 private:
  static constexpr std::size_t ring_depth = 32;
  struct slot {
    cudaEvent_t done = nullptr;
    std::vector<i32> seqs;
    expected_outcome want;
  };

  kvp::paged_kv_view cache() { return g_.cache(raw(mem_.kv), raw(mem_.table), raw(mem_.lengths), raw(mem_.positions)); }
  kvp::device_batch batch_of(i32 n) {
    return {.items = raw(items_), .num_items = n, .max_tokens = g_.max_blocks * g_.o.block};
  }
  kvp::device_result result() {
    i32* r = raw(results_);
    return {.status = r,
            .new_lengths = r + kvp::status_words,
            .released_counts = r + kvp::status_words + items_per_graph,
            .released_blocks = r + kvp::status_words + 2 * items_per_graph};
  }

  // One graph per batch size, all sharing one workspace (compressions run one after
  // the other on side_).
  void capture_graphs() {
    const auto queries = kvp::query_window_view::contiguous(raw(mem_.queries), g_.o.layers, g_.slots, g_.o.window,
                                                            g_.o.q_heads, g_.o.head_dim, kvp::dtype::bf16);
    const auto scores = kvp::score_view::contiguous(raw(mem_.f), g_.o.pool_blocks, g_.o.block, g_.o.kv_heads);
    const kvp::cuda_executor ex{.stream = side_};
    const i32 sizes = std::min(items_per_graph, g_.slots);
    std::size_t most = 1;
    for (i32 n = 1; n <= sizes; ++n) {
      std::size_t bytes = 0;
      cuda_check(ex.compress(nullptr, bytes, policy_, cache(), queries, scores, batch_of(n), result()), "sizing");
      most = std::max(most, bytes);
    }
    temp_.resize(most);
    for (i32 n = 1; n <= sizes; ++n) {
      std::size_t bytes = most;
      cudaGraph_t graph = nullptr;
      cuda_check(cudaStreamBeginCapture(side_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
      const cudaError_t run = ex.compress(raw(temp_), bytes, policy_, cache(), queries, scores, batch_of(n), result());
      cuda_check(cudaStreamEndCapture(side_, &graph), "cudaStreamEndCapture");
      cuda_check(run, "capturing a compression");
      cudaGraphExec_t exec = nullptr;
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      cuda_check(made, "cudaGraphInstantiate");
      graphs_.push_back(exec);
    }
  }

  void flush() {
    if (releases_.count > 0) {
      clear_lengths<<<1, releases_per_launch, 0, main_>>>(raw(mem_.lengths), releases_);
      releases_.count = 0;
    }
    if (writes_.count > 0) {
      const dim3 grid(static_cast<unsigned>(writes_.count), static_cast<unsigned>(g_.o.layers));
      write_tokens<<<grid, 256, 0, main_>>>(cache(), raw(mem_.queries), g_.slots, g_.o.window,
                                            static_cast<i32>(g_.query_row()), raw(mem_.table), g_.max_blocks,
                                            raw(mem_.lengths), writes_);
      writes_.count = 0;
    }
    cuda_check(cudaGetLastError(), "write_tokens");
    ++launch_;
  }

  // Checks every compression whose results have arrived, without waiting.
  void poll(report&) {
    while (!pending_.empty()) {
      const cudaError_t e = cudaEventQuery(ring_[pending_.front()].done);
      if (e == cudaErrorNotReady) return;
      cuda_check(e, "a compression");
      check_oldest();
    }
  }
  void check_oldest() {
    const slot& s = ring_[pending_.front()];
    const i32* h = pinned_ + pending_.front() * words_;
    kvp::check(h);  // a failed device validation, as the kvp::error it stands for
    const i32* new_lengths = h + kvp::status_words;
    const i32* counts = new_lengths + items_per_graph;
    const i32* blocks = counts + items_per_graph;
    for (std::size_t i = 0; i < s.seqs.size(); ++i)
      check_outcome(s.want, i, s.seqs[i], new_lengths[i],
                    std::vector<i32>(blocks + i * mb_, blocks + i * mb_ + counts[i]));
    pending_.pop_front();
  }

  geometry g_;
  kvp::presets::zipage policy_;
  cache_storage<thrust::device_vector> mem_;
  thrust::device_vector<i32> results_;
  thrust::device_vector<kvp::batch_item> items_;
  thrust::device_vector<std::byte> temp_;
  std::vector<cudaGraphExec_t> graphs_;
  cudaStream_t main_ = nullptr, side_ = nullptr;
  cudaEvent_t appended_ = nullptr, compressed_ = nullptr;
  i32* pinned_ = nullptr;
  std::size_t words_ = 0, mb_ = 0;
  slot ring_[ring_depth];
  std::deque<std::size_t> pending_;
  std::size_t next_slot_ = 0;
  write_list writes_;
  release_list releases_;
  std::vector<std::int64_t> closed_in_;  // the launch that holds each row's last queued write
  std::int64_t launch_ = 0;
};

}  // namespace
