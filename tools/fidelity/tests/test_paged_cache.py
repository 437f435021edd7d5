"""The paged cache and decode step the harness runs on."""

import numpy as np
import pytest

import model
from harness import Threshold
from paged_cache import PagedCache, decode_step


def test_decode_through_pages_equals_dense_forward(weights, tokenizer):
    ids = tokenizer.encode(model.chat_prompt([{"role": "user", "content": "Name three colours."}])).ids
    dense, _, _, _ = model.prefill_dense(weights, np.array(ids))
    # Prefill all but the last 5 tokens, then decode them one by one, in 3 sequences whose
    # blocks interleave in the pool (block size 8: several blocks each).
    _, k, v, q = model.prefill_dense(weights, np.array(ids[:-5]))
    cache = PagedCache(weights.config, 3, 40, 8, 12, 4)
    cache.fill_prompt(k, v, q)
    assert len({int(x) for x in cache.block_table[:, :3].ravel()}) == 9
    for i, t in enumerate(ids[-5:]):
        out = decode_step(weights, cache, np.full(3, t))
        np.testing.assert_allclose(out, np.repeat(dense[len(ids) - 5 + i][None], 3, 0), atol=2e-4)


def test_attention_sees_only_the_compacted_prefix(weights, tokenizer):
    """After tokens are moved to the front and the length shortened, the model sees exactly
    the kept tokens, at their original RoPE positions."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.").ids
    P = len(ids)
    _, k, v, q = model.prefill_dense(weights, np.array(ids))
    keep = np.array([0, 1, 4, 5, 9, P - 3, P - 2, P - 1])  # the same in every layer and head
    cache = PagedCache(weights.config, 1, 8, 4, 8, 4)
    cache.fill_prompt(k, v, q)
    tbl = cache.block_table[0]
    src_b, src_s = tbl[keep // 4], keep % 4
    dst = np.arange(len(keep))
    for x in (0, 1):
        moved = cache.kv[x][:, src_b, src_s].copy()
        cache.kv[x][:, tbl[dst // 4], dst % 4] = moved
    cache.lengths[0] = len(keep)
    got = decode_step(weights, cache, np.array([ids[0]]))[0]

    # The same step computed densely over the kept tokens only.
    c = weights.config
    cos, sin = model.rope_tables(c, np.array([P]))
    x = weights.embed[[ids[0]]]
    for l in range(c.n_layers):
        h = model.rmsnorm(x, weights.attn_norm[l], c.rms_eps)
        qkv = h @ weights.wqkv[l]
        qn = model.apply_rope(qkv[:, : c.hidden].reshape(1, c.n_heads, c.head_dim), cos, sin)[0]
        kn = model.apply_rope(qkv[:, c.hidden : c.hidden + 192].reshape(1, 3, 64), cos, sin)[0]
        vn = qkv[0, c.hidden + 192 :].reshape(3, 64)
        K = np.concatenate([k[l, keep], kn[None]])  # [T, 3, 64]
        V = np.concatenate([v[l, keep], vn[None]])
        o = np.empty((c.n_heads, c.head_dim), dtype=np.float32)
        for hq in range(c.n_heads):
            s = K[:, hq // c.group] @ qn[hq] / 8.0
            p = np.exp(s - s.max())
            o[hq] = (p / p.sum()) @ V[:, hq // c.group]
        x = x + o.reshape(1, -1) @ weights.wo[l]
        h = model.rmsnorm(x, weights.ffn_norm[l], c.rms_eps)
        gu = h @ weights.wgu[l]
        x = x + (model.silu(gu[:, : c.ffn]) * gu[:, c.ffn :]) @ weights.wdown[l]
    want = (model.rmsnorm(x, weights.out_norm, c.rms_eps) @ weights.embed_t)[0]
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert cache.positions[0, tbl[len(keep) // 4], len(keep) % 4, 0] == P  # the new token's original position


def test_gguf_rope_equals_hf_rope_on_unpermuted_weights():
    """llama.cpp's adjacent-pair RoPE on GGUF rows gives HF's rotate_half scores on HF rows."""
    rng = np.random.default_rng(0)
    n_heads, d, hidden = 3, 64, 32
    wq_gguf, wk_gguf = rng.normal(size=(2, n_heads * d, hidden)).astype(np.float32)
    x = rng.normal(size=(2, hidden)).astype(np.float32)
    cfg = model.Config(1, hidden, 1, n_heads, n_heads, d, 100000.0, 1e-5, 1, 1)
    cos, sin = model.rope_tables(cfg, np.array([7, 42]))

    def hf_rope(t):
        a, b = t[..., : d // 2], t[..., d // 2 :]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    q_g = model.apply_rope((x @ wq_gguf.T).reshape(2, n_heads, d), cos, sin)
    k_g = model.apply_rope((x @ wk_gguf.T).reshape(2, n_heads, d), cos, sin)
    q_h = hf_rope((x @ model.unpermute_hf(wq_gguf, n_heads).T).reshape(2, n_heads, d))
    k_h = hf_rope((x @ model.unpermute_hf(wk_gguf, n_heads).T).reshape(2, n_heads, d))
    np.testing.assert_allclose(np.einsum("ihd,jhd->hij", q_g, k_g), np.einsum("ihd,jhd->hij", q_h, k_h), rtol=1e-4, atol=1e-3)


def test_query_window_oldest_first(weights, tokenizer):
    """The window view holds the last w queries, oldest first, after prefill and decode steps."""
    cfg = weights.config
    ids = tokenizer.encode("One two three four five six seven eight nine ten").ids
    _, k, v, q = model.prefill_dense(weights, np.array(ids))
    cache = PagedCache(cfg, 2, 8, 4, 4, 4)
    cache.fill_prompt(k[:, :-3], v[:, :-3], q[:, :-3])
    np.testing.assert_array_equal(cache.query_window()[:, 1], q[:, -7:-3])
    for t in ids[-3:]:
        decode_step(weights, cache, np.full(2, t))
    win = cache.query_window()
    assert win.shape == (cfg.n_layers, 2, 4, cfg.n_heads, cfg.head_dim) and win.base is not None  # a view
    np.testing.assert_allclose(win[:, 0], q[:, -4:], atol=1e-4)


@pytest.mark.parametrize(
    "length, due", [(191, False), (192, True), (193, False), (256, True), (320, True), (128, False)]
)
def test_threshold_trigger_as_triggers_hpp(length, due):
    t = Threshold(block_size=64, max_blocks=3)  # budget 128: due at 192, 256, ... (full last block)
    assert t.budget == 128
    assert t.due(length) is due


def test_release_returns_the_table_tail_to_the_pool(weights):
    cache = PagedCache(weights.config, 1, 6, 4, 6, 4)
    cache._allocate(0, 17)  # 5 blocks
    tail = cache.block_table[0, 2:5].tolist()
    free_before = len(cache.free)
    cache.lengths[0] = 17
    cache.release(0, 8, tail)
    assert cache.lengths[0] == 8 and cache.held[0] == 2
    assert (cache.block_table[0, 2:] == -1).all() and len(cache.free) == free_before + 3
    with pytest.raises(RuntimeError):
        cache.release(0, 4, [12345])
