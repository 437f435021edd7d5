"""Kara in the harness (harness.Periodic, Engine, compression.compress_windows), on a tiny
random model of the same architecture: no GGUF needed, so it runs in seconds."""

import numpy as np
import pytest

import compression
import model
from harness import Periodic, SeqState, kara_config
from tiny import tiny_engine


def test_periodic_is_trigger_periodic():
    """The values tests/unit/test_triggers.cpp checks for kvp::trigger::periodic at KvLLM's sizes."""
    p = Periodic(period=128, block_size=256, window=768, buffer=32, window_keep=257)
    assert p.budget == 225
    assert [p.window_begin_of(T) for T in (1100, 1280, 1281)] == [256, 256, 512]
    assert p.window_begin_of(768) < 0
    fresh = SeqState()  # never compressed: its whole length is the uncompressed tail
    assert next(step for step in range(1, 4000) if p.due(fresh, step, step)) == 896
    done = SeqState(compressions=1)
    for tail, due in ((768, False), (769, True)):  # T 1281: window [512, 1280) and one token after
        done.generated_since_compression = tail
        assert p.due(done, 1281, 1280) == due
    assert not p.due(SeqState(compressions=1, generated_since_compression=900), 1281, 1281)  # off the period


def test_kara_config_budget():
    assert [kara_config(w, u, r).budget for w, u, r in ((128, 16, 0.3), (128, 16, 0.5), (256, 32, 0.3), (256, 32, 0.5))] \
        == [34, 56, 68, 112]
    assert kara_config(128, 16, 0.3).name == "kara@128/16/0.3"


@pytest.mark.parametrize("period", [8, 4])
def test_the_engine_compresses_each_window_once_with_its_own_queries(monkeypatch, period):
    b, W, U = 8, 16, 4
    cfg = kara_config(W, U, 0.5)  # 6 of W \ U's 12, 10 of the window with the buffer
    eng, w, prompt, steps = tiny_engine([cfg], rng_seed=1, steps=120, block_size=b, margin=8, kara_period=period)

    calls = []
    real = compression.kvpolicy.compress

    def spy(policy, view, **kw):
        seq, begin = int(kw["seqs"][0]), int(kw["window_begins"][0])
        T = int(eng.cache.lengths[seq])
        t = np.arange(T)
        before = eng.cache.positions[:, eng.cache.block_table[seq, t // b], t % b].copy()  # [L, T, h]
        r = real(policy, view, **kw)
        calls.append(dict(step=eng.clock, seq=seq, begin=begin, T=T, queries=kw["queries"][:, 0].copy(),
                          policy=policy, before=before, new_length=int(r.new_lengths[0])))
        return r

    monkeypatch.setattr(compression.kvpolicy, "compress", spy)
    eng.prefill(prompt)
    logits = []
    for tok in steps:
        logits.append(eng.step(np.full(2, tok)))

    assert len(calls) >= 4 and all(c["seq"] == 1 and c["step"] % period == 0 for c in calls)
    assert calls[0]["policy"] == compression.kvpolicy.Kara(window=W, buffer=U)
    tokens = np.concatenate([prompt, steps])
    previous = None
    for c in calls:
        begin, T = c["begin"], c["T"]
        assert begin % b == 0 and begin == (T - 1) // b * b - W  # trigger::periodic's window
        if previous is not None:
            # Every window starts at the first block boundary after the last compression's
            # length: no block is skipped, none compressed twice.
            assert begin == -(-previous // b) * b
        assert c["new_length"] == begin + cfg.budget + U + (T - begin - W)
        t = np.arange(c["new_length"])
        after = eng.cache.positions[:, eng.cache.block_table[1, t // b], t % b] if c is calls[-1] else None
        if after is not None:
            np.testing.assert_array_equal(after[:, :begin], c["before"][:, :begin])  # before the window: untouched
        previous = c["new_length"]

    # The first window's queries are the dense forward's at its positions (nothing compressed yet).
    first = calls[0]
    _, _, _, q = model.prefill_dense(w, tokens[: first["T"]])
    np.testing.assert_allclose(first["queries"], q[:, first["begin"] : first["begin"] + W], atol=1e-4)
    # Later windows' queries are their own positions' (held in the ring, the tokens after the window newer).
    for c in calls[1:]:
        pos = c["before"][0, c["begin"] : c["begin"] + W, 0]
        np.testing.assert_array_equal(pos, pos[0] + np.arange(W))
    # Until the first compression the Kara sequence is the full cache.
    first_step = next(i for i in range(len(steps)) if eng.keepmaps[1] and i + 1 >= eng.keepmaps[1][0]["step"])
    np.testing.assert_allclose(np.array(logits[:first_step])[:, 1], np.array(logits[:first_step])[:, 0], atol=1e-5)
    assert eng.states[1].compressions == len(calls) and eng.states[0].compressions == 0
