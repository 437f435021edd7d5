/* kvp_capi: a C face of kvpolicy's executors, for ctypes (zipage_reference.py, hard_kv_reference.py,
 * kara_reference.py; kv_compress_reference.py for the per-head entry points at the end).
 *
 * Two libraries export it:
 *   libkvp_capi.so       (kvp_capi.cu)       kvp::cuda_executor, device pointers, asynchronous on a stream
 *   libkvp_capi_host.so  (kvp_capi_host.cpp) kvp::host_executor, host pointers, synchronous (the stream is ignored)
 *
 * Layouts (nano-vllm): cache `[2, L, num_blocks, b, h_kv, d]`, queries
 * `[L, query_slots, query_window, h_q, d]` (each slot's newest queries last), F
 * `[L, num_blocks, b, h_kv]` fp32, block table int32 `[num_seqs, max_blocks_per_seq]`,
 * lengths int32 `[num_seqs]`, batch items int32 `[num_items, 4]` = (seq, query slot,
 * budget, history tokens), or `[num_items, 5]` for KVP_CAPI_KARA, whose fifth column
 * is window_begin (the columns of kvp::batch_item; below). Optional outputs: keep masks
 * uint8 and final scores fp32 (after protect), both `[num_items, layers of the batch,
 * h_kv, max_tokens]`; entries a row does not cover are left as they were.
 *
 * KVP_CAPI_KARA is kvp::presets::kara (KvLLM: window |W| 768, buffer |U| 32, gamma 8,
 * alpha 16), compressing each item's window alone (layout::window_compact):
 *   - window_begin: the window's first token, a multiple of block_size, with at least
 *     768 tokens from it to the sequence's end; tokens before it are neither read nor
 *     written, tokens after the window (a last, partial block) move down with it;
 *   - budget: tokens kept of the window's first 736 (W \ U); 225 keeps KvLLM's 257 of
 *     768. history tokens: unused (0). F: unused (any valid pointer);
 *   - queries: the slot's last 768 entries are the window's tokens' queries, oldest
 *     first (query_window >= 768);
 *   - masks and final scores cover the window: entry t of a row is token
 *     window_begin + t, for t < length - window_begin. Final scores are Kara's column
 *     sums for t < 736 and +inf for the buffer and the tokens after the window;
 *   - new lengths count from the sequence's start (window_begin + what the window and
 *     the tokens after it keep).
 * The four-column policies' items are widened to kvp::batch_item (window_begin 0) in
 * the workspace, by one small kernel on the stream ahead of the compression (CUDA) or
 * on the host (host library).
 *
 * The caller's workspace holds the result words (status, new lengths, released
 * blocks) and the executor's own workspace; kvp_capi_workspace_size sizes it.
 *
 * Return codes: 0 success, 1 a kvp::error (malformed input, or a failed device
 * validation reported by kvp_capi_status), 2 a CUDA error, 3 anything else;
 * kvp_capi_last_error() gives the message of the calling thread's last failure.
 */
#ifndef KVPOLICY_BENCH_KVP_CAPI_H
#define KVPOLICY_BENCH_KVP_CAPI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVP_CAPI_EXPORT __attribute__((visibility("default")))
#else
#define KVP_CAPI_EXPORT
#endif

enum { KVP_CAPI_OK = 0, KVP_CAPI_EINVAL = 1, KVP_CAPI_ECUDA = 2, KVP_CAPI_EOTHER = 3 };
enum { KVP_CAPI_ZIPAGE = 0, KVP_CAPI_SNAPKV = 1, KVP_CAPI_HARD_KV = 2, KVP_CAPI_KARA = 3 };

/* Must match `class KvpShape(ctypes.Structure)` in zipage_reference.py, field for field. */
typedef struct kvp_capi_shape {
  int32_t num_layers, num_blocks, block_size, num_kv_heads, num_q_heads, head_dim;
  int32_t num_seqs, max_blocks_per_seq; /* block table [num_seqs, max_blocks_per_seq] */
  int32_t query_slots, query_window;    /* queries [num_layers, query_slots, query_window, h_q, d] */
  int32_t num_items, max_tokens;        /* batch; max_tokens >= every batch sequence's length */
  int32_t layer_begin, layer_count;     /* layers [layer_begin, layer_begin + layer_count); 0 = to the end */
  int32_t dtype;                        /* 0 f16, 1 bf16, 2 f32 (kvp::dtype) */
  int32_t policy;                       /* KVP_CAPI_ZIPAGE, KVP_CAPI_SNAPKV, KVP_CAPI_HARD_KV (temperatures
                                           solved at every call: no state kept) or KVP_CAPI_KARA */
} kvp_capi_shape;

KVP_CAPI_EXPORT int kvp_capi_shape_size(void);

/* Workspace bytes kvp_capi_compress needs for this shape. */
KVP_CAPI_EXPORT int kvp_capi_workspace_size(const kvp_capi_shape* s, size_t* bytes);

/* The status words kvp_capi_status and kvp_capi_per_head_status copy (kvp::status_words):
 * size host_words from this, or from kvp_capi_status_words() where the header is not read
 * (ctypes). */
#define KVP_CAPI_STATUS_WORDS 8
KVP_CAPI_EXPORT int kvp_capi_status_words(void);

/* One compression, in place: kept K, V and F move; new lengths in the workspace.
 * `stream` is a cudaStream_t as an integer (0: the legacy default stream). */
KVP_CAPI_EXPORT int kvp_capi_compress(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                                      const int32_t* block_table, const int32_t* lengths, const int32_t* items,
                                      void* workspace, size_t workspace_bytes, uint8_t* keep_masks,
                                      float* final_scores, uintptr_t stream);

/* kvp_capi_compress with the executor's stage marks, then a synchronisation of `stream`:
 * stage_ms (host, [4]) gets the milliseconds between consecutive marks. CUDA: the
 * stages in the order they run (cuda_executor::stage_marks): score, redundancy,
 * epilogue (aggregate + select), layout, except where the redundancy stage computes
 * the softmax statistics (zipage on blocks of 256), which runs it first: redundancy,
 * score, ...; a stage the pipeline lacks takes about 0. The marks keep the stages from
 * overlapping, so the sum is a little above kvp_capi_compress's time. Host: the host
 * executor's own times of score, redundancy, aggregate + select, layout. */
KVP_CAPI_EXPORT int kvp_capi_compress_staged(const kvp_capi_shape* s, void* kv_cache, const void* queries, float* f,
                                             const int32_t* block_table, const int32_t* lengths,
                                             const int32_t* items, void* workspace, size_t workspace_bytes,
                                             float* stage_ms, uintptr_t stream);

/* Calibrated top-p's options (kvp::select::calibrated_top_p, field for field;
 * docs/pipeline.md "Head-adaptive counts") for KVP_CAPI_HARD_KV. Must match
 * `class KvpCalibration(ctypes.Structure)` in hard_kv_reference.py. The defaults
 * (kvp_capi_calibration_defaults) are hard_kv's: the authors' rule (scope 0, top-k
 * union on, T bisected on [1e-3, 1] on the scores as they are, at most 2048 per head). */
typedef struct kvp_capi_calibration {
  float p;                   /* the mass each head's kept set carries, in (0, 1] */
  float tolerance;           /* |calibrated top-n_p mass - p| accepted */
  float t_min, t_max;        /* the temperature's range */
  int32_t search;            /* 0 bisection, 1 first order (Adam) */
  int32_t iterations;        /* bisection's bound */
  int32_t steps;             /* first order's bound */
  float learning_rate;       /* first order's rate */
  float t_start;             /* first order's start */
  int32_t upper;             /* L_upper: at most this many per head, protected included; 0: no cap */
  int32_t lower;             /* L_lower: at least this many; 0: off */
  int32_t union_top_k;       /* 1: also keep the top (budget - protected) by score; 0: not */
  int32_t scope;             /* 0 whole row (the authors' rule), 1 the unprotected tokens only */
  int32_t divide_by_row_max; /* 1: scores divided by the row's largest |s| before the softmax; 0: not */
} kvp_capi_calibration;

KVP_CAPI_EXPORT int kvp_capi_calibration_size(void);

/* Fills *out with hard_kv's calibration options. */
KVP_CAPI_EXPORT int kvp_capi_calibration_defaults(kvp_capi_calibration* out);

/* kvp_capi_compress with these calibration options (shape->policy KVP_CAPI_HARD_KV;
 * NULL: the defaults, as kvp_capi_compress). Temperatures are solved at every call. An
 * option out of range is refused (KVP_CAPI_EINVAL) naming it, before any byte moves. */
KVP_CAPI_EXPORT int kvp_capi_compress_calibrated(const kvp_capi_shape* s, const kvp_capi_calibration* calibration,
                                                 void* kv_cache, const void* queries, float* f,
                                                 const int32_t* block_table, const int32_t* lengths,
                                                 const int32_t* items, void* workspace, size_t workspace_bytes,
                                                 uint8_t* keep_masks, float* final_scores, uintptr_t stream);

/* Synchronises `stream`, copies the KVP_CAPI_STATUS_WORDS status words to host_words (may be null);
 * returns KVP_CAPI_EINVAL with the message when the compression was rejected. */
KVP_CAPI_EXPORT int kvp_capi_status(const kvp_capi_shape* s, const void* workspace, int32_t* host_words,
                                    uintptr_t stream);

/* Copies the new lengths (int32 [num_items]) to host memory, synchronising `stream`. */
KVP_CAPI_EXPORT int kvp_capi_new_lengths(const kvp_capi_shape* s, const void* workspace, int32_t* host_out,
                                         uintptr_t stream);

/* ------------------------------------------------------------------------------------
 * KV-Compress over a per-head block cache (issue 31; kv_compress_reference.py).
 *
 * The CUDA library maps it onto kvp::cuda_per_head_executor, the host library onto
 * kvp::host::compress_per_head, with kvp::select::head_adaptive_blocks{protected_window,
 * sinks, sequence or layer budget} as the schedule and MoveCache as the moves.
 *
 * Layouts (KV-Compress's unified cache, one pool shared by every layer and KV head:
 * a block id names one block, of one (layer, seq, KV head), in every layer):
 *   k_cache, v_cache  [num_blocks, block_size, head_dim], dtype
 *   metric            [num_blocks, block_size] fp32, moved with its token (required)
 *   positions         [num_blocks, block_size] int32, each slot's original position,
 *                     moved with its token; NULL: slot t of a head is position t
 *   tables            int32 [num_layers, num_seqs, num_kv_heads, max_blocks]; only the
 *                     first ceil(length / block_size) entries of a row are read
 *   lengths           int32 [num_layers, num_seqs, num_kv_heads]
 *   items             int64 [num_items, 3] = (seq, blocks_to_free, logical_length), or
 *                     with per_layer_budget int64 [num_items, 3 + num_layers] = (seq,
 *                     unused, logical_length, blocks to free in layer 0, 1, ...): the
 *                     columns of kvp::per_head_item. logical_length: the sequence's
 *                     position count (protected: positions >= logical_length -
 *                     protected_window, and positions < sinks); -1: each head's own
 *                     length, allowed only without positions. seq and logical_length
 *                     must fit int32 (the host library refuses others; the CUDA library
 *                     turns such an item's seq into -1, which its validation refuses).
 * Neither library writes tables or lengths: the caller applies the new lengths and
 * frees the blocks listed.
 *
 * Results go to caller-provided arrays (struct kvp_capi_per_head_out, device memory for
 * the CUDA library, host memory for the host one). Rows are (item, layer, KV head),
 * row = (item x num_layers + layer) x num_kv_heads + head. Entries of freed_blocks past
 * a row's freed_counts are unspecified. The workspace holds the items converted to
 * kvp::per_head_item (CUDA: one small kernel on the stream ahead of the executor, no
 * host synchronisation) and the executor's own workspace; the host library needs none
 * (kvp_capi_per_head_workspace_size gives 0).
 *
 * Status: the CUDA library's malformed device data (lengths, block ids, items,
 * positions) is caught by the executor's validation before any byte moves, and read
 * back by kvp_capi_per_head_status. The host library checks everything before a byte
 * moves and returns KVP_CAPI_EINVAL with the message; its status words stay 0.
 * ------------------------------------------------------------------------------------ */

/* Must match `class PerHeadShape(ctypes.Structure)` in kv_compress_reference.py. */
typedef struct kvp_capi_per_head_shape {
  int32_t num_layers, num_blocks, block_size, num_kv_heads, head_dim;
  int32_t num_seqs, max_blocks; /* tables [num_layers, num_seqs, num_kv_heads, max_blocks] */
  int32_t num_items;            /* rows of items */
  int32_t dtype;                /* 0 f16, 1 bf16, 2 f32 (kvp::dtype) */
  int32_t protected_window;     /* last positions never evicted (KV-Compress: 64) */
  int32_t sinks;                /* first positions never evicted (0) */
  int32_t per_layer_budget;     /* 0: one count per item over all its layers and heads
                                   (KV-Compress); 1: one count per layer (items carry
                                   3 + num_layers columns) */
} kvp_capi_per_head_shape;

/* Where the results go. status, new_lengths, freed_counts and freed_blocks are required;
 * the rest may be NULL. Must match `class PerHeadOut(ctypes.Structure)`. */
typedef struct kvp_capi_per_head_out {
  int32_t* status;       /* [KVP_CAPI_STATUS_WORDS]: 0 in status[0] means success */
  int32_t* new_lengths;  /* [num_items, num_layers, num_kv_heads]: tokens each head holds after */
  int32_t* freed_counts; /* [num_items, num_layers, num_kv_heads]: blocks each head gives up */
  int32_t* freed_blocks; /* [num_items, num_layers, num_kv_heads, max_blocks]: their ids, in table
                            order (the row's last blocks, past ceil(new length / block_size)) */
  int32_t* evicted;      /* optional [num_items, num_layers, num_kv_heads]: tokens each head evicts */
  int32_t* moved;        /* optional [num_items, num_layers, num_kv_heads]: tokens each head copied
                            (MoveCache's moves: kept tokens at or past the new length) */
  int64_t* freed;        /* optional [num_items]: blocks freed in all */
  int64_t* nonfinite;    /* optional [num_items]: NaN or infinite metrics, protected ones included */
} kvp_capi_per_head_out;

KVP_CAPI_EXPORT int kvp_capi_per_head_shape_size(void);

/* Workspace bytes kvp_capi_compress_per_head needs for this shape (host library: 0). */
KVP_CAPI_EXPORT int kvp_capi_per_head_workspace_size(const kvp_capi_per_head_shape* s, size_t* bytes);

/* One compression, in place: the schedule of every item, then MoveCache on every head
 * that evicts (K, V, the metric and the positions of each surviving tail token copied
 * into the lowest evicted slot); results into *out. `stream`: a cudaStream_t as an
 * integer (0: the legacy default stream); CUDA: enqueued, nothing synchronised. */
KVP_CAPI_EXPORT int kvp_capi_compress_per_head(const kvp_capi_per_head_shape* s, void* k_cache, void* v_cache,
                                               float* metric, int32_t* positions, const int32_t* tables,
                                               const int32_t* lengths, const int64_t* items, void* workspace,
                                               size_t workspace_bytes, const kvp_capi_per_head_out* out,
                                               uintptr_t stream);

/* kvp_capi_compress_per_head with stage marks, then a synchronisation of `stream`:
 * stage_ms (host, [3]) gets
 *   [0] the schedule: the executor's validation, histograms and group selects
 *       (cuda_per_head_executor::stage_marks 0 -> 1),
 *   [1] the moves: each head's evicted tokens and MoveCache (marks 1 -> 2),
 *   [2] the whole call, from an event recorded before the items' conversion to the last mark.
 * The marks keep the stages from overlapping, so [2] is a little above
 * kvp_capi_compress_per_head's time. Host library: host::compress_per_head does not split
 * its stages: [0] and [2] are the whole call's wall time, [1] is 0. */
KVP_CAPI_EXPORT int kvp_capi_compress_per_head_staged(const kvp_capi_per_head_shape* s, void* k_cache,
                                                      void* v_cache, float* metric, int32_t* positions,
                                                      const int32_t* tables, const int32_t* lengths,
                                                      const int64_t* items, void* workspace, size_t workspace_bytes,
                                                      const kvp_capi_per_head_out* out, float* stage_ms,
                                                      uintptr_t stream);

/* Synchronises `stream`, copies the KVP_CAPI_STATUS_WORDS status words at `status` (out->status of a
 * compression) to host_words (may be NULL); returns KVP_CAPI_EINVAL with the message
 * when the compression was rejected on the device. */
KVP_CAPI_EXPORT int kvp_capi_per_head_status(const int32_t* status, int32_t* host_words, uintptr_t stream);

KVP_CAPI_EXPORT const char* kvp_capi_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPOLICY_BENCH_KVP_CAPI_H */
