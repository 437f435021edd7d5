"""The one place the harness compresses: `compress(preset, cache, items)` and, for Kara's
windows, `compress_windows(cache, items, window, buffer)`, through the `kvpolicy` Python
package (python/, the C++ host executor on NumPy arrays).

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

PRESETS = tuple(kvpolicy.PRESETS)  # the package's presets by name (kara: compress_windows)
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


_policies = {name: kvpolicy.preset(name) for name in PRESETS}  # published parameters


def _results(preset: str, r, n: int) -> list[ItemResult]:
    counts = np.asarray(r.kept_counts)
    for i in range(n):
        if (counts[i] != r.new_lengths[i]).any():
            # A head-adaptive selector (Hard-KV's) keeps a count per head; the harness's
            # attention reads one length per sequence, so such a preset needs per-head lengths.
            raise NotImplementedError(f"{preset}: kept counts differ across heads; the harness reads one length per sequence")
    return [ItemResult(int(r.new_lengths[i]), [int(b) for b in r.released(i)]) for i in range(n)]


def _view(cache: PagedCache):
    return kvpolicy.PagedCache(
        "nano_vllm", cache.kv, block_table=cache.block_table, lengths=cache.lengths, positions=cache.positions
    )


def compress(preset: str, cache: PagedCache, items: list[Item]) -> list[ItemResult]:
    """Compress `items` of `cache` in place with the named preset (one batch, one call)."""
    if preset == "kara":
        raise ValueError("kara compresses windows: compress_windows(cache, items, window, buffer)")
    r = kvpolicy.compress(
        _policies[preset],
        _view(cache),
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
