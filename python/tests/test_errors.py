"""Bad input raises kvpolicy.Error naming the field, before any byte is written."""

import numpy as np
import pytest

import kvpolicy
from paged_case import make_case


@pytest.fixture
def case():
    return make_case(lengths=(40, 37, 0), window=16, seed=7)


def raises(field, fn, *args, **kwargs):
    with pytest.raises(kvpolicy.Error) as e:
        fn(*args, **kwargs)
    assert e.value.field == field, str(e.value)
    assert isinstance(e.value, ValueError)
    return e.value


def test_error_is_a_value_error_with_a_field():
    e = kvpolicy.Error("kvpolicy: x: is 1", "x")
    assert isinstance(e, ValueError) and e.field == "x"
    assert kvpolicy.Error is kvpolicy._core.Error


@pytest.mark.parametrize(
    "field, call",
    [
        ("batch[0].budget", dict(seqs=[0], budgets=41)),  # more than the 40 tokens
        ("batch[1].budget", dict(seqs=[0, 1], budgets=[20, 0])),
        ("batch[0].seq", dict(seqs=[3], budgets=20)),
        ("batch[1].seq", dict(seqs=[0, 0], budgets=20)),
        ("batch[0].history_tokens", dict(seqs=[0], budgets=20, history_tokens=41)),
        ("batch[0].query_slot", dict(seqs=[0], budgets=20, query_slots=[5])),
        ("batch[0].budget", dict(seqs=[0], budgets=8)),  # fewer than the 16 protected
        ("batch.layer_count", dict(seqs=[0], budgets=20, layer_count=3)),
        ("batch.layer_begin", dict(seqs=[0], budgets=20, layer_begin=-1)),
        ("budgets", dict(seqs=[0, 1], budgets=[20, 20, 20])),
        ("seqs", dict(seqs=[0.5], budgets=20)),
    ],
)
def test_batch_errors_name_the_item(case, field, call):
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    raises(field, kvpolicy.compress, kvpolicy.SnapKV(window=16), cache, queries=case.queries, **call)
    np.testing.assert_array_equal(args["kv"], before)


def test_block_table_errors_name_the_entry(case):
    case.block_table[1, 2] = 1000
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    e = raises("cache.table[seq 1][2]", kvpolicy.compress, kvpolicy.StreamingLLM(), cache, seqs=[0], budgets=20)
    assert "1000" in str(e)
    np.testing.assert_array_equal(args["kv"], before)


def test_shared_blocks_are_refused(case):
    case.block_table[1, 0] = case.block_table[0, 0]  # seq 1 holds seq 0's first block
    cache, args = case.cache("nano_vllm")
    raises("cache.table[seq 0][0]", kvpolicy.compress, kvpolicy.StreamingLLM(), cache, seqs=[0], budgets=20)
    refcounts = np.ones(case.kv.shape[2], dtype=np.int32)
    refcounts[make_case(lengths=(40, 37, 0), seed=7).block_table[0, 3]] = 2
    fresh = make_case(lengths=(40, 37, 0), seed=7)
    cache, _ = fresh.cache("nano_vllm", refcounts=refcounts)
    raises("cache.table[seq 0][3]", kvpolicy.compress, kvpolicy.StreamingLLM(), cache, seqs=[0], budgets=20)


def test_missing_and_malformed_side_arrays(case):
    cache, args = case.cache("nano_vllm")
    # A missing view's error names the keyword that supplies it.
    e = raises("queries.base", kvpolicy.compress, kvpolicy.SnapKV(window=16), cache, seqs=[0], budgets=20)
    assert "pass queries=" in str(e), str(e)
    e = raises("scores.base", kvpolicy.compress, kvpolicy.Zipage(), cache, seqs=[0], budgets=20, queries=case.queries)
    assert "pass scores=" in str(e) and "null pointer" in str(e), str(e)
    raises("scores", kvpolicy.compress, kvpolicy.Zipage(), cache, seqs=[0], budgets=20, queries=case.queries,
           scores=case.scores[:, :-1])
    raises("scores", kvpolicy.compress, kvpolicy.Zipage(), cache, seqs=[0], budgets=20, queries=case.queries,
           scores=case.scores.astype(np.float64))
    raises("queries.window", kvpolicy.compress, kvpolicy.SnapKV(), cache, seqs=[0], budgets=36, queries=case.queries)
    raises("queries.head_dim", kvpolicy.compress, kvpolicy.SnapKV(window=16), cache, seqs=[0], budgets=20,
           queries=case.queries[..., :8])
    raises("queries", kvpolicy.compress, kvpolicy.SnapKV(window=16), cache, seqs=[0], budgets=20,
           queries=case.queries[0])


def test_policy_values_are_checked_by_the_executor(case):
    cache, args = case.cache("nano_vllm")
    before = args["kv"].copy()
    raises("pipeline.aggregate.kernel", kvpolicy.compress, kvpolicy.SnapKV(window=16, kernel=4), cache, seqs=[0],
           budgets=20, queries=case.queries)
    raises("pipeline.redundancy.tau", kvpolicy.compress, kvpolicy.RKV(tau=0.0), cache, seqs=[0], budgets=20,
           queries=case.queries)
    raises("pipeline.scorer.window", kvpolicy.compress, kvpolicy.SnapKV(window=0), cache, seqs=[0], budgets=20,
           queries=case.queries)
    np.testing.assert_array_equal(args["kv"], before)


def test_cache_construction_errors(case):
    kv = case.tensors("nano_vllm")["kv"]
    table, lengths = case.block_table, case.lengths
    P = kvpolicy.PagedCache
    raises("layout", P, "vllm_v0", kv, block_table=table, lengths=lengths)
    raises("kv", P, "nano_vllm", kv.astype(np.int16), block_table=table, lengths=lengths)
    raises("kv", P, "nano_vllm", kv[0], block_table=table, lengths=lengths)
    raises("kv", P, "nano_vllm", kv[:1], block_table=table, lengths=lengths)  # one entry on the K/V axis
    raises("kv", P, "nano_vllm", [kv], block_table=table, lengths=lengths)  # a list for a one-tensor layout
    raises("kv", P, "nano_vllm", "cache", block_table=table, lengths=lengths)
    frozen = kv.copy()
    frozen.flags.writeable = False
    e = raises("kv", P, "nano_vllm", frozen, block_table=table, lengths=lengths)
    assert "read-only" in str(e)
    raises("kv", P, "nhd", kv, block_table=table, lengths=lengths)  # nhd takes k and v
    raises("k", P, "nano_vllm", kv, k=kv, block_table=table, lengths=lengths)
    raises("lengths", P, "nano_vllm", kv, block_table=table, lengths=lengths.astype(np.int64))
    raises("lengths", P, "nano_vllm", kv, block_table=table, lengths=lengths[:2])
    raises("lengths", P, "nano_vllm", kv, block_table=table)
    raises("block_table", P, "nano_vllm", kv, block_table=table.astype(np.int64), lengths=lengths)
    raises("block_table", P, "nano_vllm", kv, block_table=table[:, ::2], lengths=lengths)
    raises("block_table", P, "nano_vllm", kv, lengths=lengths)
    raises("positions", P, "nano_vllm", kv, block_table=table, lengths=lengths, positions=case.positions[:1])
    raises("refcounts", P, "nano_vllm", kv, block_table=table, lengths=lengths, refcounts=np.ones(3, np.int32))
    layers = case.tensors("vllm_flash")["kv"]
    raises("kv[1]", P, "vllm_flash", [layers[0], layers[1][:, :-1]], block_table=table, lengths=lengths)
    raises("kv[1]", P, "vllm_flash", [layers[0], layers[1].astype(np.float16)], block_table=table, lengths=lengths)
    raises("kv", P, "vllm_flash", [], block_table=table, lengths=lengths)


def test_items_out_of_int32(case):
    cache, _ = case.cache("nano_vllm")
    raises("budgets", kvpolicy.compress, kvpolicy.StreamingLLM(), cache, seqs=[0], budgets=2**40)
