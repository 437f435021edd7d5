"""Independent NumPy references of two presets' keep decisions, written from the
papers' definitions (and docs/pipeline.md's tie rule), not from kvpolicy's code.

Tie rule: tokens rank by score, descending; equal scores go to the more recent token.
Protected tokens (the newest `window`, the first `sinks`) are always kept.
"""

from __future__ import annotations

import numpy as np


def keep_top(scores: np.ndarray, budget: int, window: int, sinks: int) -> np.ndarray:
    """Keep mask of the `budget` highest-ranked tokens, protected ones first."""
    T = scores.shape[0]
    key = scores.astype(np.float64).copy()
    key[max(T - window, 0) :] = np.inf
    key[:sinks] = np.inf
    order = sorted(range(T), key=lambda t: (-key[t], -t))
    keep = np.zeros(T, dtype=np.uint8)
    keep[order[:budget]] = 1
    return keep


def streaming_llm_keep(T: int, budget: int, sinks: int = 4) -> np.ndarray:
    """StreamingLLM (Xiao et al. 2023): the first `sinks` tokens and the most recent rest."""
    keep = np.zeros(T, dtype=np.uint8)
    keep[:sinks] = 1
    keep[T - (budget - sinks) :] = 1
    return keep


def snapkv_scores(keys: np.ndarray, queries: np.ndarray, window: int = 32, kernel: int = 7) -> np.ndarray:
    """SnapKV (Li et al. 2024), eq. 7-8, for one layer and KV head.

    keys [T, d]; queries [w, G, d], the newest last (entry j sits at position
    T - w + j and sees keys t <= its position). Softmax over keys per query head,
    mean over the G query heads of the KV head, sum over the window, then a max pool
    of `kernel` along the tokens (windows clipped at the ends).
    """
    T, d = keys.shape
    q = queries[-window:].astype(np.float64)
    logits = np.einsum("jgd,td->jgt", q, keys.astype(np.float64)) / np.sqrt(d)
    position = T - window + np.arange(window)
    logits = np.where(np.arange(T)[None, None, :] <= position[:, None, None], logits, -np.inf)
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=2, keepdims=True)
    s = p.mean(axis=1).sum(axis=0)
    half = kernel // 2
    return np.array([s[max(t - half, 0) : t + half + 1].max() for t in range(T)])


def kara_scores(keys: np.ndarray, queries: np.ndarray, buffer: int, group: str = "sum") -> np.ndarray:
    """Kara (eq. 4) for one layer and KV head of one window.

    keys [n, d]: the window's compressible region W \\ U (its first |W| - |U| tokens);
    queries [W, G, d]: the window's own |W| queries, oldest first. Every query sees every
    key of the region (no causal mask); softmax over the region per query head, the
    group reduced (sum, mean or max over its G heads), summed over the queries.
    """
    d = keys.shape[1]
    logits = np.einsum("jgd,td->jgt", queries.astype(np.float64), keys.astype(np.float64)) / np.sqrt(d)
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=2, keepdims=True)
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max}[group]
    return reduce(p, axis=1).sum(axis=0)


def _ranked(values, indices) -> list:
    """Indices ordered best first: larger value first, NaN as -inf, ties to the larger index."""
    key = [(-np.inf if np.isnan(v) else float(v), i) for v, i in zip(values, indices)]
    return [i for _, i in sorted(key, reverse=True)]


def token2chunk_keep(a: np.ndarray, k: int, gamma: int = 8, alpha: int = 16) -> np.ndarray:
    """Kara's Token2Chunk (eq. 5-8, C.3) over the region's scores `a` (float32) with budget k.

    1. anchors: the top max(k - alpha, 0) tokens by score;
    2. chunks: consecutive anchors lo < hi with 2 <= hi - lo < gamma enclose hi - lo - 1
       tokens, scored R = (a[lo] + a[hi]) * (hi - lo - 1) in float32; the interiors of the
       best floor(alpha / (gamma - 2)) chunks are kept (ties to the later chunk);
    3. fill: the best remaining tokens until min(k, n) are kept.
    """
    a = np.asarray(a, dtype=np.float32)
    n = len(a)
    keep = np.zeros(n, dtype=np.uint8)
    anchors = sorted(_ranked(a, range(n))[: min(max(k - alpha, 0), n)])
    keep[anchors] = 1
    pairs = [(lo, hi) for lo, hi in zip(anchors, anchors[1:]) if 2 <= hi - lo < gamma]
    r = [(a[lo] + a[hi]) * np.float32(hi - lo - 1) for lo, hi in pairs]
    for j in _ranked(r, range(len(pairs)))[: alpha // (gamma - 2)]:
        lo, hi = pairs[j]
        keep[lo + 1 : hi] = 1
    rest = [t for t in range(n) if not keep[t]]
    fill = min(k, n) - int(keep.sum())
    keep[_ranked(a[rest], rest)[: max(fill, 0)]] = 1
    return keep
