"""Compressions of a NumPy cache on the host executor, checked against independent
NumPy references and against the bytes that were there before."""

import numpy as np
import pytest

import kvpolicy
from checks import check_moved
from paged_case import make_case
from reference import keep_top, snapkv_scores, streaming_llm_keep

PRESETS = [kvpolicy.Zipage, kvpolicy.RKV, kvpolicy.GKV, kvpolicy.SnapKV, kvpolicy.H2O, kvpolicy.StreamingLLM]


@pytest.mark.parametrize("cls", PRESETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_preset_moves_the_kept_tokens(cls, dtype):
    case = make_case(dtype=dtype, lengths=(40, 37, 0, 19), seed=3)
    cache, args = case.cache("nano_vllm", positions=case.positions)
    before, positions_before = args["kv"].copy(), case.positions.copy()
    seqs, budget = [0, 1], 34
    r = kvpolicy.compress(cls(), cache, seqs=seqs, budgets=budget, queries=case.queries, scores=case.scores,
                          return_masks=True)
    assert r.new_lengths.tolist() == [budget, budget]
    assert (r.kept_counts == budget).all()
    assert r.keep_masks.shape == (2, case.num_layers, 2, 40)
    assert r.keep_masks.sum(axis=-1).tolist() == [[[budget] * 2] * case.num_layers] * 2
    assert r.nonfinite_scores.tolist() == [0, 0]
    assert r.status is None
    check_moved(case, before, args["kv"], seqs, case.lengths, r, positions_before, case.positions)
    window = cls().protect_window if cls is not kvpolicy.StreamingLLM else cls().window
    for i, seq in enumerate(seqs):  # the protected window is always kept
        T = case.lengths[seq]
        assert r.keep_masks[i, :, :, T - window : T].all()


def test_streaming_llm_keeps_the_sinks_and_the_most_recent():
    case = make_case(lengths=(40, 37), seed=1)
    cache, args = case.cache("nano_vllm")
    r = kvpolicy.compress(kvpolicy.StreamingLLM(), cache, seqs=[0, 1], budgets=[24, 20], return_masks=True)
    for i, (T, budget) in enumerate([(40, 24), (37, 20)]):
        for l in range(case.num_layers):
            for h in range(2):
                np.testing.assert_array_equal(r.keep_masks[i, l, h, :T], streaming_llm_keep(T, budget))
    assert r.new_lengths.tolist() == [24, 20]


@pytest.mark.parametrize("kernel", [1, 7])
def test_snapkv_keeps_the_reference_top_k(kernel):
    window = 8
    case = make_case(lengths=(48, 41), window=window, q_heads=4, seed=2)
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    policy = kvpolicy.SnapKV(window=window, kernel=kernel)
    budgets = [20, 30]
    r = kvpolicy.compress(policy, cache, seqs=[0, 1], budgets=budgets, queries=case.queries, return_masks=True)
    G = case.queries.shape[3] // 2  # query heads per KV head
    for i, seq in enumerate([0, 1]):
        T = case.lengths[seq]
        rows = case.rows(before, seq, T)  # [2, L, T, h, d]
        for l in range(case.num_layers):
            for h in range(2):
                s = snapkv_scores(rows[0, l, :, h], case.queries[l, seq, :, h * G : (h + 1) * G], window, kernel)
                expect = keep_top(s, budgets[i], window=window, sinks=0)
                np.testing.assert_array_equal(r.keep_masks[i, l, h, :T], expect, err_msg=f"item {i} layer {l} head {h}")
    check_moved(case, before, args["kv"], [0, 1], case.lengths, r)


def test_zipage_twice_reads_and_rewrites_f():
    case = make_case(lengths=(64, 52), window=16, seed=4)
    cache, args = case.cache("nano_vllm")
    z = kvpolicy.Zipage()
    r1 = kvpolicy.compress(z, cache, seqs=[0, 1], budgets=40, queries=case.queries, scores=case.scores)
    assert r1.new_lengths.tolist() == [40, 40]
    assert np.count_nonzero(case.scores) > 0  # F <- S for every candidate
    # The engine updates the lengths; the next round has a history of 40 tokens.
    case.lengths[[0, 1]] = r1.new_lengths
    before = args["kv"].copy()
    r2 = kvpolicy.compress(z, cache, seqs=[0, 1], budgets=24, history_tokens=40, queries=case.queries,
                           scores=case.scores, return_masks=True)
    assert r2.new_lengths.tolist() == [24, 24]
    check_moved(case, before, args["kv"], [0, 1], case.lengths, r2)


def test_scores_and_layers_and_max_tokens():
    case = make_case(lengths=(40, 33), layers=3, seed=5)
    cache, args = case.cache("nano_vllm")
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[1], budgets=16, queries=case.queries,
                          layer_begin=1, layer_count=2, max_tokens=48, return_masks=True, return_scores=True)
    assert r.keep_masks.shape == (1, 2, 2, 48) and r.scores.shape == (1, 2, 2, 48)
    assert r.released_blocks.shape == (1, 12)
    assert not r.keep_masks[..., 33:].any()
    assert np.isinf(r.scores[0, :, :, 33 - 8 : 33]).all()  # the protected window after protect
    assert (r.kept_counts == 16).all()


def test_torch_free_numpy_results_and_released_helper():
    case = make_case(lengths=(40,), seed=6)
    cache, _ = case.cache("nano_vllm")
    r = kvpolicy.compress(kvpolicy.StreamingLLM(), cache, seqs=0, budgets=20)
    assert isinstance(r.new_lengths, np.ndarray) and r.new_lengths.dtype == np.int32
    assert r.released(0).tolist() == case.block_table[0, 5:10].tolist()
    assert r.check() is r  # nothing to wait for on the host


def test_an_empty_batch_writes_nothing():
    case = make_case(lengths=(40, 33), seed=8)
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    r = kvpolicy.compress(kvpolicy.StreamingLLM(), cache, seqs=np.zeros(0, np.int32), budgets=20, return_masks=True)
    assert r.new_lengths.shape == (0,) and r.kept_counts.shape == (0, case.num_layers, 2)
    assert r.keep_masks.shape[:3] == (0, case.num_layers, 2)
    np.testing.assert_array_equal(args["kv"], before)
