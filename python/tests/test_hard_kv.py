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


def authors_rule(raw, value, protected, p, budget, upper=2048, tolerance=1e-2):
    """Hard-KV's calibrated top-p as its authors compute it (the paper's 3.2 and app. D,
    HARDInfer's search.py and snapKV_topp.py), in float64, independent of kvpolicy:
    n_p from the raw attention of the whole row (its own total); T bisected on [1e-3, 1]
    until the calibrated top-n_p mass is within the tolerance of p; the calibrated top-p
    set over the whole row, union its top (budget - protected), union the protected
    tokens; at most `upper`, the protected first. Ties go to the more recent token.
    Returns (count, keep mask)."""
    n = len(raw)
    pos = np.arange(n)
    must = int(protected.sum())
    n_p = fewest_reaching(raw, p * raw.sum())
    order = np.lexsort((-pos, -value))  # by value, descending; ties to the larger position
    top = value.max()

    def mass(T):
        e = np.exp((value - top) / T)
        return e[order[:n_p]].sum() / e.sum()

    lo, hi = 1e-3, 1.0
    mid = 0.5 * (lo + hi)
    m = mass(mid)
    while lo < hi and abs(m - p) > tolerance:
        if m > p:
            lo = mid
        else:
            hi = mid
        mid = 0.5 * (lo + hi)
        m = mass(mid)
    e = np.exp((value - top) / mid)
    kept_by_value = int(np.searchsorted(np.cumsum(e[order]), p * e.sum(), side="left") + 1)
    kept_by_value = max(kept_by_value, min(budget - must, n))
    keep = protected.copy()
    keep[order[:kept_by_value]] = True
    count = min(int(keep.sum()), upper)
    mask = protected.copy()  # the protected first, then by value
    for t in order:
        if mask.sum() >= count:
            break
        mask[t] = True
    return count, mask


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_each_head_keeps_the_authors_calibrated_count(p):
    # kernel 1: the final scores are the raw attention. A first run with nothing
    # protected reads every token's score; the second, with the window (8) and a sink
    # protected, keeps per head what the authors' rule gives on those scores.
    budget = 16
    free = kvpolicy.compress(kvpolicy.HardKV(kernel=1, protect_window=0, sinks=0, p=p),
                             peaky_case().cache("nano_vllm")[0], seqs=[0], budgets=budget,
                             queries=peaky_case().queries, return_scores=True)
    case = peaky_case()
    policy = kvpolicy.HardKV(kernel=1, protect_window=8, p=p)
    assert policy.name == "hard_kv" and (policy.p, policy.upper, policy.sinks) == (p, 2048, 1)
    assert (policy.scope, policy.union_top_k, policy.divide_by_row_max, policy.t_max) == ("whole_row", True, False, 1.0)
    r = kvpolicy.compress(policy, case.cache("nano_vllm")[0], seqs=[0], budgets=budget, queries=case.queries,
                          return_masks=True, return_scores=True)
    counts = r.kept_counts[0, 0]
    np.testing.assert_array_equal(r.keep_masks[0, 0].sum(-1), counts)
    for h in range(2):
        scores = free.scores[0, 0, h, :64].astype(np.float64)
        protected = np.isinf(r.scores[0, 0, h, :64])
        assert protected.sum() == 8 + 1 and protected[0] and protected[-8:].all()
        count, mask = authors_rule(scores, scores, protected, p, budget)
        assert counts[h] == count, (h, counts[h], count)
        np.testing.assert_array_equal(r.keep_masks[0, 0, h, :64].astype(bool), mask)
    assert counts[0] < counts[1]  # the peaky head keeps fewer than the flat one


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_unprotected_only_calibrates_over_the_unprotected_tokens(p):
    # The variant: n_p and the calibration over the unprotected tokens only, the raw mass
    # renormalised over them (scores relative to the row's largest |s|, T on [1e-3, 10],
    # no union: the rule kvpolicy had before the authors' became the default).
    case = peaky_case()
    cache, _ = case.cache("nano_vllm")
    policy = kvpolicy.HardKV(kernel=1, protect_window=8, p=p, scope="unprotected_only", divide_by_row_max=True,
                             t_max=10.0, union_top_k=False)
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
    p = cls(p=0.8, tolerance=0.02, t_min=0.01, t_max=5.0, iterations=20, upper=512, lower=16, union_top_k=False,
            search="first_order", steps=20, learning_rate=0.05, t_start=0.3, scope="unprotected_only",
            divide_by_row_max=True)
    assert (p.p, p.tolerance, p.t_min, p.t_max, p.iterations, p.upper, p.lower, p.union_top_k) == (
        0.8, 0.02, 0.01, 5.0, 20, 512, 16, False)
    assert (p.search, p.steps, p.learning_rate, p.t_start, p.scope, p.divide_by_row_max) == (
        "first_order", 20, 0.05, 0.3, "unprotected_only", True)
    assert cls(**p.params()) == p and kvpolicy.preset(cls.name, **p.params()) == p
    d = cls()  # the authors' rule
    assert (d.scope, d.union_top_k, d.divide_by_row_max, d.search, d.t_min, d.t_max, d.iterations) == (
        "whole_row", True, False, "bisection", 0.001, 1.0, 30)


@pytest.mark.parametrize("cls", [kvpolicy.HardKV, kvpolicy.HardKVRKV])
@pytest.mark.parametrize("keyword, value, why", [
    ("p", 0.0, "(0, 1]"), ("p", 1.5, "(0, 1]"), ("tolerance", 0.0, "positive"), ("t_min", -1.0, "positive"),
    ("t_max", 0.0, "positive"), ("iterations", 0, "positive"), ("steps", -3, "positive"),
    ("learning_rate", 0.0, "positive"), ("t_start", 0.0, "positive"), ("upper", -1, "negative"),
    ("lower", -2, "negative"), ("scope", "both", "'whole_row', 'unprotected_only'"),
    ("search", "newton", "'bisection', 'first_order'"), ("union_top_k", 1, "True or False"),
    ("divide_by_row_max", "yes", "True or False"), ("iterations", 2.5, "an int")])
def test_bad_calibration_keywords_are_refused_naming_them(cls, keyword, value, why):
    with pytest.raises(kvpolicy.Error) as e:
        cls(**{keyword: value})
    assert e.value.field == keyword and why in str(e.value)


# Cautious update: PagedCache(live=...), one byte per (layer, block, slot, KV head).


def live_bytes(case, dtype=np.uint8):
    """1 for every token a sequence holds, in every layer and head; 0 in free slots."""
    live = np.zeros(case.positions.shape, dtype=dtype)
    b = case.block_size
    for s, n in enumerate(case.lengths):
        for t in range(n):
            live[:, case.block_table[s, t // b], t % b, :] = 1
    return live


def held(case, live, positions, seq, length, layer, head):
    """(slot, position) of each token the head holds, in slot order."""
    b = case.block_size
    out = []
    for t in range(length):
        blk = case.block_table[seq, t // b]
        if live[layer, blk, t % b, head]:
            out.append(int(positions[layer, blk, t % b, head]))
    return out


def test_cautious_update_a_dropped_token_stays_dropped():
    # Three compressions of one sequence, the engine appending 8 tokens between them:
    # each head's held positions shrink to a subset of what it held, dense at the front.
    case = make_case(layers=2, kv_heads=2, q_heads=4, head_dim=16, block_size=4, lengths=(64,), window=8, seed=7,
                     num_blocks=40)
    spare = np.setdiff1d(np.arange(40), case.block_table[0]).astype(np.int32)[:8]  # room for the appends
    case.block_table = np.concatenate([case.block_table, spare[None, :]], axis=1)
    live = live_bytes(case)
    length, next_position = 64, 64
    rng = np.random.default_rng(3)
    policy = kvpolicy.HardKV(kernel=1, protect_window=8, p=0.6)
    budget = 16  # the top-k union's k: 16 - 9 protected
    for round_ in range(3):
        lengths = np.array([length], dtype=np.int32)
        args = case.tensors("nano_vllm")
        cache = kvpolicy.PagedCache("nano_vllm", **args, block_table=case.block_table, lengths=lengths,
                                    positions=case.positions, live=live)
        before = [[set(held(case, live, case.positions, 0, length, l, h)) for h in range(2)] for l in range(2)]
        r = kvpolicy.compress(policy, cache, seqs=[0], budgets=budget, queries=case.queries)
        case.kv = case.canonical("nano_vllm", args)
        counts = r.kept_counts[0]
        assert r.new_lengths[0] == counts.max()
        if round_ > 0:  # heads kept different counts before: some held fewer than the length
            assert min(len(x) for row in before for x in row) < length
        for l in range(2):
            for h in range(2):
                now = held(case, live, case.positions, 0, length, l, h)
                assert len(now) == counts[l, h] and now == sorted(now)
                assert set(now) <= before[l][h]
                slots = [live[l, case.block_table[0, t // 4], t % 4, h] for t in range(length)]
                assert slots == [1] * counts[l, h] + [0] * (length - counts[l, h])
        # The engine: the new length, 8 tokens appended (K, V, positions, live in every head).
        length = int(r.new_lengths[0])
        for t in range(length, length + 8):
            blk, slot = case.block_table[0, t // 4], t % 4
            case.kv[:, :, blk, slot] = rng.integers(-32, 32, size=case.kv[:, :, blk, slot].shape) / 8
            case.positions[:, blk, slot, :] = next_position
            live[:, blk, slot, :] = 1
            next_position += 1
        length += 8
        case.queries[:] = rng.integers(-32, 32, size=case.queries.shape) / 8


# Classes, not instances: an instance in the parameters outlives the interpreter's
# teardown and nanobind reports it as leaked.
@pytest.mark.parametrize("policy_cls", [kvpolicy.HardKV, kvpolicy.HardKVRKV], ids=["hard_kv", "hard_kv_rkv"])
def test_cautious_update_ignores_the_keys_of_dropped_tokens(policy_cls):
    # Head 1 of layer 0 dropped tokens 20..39: rewriting their keys changes no result (out
    # of the softmax, and for HardKVRKV out of the similarity sums too), none is kept.
    policy = policy_cls(protect_window=8)
    def run(scramble):
        case = make_case(layers=1, kv_heads=2, q_heads=4, head_dim=16, block_size=4, lengths=(48,), window=8, seed=9)
        live = live_bytes(case)
        for t in range(20, 40):
            blk, slot = case.block_table[0, t // 4], t % 4
            live[0, blk, slot, 1] = 0
            if scramble:
                case.kv[0, 0, blk, slot, 1] = case.kv[0, 0, blk - 1 if blk else 1, slot, 1]  # a copy of another key
        cache, _ = case.cache("nano_vllm", live=live)
        r = kvpolicy.compress(policy, cache, seqs=[0], budgets=48, queries=case.queries, return_masks=True,
                              return_scores=True)
        return r, live
    (plain, live_a), (scrambled, live_b) = run(False), run(True)
    np.testing.assert_array_equal(plain.kept_counts, scrambled.kept_counts)
    np.testing.assert_array_equal(plain.keep_masks, scrambled.keep_masks)
    np.testing.assert_array_equal(plain.scores, scrambled.scores)
    np.testing.assert_array_equal(live_a, live_b)
    assert not plain.keep_masks[0, 0, 1, 20:40].any()  # dropped: never kept
    assert plain.kept_counts[0, 0, 1] <= 28


def test_cautious_update_takes_bool_and_refuses_what_it_cannot_do():
    case = make_case(layers=1, kv_heads=2, q_heads=4, head_dim=16, block_size=4, lengths=(48,), window=8, seed=9)
    cache, _ = case.cache("nano_vllm", live=live_bytes(case, bool))
    r = kvpolicy.compress(kvpolicy.HardKV(protect_window=8), cache, seqs=[0], budgets=48, queries=case.queries)
    assert (r.kept_counts <= 48).all()
    before = case.kv.copy()
    cache, args = case.cache("nano_vllm", live=live_bytes(case))
    with pytest.raises(kvpolicy.Error) as e:  # lightning's pairs are a block's slots: ragged after drops
        kvpolicy.compress(kvpolicy.Zipage(window=8), cache, seqs=[0], budgets=32, queries=case.queries,
                          scores=case.scores)
    assert e.value.field == "cache.live" and "lightning" in str(e.value)
    np.testing.assert_array_equal(case.canonical("nano_vllm", args), before)
    for bad, why in [(live_bytes(case)[:, :-1], "shape"), (live_bytes(case, np.int32), "uint8 or bool")]:
        with pytest.raises(kvpolicy.Error) as e:
            case.cache("nano_vllm", live=bad)
        assert e.value.field == "live" and why in str(e.value)
