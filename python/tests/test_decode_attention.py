"""Decode attention over head-adaptive caches (kvpolicy.decode_attention_per_head,
kvpolicy.decode_attention and their torch ops): the host path against a NumPy
reference written here (a hand case, ragged per-head caches, per-head counts with a
tail, cautious update's dropped tokens, the metric updates), errors naming the field,
and with a GPU the CUDA path against the host path (bf16/f16, d 64/128, G 1-8, the
staged kernel, the metric, a CUDA graph replay)."""

import math

import numpy as np
import pytest

import kvpolicy
from paged_case import make_case as make_paged_case
from test_kv_compress import _cuda
from test_kv_compress import make_case as make_per_head_case



# ---------------------------------------------------------------------------------------
# The reference


def _softmax_rows(K, V, q, scale):
    """(probabilities, output) of one query over rows K, V (float64)."""
    if K.shape[0] == 0:
        return np.zeros(0), np.zeros(V.shape[1])
    z = K @ q * scale
    p = np.exp(z - z.max())
    p /= p.sum()
    return p, p @ V


def per_head_reference(case, queries, layer, seqs, scale, update=None, excluded=0, query_positions=None):
    """(output [n, h_q, d] float64, metric after) of decode_attention_per_head."""
    k, v, tables, lengths, positions = (case[n] for n in ("k", "v", "tables", "lengths", "positions"))
    metric = case["metric"].astype(np.float64)
    shared = k.ndim == 3
    K, V = (k, v) if shared else (k[layer], v[layer])
    M = metric if shared else metric[layer]
    P = None if positions is None else (positions if shared else positions[layer])
    b = k.shape[-2]
    H = tables.shape[2]
    G = queries.shape[1] // H
    out = np.zeros(queries.shape, np.float64)
    for i, s in enumerate(seqs):
        for h in range(H):
            T = int(lengths[layer, s, h])
            slots = [(tables[layer, s, h, t // b], t % b) for t in range(T)]
            d = K.shape[-1]
            Kt = np.array([K[blk, j] for blk, j in slots], np.float64).reshape(T, d)
            Vt = np.array([V[blk, j] for blk, j in slots], np.float64).reshape(T, d)
            pos = [int(P[blk, j]) for blk, j in slots] if P is not None else list(range(T))
            pq = query_positions[i] if query_positions is not None else (pos[-1] if T else 0)
            for g in range(G):
                p, o = _softmax_rows(Kt, Vt, queries[i, h * G + g].astype(np.float64), scale)
                out[i, h * G + g] = o
                if update is None:
                    continue
                for t, (blk, j) in enumerate(slots):
                    if pq - pos[t] >= excluded:
                        M[blk, j] += p[t] ** 2 if update == "squared" else p[t]
    return out, metric


def paged_reference(pc, queries, layer, seqs, scale, counts=None, tail_from=None, live=None, update=None):
    """(output, F after) of decode_attention over a PagedCase (canonical K/V)."""
    H = pc.kv.shape[4]
    G = queries.shape[1] // H
    b = pc.block_size
    F = pc.scores.astype(np.float64)
    out = np.zeros(queries.shape, np.float64)
    for i, s in enumerate(seqs):
        T = int(pc.lengths[s])
        rows = pc.rows(pc.kv, s, T)  # [2, L, T, h, d]
        for h in range(H):
            ts = list(range(T))
            if counts is not None:
                ts = [t for t in ts if t < counts[layer, s, h] or t >= tail_from[s]]
            if live is not None:
                ts = [t for t in ts if live[layer, pc.block_table[s, t // b], t % b, h]]
            Kt = rows[0, layer, ts, h].astype(np.float64)
            Vt = rows[1, layer, ts, h].astype(np.float64)
            for g in range(G):
                p, o = _softmax_rows(Kt, Vt, queries[i, h * G + g].astype(np.float64), scale)
                out[i, h * G + g] = o
                if update:
                    for t, pt in zip(ts, p):
                        F[layer, pc.block_table[s, t // b], t % b, h] += pt ** 2 if update == "squared" else pt
    return out, F


def _queries(rng, n, h_q, d, dtype=np.float32):
    return (rng.integers(-32, 32, size=(n, h_q, d)) / 8).astype(dtype)


# ---------------------------------------------------------------------------------------
# Host path


def test_hand_case():
    # One sequence, one KV head, two query heads, d 2, two tokens in one block:
    # keys (1, 0), (0, 1), values (2, 0), (0, 4), scale 1.
    k = np.array([[[1, 0], [0, 1]]], np.float32)  # [N 1, b 2, d 2]
    v = np.array([[[2, 0], [0, 4]]], np.float32)
    tables = np.zeros((1, 1, 1, 1), np.int32)
    lengths = np.full((1, 1, 1), 2, np.int32)
    metric = np.zeros((1, 2), np.float32)
    q = np.array([[[1, 0], [0, 0]]], np.float32)  # head 0 prefers token 0; head 1 is even
    r = kvpolicy.decode_attention_per_head(q, k, v, tables, lengths, scale=1.0, update="probability", metric=metric)
    p0 = math.e / (math.e + 1)  # softmax(1, 0)
    np.testing.assert_allclose(r.out[0, 0], [2 * p0, 4 * (1 - p0)], rtol=1e-6)
    np.testing.assert_allclose(r.out[0, 1], [1.0, 2.0], rtol=1e-6)
    # H2O's sums over the group: token 0 gets p0 + 1/2, token 1 gets (1 - p0) + 1/2.
    np.testing.assert_allclose(metric[0], [p0 + 0.5, 1.5 - p0], rtol=1e-6)
    metric[:] = 0
    kvpolicy.decode_attention_per_head(q, k, v, tables, lengths, scale=1.0, update="squared", metric=metric)
    np.testing.assert_allclose(metric[0], [p0 ** 2 + 0.25, (1 - p0) ** 2 + 0.25], rtol=1e-6)
    assert r.status is None and r.check() is r


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("G", [1, 3])
def test_per_head_against_reference(shared, G):
    rng = np.random.default_rng(1)
    case = make_per_head_case(L=2, seqs=4, H=2, b=4, d=8, max_blocks=6, shared=shared, seed=2, positions=True)
    case["lengths"][1, 2, 0] = 0  # a head that attends nothing: zeros
    seqs = [3, 0, 2]
    q = _queries(rng, len(seqs), 2 * G, 8)
    for update, excluded in ((None, 0), ("squared", 0), ("squared", 5), ("probability", 2)):
        metric = case["metric"].copy()
        qpos = [30, 27, 19]
        r = kvpolicy.decode_attention_per_head(q, case["k"], case["v"], case["tables"], case["lengths"], layer=1,
                                               seqs=seqs, scale=0.3, update=update, metric=metric,
                                               positions=case["positions"], excluded_distance=excluded,
                                               query_positions=qpos)
        want, want_metric = per_head_reference(case, q, 1, seqs, 0.3, update, excluded, qpos)
        np.testing.assert_allclose(r.out, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metric, want_metric, rtol=1e-5, atol=1e-6)
    assert not np.any(r.out[2, 0:G])  # lengths[1, 2, 0] == 0


def test_per_head_defaults_and_out():
    rng = np.random.default_rng(3)
    case = make_per_head_case(L=1, seqs=2, H=2, b=4, d=16, seed=4)
    q = _queries(rng, 2, 4, 16)
    out = np.full(q.shape, 7.0, np.float32)
    r = kvpolicy.decode_attention_per_head(q, case["k"], case["v"], case["tables"], case["lengths"], out=out)
    assert r.out is out
    assert kvpolicy.decode_attention_per_head_workspace_bytes(q, case["k"], case["v"], case["tables"],
                                                              case["lengths"]) == 0  # the host needs none
    want, _ = per_head_reference(case, q, 0, [0, 1], 1 / math.sqrt(16))  # seqs None: item i is sequence i
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_one_item_with_any_item_stride():
    """An axis of one entry has no meaningful stride: a [1, h_q, d] view of a [h_q, 1, d] tensor
    (what transposing the engine's [1, h_q, tokens, d] query gives, which frameworks call
    contiguous) is one item, not an error."""
    torch = pytest.importorskip("torch")
    case = make_per_head_case(L=1, seqs=2, H=2, b=4, d=16, seed=4)
    q = torch.from_numpy(_queries(np.random.default_rng(5), 1, 4, 16)[0][:, None, :].copy()).transpose(0, 1)
    assert q.stride(0) == 16 and q.is_contiguous()  # an item stride shorter than its 4 x 16 elements
    k, v, tables, lengths = (torch.from_numpy(case[n]) for n in ("k", "v", "tables", "lengths"))
    r = kvpolicy.decode_attention_per_head(q, k, v, tables, lengths, seqs=[1])
    want, _ = per_head_reference(case, q.numpy(), 0, [1], 1 / math.sqrt(16))
    np.testing.assert_allclose(r.out.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_counts", [False, True])
@pytest.mark.parametrize("with_live", [False, True])
def test_paged_against_reference(with_counts, with_live):
    pc = make_paged_case(layers=2, kv_heads=2, q_heads=8, head_dim=16, block_size=4, lengths=(40, 37, 9), seed=5)
    rng = np.random.default_rng(6)
    extra, counts, tail, live = {}, None, None, None
    if with_live:
        live = (rng.random(pc.scores.shape) < 0.7).astype(np.uint8)
        extra["live"] = live
    cache, _ = pc.cache("nano_vllm", **extra)
    if with_counts:
        counts = rng.integers(0, 30, size=(2, 3, 2)).astype(np.int32)
        tail = np.array([34, 30, 9], np.int32)
        counts = np.minimum(counts, tail[None, :, None]).astype(np.int32)
    seqs = [1, 0, 2]
    q = _queries(rng, 3, 8, 16)
    scores = pc.scores.copy()
    r = kvpolicy.decode_attention(q, cache, layer=1, seqs=seqs, counts=counts, tail_from=tail, update="probability",
                                  scores=scores)
    want, want_F = paged_reference(pc, q, 1, seqs, 0.25, counts, tail, live, "probability")
    np.testing.assert_allclose(r.out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, want_F, rtol=1e-5, atol=1e-6)


def raises(field, fn, *args, **kwargs):
    with pytest.raises(kvpolicy.Error) as e:
        fn(*args, **kwargs)
    assert e.value.field == field, (e.value.field, str(e.value))
    return e.value


def test_errors_name_the_field_and_write_nothing():
    rng = np.random.default_rng(7)
    case = make_per_head_case(L=2, seqs=3, H=2, b=4, d=8, seed=8)
    q = _queries(rng, 2, 4, 8)
    args = (q, case["k"], case["v"], case["tables"], case["lengths"])
    metric = case["metric"].copy()
    out = np.full(q.shape, 5.0, np.float32)
    raises("metric", kvpolicy.decode_attention_per_head, *args, update="squared")
    raises("update", kvpolicy.decode_attention_per_head, *args, update="cubed", metric=metric)
    raises("batch.layer", kvpolicy.decode_attention_per_head, *args, layer=2, out=out)
    raises("scale", kvpolicy.decode_attention_per_head, *args, scale=0.0, out=out)
    raises("queries", kvpolicy.decode_attention_per_head, q[0], *args[1:])
    raises("out", kvpolicy.decode_attention_per_head, *args, out=out[:1])
    raises("seqs", kvpolicy.decode_attention_per_head, *args, seqs=[0, 1, 2])
    e = raises("batch[1].seq", kvpolicy.decode_attention_per_head, *args, seqs=[0, 3], out=out)
    assert "3" in str(e)
    bad = case["tables"].copy()
    bad[0, 0, 0, 0] = 10_000
    raises("cache.table[layer 0][seq 0][head 0][0]", kvpolicy.decode_attention_per_head, q, case["k"], case["v"],
           bad, case["lengths"], seqs=[0, 1], out=out)
    raises("queries.num_heads", kvpolicy.decode_attention_per_head, _queries(rng, 2, 3, 8), *args[1:])
    assert np.all(out == 5.0) and np.array_equal(metric, case["metric"])  # nothing written
    pc = make_paged_case(lengths=(8, 4))
    cache, _ = pc.cache("nano_vllm")
    pq = _queries(rng, 2, 4, 16)
    raises("scores", kvpolicy.decode_attention, pq, cache, update="probability")
    raises("tail_from", kvpolicy.decode_attention, pq, cache, counts=np.zeros((2, 2, 2), np.int32))
    raises("counts", kvpolicy.decode_attention, pq, cache, counts=np.zeros((2, 2), np.int32),
           tail_from=np.zeros(2, np.int32))
    raises("cache", kvpolicy.decode_attention, pq, case)


def test_torch_ops_on_the_cpu():
    torch = pytest.importorskip("torch")
    import kvpolicy.torch_ops as ops

    rng = np.random.default_rng(9)
    case = make_per_head_case(L=2, seqs=3, H=2, b=4, d=8, seed=10)
    q = torch.from_numpy(_queries(rng, 2, 4, 8)).to(torch.bfloat16)
    t = {n: None if a is None else torch.from_numpy(a.copy()) for n, a in case.items()}
    k, v = t["k"].to(torch.bfloat16), t["v"].to(torch.bfloat16)
    seqs = torch.tensor([2, 0], dtype=torch.int32)
    r = ops.decode_attention_per_head(q, k, v, t["tables"], t["lengths"], layer=1, seqs=seqs, update="squared",
                                      metric=t["metric"])
    exact = {**case, "k": k.float().numpy(), "v": v.float().numpy()}
    want, want_metric = per_head_reference(exact, q.float().numpy(), 1, [2, 0], 1 / math.sqrt(8), "squared")
    assert r.out.dtype == torch.bfloat16 and r.status is None
    np.testing.assert_allclose(r.out.float().numpy(), want, rtol=1e-2, atol=1e-2)  # bf16 output
    np.testing.assert_allclose(t["metric"].numpy(), want_metric, rtol=1e-5, atol=1e-6)

    pc = make_paged_case(lengths=(8, 13), head_dim=16)
    cache_args = pc.tensors("nano_vllm")
    kv = torch.from_numpy(cache_args["kv"])
    pq = torch.from_numpy(_queries(rng, 2, 4, 16))
    r = ops.decode_attention(pq, "nano_vllm", kv=kv, block_table=torch.from_numpy(pc.block_table),
                             lengths=torch.from_numpy(pc.lengths), seqs=torch.tensor([1, 0], dtype=torch.int32))
    want, _ = paged_reference(pc, pq.numpy(), 0, [1, 0], 0.25)
    np.testing.assert_allclose(r.out.numpy(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# The CUDA path: the same results as the host path (skipped without a GPU)


def _device_case(torch, case, dtype):
    d = {n: None if a is None else torch.from_numpy(a.copy()).cuda() for n, a in case.items()}
    d["k"], d["v"] = d["k"].to(dtype), d["v"].to(dtype)
    return d


def _host_copy(d):
    return {n: None if a is None else a.cpu() for n, a in d.items()}


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("G", [1, 4, 5, 8])
@pytest.mark.parametrize("staged", [False, True])
def test_cuda_per_head_matches_host(dtype_name, d, G, staged):
    torch = _cuda()
    dtype = getattr(torch, dtype_name)
    lengths = np.random.default_rng(G + d).integers(0, 200, size=(2, 5, 2)).astype(np.int32)
    lengths[1, 3, 1] = 0  # a head that attends nothing
    lengths[1, 4, 0] = 640  # a long row: several splits
    case = make_per_head_case(L=2, seqs=5, H=2, b=16, d=d, max_blocks=40, shared=G % 2 == 0, seed=G + d,
                              positions=True, lengths=lengths)
    dev = _device_case(torch, case, dtype)
    host = _host_copy(dev)
    rng = np.random.default_rng(G)
    q = torch.from_numpy(_queries(rng, 4, 2 * G, d)).to(dtype)
    seqs = torch.tensor([4, 3, 0, 1], dtype=torch.int32)
    qpos = torch.tensor([700, 650, 640, 600], dtype=torch.int32)
    for update in (None, "squared", "probability"):
        m_dev, m_host = dev["metric"].clone(), host["metric"].clone()
        r = kvpolicy.decode_attention_per_head(q.cuda(), dev["k"], dev["v"], dev["tables"], dev["lengths"], layer=1,
                                               seqs=seqs.cuda(), update=update, metric=m_dev,
                                               positions=dev["positions"], excluded_distance=3,
                                               query_positions=qpos.cuda(), staged=staged)
        h = kvpolicy.decode_attention_per_head(q, host["k"], host["v"], host["tables"], host["lengths"], layer=1,
                                               seqs=seqs, update=update, metric=m_host,
                                               positions=host["positions"], excluded_distance=3,
                                               query_positions=qpos)
        torch.cuda.synchronize()
        assert r.out.is_cuda and r.out.dtype == dtype
        torch.testing.assert_close(r.out.cpu().float(), h.out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(m_dev.cpu(), m_host, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_counts", [False, True])
@pytest.mark.parametrize("with_live", [False, True])
def test_cuda_paged_matches_host(with_counts, with_live):
    torch = _cuda()
    pc = make_paged_case(layers=2, kv_heads=4, q_heads=16, head_dim=128, block_size=16, lengths=(700, 37, 0, 300),
                         seed=11)
    rng = np.random.default_rng(12)
    extra = {}
    if with_live:
        extra["live"] = (rng.random(pc.scores.shape) < 0.6).astype(np.uint8)
    args = pc.tensors("nano_vllm")
    counts = tail = None
    if with_counts:
        tail = np.array([650, 37, 0, 290], np.int32)
        counts = np.minimum(rng.integers(0, 400, size=(2, 4, 4)), tail[None, :, None]).astype(np.int32)

    def run(device):
        def on(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        kv = on(args["kv"]).to(torch.bfloat16)
        cache = kvpolicy.PagedCache("nano_vllm", kv, block_table=on(pc.block_table), lengths=on(pc.lengths),
                                    **{n: on(a) for n, a in extra.items()})
        scores = on(pc.scores)
        q = torch.from_numpy(_queries(np.random.default_rng(13), 3, 16, 128)).to(torch.bfloat16).to(device)
        r = kvpolicy.decode_attention(q, cache, layer=1, seqs=on(np.array([0, 3, 2], np.int32)),
                                      counts=None if counts is None else on(counts),
                                      tail_from=None if tail is None else on(tail), update="probability",
                                      scores=scores)
        return r.out.cpu().float(), scores.cpu()

    out_d, F_d = run("cuda")
    out_h, F_h = run("cpu")
    torch.testing.assert_close(out_d, out_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(F_d, F_h, rtol=1e-4, atol=1e-5)


def test_cuda_errors_from_the_device_and_describe():
    torch = _cuda()
    case = make_per_head_case(L=1, seqs=2, H=2, b=16, d=64, max_blocks=4, seed=14)
    dev = _device_case(torch, case, torch.bfloat16)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    args = (q, dev["k"], dev["v"], dev["tables"], dev["lengths"])
    raises("batch[1].seq", kvpolicy.decode_attention_per_head, *args,
           seqs=torch.tensor([0, 9], dtype=torch.int32, device="cuda"))
    small = _device_case(torch, make_per_head_case(L=1, seqs=2, H=2, b=16, d=16, seed=1), torch.bfloat16)
    raises("cache.head_dim", kvpolicy.decode_attention_per_head, torch.zeros(2, 4, 16, dtype=torch.bfloat16,
           device="cuda"), small["k"], small["v"], small["tables"], small["lengths"])
    # Host item values are copied to the cache's device (outside a graph capture): the same as device ones.
    on_host = kvpolicy.decode_attention_per_head(*args, seqs=[1, 0]).out
    on_device = kvpolicy.decode_attention_per_head(*args, seqs=torch.tensor([1, 0], dtype=torch.int32,
                                                                            device="cuda")).out
    assert torch.equal(on_host, on_device) and not torch.equal(on_host[0], on_host[1])
    plan = kvpolicy.decode_attention_per_head(*args, describe=True)
    assert "decode attention" in plan and "split" in plan
    # A workspace sized once serves every call; one too small is refused before a launch.
    need = kvpolicy.decode_attention_per_head_workspace_bytes(*args)
    metric_need = kvpolicy.decode_attention_per_head_workspace_bytes(*args, update="squared", metric=dev["metric"])
    assert 0 < need <= metric_need  # the metric's epilogue keeps the logits
    out = torch.full_like(q, 3.0)
    kvpolicy.decode_attention_per_head(*args, out=out, workspace=torch.empty(need, dtype=torch.uint8, device="cuda"))
    assert torch.equal(out, kvpolicy.decode_attention_per_head(*args).out)
    raises("workspace", kvpolicy.decode_attention_per_head, *args,
           workspace=torch.empty(need - 256, dtype=torch.uint8, device="cuda"))


def test_cuda_torch_op_in_a_graph():
    torch = _cuda()
    import kvpolicy.torch_ops as ops

    case = make_per_head_case(L=2, seqs=4, H=2, b=16, d=128, max_blocks=20, seed=15)
    dev = _device_case(torch, case, torch.bfloat16)
    host = _host_copy(dev)
    q = torch.randn(3, 8, 128, device="cuda").to(torch.bfloat16)
    seqs = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    metric = dev["metric"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up before the capture
        ops.decode_attention_per_head(q, dev["k"], dev["v"], dev["tables"], dev["lengths"], layer=1, seqs=seqs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = ops.decode_attention_per_head(q, dev["k"], dev["v"], dev["tables"], dev["lengths"], layer=1, seqs=seqs,
                                          update="squared", metric=metric)
    for new_seqs in ([0, 1, 2], [3, 3, 1]):
        seqs.copy_(torch.tensor(new_seqs))
        q.copy_(torch.randn(3, 8, 128).to(torch.bfloat16))
        metric.copy_(dev["metric"])
        graph.replay()
        torch.cuda.synchronize()
        r.check()
        m_host = host["metric"].clone()
        h = kvpolicy.decode_attention_per_head(q.cpu(), host["k"], host["v"], host["tables"], host["lengths"],
                                               layer=1, seqs=torch.tensor(new_seqs, dtype=torch.int32),
                                               update="squared", metric=m_host)
        torch.testing.assert_close(r.out.cpu().float(), h.out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(metric.cpu(), m_host, rtol=1e-4, atol=1e-5)
