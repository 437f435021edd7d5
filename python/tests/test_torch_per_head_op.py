"""torch.ops.kvpolicy.compress_per_head (kvpolicy.torch_ops.compress_per_head): KV-Compress
over a per-head block cache as a PyTorch custom op. On the CPU: torch.library's own
checks, the same results and the same bytes of K, V, metric and positions as
kvpolicy.compress_per_head, refusals naming the field, torch.compile. With a GPU
(skipped without one): the device against the host, CUDA graph capture and replay,
no host wait. Skipped without PyTorch."""

import os
import warnings

import numpy as np
import pytest

# python/scripts/gpu_check.sh sets it: there, a test that cannot run is a failure.
REQUIRED = os.environ.get("KVPOLICY_REQUIRE_CUDA") == "1"
torch = pytest.importorskip("torch") if not REQUIRED else __import__("torch")

import kvpolicy  # noqa: E402
import kvpolicy.torch_ops as ops  # noqa: E402
from checks import captured  # noqa: E402
from test_kv_compress import make_case  # noqa: E402

FIELDS = ("new_lengths", "freed_counts", "freed_blocks", "evicted", "moved", "freed", "nonfinite_metrics")
WRITTEN = ("k", "v", "metric", "positions")

# (make_case arguments, K/V dtype, KVCompress keywords, items): the unified pool and a
# pool per layer, the sequence and the per-layer budget, positions with logical lengths,
# the policy's own budget (blocks_to_free None), float16 with NaN and tied metrics, bfloat16.
CASES = [
    pytest.param(dict(L=3, seqs=4, H=2, b=4, d=8, max_blocks=12, seed=1), None,
                 dict(protected_window=5, sinks=1), dict(seqs=[3, 0, 2], blocks_to_free=[5, 1, 9]), id="shared"),
    pytest.param(dict(L=3, seqs=2, H=3, b=4, d=8, max_blocks=6, shared=False, dtype=np.float16, ties=True, nan=True,
                      seed=5), None,
                 dict(protected_window=4, budget="layer"), dict(seqs=[1, 0], blocks_to_free=[[2, 0, 5], [1, 3, 1]]),
                 id="per_layer_fp16_nan"),
    pytest.param(dict(L=2, seqs=3, H=2, b=4, max_blocks=6, positions=True, seed=8), None,
                 dict(protected_window=6, sinks=2),
                 dict(seqs=[0, 1, 2], blocks_to_free=[4, 2, 7], logical_lengths=[40, 35, 33]), id="positions"),
    pytest.param(dict(L=2, seqs=3, H=2, b=4, max_blocks=8, seed=6), None,
                 dict(protected_window=4, max_cache_tokens=6), dict(seqs=[0, 2]), id="policy_budget"),
    pytest.param(dict(L=2, seqs=3, H=2, b=16, d=8, max_blocks=4, seed=4), torch.bfloat16,
                 dict(protected_window=8), dict(seqs=[2, 0], blocks_to_free=[3, 2]), id="bfloat16"),
]


def tensors(case, device="cpu", dtype=None):
    """The case as fresh PyTorch tensors (K and V in `dtype`: the values are exact in bf16)."""
    out = {}
    for name, a in case.items():
        t = None if a is None else torch.from_numpy(a.copy())
        if t is not None and dtype is not None and name in ("k", "v"):
            t = t.to(dtype)
        out[name] = None if t is None else t.to(device)
    return out


def cache_args(t):
    return t["k"], t["v"], t["metric"], t["tables"], t["lengths"]


def eager(case, dtype, policy, **items):
    """kvpolicy.compress_per_head on CPU tensors of the case: (result, tensors after)."""
    t = tensors(case, dtype=dtype)
    return kvpolicy.compress_per_head(policy, *cache_args(t), positions=t["positions"], **items), t


def as_bytes(x):
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(r, t, want, want_t):
    """Every result field and every byte of what the call writes (NaN metrics as bits)."""
    for name in FIELDS:
        got, exp = getattr(r, name), getattr(want, name)
        assert got.dtype == exp.dtype and torch.equal(got.cpu(), exp.cpu()), name
    for name in WRITTEN:
        if want_t[name] is not None:
            assert torch.equal(as_bytes(t[name]), as_bytes(want_t[name])), name


def op_args(t, policy, seqs, blocks_to_free=None, logical_lengths=None):
    """The op's own arguments, items as the wrapper passes them."""
    def item(x):
        return None if x is None else torch.as_tensor(x)

    return (ops.policy_spec(policy), *cache_args(t), t["positions"], item(seqs), item(blocks_to_free),
            item(logical_lengths))


# ---------------------------------------------------------------------------------------
# On the CPU


@pytest.mark.parametrize("shape, dtype, keywords, items", CASES)
def test_the_op_passes_torch_library_checks(shape, dtype, keywords, items):
    # Schema and mutation declarations (K, V, metric, positions written; tables and
    # lengths not), the fake implementation and AOT dispatch, each against real calls
    # on fresh clones of the arguments.
    t = tensors(make_case(**shape), dtype=dtype)
    args = op_args(t, kvpolicy.KVCompress(**keywords), **items)
    results = torch.library.opcheck(torch.ops.kvpolicy.compress_per_head.default, args)
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("shape, dtype, keywords, items", CASES)
def test_the_op_equals_compress_per_head(shape, dtype, keywords, items):
    case, policy = make_case(**shape), kvpolicy.KVCompress(**keywords)
    t = tensors(case, dtype=dtype)
    tables, lengths = t["tables"].clone(), t["lengths"].clone()
    r = ops.compress_per_head(policy, *cache_args(t), positions=t["positions"], **items)
    want, want_t = eager(case, dtype, policy, **items)
    assert_same(r, t, want, want_t)
    assert r.status is None and isinstance(r.new_lengths, torch.Tensor)
    assert int(r.freed.sum()) > 0 and int(r.moved.sum()) > 0  # the comparison covers real moves
    assert torch.equal(t["tables"], tables) and torch.equal(t["lengths"], lengths)  # only read
    assert r.released(0).tolist() == want.released(0).tolist()


def test_items_as_ints_lists_arrays_and_tensors():
    case = make_case(L=2, seqs=3, H=2, b=4, max_blocks=6, positions=True, seed=8)
    policy = kvpolicy.KVCompress(protected_window=6)
    want, want_t = eager(case, None, policy, seqs=[1], blocks_to_free=[3], logical_lengths=[35])
    for items in (dict(seqs=1, blocks_to_free=3, logical_lengths=35),
                  dict(seqs=np.array([1]), blocks_to_free=np.int64(3), logical_lengths=(35,)),
                  dict(seqs=torch.tensor([1], dtype=torch.int32), blocks_to_free=torch.tensor(3),
                       logical_lengths=torch.tensor([35], dtype=torch.int16))):
        t = tensors(case)
        assert_same(ops.compress_per_head(ops.policy_spec(policy), *cache_args(t), positions=t["positions"], **items),
                    t, want, want_t)


def test_k_and_v_halves_of_one_tensor():
    """K and V as kv[:, 0] and kv[:, 1] of one [N, 2, b, d] tensor, eager and compiled."""
    case = make_case(L=2, seqs=3, H=2, b=4, d=8, max_blocks=6, seed=3)
    policy = kvpolicy.KVCompress(protected_window=4)
    spec = ops.policy_spec(policy)
    kv = torch.from_numpy(np.stack([case["k"], case["v"]], axis=1))
    tables, lengths = torch.from_numpy(case["tables"]), torch.from_numpy(case["lengths"])

    def step(kv, metric, seqs, counts):
        r = ops.compress_per_head(spec, kv[:, 0], kv[:, 1], metric, tables, lengths, seqs=seqs, blocks_to_free=counts)
        return r.new_lengths + 0, r.freed_blocks

    want, want_t = eager(case, None, policy, seqs=[0, 1], blocks_to_free=[3, 5])
    want_kv = torch.stack([want_t["k"], want_t["v"]], dim=1)
    torch._dynamo.reset()
    for fn in (step, torch.compile(step, backend="inductor", fullgraph=True)):
        pool, metric = kv.clone(), torch.from_numpy(case["metric"].copy())
        new_lengths, freed_blocks = fn(pool, metric, torch.tensor([0, 1]), torch.tensor([3, 5]))
        assert torch.equal(new_lengths, want.new_lengths) and torch.equal(freed_blocks, want.freed_blocks)
        assert torch.equal(pool, want_kv) and torch.equal(metric, want_t["metric"])


def raises(field, fn, *args, **kwargs):
    with pytest.raises(kvpolicy.Error) as e:
        fn(*args, **kwargs)
    assert e.value.field == field, str(e.value)
    return e.value


def test_refusals_name_the_field_and_write_nothing():
    case = make_case(L=2, seqs=3, H=2, b=4, max_blocks=4, seed=9, lengths=np.full((2, 3, 2), 13, np.int32))
    t = tensors(case)
    before = {name: t[name].clone() for name in ("k", "v", "metric")}
    P = kvpolicy.KVCompress(protected_window=4)

    def call(policy=P, **over):
        args = {name: t[name] for name in ("k", "v", "metric", "tables", "lengths")}
        kw = {"seqs": [0], "blocks_to_free": 2}
        for name, value in over.items():
            (args if name in args else kw)[name] = value
        return ops.compress_per_head(policy, args["k"], args["v"], args["metric"], args["tables"], args["lengths"],
                                     **kw)

    raises("policy", call, policy=kvpolicy.SnapKV())  # a PagedCache preset
    raises("policy", call, policy='["kv_compress", {"window": 3}]')  # not a spec policy_spec made
    raises("k", call, k=t["k"].to(torch.int32), v=t["v"].to(torch.int32))
    raises("v", call, v=t["v"][:-1])
    raises("metric", call, metric=t["metric"].double())
    raises("tables", call, tables=t["tables"].long())
    raises("tables", call, tables=t["tables"][..., 0])
    raises("lengths", call, lengths=t["lengths"][:, :2])
    raises("positions", call, positions=torch.zeros(3, 3, dtype=torch.int32))
    raises("seqs", call, seqs=[0.5])
    raises("blocks_to_free", call, blocks_to_free=[1, 2])
    raises("blocks_to_free", call, blocks_to_free=None)  # and no budget in the policy
    raises("logical_lengths", call, logical_lengths=[1, 2])
    raises("batch[0].seq", call, seqs=[3])
    raises("batch[1].seq", call, seqs=torch.tensor([1, 1]))
    raises("batch[0].blocks_to_free", call, blocks_to_free=-1)
    raises("kv_compress.max_cache_tokens", call, policy=kvpolicy.KVCompress(max_cache_tokens=3), blocks_to_free=None)
    bad = t["tables"].clone()
    bad[1, 2, 1, 3] = 9999
    raises("cache.table[layer 1][seq 2][head 1][3]", call, tables=bad)
    for name, x in before.items():
        assert torch.equal(as_bytes(t[name]), as_bytes(x)), name
    assert call().freed.tolist() == [2]  # nothing refused: the same case compresses


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_the_op(backend):
    case = make_case(L=2, seqs=3, H=2, b=4, max_blocks=6, positions=True, seed=8)
    policy = kvpolicy.KVCompress(protected_window=6, sinks=2, max_cache_tokens=8)
    spec = ops.policy_spec(policy)  # a string: made outside the compiled function
    tables, lengths = torch.from_numpy(case["tables"]), torch.from_numpy(case["lengths"])

    def step(k, v, metric, positions, seqs, counts, logical):
        r = ops.compress_per_head(spec, k, v, metric, tables, lengths, seqs=seqs, blocks_to_free=counts,
                                  logical_lengths=logical, positions=positions)
        return r.new_lengths + 0, r.freed_blocks, r.moved, r.freed

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    # The items are read when the graph runs: other values, the same graph. None: the
    # policy's budget, read off the lengths inside the op.
    for seqs, counts, logical in (([0, 1, 2], [4, 2, 7], [40, 35, 33]), ([2, 0], [1, 3], [33, 40]),
                                  ([1, 2], None, [35, 33])):
        t = tensors(case)
        out = compiled(t["k"], t["v"], t["metric"], t["positions"], torch.tensor(seqs),
                       None if counts is None else torch.tensor(counts), torch.tensor(logical))
        want, want_t = eager(case, None, policy, seqs=seqs, blocks_to_free=counts, logical_lengths=logical)
        for got, name in zip(out, ("new_lengths", "freed_blocks", "moved", "freed")):
            assert torch.equal(got, getattr(want, name)), name
        assert int(want.freed.sum()) > 0
        for name in WRITTEN:  # written in place through functionalization
            assert torch.equal(as_bytes(t[name]), as_bytes(want_t[name])), name


def test_a_preset_inside_torch_compile_is_refused_with_what_to_do():
    case = make_case(L=2, seqs=3, H=2, b=4, seed=1)
    t = tensors(case)
    policy = kvpolicy.KVCompress(protected_window=4)

    def step(k):
        return ops.compress_per_head(policy, k, t["v"], t["metric"], t["tables"], t["lengths"], seqs=[0],
                                     blocks_to_free=1).new_lengths + 0

    torch._dynamo.reset()
    with pytest.raises(Exception, match="policy_spec"):
        torch.compile(step, backend="eager", fullgraph=True)(t["k"])


def test_a_malformed_table_is_named_while_tracing():
    case = make_case(L=2, seqs=3, H=2, b=4, seed=1)
    t = tensors(case)
    spec = ops.policy_spec(kvpolicy.KVCompress(protected_window=4))

    def step(tables):  # the fake implementation sizes the results from the tables
        return ops.compress_per_head(spec, t["k"], t["v"], t["metric"], tables, t["lengths"], seqs=[0],
                                     blocks_to_free=1).new_lengths + 0

    torch._dynamo.reset()
    with pytest.raises(Exception, match="tables: has shape"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(t["tables"][..., 0])


# ---------------------------------------------------------------------------------------
# On a GPU: the device against the host (skipped without one)

cuda = [
    pytest.mark.skipif(not REQUIRED and not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not REQUIRED and not kvpolicy.has_cuda, reason="kvpolicy built without its CUDA path"),
]


def on_cuda(fn):
    for mark in cuda:
        fn = mark(fn)
    return fn


DEVICE_CASES = [p for p in CASES if p.id in ("shared", "per_layer_fp16_nan", "positions", "bfloat16")]


@on_cuda
@pytest.mark.parametrize("shape, dtype, keywords, items", DEVICE_CASES)
def test_cuda_op_equals_host(shape, dtype, keywords, items):
    case, policy = make_case(**shape), kvpolicy.KVCompress(**keywords)
    want, want_t = eager(case, dtype, policy, **items)
    # Device items, then host items (kernel arguments). The policy's own budget is left
    # out here: it reads the lengths back (a wait, which the sync debug mode refuses).
    device_items = {name: torch.tensor(x, device="cuda") for name, x in items.items()}
    for form in (device_items, items):
        t = tensors(case, "cuda", dtype)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a torch-side wait inside the call raises
        try:
            r = ops.compress_per_head(policy, *cache_args(t), positions=t["positions"], **form)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert r.status.is_cuda and r.new_lengths.is_cuda
        torch.cuda.synchronize()
        r.check()
        assert_same(r, t, want, want_t)


@on_cuda
def test_cuda_device_errors_come_through_the_status():
    case = make_case(L=2, seqs=3, H=2, b=4, d=16, seed=5)
    t = tensors(case, "cuda")
    before = as_bytes(t["k"])
    r = ops.compress_per_head(kvpolicy.KVCompress(protected_window=4), *cache_args(t),
                              seqs=torch.tensor([7], device="cuda"), blocks_to_free=1)
    raises("batch[0].seq", r.check)
    assert torch.equal(as_bytes(t["k"]), before)


@on_cuda
def test_cuda_graph_capture_and_replay():
    case = make_case(L=2, seqs=4, H=2, b=4, d=16, max_blocks=8, positions=True, seed=6)
    policy = kvpolicy.KVCompress(protected_window=4, max_cache_tokens=8)
    spec = ops.policy_spec(policy)
    t = tensors(case, "cuda")
    pristine = {name: x.clone() for name, x in t.items() if x is not None}
    seqs = torch.tensor([0, 1], device="cuda")
    counts = torch.tensor([2, 3], device="cuda")
    logical = torch.tensor([40, 41], dtype=torch.int32, device="cuda")  # above every position (< 40)

    def step():
        return ops.compress_per_head(spec, *cache_args(t), positions=t["positions"], seqs=seqs,
                                     blocks_to_free=counts, logical_lengths=logical)

    step()  # warm-up outside the capture (the first call loads the kernels)
    torch.cuda.synchronize()
    for name, x in pristine.items():
        t[name].copy_(x)
    torch.cuda.synchronize()
    graph, r = captured(step)
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(t["k"]), as_bytes(pristine["k"]))  # captured, not run
    # The items are read on the device at each replay: other values, the same graph.
    for new_seqs, new_counts, new_logical in (([0, 1], [2, 3], [40, 41]), ([3, 2], [4, 1], [44, 42])):
        for name, x in pristine.items():
            t[name].copy_(x)
        seqs.copy_(torch.tensor(new_seqs))
        counts.copy_(torch.tensor(new_counts))
        logical.copy_(torch.tensor(new_logical))
        graph.replay()
        torch.cuda.synchronize()
        r.check()
        assert_same(r, t, *eager(case, None, policy, seqs=new_seqs, blocks_to_free=new_counts,
                                 logical_lengths=new_logical))

    # All items on the host: kernel arguments, fixed at capture.
    for name, x in pristine.items():
        t[name].copy_(x)
    graph, r = captured(lambda: ops.compress_per_head(spec, *cache_args(t), positions=t["positions"], seqs=[2, 0],
                                                      blocks_to_free=[1, 4], logical_lengths=[42, 40]))
    graph.replay()
    torch.cuda.synchronize()
    r.check()
    assert_same(r, t, *eager(case, None, policy, seqs=[2, 0], blocks_to_free=[1, 4], logical_lengths=[42, 40]))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")  # these captures stop before any work
        with pytest.raises(kvpolicy.Error) as e:  # the policy's budget reads the lengths on the host
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                ops.compress_per_head(spec, *cache_args(t), seqs=[0, 1])
        assert e.value.field == "blocks_to_free"
        with pytest.raises(kvpolicy.Error) as e:  # a host list next to device items would need a copy
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                ops.compress_per_head(spec, *cache_args(t), seqs=seqs, blocks_to_free=[2, 3])
        assert e.value.field == "blocks_to_free" and "device array" in str(e.value)


@on_cuda
def test_cuda_torch_compile():
    case = make_case(L=2, seqs=3, H=2, b=4, d=16, max_blocks=6, positions=True, seed=8)
    policy = kvpolicy.KVCompress(protected_window=6, sinks=2)
    spec = ops.policy_spec(policy)
    t = tensors(case, "cuda")

    def step(seqs, counts, logical):
        r = ops.compress_per_head(spec, *cache_args(t), positions=t["positions"], seqs=seqs, blocks_to_free=counts,
                                  logical_lengths=logical)
        return r.new_lengths + 0, r.freed_blocks

    torch._dynamo.reset()
    new_lengths, freed_blocks = torch.compile(step, backend="aot_eager", fullgraph=True)(
        torch.tensor([0, 2], device="cuda"), torch.tensor([4, 7], device="cuda"), torch.tensor([40, 33], device="cuda"))
    want, want_t = eager(case, None, policy, seqs=[0, 2], blocks_to_free=[4, 7], logical_lengths=[40, 33])
    assert torch.equal(new_lengths.cpu(), want.new_lengths) and torch.equal(freed_blocks.cpu(), want.freed_blocks)
    for name in WRITTEN:
        assert torch.equal(as_bytes(t[name]), as_bytes(want_t[name])), name
