"""Hard-KV in the harness (compression.HEAD_ADAPTIVE, PagedCache's live bytes), on a tiny
random model: attention over each head's live slots against a dense forward over the
tokens each head holds, and the engine's compressions: counts per head at most the budget,
the sequence as long as its longest head, and a token a head dropped never back."""

import numpy as np

import compression
import kvpolicy
import model
from harness import KEEPMAP_LAYERS, SeqConfig
from paged_cache import PagedCache, decode_step
from test_per_head_cache import dense_step
from tiny import tiny_engine, tiny_weights


def test_attention_reads_each_heads_live_slots():
    """Two sequences holding the same prompt, some of each head's slots dropped (live 0) in
    the first: its decode step equals a dense forward over what each head holds; the second,
    all live, the full prompt's."""
    w = tiny_weights()
    c = w.config
    rng = np.random.default_rng(11)
    P = 37
    prompt = rng.integers(0, c.vocab, size=P)
    _, k, v, q = model.prefill_dense(w, prompt)
    cache = PagedCache(c, 2, 24, 4, 12, 8)
    cache.fill_prompt(k, v, q)
    cache.cautious[:] = True
    kept = [[None] * c.n_kv_heads for _ in range(c.n_layers)]
    for l in range(c.n_layers):
        for h in range(c.n_kv_heads):
            dropped = rng.choice(P, size=int(rng.integers(0, P - 1)), replace=False)
            t = np.sort(dropped)
            cache.live[l, cache.block_table[0, t // 4], t % 4, h] = 0
            kept[l][h] = np.setdiff1d(np.arange(P), dropped)
    full = [[np.arange(P)] * c.n_kv_heads for _ in range(c.n_layers)]
    tokens = np.array([5, 17])
    got = decode_step(w, cache, tokens)
    np.testing.assert_allclose(got[0], dense_step(w, tokens[0], P, kept, k, v)[0], atol=2e-4)
    np.testing.assert_allclose(got[1], dense_step(w, tokens[1], P, full, k, v)[0], atol=2e-4)
    assert cache.held_slots(0)[:, :, P].all()  # the new token is live in every head


def test_the_engine_keeps_hard_kv_counts_per_head_and_dropped_tokens_out(monkeypatch):
    """hard_kv beside snapkv at one budget, the threshold trigger compressing both: each head
    keeps its own count (at most the budget), the sequence is as long as its longest head,
    and no position a head dropped is held by it again. (p 0.6 and a window of 8, so that
    a tiny model's flat attention leaves the heads different counts under the budget.)"""
    monkeypatch.setitem(compression._policies, "hard_kv", kvpolicy.HardKV(p=0.6, protect_window=8))
    b, budget = 16, 32
    eng, w, prompt, steps = tiny_engine([SeqConfig("hard_kv@32", "hard_kv", budget), SeqConfig("snapkv@32", "snapkv", budget)],
                                        weights_seed=2, rng_seed=5, steps=150, block_size=b)
    assert eng.cache.cautious.tolist() == [False, True, False]
    eng.prefill(prompt)
    differ = False
    for tok in steps:
        eng.step(np.full(3, tok))
        held = eng.cache.held_slots(1).sum(-1)  # [L, h_kv]
        assert held.max() <= budget + b and eng.cache.lengths[1] >= held.max()
        differ |= held.min() < held.max()
    records = eng.keepmaps[1]
    assert len(records) >= 4 and eng.states[1].compressions == len(records)
    assert differ  # the heads held different counts
    for before, after in zip(records, records[1:]):
        for layer_before, layer_after in zip(before["positions"], after["positions"]):
            for head_before, head_after in zip(layer_before, layer_after):
                assert len(head_after) <= budget
                came_back = set(head_after) - set(head_before) - set(range(before["next_pos"], after["next_pos"]))
                assert not came_back, f"positions {sorted(came_back)} came back"
    assert len(records[-1]["positions"]) == len([l for l in KEEPMAP_LAYERS if l < w.config.n_layers])
