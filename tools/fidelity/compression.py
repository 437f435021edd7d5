"""The one place the harness compresses: `compress(preset, cache, items)`, through the
`kvpolicy` Python package (python/, the C++ host executor on NumPy arrays).

Every array is the harness's own and is handed over by DLPack with no copy: the K/V
tensor in the nano_vllm layout, the block table, the lengths, the positions, F and the
query window (a strided view). The package moves the kept tokens (their K, V, F and
positions) in place and returns the new lengths and released blocks; updating the
lengths, the table and the free list is the engine's part (PagedCache.release).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import kvpolicy
from paged_cache import PagedCache

PRESETS = tuple(kvpolicy.PRESETS)  # the package's presets by name
BACKEND = f"kvpolicy {kvpolicy.__version__}"


@dataclasses.dataclass
class Item:
    seq: int
    budget: int
    history_tokens: int


@dataclasses.dataclass
class ItemResult:
    new_length: int
    released_blocks: list[int]


_policies = {name: kvpolicy.preset(name) for name in PRESETS}  # published parameters


def compress(preset: str, cache: PagedCache, items: list[Item]) -> list[ItemResult]:
    """Compress `items` of `cache` in place with the named preset (one batch, one call)."""
    view = kvpolicy.PagedCache(
        "nano_vllm", cache.kv, block_table=cache.block_table, lengths=cache.lengths, positions=cache.positions
    )
    r = kvpolicy.compress(
        _policies[preset],
        view,
        seqs=np.array([it.seq for it in items]),
        budgets=np.array([it.budget for it in items]),
        history_tokens=np.array([it.history_tokens for it in items]),
        queries=cache.query_window(),  # slot s is sequence s
        scores=cache.scores,
    )
    counts = np.asarray(r.kept_counts)
    for i in range(len(items)):
        if (counts[i] != r.new_lengths[i]).any():
            # A head-adaptive selector (Hard-KV's) keeps a count per head; the harness's
            # attention reads one length per sequence, so such a preset needs per-head lengths.
            raise NotImplementedError(f"{preset}: kept counts differ across heads; the harness reads one length per sequence")
    return [ItemResult(int(r.new_lengths[i]), [int(b) for b in r.released(i)]) for i in range(len(items))]
