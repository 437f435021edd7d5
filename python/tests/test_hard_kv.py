"""Hard-KV (kvpolicy.HardKV, HardKVRKV) on the host: each KV head keeps its own count,
the calibrated top-p rule's (kvp::select::calibrated_top_p, without a calibration
state: temperatures solved at every call)."""

import numpy as np
import pytest

import kvpolicy
from paged_case import make_case


def peaky_case():
    """One sequence of 64 tokens, 2 KV heads: head 0's queries scaled up (attention on a
    few keys), head 1's scaled down (attention spread over many)."""
    case = make_case(layers=1, kv_heads=2, q_heads=4, head_dim=16, block_size=4, lengths=(64,), window=8, seed=41)
    case.queries[:, :, :, 0:2] *= 4.0  # query heads 0, 1: KV head 0
    case.queries[:, :, :, 2:4] *= 0.125  # query heads 2, 3: KV head 1
    return case


def fewest_reaching(weights, target):
    """Fewest tokens, largest first, whose weights sum to at least target."""
    w = np.sort(weights)[::-1]
    return int(np.searchsorted(np.cumsum(w), target, side="left") + 1)


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_each_head_keeps_the_calibrated_count(p):
    case = peaky_case()
    cache, _ = case.cache("nano_vllm")
    # kernel 1: the final scores are the raw attention the rule's n_p is read from.
    policy = kvpolicy.HardKV(kernel=1, protect_window=8, p=p)
    assert policy.name == "hard_kv" and (policy.p, policy.upper, policy.sinks) == (p, 2048, 1)
    r = kvpolicy.compress(policy, cache, seqs=[0], budgets=64, queries=case.queries, return_masks=True,
                          return_scores=True)
    counts = r.kept_counts[0, 0]
    assert counts[0] != counts[1]  # the peaky head keeps fewer than the flat one
    assert counts[0] < counts[1]
    np.testing.assert_array_equal(r.keep_masks[0, 0].sum(-1), counts)
    for h in range(2):
        s = r.scores[0, 0, h, :64]
        protected = np.isinf(s)
        assert protected.sum() == 8 + 1  # the window and one sink
        raw = np.where(protected, 0.0, np.maximum(s, 0.0))
        n_p = fewest_reaching(raw, p * raw.sum())
        # T makes the calibrated top-n_p mass p within the tolerance (1e-2), so the
        # calibrated top-p set is n_p tokens, give or take the one at the margin.
        assert abs(int(counts[h]) - (9 + n_p)) <= 1, (h, counts[h], n_p)
        kept = r.keep_masks[0, 0, h, :64].astype(bool)
        assert kept[protected].all()
        candidates = ~protected
        if (kept & candidates).any() and (~kept & candidates).any():  # the highest scores are the kept ones
            assert s[kept & candidates].min() >= s[~kept & candidates].max()


def test_upper_and_lower_bound_the_counts():
    case = peaky_case()
    r = kvpolicy.compress(kvpolicy.HardKV(kernel=1, protect_window=8, upper=12, lower=11), case.cache("nano_vllm")[0],
                          seqs=[0], budgets=64, queries=case.queries)
    assert ((r.kept_counts >= 11) & (r.kept_counts <= 12)).all()


def test_hard_kv_rkv_runs_and_keeps_per_head_counts():
    case = peaky_case()
    policy = kvpolicy.HardKVRKV(protect_window=8)
    assert policy.name == "hard_kv_rkv" and policy.keys_before_window and policy.lambda_ == pytest.approx(0.1)
    r = kvpolicy.compress(policy, case.cache("nano_vllm")[0], seqs=[0], budgets=64, queries=case.queries,
                          return_masks=True)
    counts = r.kept_counts[0, 0]
    np.testing.assert_array_equal(r.keep_masks[0, 0].sum(-1), counts)
    assert (counts >= 9).all() and (counts <= 64).all()


@pytest.mark.parametrize("cls", [kvpolicy.HardKV, kvpolicy.HardKVRKV])
def test_keywords_round_trip(cls):
    p = cls(p=0.8, tolerance=0.02, t_min=0.01, t_max=5.0, iterations=20, upper=512, lower=16, union_top_k=True)
    assert (p.p, p.tolerance, p.t_min, p.t_max, p.iterations, p.upper, p.lower, p.union_top_k) == (
        0.8, 0.02, 0.01, 5.0, 20, 512, 16, True)
    assert cls(**p.params()) == p and kvpolicy.preset(cls.name, **p.params()) == p
