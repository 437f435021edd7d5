"""KV-Compress over a per-head block cache (kvpolicy.KVCompress, kvpolicy.compress_per_head):
the host path against an independent NumPy reference of the block schedule and
MoveCache, byte for byte; the policy's budget; errors naming the field; and, with a
GPU, the CUDA path against the host path (CUDA graph capture included)."""

import math
import os

import numpy as np
import pytest

import kvpolicy

REQUIRED = os.environ.get("KVPOLICY_REQUIRE_CUDA") == "1"


# ---------------------------------------------------------------------------------------
# The reference: KV-Compress's schedule (head_adaptive_blocks) and MoveCache in NumPy.


def _key(x):
    """The eviction order's metric key: NaN ranks as -inf (lowest, evicted first)."""
    x = float(x)
    return -math.inf if math.isnan(x) else x


def reference(case, seqs, blocks_to_free, logical_lengths=None, protected_window=64, sinks=0, budget="sequence"):
    """What compress_per_head does to a copy of `case`: returns (results dict, case after)."""
    c = {name: (a.copy() if isinstance(a, np.ndarray) else a) for name, a in case.items()}
    k, v, metric, positions, tables, lengths = (c[n] for n in ("k", "v", "metric", "positions", "tables", "lengths"))
    L, _, H, max_blocks = tables.shape
    b = k.shape[-2]
    shared = k.ndim == 3

    def at(a, l):  # layer l's pool of a per-slot or K/V array
        return a if shared else a[l]

    n = len(seqs)
    res = {name: np.zeros((n, L, H), np.int32) for name in ("new_lengths", "freed_counts", "evicted", "moved")}
    res["freed_blocks"] = np.full((n, L, H, max_blocks), -1, np.int32)
    res["freed"] = np.zeros(n, np.int64)
    res["nonfinite_metrics"] = np.zeros(n, np.int64)
    for i, seq in enumerate(seqs):
        logical = -1 if logical_lengths is None else logical_lengths[i]
        rows = []  # per (l, h): (T, metric per slot, eviction order, possible blocks)
        for l in range(L):
            for h in range(H):
                T = int(lengths[l, seq, h])
                slots = [(tables[l, seq, h, t // b], t % b) for t in range(T)]
                m = np.array([at(metric, l)[blk, s] for blk, s in slots], np.float32)
                pos = [int(at(positions, l)[blk, s]) for blk, s in slots] if positions is not None else list(range(T))
                length = logical if logical >= 0 else T
                res["nonfinite_metrics"][i] += int(np.count_nonzero(~np.isfinite(m)))
                evictable = [t for t in range(T) if not (pos[t] < sinks or pos[t] >= length - protected_window)]
                order = sorted(evictable, key=lambda t: (_key(m[t]), pos[t]))
                hanging = b if T % b == 0 else T % b
                held = -(-T // b)
                possible = 0 if T == 0 or len(order) < hanging else min(held, 1 + (len(order) - hanging) // b)
                rows.append((T, m, order, possible, hanging))
        groups = [range(L * H)] if budget == "sequence" else [range(l * H, (l + 1) * H) for l in range(L)]
        counts = np.broadcast_to(np.asarray(blocks_to_free[i]).reshape(-1), (len(groups),))
        taken = [0] * (L * H)
        for g, group in enumerate(groups):
            blocks = []
            for r in group:
                T, m, order, possible, hanging = rows[r]
                for e in range(1, possible + 1):
                    last = order[(e - 1) * b + hanging - 1]
                    blocks.append((_key(m[last]), r, e))
            blocks.sort()
            for _, r, _ in blocks[: int(counts[g])]:
                taken[r] += 1
            res["freed"][i] += min(int(counts[g]), len(blocks))
        for r in range(L * H):
            l, h = divmod(r, H)
            T, m, order, possible, hanging = rows[r]
            e = taken[r]
            evicted = sorted(order[: (e - 1) * b + hanging] if e else [])
            keep = np.ones(T, bool)
            keep[evicted] = False
            new_length = T - len(evicted)
            holes, moved = list(evicted), 0
            for src in range(T - 1, new_length - 1, -1):  # MoveCache: the last kept fill the first holes
                if not keep[src]:
                    continue
                dst = holes.pop(0)
                sb, ss = tables[l, seq, h, src // b], src % b
                db, ds = tables[l, seq, h, dst // b], dst % b
                for a in (k, v, metric, positions):
                    if a is not None:
                        at(a, l)[db, ds] = at(a, l)[sb, ss]
                moved += 1
            freed = tables[l, seq, h, -(-new_length // b): -(-T // b)]
            res["new_lengths"][i, l, h] = new_length
            res["evicted"][i, l, h] = len(evicted)
            res["moved"][i, l, h] = moved
            res["freed_counts"][i, l, h] = len(freed)
            res["freed_blocks"][i, l, h, : len(freed)] = freed
    return res, c


# ---------------------------------------------------------------------------------------
# Cases


def make_case(L=2, seqs=3, H=2, b=4, d=8, max_blocks=6, shared=True, dtype=np.float32, seed=0, positions=False,
              ties=False, lengths=None, nan=False):
    """A per-head cache with ragged head lengths, each head's blocks drawn from a shuffled
    pool (one for every layer when `shared`, else one per layer)."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = rng.integers(0, max_blocks * b + 1, size=(L, seqs, H)).astype(np.int32)
    lengths = np.asarray(lengths, np.int32)
    need = [-(-int(T) // b) for T in lengths.reshape(-1)]
    per_layer_need = max(sum(-(-int(T) // b) for T in lengths[l].reshape(-1)) for l in range(L))
    N = (sum(need) if shared else per_layer_need) + 3  # a few blocks no head holds
    tables = np.full((L, seqs, H, max_blocks), -1, np.int32)
    pool = rng.permutation(N)
    used = 0
    for l in range(L):
        if not shared:
            pool, used = rng.permutation(N), 0
        for s in range(seqs):
            for h in range(H):
                m = -(-int(lengths[l, s, h]) // b)
                tables[l, s, h, :m] = pool[used: used + m]
                used += m
    lead = () if shared else (L,)
    k = (rng.integers(-32, 32, size=lead + (N, b, d)) / 8).astype(dtype)
    v = (rng.integers(-32, 32, size=lead + (N, b, d)) / 8).astype(dtype)
    if ties:
        metric = (rng.integers(0, 6, size=lead + (N, b)) / 4).astype(np.float32)
    else:
        metric = rng.random(lead + (N, b), dtype=np.float32)
    if nan:
        metric.reshape(-1)[rng.integers(0, metric.size, size=3)] = np.nan
    pos = None
    if positions:
        # Each slot's position: a head's tokens keep increasing positions with gaps.
        pos = np.zeros(lead + (N, b), np.int32)
        for l in range(L):
            for s in range(seqs):
                for h in range(H):
                    T = int(lengths[l, s, h])
                    p = np.sort(rng.choice(np.arange(max_blocks * b + 8), size=T, replace=False)).astype(np.int32)
                    for t in range(T):
                        (pos if shared else pos[l])[tables[l, s, h, t // b], t % b] = p[t]
    return {"k": k, "v": v, "metric": metric, "positions": pos, "tables": tables, "lengths": lengths}


def run(case, policy, **kwargs):
    c = {name: (a.copy() if isinstance(a, np.ndarray) else a) for name, a in case.items()}
    r = kvpolicy.compress_per_head(policy, c["k"], c["v"], c["metric"], c["tables"], c["lengths"],
                                   positions=c["positions"], **kwargs)
    return r, c


def assert_same(r, expected, after, c):
    for name, want in expected.items():
        np.testing.assert_array_equal(np.asarray(getattr(r, name)), want, err_msg=name)
    for name in ("k", "v", "metric", "positions"):
        if after[name] is not None:
            # Bytes: NaN metrics compare equal as bits.
            assert np.asarray(c[name]).tobytes() == after[name].tobytes(), name


# ---------------------------------------------------------------------------------------
# Host path against the reference


def test_hand_case():
    """One layer, one head, b 2: 7 tokens, metric by hand; window 2 protects positions 5, 6."""
    tables = np.array([[[[3, 0, 4, 1]]]], np.int32)  # blocks of 2 tokens: t 0,1 -> 3; 2,3 -> 0; 4,5 -> 4; 6 -> 1
    lengths = np.array([[[7]]], np.int32)
    metric = np.zeros((5, 2), np.float32)
    values = [0.5, 0.1, 0.9, 0.2, 0.3, 0.0, 0.0]  # token t's metric
    for t, m in enumerate(values):
        metric[tables[0, 0, 0, t // 2], t % 2] = m
    k = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
    v = -k
    case = {"k": k, "v": v, "metric": metric, "positions": None, "tables": tables, "lengths": lengths}
    policy = kvpolicy.KVCompress(protected_window=2)
    r, c = run(case, policy, seqs=0, blocks_to_free=2)
    # Order of the evictable tokens 0..4: 1 (0.1), 3 (0.2), 4 (0.3), 0 (0.5), 2 (0.9). The last
    # block holds 1 token (hanging 1): block 1 evicts token 1 (cost 0.1), block 2 tokens 1, 3, 4
    # (cost 0.3). So 3 evicted, 4 kept: 0, 2, 5, 6; tokens 5, 6 move into the holes 1, 3.
    assert r.new_lengths.tolist() == [[[4]]]
    assert r.evicted.tolist() == [[[3]]] and r.moved.tolist() == [[[2]]]
    assert r.freed_counts.tolist() == [[[2]]] and r.freed.tolist() == [2]
    assert r.freed_blocks[0, 0, 0, :2].tolist() == [4, 1] and r.released(0).tolist() == [4, 1]
    after = [c["metric"][tables[0, 0, 0, t // 2], t % 2] for t in range(4)]
    assert after == [0.5, 0.0, 0.9, 0.0]  # tokens 0, 6 (-> slot 1), 2, 5 (-> slot 3)
    np.testing.assert_array_equal(c["k"][3, 1], k[1, 0])  # slot 1 (block 3, 1) holds token 6 (block 1, 0)
    np.testing.assert_array_equal(c["v"][0, 1], v[4, 1])  # slot 3 (block 0, 1) holds token 5 (block 4, 1)
    expected, after_ref = reference(case, [0], [2], protected_window=2)
    assert_same(r, expected, after_ref, c)


@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shared", [True, False])
def test_random_against_reference(b, dtype, shared):
    for seed in range(3):
        case = make_case(L=3, seqs=4, H=2, b=b, d=8, max_blocks=max(2, 48 // b), shared=shared, dtype=dtype,
                         seed=seed + 10 * b, ties=seed == 1, nan=seed == 2)
        rng = np.random.default_rng(seed)
        seqs = [int(s) for s in rng.permutation(4)[:3]]
        counts = [int(x) for x in rng.integers(0, 12, size=3)]
        policy = kvpolicy.KVCompress(protected_window=int(rng.integers(0, 2 * b + 3)), sinks=seed)
        r, c = run(case, policy, seqs=seqs, blocks_to_free=counts)
        expected, after = reference(case, seqs, counts, protected_window=policy.protected_window, sinks=policy.sinks)
        assert_same(r, expected, after, c)
        assert isinstance(r.new_lengths, np.ndarray) and r.freed.dtype == np.int64


@pytest.mark.parametrize("b", [1, 4])
def test_asking_for_more_than_can_be_freed(b):
    """blocks_to_free is the most an item frees: no head frees a block holding a protected
    token (its last protected_window tokens), and freeing e blocks evicts the hanging
    tokens of its partial last block and (e - 1) whole ones. Asked for more than that, an
    item frees exactly that, the same as when asked for exactly that."""
    window = 3
    case = make_case(L=2, seqs=3, H=2, b=b, max_blocks=max(2, 24 // b), seed=4 + b)
    can = 0
    for T in case["lengths"][:, 1].reshape(-1).tolist():  # sequence 1's heads
        hanging = T % b or b
        evictable = max(T - window, 0)
        can += 0 if T == 0 or evictable < hanging else 1 + (evictable - hanging) // b
    policy = kvpolicy.KVCompress(protected_window=window)
    r, c = run(case, policy, seqs=[1], blocks_to_free=10**6)
    exact, c_exact = run(case, policy, seqs=[1], blocks_to_free=can)
    assert int(r.freed[0]) == can > 0
    for name in ("new_lengths", "freed_counts", "freed_blocks", "evicted", "moved"):
        np.testing.assert_array_equal(getattr(r, name), getattr(exact, name), err_msg=name)
    for name in ("k", "v", "metric"):
        assert c[name].tobytes() == c_exact[name].tobytes(), name
    # What is left of each head: at most its protected tokens and a partial block's remainder.
    assert (r.new_lengths <= window + b).all()


@pytest.mark.parametrize("shared", [True, False])
def test_per_layer_budget(shared):
    case = make_case(L=3, seqs=2, H=3, b=4, shared=shared, seed=5)
    policy = kvpolicy.KVCompress(protected_window=4, budget="layer")
    counts = [[2, 0, 5], [1, 3, 1]]
    r, c = run(case, policy, seqs=[1, 0], blocks_to_free=counts)
    expected, after = reference(case, [1, 0], counts, protected_window=4, budget="layer")
    assert_same(r, expected, after, c)
    r2, _ = run(case, policy, seqs=[1, 0], blocks_to_free=2)  # an int: every layer of every item
    expected, _ = reference(case, [1, 0], [[2, 2, 2], [2, 2, 2]], protected_window=4, budget="layer")
    np.testing.assert_array_equal(r2.new_lengths, expected["new_lengths"])


def test_positions_and_logical_lengths():
    case = make_case(L=2, seqs=3, H=2, b=4, max_blocks=6, positions=True, seed=8)
    logical = [40, 35, 33]
    policy = kvpolicy.KVCompress(protected_window=6, sinks=2)
    r, c = run(case, policy, seqs=[0, 1, 2], blocks_to_free=[4, 2, 7], logical_lengths=logical)
    expected, after = reference(case, [0, 1, 2], [4, 2, 7], logical, protected_window=6, sinks=2)
    assert_same(r, expected, after, c)


def test_strided_views():
    """K and V interleaved in one [N, 2, b, d] tensor, a metric with padded rows."""
    case = make_case(L=2, seqs=2, H=2, b=4, d=8, seed=3)
    N = case["k"].shape[0]
    kv = np.stack([case["k"], case["v"]], axis=1)
    padded = np.zeros((N, 8), np.float32)
    padded[:, :4] = case["metric"]
    metric = padded[:, :4]
    policy = kvpolicy.KVCompress(protected_window=4)
    r = kvpolicy.compress_per_head(policy, kv[:, 0], kv[:, 1], metric, case["tables"], case["lengths"], seqs=[0, 1],
                                   blocks_to_free=[3, 5])
    expected, after = reference(case, [0, 1], [3, 5], protected_window=4)
    for name, want in expected.items():
        np.testing.assert_array_equal(getattr(r, name), want, err_msg=name)
    np.testing.assert_array_equal(kv[:, 0], after["k"])
    np.testing.assert_array_equal(kv[:, 1], after["v"])
    np.testing.assert_array_equal(metric, after["metric"])
    assert not padded[:, 4:].any()


def test_torch_cpu_bfloat16():
    torch = pytest.importorskip("torch")
    case = make_case(L=2, seqs=3, H=2, b=16, d=8, max_blocks=4, seed=4)
    # bf16 as its bits: the reference moves uint16 rows, PyTorch bfloat16 ones.
    bits = {name: (case[name].view(np.uint32) >> 16).astype(np.uint16) for name in ("k", "v")}
    as_bf16 = {name: torch.from_numpy(bits[name].view(np.int16)).view(torch.bfloat16).clone() for name in bits}
    metric, tables, lengths = (torch.from_numpy(case[n].copy()) for n in ("metric", "tables", "lengths"))
    policy = kvpolicy.KVCompress(protected_window=8)
    r = kvpolicy.compress_per_head(policy, as_bf16["k"], as_bf16["v"], metric, tables, lengths, seqs=[2, 0],
                                   blocks_to_free=[3, 2])
    assert isinstance(r.new_lengths, torch.Tensor)
    expected, after = reference({**case, **bits}, [2, 0], [3, 2], protected_window=8)
    for name, want in expected.items():
        np.testing.assert_array_equal(getattr(r, name).numpy(), want, err_msg=name)
    for name in ("k", "v"):
        np.testing.assert_array_equal(as_bf16[name].view(torch.int16).numpy().view(np.uint16), after[name])
    np.testing.assert_array_equal(metric.numpy(), after["metric"])


# ---------------------------------------------------------------------------------------
# The budget


def test_budget_from_the_policy():
    case = make_case(L=2, seqs=3, H=2, b=4, max_blocks=8, seed=6)
    lengths, b = case["lengths"], 4
    rows = 2 * 2
    for s in range(3):
        held = sum(-(-int(T) // b) for T in lengths[:, s].reshape(-1))
        p = kvpolicy.KVCompress(protected_window=4, max_cache_tokens=6)
        want = max(0, held - (-(-6 // b)) * rows)
        assert kvpolicy.blocks_to_free(p, lengths, b, [s]).tolist() == [[want]]
        p = kvpolicy.KVCompress(protected_window=4, compression_rate=0.5)
        kvs, longest = int(lengths[:, s].sum()), int(lengths[:, s].max())
        P = -(-4 // b) * b
        target = math.ceil((longest - P) * rows * 0.5) + P * rows
        want = 0 if longest - P <= 0 else max(0, -(-(kvs - target) // b))
        assert kvpolicy.blocks_to_free(p, lengths, b, s).tolist() == [[want]]
    per_layer = kvpolicy.KVCompress(protected_window=4, max_cache_tokens=4, budget="layer")
    got = kvpolicy.blocks_to_free(per_layer, lengths, b, [0, 2])
    want = [[max(0, sum(-(-int(T) // b) for T in lengths[l, s]) - 2) for l in range(2)] for s in (0, 2)]
    assert got.tolist() == want
    # compress_per_head without blocks_to_free uses the same counts.
    p = kvpolicy.KVCompress(protected_window=4, max_cache_tokens=6)
    r, c = run(case, p, seqs=[0, 2])
    counts = kvpolicy.blocks_to_free(p, lengths, b, [0, 2])[:, 0].tolist()
    expected, after = reference(case, [0, 2], counts, protected_window=4)
    assert_same(r, expected, after, c)


# ---------------------------------------------------------------------------------------
# The preset


def test_preset():
    p = kvpolicy.KVCompress()
    assert p.params() == {"protected_window": 64, "sinks": 0, "budget": "sequence", "max_cache_tokens": -1,
                          "compression_rate": 1.0, "metric_window": 32, "pool_kernel": 7, "excluded_distance": 0}
    q = kvpolicy.KVCompress(protected_window=32, budget="layer", compression_rate=0.25)
    assert (q.protected_window, q.budget, q.compression_rate) == (32, "layer", 0.25)
    assert type(q)(**q.params()) == q and q != p
    assert kvpolicy.preset("kv_compress", sinks=4).sinks == 4
    assert kvpolicy.KVCompress.name == "kv_compress" and "kv_compress" not in kvpolicy.PRESETS
    assert "KVCompress(protected_window=32" in repr(q)
    with pytest.raises(TypeError, match="window"):
        kvpolicy.KVCompress(window=3)
    raises("budget", kvpolicy.KVCompress, budget="head")
    raises("compression_rate", kvpolicy.KVCompress, compression_rate="half")


# ---------------------------------------------------------------------------------------
# Errors: kvpolicy.Error naming the field, nothing written


def raises(field, fn, *args, **kwargs):
    with pytest.raises(kvpolicy.Error) as e:
        fn(*args, **kwargs)
    assert e.value.field == field, str(e.value)
    return e.value


@pytest.fixture
def err_case():
    return make_case(L=2, seqs=3, H=2, b=4, max_blocks=4, seed=9, lengths=np.full((2, 3, 2), 13, np.int32))


def test_errors(err_case):
    c = err_case
    before = {n: c[n].copy() for n in ("k", "v", "metric")}
    P = kvpolicy.KVCompress(protected_window=4)

    def call(policy=P, **over):
        args = {n: c[n] for n in ("k", "v", "metric", "tables", "lengths")}
        kw = {"seqs": [0], "blocks_to_free": 2}
        for name, value in over.items():
            (args if name in args else kw)[name] = value
        return kvpolicy.compress_per_head(policy, args["k"], args["v"], args["metric"], args["tables"],
                                          args["lengths"], **kw)

    raises("policy", call, policy=kvpolicy.SnapKV())
    raises("k", call, k=c["k"][..., 0])
    raises("k", call, k=c["k"].astype(np.int32), v=c["v"].astype(np.int32))
    raises("k", call, k=np.asfortranarray(c["k"]))
    raises("v", call, v=c["v"][:-1])
    raises("v", call, v=c["v"].astype(np.float16))
    raises("metric", call, metric=c["metric"].astype(np.float64))
    raises("metric", call, metric=c["metric"][:, :2])
    raises("metric", call, metric=None)
    raises("tables", call, tables=c["tables"].astype(np.int64))
    raises("tables", call, tables=c["tables"][..., 0])
    raises("lengths", call, lengths=c["lengths"][:, :2])
    raises("lengths", call, lengths=c["lengths"].astype(np.int64))
    raises("positions", call, positions=np.zeros((3, 3), np.int32))
    raises("k", call, k=c["k"][None].repeat(3, 0), v=c["v"][None].repeat(3, 0), metric=c["metric"][None].repeat(3, 0))
    raises("seqs", call, seqs=[0.5])
    raises("blocks_to_free", call, blocks_to_free=[1, 2])
    raises("blocks_to_free", call, blocks_to_free=None)  # no budget in the policy
    raises("blocks_to_free", call, policy=kvpolicy.KVCompress(budget="layer"), blocks_to_free=[1, 2, 3])
    raises("logical_lengths", call, logical_lengths=[1, 2])
    raises("kv_compress.compression_rate", call, policy=kvpolicy.KVCompress(compression_rate=2.0),
           blocks_to_free=None)
    raises("kv_compress.max_cache_tokens", call, policy=kvpolicy.KVCompress(max_cache_tokens=3), blocks_to_free=None)
    raises("batch[0].seq", call, seqs=[3])
    raises("batch[1].seq", call, seqs=[1, 1])
    raises("batch[0].logical_length", call, positions=np.zeros(c["metric"].shape, np.int32))
    raises("pipeline.select.protected_window", call, policy=kvpolicy.KVCompress(protected_window=-1))
    raises("batch[0].blocks_to_free", call, blocks_to_free=-1)
    bad = c["tables"].copy()
    bad[1, 2, 1, 3] = 9999
    raises("cache.table[layer 1][seq 2][head 1][3]", call, tables=bad)
    bad = c["tables"].copy()
    bad[0, 1, 0, 0] = bad[0, 0, 0, 0]
    raises("cache.table[layer 0][seq 1][head 0][0]", call, tables=bad)
    bad = c["lengths"].copy()
    bad[1, 0, 1] = 17
    raises("cache.lengths[layer 1][seq 0][head 1]", call, lengths=bad)
    ro = c["k"].copy()
    ro.flags.writeable = False
    raises("k", call, k=ro)
    for name, a in before.items():
        assert a.tobytes() == c[name].tobytes(), name
    # Nothing refused: the same case compresses.
    assert call().freed.tolist() == [2]


def test_cuda_arrays_without_cuda_build():
    if kvpolicy.has_cuda:
        pytest.skip("this kvpolicy has its CUDA path")
    from test_host_only_build import CudaLabelled  # a NumPy array whose DLPack device says CUDA

    c = make_case(seed=1)
    e = raises("k", kvpolicy.compress_per_head, kvpolicy.KVCompress(), CudaLabelled(c["k"]), c["v"], c["metric"],
               c["tables"], c["lengths"], seqs=0, blocks_to_free=1)
    assert "KVPOLICY_PYTHON_CUDA" in str(e)
    queries = np.zeros((2, 3, 4, 2, 8), np.float32)
    raises("k", kvpolicy.per_head_metric, kvpolicy.KVCompress(), queries, CudaLabelled(c["k"]), c["metric"],
           c["tables"], c["lengths"], seqs=0)


# ---------------------------------------------------------------------------------------
# The CUDA path: the same results as the host path (skipped without a GPU)


def _cuda():
    torch = pytest.importorskip("torch") if not REQUIRED else __import__("torch")
    if not REQUIRED and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not REQUIRED and not kvpolicy.has_cuda:
        pytest.skip("kvpolicy built without its CUDA path")
    return torch


def _on_device(torch, case):
    return {n: None if a is None else torch.from_numpy(a.copy()).cuda() for n, a in case.items()}


def _host_and_device(torch, case, policy, **kwargs):
    r_host, c_host = run(case, policy, **kwargs)
    d = _on_device(torch, case)
    r = kvpolicy.compress_per_head(policy, d["k"], d["v"], d["metric"], d["tables"], d["lengths"],
                                   positions=d["positions"], **kwargs)
    torch.cuda.synchronize()
    return r_host, c_host, r, d


def _assert_parity(r_host, c_host, r, d):
    for name in ("new_lengths", "freed_counts", "freed_blocks", "evicted", "moved", "freed", "nonfinite_metrics"):
        np.testing.assert_array_equal(getattr(r, name).cpu().numpy(), getattr(r_host, name), err_msg=name)
    for name in ("k", "v", "metric", "positions"):
        if c_host[name] is not None:
            assert d[name].cpu().numpy().tobytes() == c_host[name].tobytes(), name


@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("shared", [True, False])
def test_cuda_matches_host(b, shared):
    torch = _cuda()
    for seed in range(2):
        case = make_case(L=3, seqs=4, H=2, b=b, d=16, max_blocks=max(2, 48 // b), shared=shared, seed=seed,
                         ties=seed == 1, nan=seed == 1)
        policy = kvpolicy.KVCompress(protected_window=2 * b + 1, sinks=1)
        got = _host_and_device(torch, case, policy, seqs=[3, 0, 2], blocks_to_free=[5, 1, 9])
        _assert_parity(*got)
        assert isinstance(got[2].new_lengths, torch.Tensor) and got[2].new_lengths.is_cuda


def test_cuda_per_layer_positions_and_budget():
    torch = _cuda()
    case = make_case(L=2, seqs=3, H=4, b=4, d=16, max_blocks=6, positions=True, seed=3)
    policy = kvpolicy.KVCompress(protected_window=5, budget="layer")
    _assert_parity(*_host_and_device(torch, case, policy, seqs=[0, 2], blocks_to_free=[[1, 3], [4, 0]],
                                     logical_lengths=[40, 36]))
    policy = kvpolicy.KVCompress(protected_window=4, max_cache_tokens=8)
    _assert_parity(*_host_and_device(torch, make_case(seed=4, d=16), policy, seqs=[1, 2]))


def test_cuda_errors_and_device_items():
    torch = _cuda()
    case = make_case(L=2, seqs=3, H=2, b=4, d=16, seed=5)
    d = _on_device(torch, case)
    P = kvpolicy.KVCompress(protected_window=4)
    args = (P, d["k"], d["v"], d["metric"], d["tables"], d["lengths"])
    raises("batch[0].seq", kvpolicy.compress_per_head, *args, seqs=[7], blocks_to_free=1)  # from the device status
    raises("metric", kvpolicy.compress_per_head, P, d["k"], d["v"], d["metric"].cpu(), d["tables"], d["lengths"],
           seqs=0, blocks_to_free=1)
    seqs = torch.tensor([2, 1], device="cuda")
    counts = torch.tensor([3, 2], device="cuda")
    r_host, c_host = run(case, P, seqs=[2, 1], blocks_to_free=[3, 2])
    r = kvpolicy.compress_per_head(*args, seqs=seqs, blocks_to_free=counts)
    _assert_parity(r_host, c_host, r, d)
    assert r.released(0).tolist() == r_host.released(0).tolist()


def test_cuda_graph_capture():
    torch = _cuda()
    case = make_case(L=2, seqs=4, H=2, b=4, d=16, max_blocks=8, seed=6)
    P = kvpolicy.KVCompress(protected_window=4)
    d = _on_device(torch, case)
    seqs = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    counts = torch.tensor([2, 3], dtype=torch.int64, device="cuda")
    n = 2
    ws = torch.empty(kvpolicy.per_head_workspace_bytes(P, d["k"], d["v"], d["metric"], d["tables"], d["lengths"],
                                                       num_items=n), dtype=torch.uint8, device="cuda")
    pristine = {name: x.clone() for name, x in d.items() if x is not None}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (PyTorch's advice before a capture)
        kvpolicy.compress_per_head(P, d["k"], d["v"], d["metric"], d["tables"], d["lengths"], seqs=seqs,
                                   blocks_to_free=counts, workspace=ws, check=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kvpolicy.compress_per_head(P, d["k"], d["v"], d["metric"], d["tables"], d["lengths"], seqs=seqs,
                                       blocks_to_free=counts, workspace=ws, check=False)
        raises("check", kvpolicy.compress_per_head, P, d["k"], d["v"], d["metric"], d["tables"], d["lengths"],
               seqs=seqs, blocks_to_free=counts, workspace=ws)
    for new_seqs, new_counts in (([0, 1], [2, 3]), ([3, 2], [4, 1])):
        for name, x in pristine.items():
            d[name].copy_(x)
        seqs.copy_(torch.tensor(new_seqs))
        counts.copy_(torch.tensor(new_counts))
        graph.replay()
        torch.cuda.synchronize()
        r.check()
        r_host, c_host = run(case, P, seqs=new_seqs, blocks_to_free=new_counts)
        _assert_parity(r_host, c_host, r, d)


# ---------------------------------------------------------------------------------------
# The metric: squared attention, against NumPy


def metric_reference(case, queries, seqs, slots, prefill, window=32, pool=7, excluded=0, query_positions=None):
    k, metric, positions, tables, lengths = (case[n] for n in ("k", "metric", "positions", "tables", "lengths"))
    out = metric.astype(np.float64)
    L, _, H, _ = tables.shape
    b, d = k.shape[-2], k.shape[-1]
    G = queries.shape[3] // H
    shared = k.ndim == 3
    for i, seq in enumerate(seqs):
        for l in range(L):
            for h in range(H):
                T = int(lengths[l, seq, h])
                if T == 0:
                    continue
                slot_of = [(tables[l, seq, h, t // b], t % b) for t in range(T)]
                kl = k if shared else k[l]
                keys = np.array([kl[blk, s] for blk, s in slot_of], np.float64).reshape(T, d)
                pos = (np.array([(positions if shared else positions[l])[blk, s] for blk, s in slot_of])
                       if positions is not None else np.arange(T))
                total = np.zeros(T)
                if prefill:
                    n = min(window, T)
                    for g in range(G):
                        acc = np.zeros(T)
                        for j in range(n):
                            pj = T - n + j
                            q = queries[l, slots[i], queries.shape[2] - n + j, h * G + g].astype(np.float64)
                            z = keys[: pj + 1] @ q / math.sqrt(d)
                            p = np.exp(z - z.max())
                            p /= p.sum()
                            for t in range(pj + 1):
                                if pj - t >= excluded:
                                    acc[t] += p[t] ** 2
                        half = pool // 2
                        total += [acc[max(0, t - half): t + half + 1].max() for t in range(T)]
                    values = total
                else:
                    pq = T - 1 if query_positions is None else query_positions[i]
                    values = np.array([out[(l,) * (not shared) + slot_of[t]] for t in range(T)])
                    for g in range(G):
                        q = queries[l, slots[i], queries.shape[2] - 1, h * G + g].astype(np.float64)
                        z = keys @ q / math.sqrt(d)
                        p = np.exp(z - z.max())
                        p /= p.sum()
                        values = values + np.where(pq - pos >= excluded, p ** 2, 0.0)
                for t in range(T):
                    out[(l,) * (not shared) + slot_of[t]] = values[t]
    return out


def metric_case(shared=True, G=2, w=6, seed=0, positions=False):
    case = make_case(L=2, seqs=3, H=2, b=4, d=8, max_blocks=5, shared=shared, seed=seed, positions=positions)
    rng = np.random.default_rng(seed + 100)
    queries = (rng.integers(-16, 16, size=(2, 3, w, 2 * G, 8)) / 8).astype(np.float32)
    return case, queries


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("G", [1, 3])
def test_metric_prefill_and_decode(shared, G):
    case, queries = metric_case(shared, G, seed=G)
    for prefill, kw in ((True, dict(metric_window=6)), (True, dict(metric_window=3, pool_kernel=3, excluded_distance=2)),
                        (False, dict(excluded_distance=1))):
        policy = kvpolicy.KVCompress(**kw)
        c = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in case.items()}
        r = kvpolicy.per_head_metric(policy, queries, c["k"], c["metric"], c["tables"], c["lengths"], seqs=[2, 0],
                                     query_slots=[1, 2], mode="prefill" if prefill else "decode")
        assert r.check() is r
        want = metric_reference(case, queries, [2, 0], [1, 2], prefill, policy.metric_window, policy.pool_kernel,
                                policy.excluded_distance)
        np.testing.assert_allclose(c["metric"], want, rtol=1e-5, atol=1e-7)
        untouched = np.ones(case["metric"].shape, bool)  # seq 1's slots and free blocks keep their metric
        for l in range(2):
            for s in (0, 2):
                for h in range(2):
                    for t in range(int(case["lengths"][l, s, h])):
                        idx = ((l,) if not shared else ()) + (case["tables"][l, s, h, t // 4], t % 4)
                        untouched[idx] = False
        np.testing.assert_array_equal(c["metric"][untouched], case["metric"][untouched])


def test_metric_decode_positions():
    case, queries = metric_case(seed=4, positions=True)
    policy = kvpolicy.KVCompress(excluded_distance=3)
    c = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in case.items()}
    kvpolicy.per_head_metric(policy, queries, c["k"], c["metric"], c["tables"], c["lengths"], seqs=[0, 1],
                             mode="decode", positions=c["positions"], query_positions=[25, 20])
    want = metric_reference(case, queries, [0, 1], [0, 1], False, excluded=3, query_positions=[25, 20])
    np.testing.assert_allclose(c["metric"], want, rtol=1e-5, atol=1e-7)


def test_metric_errors():
    case, queries = metric_case(seed=2)
    c = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in case.items()}
    P = kvpolicy.KVCompress(metric_window=4)

    def call(policy=P, q=queries, **kw):
        kw = {"seqs": [0], **kw}
        return kvpolicy.per_head_metric(policy, q, c["k"], c["metric"], c["tables"], c["lengths"], **kw)

    raises("mode", call, mode="both")
    raises("queries", call, q=queries[..., :4])
    raises("queries", call, q=queries[:, :, :, :3])
    raises("queries", call, q=queries[:1])
    raises("queries", call, q=queries.astype(np.int32))
    e = raises("queries", call, policy=kvpolicy.KVCompress(metric_window=7))  # the slot holds 6
    assert "metric_window=6" in str(e), str(e)  # the keyword that fits these queries
    raises("seqs[0]", call, seqs=[5])
    raises("query_slots[0]", call, query_slots=[3])
    raises("query_slots", call, query_slots=[0, 1])
    raises("query_positions", call, mode="decode", query_positions=[-2])
    raises("pipeline.scorer.pool_kernel", call, policy=kvpolicy.KVCompress(metric_window=4, pool_kernel=4))
    raises("policy", call, policy=kvpolicy.SnapKV())
    assert c["metric"].tobytes() == case["metric"].tobytes()


def test_cuda_metric_matches_host():
    torch = _cuda()
    for shared, prefill in ((True, True), (False, True), (True, False)):
        case, queries = metric_case(shared, G=2, seed=7)
        case["k"] = np.ascontiguousarray(case["k"])
        policy = kvpolicy.KVCompress(metric_window=5, pool_kernel=3)
        mode = "prefill" if prefill else "decode"
        c = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in case.items()}
        kvpolicy.per_head_metric(policy, queries, c["k"], c["metric"], c["tables"], c["lengths"], seqs=[1, 2],
                                 mode=mode)
        d = _on_device(torch, case)
        r = kvpolicy.per_head_metric(policy, torch.from_numpy(queries).cuda(), d["k"], d["metric"], d["tables"],
                                     d["lengths"], seqs=[1, 2], mode=mode)
        r.check()
        np.testing.assert_allclose(d["metric"].cpu().numpy(), c["metric"], rtol=1e-4, atol=1e-6)
    raises("seqs", kvpolicy.per_head_metric, policy, torch.from_numpy(queries).cuda(), d["k"], d["metric"],
           d["tables"], d["lengths"], seqs=torch.tensor([0], device="cuda"))
