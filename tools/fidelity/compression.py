"""The one place the harness compresses: `compress(preset, cache, items)` and, for Kara's
windows, `compress_windows(cache, items, window, buffer)`, through the `kvpolicy` Python
package (python/, the C++ host executor on NumPy arrays); and for KV-Compress, over the
per-head cache, `compress_per_head(cache, items)` and the metric it evicts by,
`kv_compress_prefill_metric(cache, queries)`.

Every array is the harness's own and is handed over by DLPack with no copy: the K/V
tensor in the nano_vllm layout, the block table, the lengths, the positions, F and the
query window (a strided view). The package moves the kept tokens (their K, V, F and
positions) in place and returns the new lengths and released blocks; updating the
lengths, the table and the free list is the engine's part (PagedCache.release).

Kara's query slots are the one copy: each item's window's |W| queries, gathered from the
sequence's query ring (PagedCache.window_queries) into a `[L, items, |W|, h_q, d]` array,
as an engine that keeps the queries it decoded would copy them into the slots
(docs/integration.md, section 7).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import kvpolicy
from paged_cache import PagedCache
from per_head_cache import PerHeadCache

# The package's presets by name (kara: compress_windows), and KV-Compress, which the
# package keeps out of its PRESETS (it is not a PagedCache policy): compress_per_head.
PRESETS = tuple(kvpolicy.PRESETS) + ("kv_compress",)
BACKEND = f"kvpolicy {kvpolicy.__version__}"


@dataclasses.dataclass
class Item:
    seq: int
    budget: int
    history_tokens: int
    window_begin: int = 0  # Kara: the window's first token (a multiple of the block size)


@dataclasses.dataclass
class ItemResult:
    new_length: int
    released_blocks: list[int]


_policies = {name: kvpolicy.preset(name) for name in kvpolicy.PRESETS}  # published parameters
KV_COMPRESS = kvpolicy.preset("kv_compress")  # published parameters (configure_kv_compress); budget per item


# Presets that keep a count per (layer, KV head) (Hard-KV's calibrated top-p): compressed
# over the cache's live bytes (cautious update), each with L_upper = its budget.
HEAD_ADAPTIVE = ("hard_kv", "hard_kv_rkv")


def hard_kv_item_budget(preset: str, upper: int) -> int:
    """The items' budget of a head-adaptive preset at L_upper `upper`: the top-k union's
    floor (every head keeps at least its top budget - protected by score). With the union
    on, an item budget equal to L_upper makes every head keep L_upper and the preset
    uniform. Hard-KV's experiments cap each head at L_upper and run with L_lower =
    L_upper / 2 (section 4 and appendix B: where their system starts selecting), so heads
    keep between about L_upper / 2 and L_upper as their calibrated top-p sets need: the
    harness takes L_upper / 2 as the floor (our choice: their code takes k from the budget
    it is given), and at least the protected tokens (sinks and window), below which the
    union adds nothing; never above L_upper (an item's budget may not exceed the tokens
    a compression finds, which the trigger makes more than L_upper)."""
    p = _policies[preset].params()
    return min(upper, max(upper // 2, p["protect_window"] + p["sinks"]))


def _results(preset: str, r, n: int) -> list[ItemResult]:
    counts = np.asarray(r.kept_counts)
    for i in range(n):
        if preset not in HEAD_ADAPTIVE and (counts[i] != r.new_lengths[i]).any():
            raise RuntimeError(f"{preset}: kept counts differ across heads, which only a head-adaptive preset does")
    return [ItemResult(int(r.new_lengths[i]), [int(b) for b in r.released(i)]) for i in range(n)]


def _view(cache: PagedCache, live: bool = False):
    return kvpolicy.PagedCache(
        "nano_vllm", cache.kv, block_table=cache.block_table, lengths=cache.lengths, positions=cache.positions,
        live=cache.live if live else None,
    )


def compress(preset: str, cache: PagedCache, items: list[Item], upper: int | None = None) -> list[ItemResult]:
    """Compress `items` of `cache` in place with the named preset (one batch, one call);
    `upper`: a head-adaptive preset's L_upper."""
    if preset == "kara":
        raise ValueError("kara compresses windows: compress_windows(cache, items, window, buffer)")
    policy, adaptive = _policies[preset], preset in HEAD_ADAPTIVE
    if adaptive:
        # Each head keeps its calibrated top-p set union the top (item budget - protected)
        # by score, at most `upper` (L_upper): the harness passes the threshold budget as
        # upper and hard_kv_item_budget(upper) as the items' budget.
        if upper is None:
            raise ValueError(f"{preset}: compress needs upper (L_upper) for a head-adaptive preset")
        policy = kvpolicy.preset(preset, **{**policy.params(), "upper": upper})
    elif upper is not None:
        raise ValueError(f"{preset}: upper is for the head-adaptive presets {HEAD_ADAPTIVE} only")
    r = kvpolicy.compress(
        policy,
        _view(cache, live=adaptive),
        seqs=np.array([it.seq for it in items]),
        budgets=np.array([it.budget for it in items]),
        history_tokens=np.array([it.history_tokens for it in items]),
        queries=cache.query_window(),  # slot s is sequence s
        scores=cache.scores,
    )
    return _results(preset, r, len(items))


def compress_windows(cache: PagedCache, items: list[Item], window: int, buffer: int) -> list[ItemResult]:
    """Kara (kvpolicy.Kara, its gamma 8 and alpha 16) over each item's window
    [window_begin, window_begin + window) and the tokens after it, in one call; the budget
    counts the tokens kept of the window's first window - buffer. Query slot i holds item
    i's window queries."""
    queries = np.stack([cache.window_queries(it.seq, it.window_begin, window) for it in items], axis=1)
    r = kvpolicy.compress(
        kvpolicy.Kara(window=window, buffer=buffer),
        _view(cache),
        seqs=np.array([it.seq for it in items]),
        budgets=np.array([it.budget for it in items]),
        history_tokens=np.array([it.history_tokens for it in items]),
        window_begins=np.array([it.window_begin for it in items]),
        query_slots=np.arange(len(items)),
        queries=queries,
    )
    return _results("kara", r, len(items))


@dataclasses.dataclass
class PerHeadItemResult:
    new_lengths: np.ndarray  # [L, h_kv]
    freed_blocks: np.ndarray  # [L, h_kv, max_blocks], the first freed_counts[l, h] of each row
    freed_counts: np.ndarray  # [L, h_kv]
    asked: int  # blocks the budget asked the sequence to free
    freed: int  # blocks it freed (fewer only where the unprotected tokens cover fewer)


def configure_kv_compress(overrides: dict) -> None:
    """KV_COMPRESS with some of its KVCompress keywords changed (harness.py --kv-compress);
    kvpolicy.Error names a field it refuses."""
    global KV_COMPRESS
    KV_COMPRESS = kvpolicy.KVCompress(**{**kvpolicy.preset("kv_compress").params(), **overrides})


def kv_compress_blocks(cache: PerHeadCache, seq: int, budget: int) -> int:
    """Blocks the sequence frees to its budget: kvpolicy.blocks_to_free of KV-Compress with
    max_cache_tokens = budget, every (layer, KV head) keeping ceil(budget / b) blocks on
    average, so the sequence keeps at most rows x budget tokens, what a uniform preset at
    that budget keeps."""
    policy = kvpolicy.KVCompress(**{**KV_COMPRESS.params(), "max_cache_tokens": budget})
    return int(kvpolicy.blocks_to_free(policy, cache.lengths, cache.b, seq, int(cache.next_pos[seq]))[0, 0])


def compress_per_head(cache: PerHeadCache, items: list[Item]) -> list[PerHeadItemResult]:
    """Compress `items` of the per-head cache in place with KV-Compress (one call): each
    frees its budget's blocks across all its layers and heads, the cheapest by the metric;
    every position of the last protected_window is kept (read off the positions, with the
    sequence's position count as its logical length)."""
    seqs = np.array([it.seq for it in items])
    asked = np.array([kv_compress_blocks(cache, it.seq, it.budget) for it in items])
    r = kvpolicy.compress_per_head(
        KV_COMPRESS, cache.k, cache.v, cache.metric, cache.tables, cache.lengths,
        seqs=seqs, blocks_to_free=asked, logical_lengths=cache.next_pos[seqs], positions=cache.positions,
    )
    return [PerHeadItemResult(np.asarray(r.new_lengths[i]), np.asarray(r.freed_blocks[i]), np.asarray(r.freed_counts[i]),
                              int(asked[i]), int(r.freed[i])) for i in range(len(items))]


def kv_compress_prefill_metric(cache: PerHeadCache, queries: np.ndarray) -> None:
    """KV-Compress's prefill metric in every head of every sequence of the cache
    (kvpolicy.per_head_metric, mode "prefill"), from queries [L, 1, w, h_q, d], the prompt's
    last queries (the same prompt in every sequence): each head's metric becomes the last
    metric_window queries' squared causal attention, summed over them, max-pooled (kernel 7)
    per query head, summed over the group. Each decode step's is added by the cache's
    attention (PerHeadCache.attend)."""
    S = cache.num_seqs
    kvpolicy.per_head_metric(KV_COMPRESS, queries, cache.k, cache.metric, cache.tables, cache.lengths,
                             seqs=np.arange(S), query_slots=np.zeros(S, dtype=np.int64), mode="prefill")
