"""Tensor parallelism on the host: two processes joined by torch.distributed (gloo), each
holding two of the four KV heads (its own tensors, as an engine's rank does), compress
through kvpolicy.compress with TorchDistributed; each rank's new lengths and released
blocks, and its heads' bytes, equal one call over all four heads."""

import os

import numpy as np
import pytest

import kvpolicy
from paged_case import make_case

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

RANKS, HEADS, Q_HEADS = 2, 4, 8
LENGTHS = (120, 96, 57)


def case():
    return make_case(layers=2, kv_heads=HEADS, q_heads=Q_HEADS, head_dim=16, block_size=8, lengths=LENGTHS, seed=31)


def policies():
    return {"hard_kv": kvpolicy.HardKV(protect_window=8), "zipage": kvpolicy.Zipage(),
            "snapkv": kvpolicy.SnapKV()}


def compress(name, pc, kv, live, queries, scores, communicator=None):
    cache = kvpolicy.PagedCache("nano_vllm", kv, block_table=pc.block_table, lengths=pc.lengths,
                                live=live if name == "hard_kv" else None)
    return kvpolicy.compress(policies()[name], cache, seqs=[0, 2], budgets=[48, 40], queries=queries, scores=scores,
                             communicator=communicator)


def heads(x, axis, first, count):
    """A copy of heads [first, first + count) along `axis`: the rank's own array."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(first, first + count)
    return np.ascontiguousarray(x[tuple(index)])


def rank_main(rank, out_dir, name):
    from kvpolicy.integrations.torch_distributed import TorchDistributed

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=RANKS)
    try:
        pc = case()
        per = HEADS // RANKS
        kv = heads(pc.kv, 4, rank * per, per)  # [2, L, NB, b, h, d]
        live = np.ones(pc.scores.shape, np.uint8)[..., rank * per:(rank + 1) * per].copy()
        queries = heads(pc.queries, 3, rank * per * (Q_HEADS // HEADS), per * (Q_HEADS // HEADS))
        scores = heads(pc.scores, 3, rank * per, per)
        r = compress(name, pc, kv, live, queries, scores, TorchDistributed())
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), kv=kv, live=live, scores=scores,
                 new_lengths=np.asarray(r.new_lengths), released_counts=np.asarray(r.released_counts),
                 released_blocks=np.asarray(r.released_blocks), kept_counts=np.asarray(r.kept_counts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["hard_kv", "zipage", "snapkv"])
def test_two_ranks_equal_one_call_over_all_heads(name, tmp_path):
    import torch.multiprocessing as mp

    pc = case()
    kv, scores = pc.kv.copy(), pc.scores.copy()
    live = np.ones(pc.scores.shape, np.uint8)
    whole = compress(name, pc, kv, live, pc.queries, scores)
    mp.spawn(rank_main, args=(str(tmp_path), name), nprocs=RANKS, join=True)
    per = HEADS // RANKS
    own_maxima = []
    for rank in range(RANKS):
        got = np.load(tmp_path / f"rank{rank}.npz")
        sl = slice(rank * per, (rank + 1) * per)
        np.testing.assert_array_equal(got["new_lengths"], whole.new_lengths)
        np.testing.assert_array_equal(got["released_counts"], whole.released_counts)
        np.testing.assert_array_equal(got["released_blocks"], whole.released_blocks)
        np.testing.assert_array_equal(got["kept_counts"], np.asarray(whole.kept_counts)[:, :, sl])
        own_maxima.append(got["kept_counts"].max(axis=(1, 2)))
        assert got["kv"].tobytes() == np.ascontiguousarray(kv[:, :, :, :, sl]).tobytes()  # every byte of its heads
        np.testing.assert_array_equal(got["live"], live[..., sl])
        np.testing.assert_array_equal(got["scores"], scores[..., sl])
    # Hard-KV: the ranks' own longest heads differ, so the reduction decided what was released.
    assert (not np.array_equal(own_maxima[0], own_maxima[1])) == (name == "hard_kv")


def test_communicator_refusals():
    pc = case()
    cache = kvpolicy.PagedCache("nano_vllm", pc.kv.copy(), block_table=pc.block_table, lengths=pc.lengths)
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.compress(kvpolicy.SnapKV(), cache, seqs=[0], budgets=48, queries=pc.queries, communicator=object())
    assert e.value.field == "communicator"


# ---------------------------------------------------------------------------------------
# KV-Compress: the block cut over every rank's heads


def per_head_case():
    from test_kv_compress import make_case as make_per_head

    c = make_per_head(L=2, seqs=3, H=HEADS, b=4, d=8, max_blocks=8, seed=41, ties=True)
    return c


def per_head_rank(rank, out_dir):
    from kvpolicy.integrations.torch_distributed import TorchDistributed

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous_ph", rank=rank, world_size=RANKS)
    try:
        c = per_head_case()
        per = HEADS // RANKS
        tables = np.ascontiguousarray(c["tables"][:, :, rank * per:(rank + 1) * per])
        lengths = np.ascontiguousarray(c["lengths"][:, :, rank * per:(rank + 1) * per])
        r = kvpolicy.compress_per_head(kvpolicy.KVCompress(protected_window=6), c["k"], c["v"], c["metric"], tables,
                                       lengths, seqs=[2, 0], blocks_to_free=[7, 3], communicator=TorchDistributed(),
                                       heads=(rank * per, HEADS))
        np.savez(os.path.join(out_dir, f"ph{rank}.npz"), k=c["k"], v=c["v"], metric=c["metric"],
                 **{name: np.asarray(getattr(r, name)) for name in ("new_lengths", "freed_counts", "freed_blocks",
                                                                   "evicted", "moved", "freed")})
    finally:
        dist.destroy_process_group()


def test_kv_compress_on_two_ranks_equals_one_schedule(tmp_path):
    import torch.multiprocessing as mp

    c = per_head_case()
    whole = kvpolicy.compress_per_head(kvpolicy.KVCompress(protected_window=6), c["k"], c["v"], c["metric"],
                                       c["tables"], c["lengths"], seqs=[2, 0], blocks_to_free=[7, 3])
    assert int(np.asarray(whole.freed).sum()) > 0
    mp.spawn(per_head_rank, args=(str(tmp_path),), nprocs=RANKS, join=True)
    per = HEADS // RANKS
    for rank in range(RANKS):
        got = np.load(tmp_path / f"ph{rank}.npz")
        sl = slice(rank * per, (rank + 1) * per)
        for name in ("new_lengths", "freed_counts", "freed_blocks", "evicted", "moved"):
            np.testing.assert_array_equal(got[name], np.asarray(getattr(whole, name))[:, :, sl], err_msg=name)
        np.testing.assert_array_equal(got["freed"], np.asarray(whole.freed))  # the whole sequence's
        # Every block the rank's heads held: the same bytes as after the single call.
        fresh = per_head_case()
        for l in range(fresh["tables"].shape[0]):
            for s in range(fresh["tables"].shape[1]):
                for h in range(rank * per, (rank + 1) * per):
                    held = fresh["tables"][l, s, h][: -(-int(fresh["lengths"][l, s, h]) // 4)]
                    for name in ("k", "v", "metric"):
                        np.testing.assert_array_equal(got[name][held], c[name][held], err_msg=name)


def test_per_head_communicator_refusals():
    c = per_head_case()
    args = (kvpolicy.KVCompress(), c["k"], c["v"], c["metric"], c["tables"], c["lengths"])

    class Echo:
        def all_reduce(self, values, op):
            pass

    for kwargs, field in (({"heads": (0, 4)}, "heads"), ({"communicator": Echo(), "heads": (0, 4)}, "blocks_to_free"),
                          ({"communicator": Echo(), "blocks_to_free": 1}, "heads"),
                          ({"communicator": Echo(), "blocks_to_free": 1, "heads": (2, 4)}, "heads")):
        with pytest.raises(kvpolicy.Error) as e:
            kvpolicy.compress_per_head(*args, seqs=[0], **kwargs)
        assert e.value.field == field, (kwargs, str(e.value))
