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
    for round_ in range(3):
        lengths = np.array([length], dtype=np.int32)
        args = case.tensors("nano_vllm")
        cache = kvpolicy.PagedCache("nano_vllm", **args, block_table=case.block_table, lengths=lengths,
                                    positions=case.positions, live=live)
        before = [[set(held(case, live, case.positions, 0, length, l, h)) for h in range(2)] for l in range(2)]
        r = kvpolicy.compress(policy, cache, seqs=[0], budgets=length, queries=case.queries)
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
