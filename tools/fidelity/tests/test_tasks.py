"""tasks.py: deterministic from seeds, facts where they are said to be, answers checked."""

import pytest

import tasks


def words(text: str) -> int:  # a stand-in for the tokenizer: one token per word
    return len(text.split())


def test_needle_is_reproducible_and_differs_by_seed():
    a = tasks.needle(3, 400, 0.5, words)
    assert a == tasks.needle(3, 400, 0.5, words)
    assert a.prompt != tasks.needle(4, 400, 0.5, words).prompt
    assert a.answer.isdigit() and len(a.answer) == 4
    assert a.prompt.endswith(a.question)


@pytest.mark.parametrize("depth", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_needle_sits_at_its_depth(depth):
    t = tasks.needle(1, 1000, depth, words)
    ctx = t.prompt[: t.prompt.index(t.question)]
    at = ctx.index("locker at the swimming pool is number")
    before = words(ctx[:at]) - words("Read the following notes. I will ask you one question about them.")
    total = words(ctx) - words("Read the following notes. I will ask you one question about them.")
    assert abs(before / total - depth) < 0.05  # within a sentence of the depth
    assert total >= 1000


def test_filler_repeats_few_8grams():
    import stats

    t = tasks.needle(0, 3000, 0.5, words)
    toks = t.prompt.split()
    share = stats.repeated_ngram_share(toks, range(len(toks)), 8)
    assert share < 0.1


def test_arithmetic_answers_are_the_planted_numbers():
    for seed in range(30):
        t = tasks.arithmetic(seed, 300, words)
        nums = [int(x) for x in tasks.numbers_in(t.prompt[: t.prompt.index(t.question)])]
        a = int(t.answer)
        if "together" in t.question:
            assert a == nums[0] + nums[1]
        elif "more" in t.question:
            assert a == nums[0] - nums[1] and a > 0
        else:
            assert a == nums[0] * nums[1]
        assert t == tasks.arithmetic(seed, 300, words)


def test_is_right():
    n = tasks.Task("needle", 0, 10, (0.5,), "p", "q", "4821")
    assert tasks.is_right(n, "The locker is number 4821.")
    assert not tasks.is_right(n, "It is 48210.") and not tasks.is_right(n, "I do not know.")
    a = tasks.Task("arithmetic", 0, 10, (0.2, 0.6), "p", "q", "1250")
    assert tasks.is_right(a, "37 + 1213 = 1,250")
    assert not tasks.is_right(a, "1250 - 3 = 1247")  # the last number is the answer given
    assert tasks.numbers_in("1,250 and 7.") == ["1250", "7"]


def test_build_counts_and_bad_depth():
    ts = tasks.build(words, lengths=(200, 400), depths=(0.1, 0.9), seeds=(0, 1), arithmetic_per_length=2)
    assert sum(t.kind == "needle" for t in ts) == 8 and sum(t.kind == "arithmetic" for t in ts) == 8
    assert len({t.prompt for t in ts}) == 16
    with pytest.raises(ValueError, match="depth"):
        tasks.needle(0, 100, 1.5, words)
