"""The statistics the report reads: per-step measures, intervals, multiple comparisons.

Everything here is NumPy on plain arrays, so the tests check each function on cases small
enough to work by hand.

- `kl_and_top1`: per configuration, KL(reference || configuration) and top-1 agreement.
- `repeated_ngram_share`: how much of the measured text repeats itself (a loop rewards
  recency: a preset that keeps the last tokens predicts a loop well).
- `conversation_bootstrap` / `paired_conversation_bootstrap`: intervals that resample
  conversations, the unit that is independent (steps of one conversation share its text
  and its cache state); the pooled mean is a ratio (sum over steps / steps), recomputed
  for each draw.
- `block_bootstrap` / `block_length_profile`: the within-conversation block bootstrap and
  the check of its block length (the half-width should stop growing once blocks are
  longer than the correlation of the steps).
- `holm`: Holm's step-down adjustment of the p-values of a family of comparisons.
"""

from __future__ import annotations

import numpy as np


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kl_and_top1(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [configs, vocab], row 0 the reference: per configuration KL(reference ||
    configuration) in nats (computed in float64) and whether its argmax is the reference's."""
    lp = log_softmax(np.asarray(logits, dtype=np.float64))
    p0 = np.exp(lp[0])
    kl = (p0[None] * (lp[0][None] - lp)).sum(-1)
    top = np.asarray(logits).argmax(-1)
    return kl, top == top[0]


def sample_token(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits / temperature) (greedy at temperature 0)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(np.argmax(logits))
    p = np.exp(log_softmax(np.asarray(logits, dtype=np.float64) / temperature))
    return int(rng.choice(len(p), p=p / p.sum()))


def repeated_ngram_flags(tokens, measured, n: int = 8) -> np.ndarray:
    """For each index t in `measured` (positions in `tokens`: token ids, or any hashable
    items): whether the n-gram ending at t (tokens[t-n+1 .. t]) already occurred, ending
    earlier, anywhere in tokens[: t]. A position with fewer than n tokens up to it is never
    repeated."""
    tokens = list(tokens)
    seen = set()
    flags = {}
    want = set(int(t) for t in measured)
    for t in range(len(tokens)):
        if t >= n - 1:
            g = tuple(tokens[t - n + 1 : t + 1])
            if t in want:
                flags[t] = g in seen
            seen.add(g)
        elif t in want:
            flags[t] = False
    return np.array([flags[int(t)] for t in measured], dtype=bool)


def repeated_ngram_share(tokens, measured, n: int = 8) -> float:
    """Share of the measured positions whose n-gram repeats one earlier in the text (nan
    when nothing is measured)."""
    f = repeated_ngram_flags(tokens, measured, n)
    return float(f.mean()) if f.size else float("nan")


def pooled_mean(values: list[np.ndarray]) -> float:
    n = sum(len(v) for v in values)
    return float(sum(float(np.sum(v)) for v in values) / n) if n else float("nan")


def _draws(values: list[np.ndarray], rng: np.random.Generator, draws: int) -> np.ndarray:
    """Pooled means of `draws` resamples of the conversations (with replacement)."""
    sums = np.array([float(np.sum(v)) for v in values])
    counts = np.array([len(v) for v in values], dtype=float)
    picks = rng.integers(0, len(values), size=(draws, len(values)))
    den = counts[picks].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, sums[picks].sum(1) / np.maximum(den, 1), np.nan)


def conversation_bootstrap(values: list[np.ndarray], rng: np.random.Generator, draws: int = 4000,
                           level: float = 0.95) -> tuple[float, float, float]:
    """(pooled mean, low, high): a percentile interval of the pooled mean over steps,
    resampling conversations. values: one array per conversation (its measured steps; an
    empty one counts as a conversation without steps). Fewer than two conversations with
    steps: the interval is (nan, nan)."""
    est = pooled_mean(values)
    if sum(len(v) > 0 for v in values) < 2:
        return est, float("nan"), float("nan")
    m = _draws(values, rng, draws)
    m = m[np.isfinite(m)]
    a = (1 - level) / 2
    return est, float(np.quantile(m, a)), float(np.quantile(m, 1 - a))


def paired_conversation_bootstrap(a: list[np.ndarray], b: list[np.ndarray], rng: np.random.Generator,
                                  draws: int = 4000, level: float = 0.95) -> dict:
    """The pooled mean of a - b (the same steps of the same conversations), its percentile
    interval resampling conversations, and a two-sided bootstrap p-value for a zero
    difference: twice the smaller share of draws on either side of 0 (at most 1, at least
    1 / draws when every draw falls on one side)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError("paired_conversation_bootstrap: a and b must hold the same steps of the same conversations")
    d = [np.asarray(x, dtype=float) - np.asarray(y, dtype=float) for x, y in zip(a, b)]
    est, lo, hi = conversation_bootstrap(d, rng, draws, level)
    if not np.isfinite(lo):
        return {"diff": est, "low": lo, "high": hi, "p": float("nan")}
    m = _draws(d, rng, draws)
    m = m[np.isfinite(m)]
    p = 2 * min((m <= 0).mean(), (m >= 0).mean())
    return {"diff": est, "low": lo, "high": hi, "p": float(min(1.0, max(p, 1 / len(m))))}


def holm(pvalues) -> np.ndarray:
    """Holm's adjusted p-values (same order as given): the i-th smallest p times (m - i),
    i from 0, made non-decreasing in that order and capped at 1. Rejecting where the
    adjusted p < alpha keeps the family-wise error rate at alpha. nan stays nan and does
    not count in m."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    order = ok[np.argsort(p[ok], kind="stable")]
    running = 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[j]))
        out[j] = running
    return out


def block_bootstrap(x: np.ndarray, rng: np.random.Generator, block: int = 64, draws: int = 2000) -> float:
    """Half-width (1.96 standard errors) of the mean of x, resampling non-overlapping
    blocks of `block` consecutive steps (the tail that does not fill a block is left out);
    nan with fewer than two blocks."""
    x = np.asarray(x, dtype=float)
    n = len(x) // block
    if n < 2:
        return float("nan")
    means = x[: n * block].reshape(n, block).mean(1)
    picks = rng.integers(0, n, size=(draws, n))
    return float(1.96 * means[picks].mean(1).std())


def block_length_profile(x: np.ndarray, rng: np.random.Generator, blocks=(1, 4, 16, 64, 256),
                         draws: int = 2000) -> dict[int, float]:
    """block_bootstrap's half-width at each block length: with correlated steps it grows
    with the block until blocks are longer than the correlation, then levels off; a
    half-width still growing at the longest block says the blocks were too short."""
    return {int(b): block_bootstrap(x, rng, b, draws) for b in blocks}
