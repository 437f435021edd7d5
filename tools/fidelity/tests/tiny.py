"""A tiny random model of SmolLM2's architecture (GQA, SwiGLU, tied embeddings): no GGUF
needed, so the engine tests run in seconds."""

import types

import numpy as np

import model
from harness import Engine, SeqConfig


def tiny_weights(seed=0, layers=3):  # 3: the harness records layer 2's keep map
    cfg = model.Config(n_layers=layers, hidden=32, ffn=48, n_heads=4, n_kv_heads=2, head_dim=8, rope_base=10000.0,
                       rms_eps=1e-5, vocab=61, context=4096)
    rng = np.random.default_rng(seed)

    def f(*shape):
        return (rng.standard_normal(shape) * 0.4).astype(np.float32)

    kv = cfg.n_kv_heads * cfg.head_dim
    ones = np.ones(cfg.hidden, dtype=np.float32)
    w = types.SimpleNamespace(
        config=cfg, embed=f(cfg.vocab, cfg.hidden), out_norm=ones, attn_norm=[ones] * layers, ffn_norm=[ones] * layers,
        wqkv=[f(cfg.hidden, cfg.hidden + 2 * kv) for _ in range(layers)], wo=[f(cfg.hidden, cfg.hidden) for _ in range(layers)],
        wgu=[f(cfg.hidden, 2 * cfg.ffn) for _ in range(layers)], wdown=[f(cfg.ffn, cfg.hidden) for _ in range(layers)])
    w.embed_t = np.ascontiguousarray(w.embed.T)
    return w


def tiny_engine(configs, *, weights_seed=0, rng_seed, steps, block_size, margin=4, **engine_kw):
    """An Engine over the tiny model: the full cache, then `configs`; a random prompt of 21
    tokens and `steps` random decode tokens. Returns (engine, weights, prompt, tokens)."""
    w = tiny_weights(seed=weights_seed)
    rng = np.random.default_rng(rng_seed)
    prompt = rng.integers(0, w.config.vocab, size=21)
    tokens = rng.integers(0, w.config.vocab, size=steps)
    eng = Engine(w, [SeqConfig("full", None, None), *configs], len(prompt), len(prompt) + len(tokens) + margin,
                 block_size=block_size, **engine_kw)
    return eng, w, prompt, tokens
