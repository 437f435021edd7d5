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
