"""KV-Compress in the harness (per_head_cache.PerHeadCache, compression.compress_per_head,
harness.PerHeadThreshold), on a tiny random model: attention over each head's own table and
length against a dense forward, the decode metric against kvpolicy.per_head_metric, a
compression against an independent NumPy reference of KV-Compress's block schedule, and
the trigger against the uniform presets' threshold trigger."""

import math

import numpy as np
import pytest

import compression
import kvpolicy
import model
from harness import PerHeadThreshold, SeqConfig, Threshold
from paged_cache import decode_step
from per_head_cache import PerHeadCache
from tiny import tiny_engine, tiny_weights


def prefilled(w, prompt, seqs=2, b=4):
    _, k, v, q = model.prefill_dense(w, prompt)
    L, hk = w.config.n_layers, w.config.n_kv_heads
    max_blocks = -(-(len(prompt) + 40) // b)
    cache = PerHeadCache(w.config, seqs, seqs * L * hk * max_blocks, b, max_blocks)
    cache.fill_prompt(k, v)
    return cache, k, v, q


def keep_only(cache, l, s, h, order):
    """Leave head (l, s, h) holding the prompt positions `order`, in that slot order (as a
    MoveCache leaves a head: dense, not in position order), by hand: its K/V/metric/position
    rows rewritten, its table trimmed, its tail blocks freed."""
    blocks, slots = cache.head_slots(l, s, h)
    src = {int(p): (cache.k[bb, ss].copy(), cache.v[bb, ss].copy(), cache.metric[bb, ss])
           for bb, ss, p in zip(blocks, slots, cache.positions[blocks, slots])}
    for t, p in enumerate(order):
        bb, ss = cache.tables[l, s, h, t // cache.b], t % cache.b
        cache.k[bb, ss], cache.v[bb, ss], cache.metric[bb, ss] = src[int(p)]
        cache.positions[bb, ss] = p
    keep, held = -(-len(order) // cache.b), -(-len(blocks) // cache.b)
    cache.free.extend(int(x) for x in cache.tables[l, s, h, keep:held])
    cache.tables[l, s, h, keep:] = -1
    cache.lengths[l, s, h] = len(order)


def dense_step(w, token, pos, kept, k, v):
    """One token's forward, written out: KV head h of layer l attends to the prompt's keys at
    positions kept[l][h] and the new token's. Returns (logits, queries [L, h_q, d])."""
    c = w.config
    cos, sin = model.rope_tables(c, np.array([pos]))
    x = w.embed[[token]]
    qs = []
    for l in range(c.n_layers):
        h = model.rmsnorm(x, w.attn_norm[l], c.rms_eps)
        qkv = h @ w.wqkv[l]
        kvd = c.n_kv_heads * c.head_dim
        qn = model.apply_rope(qkv[:, : c.hidden].reshape(1, c.n_heads, c.head_dim), cos, sin)[0]
        kn = model.apply_rope(qkv[:, c.hidden : c.hidden + kvd].reshape(1, c.n_kv_heads, c.head_dim), cos, sin)[0]
        vn = qkv[0, c.hidden + kvd :].reshape(c.n_kv_heads, c.head_dim)
        o = np.empty((c.n_heads, c.head_dim), dtype=np.float32)
        for hq in range(c.n_heads):
            hk = hq // c.group
            K = np.concatenate([k[l, kept[l][hk], hk], kn[hk][None]])
            V = np.concatenate([v[l, kept[l][hk], hk], vn[hk][None]])
            s = K @ qn[hq] / math.sqrt(c.head_dim)
            p = np.exp(s - s.max())
            o[hq] = (p / p.sum()) @ V
        qs.append(qn)
        x = x + o.reshape(1, -1) @ w.wo[l]
        h = model.rmsnorm(x, w.ffn_norm[l], c.rms_eps)
        gu = h @ w.wgu[l]
        x = x + (model.silu(gu[:, : c.ffn]) * gu[:, c.ffn :]) @ w.wdown[l]
    return (model.rmsnorm(x, w.out_norm, c.rms_eps) @ w.embed_t)[0], np.stack(qs)


@pytest.mark.parametrize("excluded", [0, 3])
def test_attention_over_per_head_lengths_equals_dense(excluded):
    """Heads of different lengths, their tokens out of position order, some heads' last block
    partial and some full: the decode step equals a dense forward over each head's own kept
    tokens, and the metric it adds is kvpolicy.per_head_metric's decode metric."""
    w = tiny_weights()
    c = w.config
    rng = np.random.default_rng(3)
    P = 37
    prompt = rng.integers(0, c.vocab, size=P)
    cache, k, v, _ = prefilled(w, prompt)
    cache.excluded_distance = excluded
    cache.metric[:] = rng.random(cache.metric.shape, dtype=np.float32)
    kept = [[[None] * c.n_kv_heads for _ in range(c.n_layers)] for _ in range(2)]
    for s in range(2):
        for l in range(c.n_layers):
            for h in range(c.n_kv_heads):
                n = int(rng.choice([1, 8, 12, 19, P]))  # whole blocks of 4, partial ones, the full prompt
                order = rng.permutation(P)[:n]
                keep_only(cache, l, s, h, order)
                kept[s][l][h] = np.sort(order)
    assert len(np.unique(cache.lengths)) > 3
    metric_before = cache.metric.copy()

    tokens = np.array([5, 17])
    got = decode_step(w, [(cache, np.arange(2))], tokens)
    queries = np.empty((c.n_layers, 2, 1, c.n_heads, c.head_dim), dtype=np.float32)
    for s in range(2):
        want, queries[:, s, 0] = dense_step(w, tokens[s], P, kept[s], k, v)
        np.testing.assert_allclose(got[s], want, atol=2e-4)
    assert (cache.lengths == np.array([[[len(kept[s][l][h]) + 1 for h in range(2)] for s in range(2)]
                                       for l in range(c.n_layers)])).all()
    assert (cache.next_pos == P + 1).all()

    # The metric: what per_head_metric adds to the metric held before the step (the new
    # token's slot starting at 0) from the step's queries.
    expect = cache.snapshot()
    expect.metric[:] = metric_before
    for l in range(c.n_layers):
        for s in range(2):
            for h in range(c.n_kv_heads):
                blocks, slots = expect.head_slots(l, s, h)
                expect.metric[blocks[-1], slots[-1]] = 0.0
    kvpolicy.per_head_metric(kvpolicy.KVCompress(excluded_distance=excluded), queries, expect.k, expect.metric,
                             expect.tables, expect.lengths, seqs=[0, 1], mode="decode", positions=expect.positions,
                             query_positions=[P, P])
    np.testing.assert_allclose(cache.metric, expect.metric, rtol=1e-5, atol=1e-6)


def reference_compress(heads, asked, b, protected, logical):
    """KV-Compress's schedule as SPEC.md states it, over one sequence's heads (a list, in
    (layer, KV head) order, of {position: metric}): evicting e blocks from a head costs its
    (e - 1) b + hanging lowest metrics (hanging: the tokens of its last, possibly partial,
    block), and is priced at the highest of them; the `asked` cheapest blocks over all the
    heads go. The last `protected` positions are never evicted. Returns each head's kept
    positions."""
    blocks = []
    orders = []
    for r, head in enumerate(heads):
        T = len(head)
        order = sorted((p for p in head if p < logical - protected), key=lambda p: (head[p], p))
        hanging = b if T % b == 0 else T % b
        possible = 0 if len(order) < hanging else min(-(-T // b), 1 + (len(order) - hanging) // b)
        blocks += [(head[order[(e - 1) * b + hanging - 1]], r, e) for e in range(1, possible + 1)]
        orders.append((order, hanging))
    taken = [0] * len(heads)
    for _, r, _ in sorted(blocks)[:asked]:
        taken[r] += 1
    kept = []
    for head, (order, hanging), e in zip(heads, orders, taken):
        gone = set(order[: (e - 1) * b + hanging]) if e else set()
        kept.append(sorted(p for p in head if p not in gone))
    return kept


def read_heads(cache, seq):
    """Per (layer, KV head) of the sequence: {position: (k, v, metric)}."""
    out = []
    for l in range(cache.lengths.shape[0]):
        for h in range(cache.lengths.shape[2]):
            blocks, slots = cache.head_slots(l, seq, h)
            out.append({int(cache.positions[bb, ss]): (cache.k[bb, ss].copy(), cache.v[bb, ss].copy(),
                                                       float(cache.metric[bb, ss])) for bb, ss in zip(blocks, slots)})
    return out


def test_compression_through_the_package_keeps_what_the_reference_keeps(monkeypatch):
    """Two compressions of two sequences, the second after MoveCache has left heads of
    different lengths out of position order: each head keeps the positions the reference
    schedule keeps, with their own K, V and metric, and the sequence frees its budget."""
    monkeypatch.setattr(compression, "KV_COMPRESS", kvpolicy.KVCompress(protected_window=8, metric_window=8))
    w = tiny_weights(seed=2)
    c = w.config
    rows = c.n_layers * c.n_kv_heads
    rng = np.random.default_rng(5)
    P, b, budget = 45, 4, 16
    cache, _, _, q = prefilled(w, rng.integers(0, c.vocab, size=P), b=b)
    compression.kv_compress_prefill_metric(cache, np.ascontiguousarray(q[:, None, -8:]))
    for rounds in range(2):
        for _ in range(7 + 12 * rounds):  # the metric accumulates; the second round's heads start ragged
            decode_step(w, [(cache, np.arange(2))], rng.integers(0, c.vocab, size=2))
        items = [compression.Item(seq=s, budget=budget, history_tokens=0) for s in (1, 0)]
        before = {s: read_heads(cache, s) for s in (0, 1)}
        held = {s: sum(-(-int(T) // b) for T in cache.lengths[:, s].ravel()) for s in (0, 1)}
        free_before = len(cache.free)
        results = compression.compress_per_head(cache, items)
        for it, r in zip(items, results):
            cache.release(it.seq, r.new_lengths, r.freed_blocks, r.freed_counts)
        for it, r in zip(items, results):
            s = it.seq
            # The mapping: every (layer, KV head) keeps budget / b blocks on average.
            assert r.asked == held[s] - rows * (budget // b) and r.freed == r.asked
            kept = reference_compress([{p: m for p, (_, _, m) in head.items()} for head in before[s]], r.asked, b, 8,
                                      int(cache.next_pos[s]))
            after = read_heads(cache, s)
            for head_before, head_after, want in zip(before[s], after, kept):
                assert sorted(head_after) == want
                for p in want:
                    for x, y in zip(head_after[p], head_before[p]):
                        np.testing.assert_array_equal(x, y)
            # At most the budget: a head that evicted nothing may end in a partial block.
            assert cache.tokens(s) <= rows * budget and (rounds or cache.tokens(s) == rows * budget)
            held_after = [-(-int(T) // b) for T in cache.lengths[:, s].ravel()]
            assert sum(held_after) == rows * (budget // b)
            assert (cache.tables[:, s].reshape(rows, -1) >= 0).sum(1).tolist() == held_after
        assert len(cache.free) == free_before + sum(r.freed for r in results)
        assert len(set(cache.free)) == len(cache.free)
    assert len(np.unique(cache.lengths)) > 1  # the heads kept different counts


@pytest.mark.parametrize("positions, tokens, due", [
    (192, 90 * 192, True),  # before a first compression every head holds T = budget + b
    (191, 90 * 191, False), (193, 90 * 193, False), (128, 90 * 128, False),
    (512, 90 * 512, True),  # a prompt past the budget: the first block boundary after it
    (256, 90 * 192, True),  # b steps after a compression to 90 x 128
    (256, 90 * 192 - 1, False), (240, 90 * 200, False),
])
def test_per_head_threshold(positions, tokens, due):
    t = PerHeadThreshold(block_size=64, budget=128, rows=90)
    assert t.due(positions, tokens) is due
    if tokens == 90 * positions:  # every head the same length: the uniform trigger's answer
        assert Threshold(block_size=64, max_blocks=3).due(positions) is due


def test_the_engine_compresses_kv_compress_when_the_threshold_trigger_fires(monkeypatch):
    """kv_compress beside a uniform preset at the same budget: compressed at the same steps,
    to the same cache (budget tokens per head on average), the same cache at every step; and,
    until its first compression, the full cache's logits."""
    monkeypatch.setattr(compression, "KV_COMPRESS", kvpolicy.KVCompress(protected_window=8, metric_window=8))
    b, budget = 16, 32
    eng, w, prompt, steps = tiny_engine(
        [SeqConfig("kv_compress@32", "kv_compress", budget), SeqConfig("streaming_llm@32", "streaming_llm", budget)],
        weights_seed=1, rng_seed=7, steps=120, block_size=b, per_head_block_size=4)
    rows = w.config.n_layers * w.config.n_kv_heads
    assert eng.per_head_ids.tolist() == [1] and eng.paged_ids.tolist() == [0, 2]
    eng.prefill(prompt)
    logits, cache = [], []
    for tok in steps:
        logits.append(eng.step(np.full(3, tok)))
        cache.append(eng.attended.copy())
        assert eng.per_head.tokens(0) <= rows * (budget + b)
    cache = np.array(cache)
    kv_steps = [r["step"] for r in eng.keepmaps[1]]
    assert len(kv_steps) >= 5 and kv_steps == [r["step"] for r in eng.keepmaps[2]]
    # Threshold's steps: length 48 (budget + b, a full last block), then every b steps.
    lengths = len(prompt) + np.arange(1, len(steps) + 1)
    assert kv_steps[0] == int(np.flatnonzero(lengths == budget + b)[0]) + 1
    assert np.diff(kv_steps).tolist() == [b] * (len(kv_steps) - 1)
    np.testing.assert_array_equal(cache[:, 1], cache[:, 2])  # tokens per head: the mean equals the uniform length
    assert eng.states[1].compressions == len(kv_steps) and eng.short_frees == 0
    first = kv_steps[0]
    np.testing.assert_allclose(np.array(logits[:first])[:, 1], np.array(logits[:first])[:, 0], atol=1e-5)
    assert np.abs(np.array(logits[first:])[:, 1] - np.array(logits[first:])[:, 0]).max() > 1e-3
    # The keep map holds each head's own positions: the protected window in every head.
    last = eng.keepmaps[1][-1]
    for layer in last["positions"]:
        for head in layer:
            assert set(range(last["next_pos"] - 8, last["next_pos"])) <= set(head)


def test_kv_compress_overrides(monkeypatch):
    """harness.py --kv-compress: KVCompress keywords over the published ones, as report.py knows them."""
    import harness
    import report

    monkeypatch.setattr(compression, "KV_COMPRESS", compression.KV_COMPRESS)
    assert compression.KV_COMPRESS.params() == report.PUBLISHED_KV_COMPRESS
    assert harness.parse_keywords("excluded_distance=10,budget=layer,compression_rate=0.5") == \
        {"excluded_distance": 10, "budget": "layer", "compression_rate": 0.5}
    compression.configure_kv_compress({"excluded_distance": 10})
    assert compression.KV_COMPRESS.params() == {**report.PUBLISHED_KV_COMPRESS, "excluded_distance": 10}
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        harness.parse_keywords("excluded_distance")
