"""stats.py on cases worked by hand, and properties on random ones."""

import math

import numpy as np
import pytest

import stats


def test_kl_and_top1_by_hand():
    # Reference p = (1/2, 1/2); a configuration with q = (1/4, 3/4):
    # KL = 1/2 ln(2) + 1/2 ln(2/3); its argmax (index 1) against the reference's (index 0,
    # the first of a tie).
    ref = np.log([0.5, 0.5])
    q = np.log([0.25, 0.75])
    kl, top = stats.kl_and_top1(np.stack([ref, q, ref + 3.0]))
    assert kl[0] == pytest.approx(0.0, abs=1e-15)
    assert kl[1] == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-12)
    assert kl[2] == pytest.approx(0.0, abs=1e-12)  # a shift of the logits is the same distribution
    assert top.tolist() == [True, False, True]


def test_kl_nonnegative_and_float64():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((6, 50)) * 4).astype(np.float32)
    kl, top = stats.kl_and_top1(logits)
    assert (kl >= -1e-12).all() and kl[0] == pytest.approx(0, abs=1e-12)
    p = np.exp(stats.log_softmax(logits.astype(np.float64)))
    want = (p[0] * (np.log(p[0]) - np.log(p))).sum(-1)
    np.testing.assert_allclose(kl, want, rtol=1e-10, atol=1e-14)
    assert top.tolist() == (logits.argmax(-1) == logits[0].argmax()).tolist()


def test_sample_token_greedy_and_seeded():
    logits = np.array([0.0, 5.0, 1.0])
    assert stats.sample_token(logits, 0.0, np.random.default_rng(0)) == 1
    a = [stats.sample_token(logits, 0.7, np.random.default_rng(9)) for _ in range(3)]
    assert len(set(a)) == 1  # the same seed, the same draw
    draws = [stats.sample_token(np.zeros(4), 1.0, np.random.default_rng(s)) for s in range(400)]
    assert set(draws) == {0, 1, 2, 3}  # flat logits reach every token
    with pytest.raises(ValueError, match="temperature"):
        stats.sample_token(logits, -1.0, np.random.default_rng(0))


def test_repeated_ngram_share_by_hand():
    # n = 3: "1 2 3 4 1 2 3 5": the 3-gram ending at index 6 (1 2 3) ends earlier at index 2.
    toks = [1, 2, 3, 4, 1, 2, 3, 5]
    flags = stats.repeated_ngram_flags(toks, range(8), n=3)
    assert flags.tolist() == [False, False, False, False, False, False, True, False]
    assert stats.repeated_ngram_share(toks, [5, 6, 7], n=3) == pytest.approx(1 / 3)
    # A loop: every 8-gram from the second period on repeats.
    loop = list(range(10)) * 4
    f = stats.repeated_ngram_flags(loop, range(len(loop)), n=8)
    assert not f[:10].any() and f[17:].all()
    assert math.isnan(stats.repeated_ngram_share(toks, [], n=3))


def test_repeated_ngram_counts_overlap_with_itself_only_earlier():
    # "a a a a": the 2-gram (a a) ending at 2 repeats the one ending at 1; the first does not.
    assert stats.repeated_ngram_flags([7, 7, 7, 7], [1, 2, 3], n=2).tolist() == [False, True, True]


def test_conversation_bootstrap_pools_steps():
    rng = np.random.default_rng(0)
    # Identical conversations: every resample has the same pooled mean.
    est, lo, hi = stats.conversation_bootstrap([np.array([1.0, 0.0]), np.array([1.0, 0.0])], rng)
    assert (est, lo, hi) == (0.5, 0.5, 0.5)
    # Pooled over steps, not a mean of means: (3 + 0) / (3 + 1).
    est, lo, hi = stats.conversation_bootstrap([np.ones(3), np.zeros(1)], rng)
    assert est == pytest.approx(0.75)
    assert 0.0 <= lo <= est <= hi <= 1.0 and lo == 0.0 and hi == 1.0
    est, lo, hi = stats.conversation_bootstrap([np.ones(5)], rng)
    assert est == 1.0 and math.isnan(lo) and math.isnan(hi)


def test_conversation_bootstrap_covers_and_is_wider_than_steps_when_conversations_differ():
    """Conversations with their own levels: the interval over conversations covers the
    true mean in most of 200 trials and is wider than an interval that treats steps as
    independent."""
    rng = np.random.default_rng(1)
    cover, wider = 0, 0
    for _ in range(200):
        levels = rng.normal(0.0, 1.0, size=12)
        convs = [lv + rng.normal(0, 0.3, size=40) for lv in levels]
        est, lo, hi = stats.conversation_bootstrap(convs, rng, draws=1000)
        cover += lo <= 0.0 <= hi
        allsteps = np.concatenate(convs)
        naive = 1.96 * allsteps.std() / math.sqrt(allsteps.size)
        wider += (hi - lo) / 2 > naive
    assert cover >= 170  # nominal 95%: 190 of 200; a percentile bootstrap of 12 is a bit short
    assert wider == 200


def test_paired_bootstrap_p_values():
    rng = np.random.default_rng(2)
    a = [np.ones(10) for _ in range(8)]
    b = [np.zeros(10) for _ in range(8)]
    r = stats.paired_conversation_bootstrap(a, b, rng, draws=500)
    assert r["diff"] == 1.0 and r["low"] == 1.0 and r["high"] == 1.0
    assert r["p"] == pytest.approx(1 / 500)  # every draw on one side: the smallest p the draws can say
    same = stats.paired_conversation_bootstrap(a, a, rng, draws=500)
    assert same["diff"] == 0.0 and same["p"] == 1.0
    # Under no difference the p-values are roughly uniform: few below 0.05.
    small = 0
    for _ in range(100):
        x = [rng.normal(size=20) for _ in range(10)]
        y = [rng.normal(size=20) for _ in range(10)]
        small += stats.paired_conversation_bootstrap(x, y, rng, draws=400)["p"] < 0.05
    assert small <= 15
    with pytest.raises(ValueError, match="same steps"):
        stats.paired_conversation_bootstrap([np.ones(2)], [np.ones(3)], rng)


def test_holm_by_hand():
    # p = (0.01, 0.04, 0.03, 0.2), m = 4: sorted 0.01*4 = 0.04, 0.03*3 = 0.09, 0.04*2 = 0.08 -> 0.09
    # (monotone), 0.2*1 = 0.2.
    np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03, 0.2]), [0.04, 0.09, 0.09, 0.2])
    np.testing.assert_allclose(stats.holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1
    out = stats.holm([0.01, float("nan"), 0.02])
    assert math.isnan(out[1]) and out[0] == pytest.approx(0.02) and out[2] == pytest.approx(0.02)
    assert stats.holm([]).size == 0


def test_holm_properties():
    rng = np.random.default_rng(4)
    for _ in range(100):
        p = rng.uniform(size=rng.integers(1, 12))
        adj = stats.holm(p)
        assert (adj >= p - 1e-15).all() and (adj <= 1).all()
        order = np.argsort(p, kind="stable")
        assert (np.diff(adj[order]) >= -1e-15).all()
        # Holm rejects at least what Bonferroni rejects.
        assert ((adj < 0.05) >= (np.minimum(1, p * len(p)) < 0.05)).all()


def test_block_bootstrap_by_hand_and_short_input():
    rng = np.random.default_rng(5)
    assert stats.block_bootstrap(np.ones(100), rng, block=10) == 0.0  # constant: no spread
    assert math.isnan(stats.block_bootstrap(np.ones(15), rng, block=10))  # one whole block
    # Blocks (0, 0) and (1, 1): the mean of n = 2 block means drawn from {0, 1}: std 1/(2 sqrt 2).
    hw = stats.block_bootstrap(np.array([0.0, 0.0, 1.0, 1.0, 5.0]), rng, block=2, draws=200000)
    assert hw == pytest.approx(1.96 * 0.5 / math.sqrt(2), rel=0.02)


def test_block_length_profile_grows_with_correlation():
    """Steps in runs of 32 equal values: blocks shorter than the run understate the spread
    (they are nearly independent draws of a correlated series); from the run's length on
    the half-width levels off."""
    rng = np.random.default_rng(6)
    x = np.repeat(rng.normal(size=64), 32)
    prof = stats.block_length_profile(x, rng, blocks=(1, 4, 32, 128), draws=3000)
    assert prof[1] < prof[4] < prof[32]
    assert prof[128] == pytest.approx(prof[32], rel=0.35)
    iid = stats.block_length_profile(rng.normal(size=4096), rng, blocks=(1, 64), draws=3000)
    assert iid[64] == pytest.approx(iid[1], rel=0.3)
