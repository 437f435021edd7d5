"""The protocol's wiring: memory held, the forced compression of the tasks, Hard-KV's item
budget, the seeded reference; on the tiny model, then one short task on the real one."""

import numpy as np
import pytest

import compression
import harness
import model
import prompts
import tasks
from harness import SeqConfig
from tiny import tiny_weights


def test_hard_kv_item_budget_is_half_of_l_upper_and_at_least_protected():
    protected = 32 + 1  # the presets' protected window and sink
    assert compression.hard_kv_item_budget("hard_kv", 512) == 256
    assert compression.hard_kv_item_budget("hard_kv_rkv", 128) == 64
    assert compression.hard_kv_item_budget("hard_kv", 64) == protected
    assert compression.hard_kv_item_budget("hard_kv", 16) == 16  # never above L_upper


def test_compress_now_and_memory_held():
    # (KV-Compress's metric reads 32 prompt queries; the model test below holds it to its
    # budget.) A prompt of 70 tokens: longer than the presets' protected window of 32.
    w = tiny_weights()
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, w.config.vocab, size=70)
    cfgs = [SeqConfig("full", None, None), SeqConfig("zipage@48", "zipage", 48), SeqConfig("hard_kv@48", "hard_kv", 48)]
    eng = harness.Engine(w, cfgs, len(prompt), len(prompt) + 20, block_size=8)
    eng.prefill(prompt)
    before = eng.held()
    rows = w.config.n_layers * w.config.n_kv_heads
    assert (before["mean"] == 70).all() and (before["sequence"] == rows * 70).all()
    eng.compress_now()
    h = eng.held()
    assert h["mean"][0] == 70  # the full cache is never compressed
    assert h["mean"][1] == 48 and h["peak_head"][1] == 48 and h["sequence"][1] == rows * 48
    # Hard-KV: at most L_upper per head, at least its item budget (the union's floor, 33).
    assert 33 <= h["mean"][2] <= h["peak_head"][2] <= 48
    assert h["sequence"][2] == pytest.approx(h["mean"][2] * rows)
    assert all(st.compressions == 1 for st in eng.states[1:]) and eng.states[0].compressions == 0
    # Block slots: whole blocks of b tokens in every row.
    assert h["slots"][1] == rows * 48 and h["slots"][2] >= h["peak_head"][2] * rows
    assert (eng.peak_slots >= h["slots"]).all() and eng.peak_slots[1] == rows * 72  # the prompt's 9 blocks
    eng.compress_now()  # nothing over budget: no second compression
    assert all(st.compressions == 1 for st in eng.states[1:])
    for t in rng.integers(0, w.config.vocab, size=12):
        eng.step(np.full(len(cfgs), t))
    assert (eng.held()["peak_head"][1:] <= 48 + 8).all()


def test_conversation_rng_is_seeded_by_session_and_seed():
    a = harness.conversation_rng("story", 0).random(4)
    assert (a == harness.conversation_rng("story", 0).random(4)).all()
    assert not (a == harness.conversation_rng("story", 1).random(4)).all()
    assert not (a == harness.conversation_rng("orchard", 0).random(4)).all()


def test_sessions_are_distinct_and_twenty():
    names = [s.name for s in prompts.SESSIONS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    firsts = [s.turns[0].user for s in prompts.SESSIONS]
    assert len(set(firsts)) == len(firsts)


def test_a_short_task_on_the_model(weights, tokenizer):
    """A needle in 160 tokens of filler, budget 64 (KV-Compress's least: its protected
    window): every compressed configuration holds at
    most its budget after the context, and answers for itself."""
    count = lambda text: len(tokenizer.encode(text).ids)  # noqa: E731
    task = tasks.needle(0, 160, 0.5, count)
    cfgs = [SeqConfig("full", None, None)] + [SeqConfig(f"{p}@64", p, 64) for p in ("snapkv", "hard_kv", "kv_compress")]
    r = harness.run_task(weights, tokenizer, task, cfgs, lambda m: None)
    assert r["configs"] == [c.name for c in cfgs]
    assert len(r["answers"]) == 4 and len(r["right"]) == 4
    held = r["held_after_context"]
    assert held[0] == r["context_ids"] > 160
    assert held[1] == 64 and held[2] <= 64 and held[3] <= 64
    assert r["right"][0] == tasks.is_right(task, r["answers"][0])


def test_last_compressed_describes_the_cache_the_logits_read():
    """The step that compresses returns logits computed before its compression: it is
    flagged not compressed; the next step's logits read the compressed cache."""
    w = tiny_weights()
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, w.config.vocab, size=40)
    cfgs = [SeqConfig("full", None, None), SeqConfig("snapkv@40", "snapkv", 40)]
    eng = harness.Engine(w, cfgs, len(prompt), len(prompt) + 20, block_size=8)
    eng.prefill(prompt)
    assert not eng.last_compressed.any()
    flags, counts = [], []
    for t in rng.integers(0, w.config.vocab, size=12):
        eng.step(np.full(2, t))
        flags.append(bool(eng.last_compressed[1]))
        counts.append(eng.states[1].compressions)
    first = counts.index(1)  # the step whose compression came after its logits
    assert flags[first] is False and flags[first + 1] is True and not any(flags[:first])
    assert not eng.last_compressed[0]  # the full cache is never compressed
