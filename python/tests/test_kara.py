"""Kara (kvpolicy.Kara) on the host: a window at a time (compress's window_begins).

Each item's pipeline runs over [window_begin, T): bidirectional scores among the
window's tokens, Token2Chunk over its compressible region W \\ U, compaction of the
window alone. Checked against NumPy references written from Kara's definitions
(reference.py: kara_scores, token2chunk_keep) and against the bytes that were there
before (checks.check_moved on the whole sequence: the tokens before the window kept
in place, the window's kept tokens and the ones after it moved down)."""

import numpy as np
import pytest

import kvpolicy
from checks import check_moved, whole_sequence
from paged_case import make_case
from reference import kara_scores, token2chunk_keep

B = 4  # block size
W, U = 24, 4  # window and buffer
LENGTHS = (45, 37, 28, 0)
# trigger::periodic's window: the |W| tokens in whole blocks before the last block.
BEGINS = [(T - 1) // B * B - W for T in LENGTHS[:3]]  # 20, 12, 0


def kara_case(seed=51, dtype=np.float32):
    # The query slot of each sequence holds |W| queries: the window's own, oldest first.
    return make_case(layers=2, kv_heads=2, q_heads=4, head_dim=16, block_size=B, lengths=LENGTHS, window=W,
                     dtype=dtype, seed=seed)


@pytest.mark.parametrize("group", ["sum", "max"])
@pytest.mark.parametrize("gamma, alpha", [(8, 16), (4, 4), (5, 6)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kara_keeps_the_token2chunk_pattern_of_each_window(group, gamma, alpha, dtype):
    case = kara_case(dtype=dtype)
    cache, args = case.cache("nano_vllm", positions=case.positions)
    before, positions_before = args["kv"].copy(), case.positions.copy()
    policy = kvpolicy.Kara(window=W, buffer=U, group=group, gamma=gamma, alpha=alpha)
    seqs, budgets = [0, 1, 2], [12, 9, 20]  # tokens kept of the region's W - U = 20
    r = kvpolicy.compress(policy, cache, seqs=seqs, budgets=budgets, window_begins=BEGINS, queries=case.queries,
                          return_masks=True, return_scores=True)
    n = W - U
    G = case.queries.shape[3] // 2
    for i, seq in enumerate(seqs):
        T, wb, k = int(case.lengths[seq]), BEGINS[i], budgets[i]
        after = T - wb - W  # the tokens after the window (its last, partial block)
        assert r.new_lengths[i] == wb + k + U + after  # counted from the sequence's start
        assert (r.kept_counts[i] == wb + k + U + after).all()
        rows = case.rows(before, seq, T)  # [2, L, T, h, d]
        for l in range(case.num_layers):
            for h in range(2):
                where = f"item {i} layer {l} head {h}"
                s = r.scores[i, l, h]
                expect = kara_scores(rows[0, l, wb : wb + n, h], case.queries[l, seq, :, h * G : (h + 1) * G], U, group)
                np.testing.assert_allclose(s[:n], expect, rtol=1e-5, atol=1e-6, err_msg=where)
                mask = r.keep_masks[i, l, h]
                # The selection, exactly, on the executor's own scores (a float64 reference
                # could order a near tie the other way).
                np.testing.assert_array_equal(mask[:n], token2chunk_keep(s[:n], k, gamma, alpha), err_msg=where)
                assert mask[n : T - wb].all(), where  # the buffer and the tokens after the window
                assert not mask[T - wb :].any(), where  # the masks cover the window only
                assert np.isposinf(s[n : T - wb]).all(), where  # not candidates: protected
                assert not s[T - wb :].any(), where
    check_moved(case, before, args["kv"], seqs, case.lengths, whole_sequence(r, BEGINS, case.lengths, seqs),
                positions_before, case.positions)


def test_window_begins_as_int_and_per_item_agree():
    one, two = kara_case(seed=52), kara_case(seed=52)
    p = kvpolicy.Kara(window=W, buffer=U, gamma=4, alpha=4)
    ra = kvpolicy.compress(p, one.cache("nano_vllm")[0], seqs=[1], budgets=10, window_begins=12, queries=one.queries,
                           return_masks=True)
    rb = kvpolicy.compress(p, two.cache("nano_vllm")[0], seqs=np.array([1]), budgets=[10],
                           window_begins=np.array([12], dtype=np.int64), queries=two.queries, return_masks=True)
    np.testing.assert_array_equal(ra.keep_masks, rb.keep_masks)
    assert ra.new_lengths.tolist() == rb.new_lengths.tolist() == [12 + 10 + U + 1]
    # Released: the blocks past the new length (27 tokens: 7 blocks of the 10 held).
    assert ra.released(0).tolist() == one.block_table[1, 7:10].tolist()


def test_kvllm_defaults_on_a_long_window():
    """The preset's own sizes (|W| 768, |U| 32, gamma 8, alpha 16) at KvLLM's budget."""
    Wk, Bk = 768, 16
    case = make_case(layers=1, kv_heads=1, q_heads=2, head_dim=8, block_size=Bk, lengths=(16 * 60 + 5,), window=Wk,
                     seed=53)
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    T = int(case.lengths[0])
    wb = (T - 1) // Bk * Bk - Wk
    p = kvpolicy.Kara()
    assert (p.window, p.buffer, p.group, p.gamma, p.alpha) == (768, 32, "sum", 8, 16) and p.name == "kara"
    k = kvpolicy.Kara.kara_budget
    r = kvpolicy.compress(p, cache, seqs=0, budgets=k, window_begins=wb, queries=case.queries, return_masks=True,
                          return_scores=True)
    assert r.new_lengths.tolist() == [wb + 257 + (T - wb - Wk)]
    n = Wk - 32
    s = r.scores[0, 0, 0]
    np.testing.assert_array_equal(r.keep_masks[0, 0, 0, :n], token2chunk_keep(s[:n], k))
    rows = case.rows(before, 0, T)
    np.testing.assert_allclose(s[:n], kara_scores(rows[0, 0, wb : wb + n, 0], case.queries[0, 0], 32), rtol=1e-4,
                               atol=1e-6)
    check_moved(case, before, args["kv"], [0], case.lengths, whole_sequence(r, [wb], case.lengths, [0]))


def raises(field, fn, *args, **kwargs):
    with pytest.raises(kvpolicy.Error) as e:
        fn(*args, **kwargs)
    assert e.value.field == field, str(e.value)
    return e.value


def test_window_begin_errors_name_the_field_and_write_nothing():
    case = kara_case(seed=54)
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    kara = kvpolicy.Kara(window=W, buffer=U)
    e = raises("batch[1].window_begin", kvpolicy.compress, kara, cache, seqs=[0, 1], budgets=10,
               window_begins=[20, 14], queries=case.queries)  # 14: not a multiple of the block size 4
    assert "block" in str(e)
    raises("batch[0].window_begin", kvpolicy.compress, kara, cache, seqs=[1], budgets=10, window_begins=-4,
           queries=case.queries)
    raises("batch[0].window_begin", kvpolicy.compress, kara, cache, seqs=[1], budgets=10, window_begins=40,
           queries=case.queries)  # past the sequence's 37 tokens
    raises("window_begins", kvpolicy.compress, kara, cache, seqs=[0, 1], budgets=10, window_begins=[20, 12, 0],
           queries=case.queries)
    raises("window_begins", kvpolicy.compress, kara, cache, seqs=[0], budgets=10, window_begins=[2.5],
           queries=case.queries)
    np.testing.assert_array_equal(args["kv"], before)


@pytest.mark.parametrize("cls", [kvpolicy.SnapKV, kvpolicy.StreamingLLM, kvpolicy.Zipage])
def test_window_begins_with_a_whole_sequence_preset_raise(cls):
    case = kara_case(seed=55)
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    policy = cls(window=8) if cls is not kvpolicy.StreamingLLM else cls()
    e = raises("batch[0].window_begin", kvpolicy.compress, policy, cache, seqs=[0], budgets=30, window_begins=8,
               queries=case.queries, scores=case.scores)
    assert "window-only" in str(e)
    np.testing.assert_array_equal(args["kv"], before)
    # 0, the default, is every preset's.
    kvpolicy.compress(policy, cache, seqs=[0], budgets=30, window_begins=0, queries=case.queries, scores=case.scores)


def test_kara_keywords_round_trip():
    p = kvpolicy.Kara(window=128, buffer=16, group="mean", gamma=6, alpha=8)
    assert (p.window, p.buffer, p.group, p.gamma, p.alpha) == (128, 16, "mean", 6, 8)
    assert kvpolicy.Kara(**p.params()) == p and kvpolicy.preset("kara", **p.params()) == p
    assert kvpolicy.PRESETS["kara"] is kvpolicy.Kara
    with pytest.raises(TypeError, match="'protect_window'"):
        kvpolicy.Kara(protect_window=8)  # Kara keeps its own pattern: no protect
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.Kara(group="median")
    assert e.value.field == "group"


def test_kara_parameters_are_checked_by_the_executor():
    case = kara_case(seed=56)
    cache, _ = case.cache("nano_vllm")
    kw = dict(seqs=[0], budgets=10, window_begins=20, queries=case.queries)
    raises("pipeline.select.gamma", kvpolicy.compress, kvpolicy.Kara(window=W, buffer=U, gamma=2), cache, **kw)
    raises("pipeline.scorer.buffer", kvpolicy.compress, kvpolicy.Kara(window=W, buffer=W), cache, **kw)
    raises("queries.window", kvpolicy.compress, kvpolicy.Kara(window=2 * W, buffer=U), cache, **kw)
