"""The one place the harness compresses: `compress(preset, cache, items)`.

DEVELOPMENT STAND-IN. The `kvpolicy` Python package (issue 35 part 1) does not exist
yet; until it does, `_dev_fallback` below keeps the harness runnable end to end. It is
NOT any of the presets (it ranks every preset's tokens by the mean attention of the
last 16 queries and keeps the top `budget`, protecting the last 16): its numbers mean
nothing and the report refuses to publish them. It will be replaced by the package.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_cache import PagedCache

PRESETS = ("zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm")


@dataclasses.dataclass
class Item:
    seq: int
    budget: int
    history_tokens: int


@dataclasses.dataclass
class ItemResult:
    new_length: int
    released_blocks: list[int]
    keep_mask: np.ndarray  # [L, h_kv, T] uint8, T the length before compression


BACKEND = "dev-fallback"


def compress(preset: str, cache: PagedCache, items: list[Item]) -> list[ItemResult]:
    """Compress `items` of `cache` in place with `preset`; lengths and tables are the caller's."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}")
    return [_dev_fallback(cache, it) for it in items]


def _dev_fallback(cache: PagedCache, it: Item) -> ItemResult:
    c = cache.cfg
    s, T, k = it.seq, int(cache.lengths[it.seq]), it.budget
    w = 16
    nb = -(-T // cache.b)
    tbl = cache.block_table[s, :nb]
    q = cache.ordered_queries([s])[:, 0, -w:]  # [L, w, hq, d]
    masks = np.zeros((c.n_layers, c.n_kv_heads, T), dtype=np.uint8)
    for l in range(c.n_layers):
        K = cache.kv[0, l][tbl].reshape(nb * cache.b, c.n_kv_heads, c.head_dim)[:T]
        for h in range(c.n_kv_heads):
            qh = q[l, :, h * c.group : (h + 1) * c.group].reshape(-1, c.head_dim)
            a = qh @ K[:, h].T / np.sqrt(c.head_dim)
            a = np.exp(a - a.max(-1, keepdims=True))
            score = (a / a.sum(-1, keepdims=True)).mean(0)
            score[T - w :] = np.inf
            keep = np.sort(np.argsort(-score, kind="stable")[:k])
            masks[l, h, keep] = 1
            for arr in (cache.kv[0, l], cache.kv[1, l]):
                flat = arr[tbl].reshape(nb * cache.b, c.n_kv_heads, c.head_dim)
                moved = flat[keep, h]
                dst = np.arange(len(keep))
                arr[tbl[dst // cache.b], dst % cache.b, h] = moved
            pflat = cache.positions[l][tbl].reshape(nb * cache.b, c.n_kv_heads)
            moved = pflat[keep, h]
            cache.positions[l][tbl[np.arange(len(keep)) // cache.b], np.arange(len(keep)) % cache.b, h] = moved
    keep_blocks = -(-k // cache.b)
    return ItemResult(new_length=k, released_blocks=[int(x) for x in tbl[keep_blocks:]], keep_mask=masks)
