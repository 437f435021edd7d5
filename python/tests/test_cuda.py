"""The CUDA path with PyTorch tensors: the same results as the host executor, errors
through the status, streams, workspaces, torch.compile and CUDA graph capture.
Skipped without a GPU, PyTorch with CUDA, or a kvpolicy built with CUDA
(python/scripts/gpu_check.sh runs them on the GPU machine)."""

import os
import warnings

import numpy as np
import pytest

# python/scripts/gpu_check.sh sets it: there, a test that cannot run is a failure.
REQUIRED = os.environ.get("KVPOLICY_REQUIRE_CUDA") == "1"
torch = pytest.importorskip("torch") if not REQUIRED else __import__("torch")

import kvpolicy  # noqa: E402
from checks import captured, check_moved, whole_sequence  # noqa: E402
from paged_case import make_case  # noqa: E402
from reference import token2chunk_keep  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not REQUIRED and not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not REQUIRED and not kvpolicy.has_cuda, reason="kvpolicy built without its CUDA path"),
]

PRESETS = [kvpolicy.Zipage, kvpolicy.RKV, kvpolicy.GKV, kvpolicy.SnapKV, kvpolicy.H2O, kvpolicy.StreamingLLM,
           kvpolicy.HardKV, kvpolicy.HardKVRKV]
LAYOUT = "vllm_flash"


class Twin:
    """One case as PyTorch tensors on `device`: cache, table, lengths, queries, F."""

    def __init__(self, case, device, dtype=torch.bfloat16, layout=LAYOUT):
        self.case, self.layout = case, layout

        def to(x, kind=dtype):  # a copy: twins never share memory with the case or each other
            return torch.from_numpy(np.array(x)).to(device=device, dtype=kind)

        self.args = {k: [to(x) for x in v] if isinstance(v, list) else to(v) for k, v in case.tensors(layout).items()}
        self.table = to(case.block_table, torch.int32)
        self.lengths = to(case.lengths, torch.int32)
        self.queries = to(case.queries)
        self.scores = to(case.scores, torch.float32)
        self.positions = to(case.positions, torch.int32)
        self.cache = kvpolicy.PagedCache(layout, **self.args, block_table=self.table, lengths=self.lengths,
                                         positions=self.positions)

    def canonical(self):
        return self.case.canonical(self.layout, {k: [x.float().cpu().numpy() for x in v] if isinstance(v, list)
                                                 else v.float().cpu().numpy() for k, v in self.args.items()})

    def compress(self, policy, **kw):
        return kvpolicy.compress(policy, self.cache, queries=self.queries, scores=self.scores, **kw)


def numpy_result(r):
    return type(r)(**{k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in vars(r).items()})


def near_tie_differences(host, device, tolerance=1e-3):
    """Keep-mask entries that differ between the two runs; each must be a near-tie: the
    token's host score within `tolerance` of its row's lowest kept score (fp32 rounding
    decides such a tie either way, as the library's own parity tests allow)."""
    masks_h, masks_d = host.keep_masks, device.keep_masks
    differ = np.argwhere(masks_h != masks_d)
    for i, l, h, t in differ:
        row = host.scores[i, l, h]
        boundary = row[masks_h[i, l, h] == 1].min()
        assert abs(row[t] - boundary) <= tolerance * max(1.0, abs(boundary)), (
            f"item {i} layer {l} head {h} token {t}: {row[t]} vs boundary {boundary}")
    return len(differ)


@pytest.mark.parametrize("cls", PRESETS)
def test_device_equals_host(cls):
    case = make_case(lengths=(64, 0, 57, 33), window=32, head_dim=64, block_size=16, seed=31)
    host, dev = Twin(case, "cpu"), Twin(case, "cuda")
    before = dev.canonical()
    kw = dict(seqs=[0, 2, 3], budgets=[40, 33, 32], return_masks=True, return_scores=True, max_tokens=64)
    rh = numpy_result(host.compress(cls(), **kw))
    rd = dev.compress(cls(), **kw)
    assert rd.new_lengths.is_cuda and rd.keep_masks.is_cuda
    rd = numpy_result(rd)
    np.testing.assert_array_equal(rd.new_lengths, rh.new_lengths)
    np.testing.assert_array_equal(rd.kept_counts, rh.kept_counts)
    np.testing.assert_array_equal(rd.released_counts, rh.released_counts)
    np.testing.assert_array_equal(rd.released_blocks, rh.released_blocks)
    check_moved(case, before, dev.canonical(), [0, 2, 3], case.lengths, rd, case.positions,
                dev.positions.cpu().numpy())
    if near_tie_differences(rh, rd) == 0:
        np.testing.assert_array_equal(dev.canonical(), host.canonical())
        np.testing.assert_allclose(dev.scores.cpu().numpy(), host.scores.cpu().numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("policy_cls", [kvpolicy.HardKV, kvpolicy.HardKVRKV])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cautious_update_device_equals_host(dtype, policy_cls):
    """HardKV and HardKVRKV (full redundancy over the held keys) over a live view
    (cautious update) in which heads dropped tokens before: the device keeps, moves and
    marks (live bytes) exactly what the host does."""
    case = make_case(lengths=(64, 0, 57, 48), window=32, head_dim=64, block_size=16, seed=35)
    live = np.zeros(case.positions.shape, dtype=np.uint8)
    b, rng = case.block_size, np.random.default_rng(5)
    for s, n in enumerate(case.lengths):
        for t in range(n):
            live[:, case.block_table[s, t // b], t % b, :] = 1
    for s in (0, 2, 3):  # each (layer, head) dropped a run of its own
        for l in range(live.shape[0]):
            for h in range(live.shape[3]):
                start = int(rng.integers(0, 20))
                for t in range(start, start + int(rng.integers(0, 12))):
                    live[l, case.block_table[s, t // b], t % b, h] = 0
    twins = []
    for device in ("cpu", "cuda"):
        twin = Twin(case, device, dtype)
        twin.live = torch.from_numpy(live.copy()).to(device)
        twin.cache = kvpolicy.PagedCache(LAYOUT, **twin.args, block_table=twin.table, lengths=twin.lengths,
                                         positions=twin.positions, live=twin.live)
        twins.append(twin)
    host, dev = twins
    policy = policy_cls(protect_window=8, p=0.7)
    kw = dict(seqs=[0, 2, 3], budgets=[40, 33, 32], return_masks=True, return_scores=True, max_tokens=64)
    rh = numpy_result(host.compress(policy, **kw))
    rd = numpy_result(dev.compress(policy, **kw))
    np.testing.assert_array_equal(rd.kept_counts, rh.kept_counts)
    np.testing.assert_array_equal(rd.new_lengths, rh.new_lengths)
    np.testing.assert_array_equal(rd.released_blocks, rh.released_blocks)
    assert not (rh.keep_masks.astype(bool) & (live_of(case, live, [0, 2, 3]) == 0)).any()  # dropped: never kept
    if near_tie_differences(rh, rd) == 0:
        np.testing.assert_array_equal(dev.canonical(), host.canonical())
        np.testing.assert_array_equal(dev.live.cpu().numpy(), host.live.numpy())
        np.testing.assert_array_equal(dev.positions.cpu().numpy(), host.positions.numpy())


def live_of(case, live, seqs):
    """The live bytes of each item's rows as [items, L, h, max_tokens] (0 past a length)."""
    b = case.block_size
    out = np.zeros((len(seqs), live.shape[0], live.shape[3], 64), dtype=np.uint8)
    for i, s in enumerate(seqs):
        for t in range(case.lengths[s]):
            out[i, :, :, t] = live[:, case.block_table[s, t // b], t % b, :]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kara_device_equals_host(dtype):
    """Kara's windows (window_begins, host ints and a device tensor): the 16-bit tensor-core
    scorer and the fp32 one against the host executor; masks over the window."""
    b, W, U = 16, 48, 8
    case = make_case(lengths=(100, 0, 77, 64), window=W, head_dim=64, block_size=b, seed=34)
    begins = [(int(case.lengths[s]) - 1) // b * b - W for s in (0, 2, 3)]  # 48, 16, 0
    host, dev = Twin(case, "cpu", dtype), Twin(case, "cuda", dtype)
    before = dev.canonical()
    policy = kvpolicy.Kara(window=W, buffer=U, gamma=6, alpha=8)
    kw = dict(seqs=[0, 2, 3], budgets=[20, 13, 40], return_masks=True, return_scores=True, max_tokens=112)
    rh = numpy_result(host.compress(policy, window_begins=begins, **kw))
    rd = numpy_result(dev.compress(policy, window_begins=torch.tensor(begins, device="cuda"), **kw))
    np.testing.assert_array_equal(rd.new_lengths, rh.new_lengths)
    np.testing.assert_array_equal(rd.kept_counts, rh.kept_counts)
    np.testing.assert_array_equal(rd.released_counts, rh.released_counts)
    np.testing.assert_array_equal(rd.released_blocks, rh.released_blocks)
    for i, s in enumerate((0, 2, 3)):  # nothing past each window's T - window_begin entries
        assert not rd.keep_masks[i, ..., int(case.lengths[s]) - begins[i] :].any()
    check_moved(case, before, dev.canonical(), [0, 2, 3], case.lengths,
                whole_sequence(rd, begins, case.lengths, [0, 2, 3]), case.positions, dev.positions.cpu().numpy())
    # Each row's selection is Token2Chunk's on the device's own scores, exactly; the scores
    # are the host's up to fp32 summation order. A near tie may pick other anchors (and
    # with them other chunks) than the host: the bytes are compared where none did.
    n = W - U
    for i, k in enumerate(kw["budgets"]):
        for l in range(case.num_layers):
            for h in range(2):  # make_case's two KV heads
                np.testing.assert_array_equal(rd.keep_masks[i, l, h, :n],
                                              token2chunk_keep(rd.scores[i, l, h, :n], k, 6, 8))
    np.testing.assert_allclose(rd.scores[..., :n], rh.scores[..., :n], rtol=1e-4, atol=1e-6)
    if np.array_equal(rd.keep_masks, rh.keep_masks):
        np.testing.assert_array_equal(dev.canonical(), host.canonical())
    with pytest.raises(kvpolicy.Error) as e:  # a window off a block boundary, found on the device
        Twin(case, "cuda", dtype).compress(policy, window_begins=torch.tensor([40], device="cuda"), seqs=[0],
                                           budgets=20)
    assert e.value.field == "batch[0].window_begin"


def test_device_validation_errors_raise_on_check_and_write_nothing():
    case = make_case(lengths=(40, 33), window=8, seed=32)
    dev = Twin(case, "cuda")
    before = dev.canonical()
    with pytest.raises(kvpolicy.Error) as e:  # lengths live on the device: checked there
        dev.compress(kvpolicy.SnapKV(window=8), seqs=[1], budgets=34)
    assert e.value.field == "batch[0].budget"
    r = dev.compress(kvpolicy.SnapKV(window=8), seqs=[0], budgets=20, history_tokens=41, check=False)
    assert r.status.is_cuda
    with pytest.raises(kvpolicy.Error) as e:
        r.check()
    assert e.value.field == "batch[0].history_tokens"
    np.testing.assert_array_equal(dev.canonical(), before)
    with pytest.raises(kvpolicy.Error) as e:  # shapes are checked on the host, before any launch
        dev.compress(kvpolicy.SnapKV(), seqs=[0], budgets=20)
    assert e.value.field == "queries.window"


def test_streams_and_workspace():
    case = make_case(lengths=(40, 33), window=8, seed=33)
    a, b, c = Twin(case, "cuda"), Twin(case, "cuda"), Twin(case, "cuda")
    policy = kvpolicy.SnapKV(window=8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the twins' copies to the device
    need = kvpolicy.workspace_bytes(policy, a.cache, num_items=2, queries=a.queries, return_masks=True)
    workspace = torch.empty(need, dtype=torch.uint8, device="cuda")
    ra = a.compress(policy, seqs=[0, 1], budgets=20, return_masks=True, stream=side, workspace=workspace)
    rb = b.compress(policy, seqs=[0, 1], budgets=20, return_masks=True, stream=side.cuda_stream)
    rc = c.compress(policy, seqs=torch.tensor([0, 1], device="cuda"), budgets=20, return_masks=True)
    assert torch.equal(ra.keep_masks, rb.keep_masks) and torch.equal(ra.keep_masks, rc.keep_masks)
    assert np.array_equal(a.canonical(), b.canonical()) and np.array_equal(a.canonical(), c.canonical())
    with pytest.raises(kvpolicy.Error) as e:
        c.compress(policy, seqs=[0, 1], budgets=20, workspace=workspace[: need // 2])
    assert e.value.field == "workspace"


def test_cuda_graph_capture_and_replay():
    case = make_case(lengths=(64, 57, 50), window=16, head_dim=64, block_size=16, seed=34)
    eager, graphed = Twin(case, "cuda"), Twin(case, "cuda")
    policy = kvpolicy.Zipage()
    seqs = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    budgets = torch.tensor([32, 24], dtype=torch.int32, device="cuda")
    want = eager.compress(policy, seqs=seqs, budgets=budgets, return_masks=True)

    warm = Twin(case, "cuda")  # the first call loads the kernels: outside the capture
    warm.compress(policy, seqs=seqs, budgets=32)
    torch.cuda.synchronize()
    before = graphed.canonical()
    # Device items and an int (a fill on the device): no host-to-device copy in the capture.
    graph, got = captured(lambda: graphed.compress(policy, seqs=seqs, budgets=budgets, history_tokens=0,
                                                   return_masks=True, check=False))
    torch.cuda.synchronize()
    assert np.array_equal(graphed.canonical(), before)  # captured, not run
    graph.replay()
    torch.cuda.synchronize()
    got.check()
    assert torch.equal(got.new_lengths, want.new_lengths) and torch.equal(got.keep_masks, want.keep_masks)
    assert np.array_equal(graphed.canonical(), eager.canonical())
    assert torch.equal(graphed.scores, eager.scores)

    # The items are read on the device at each replay: another batch, the same graph.
    seqs.copy_(torch.tensor([1, 0], dtype=torch.int32))
    budgets.copy_(torch.tensor([20, 16], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    got.check()
    assert got.new_lengths.tolist() == [20, 16]

    # All items on the host: kernel arguments, fixed at capture (no copy either).
    hosted = Twin(case, "cuda")
    graph, got = captured(lambda: hosted.compress(policy, seqs=[0, 2], budgets=[32, 24], return_masks=True,
                                                  check=False))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.check().new_lengths, want.new_lengths) and torch.equal(got.keep_masks, want.keep_masks)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")  # these captures stop before any work
        with pytest.raises(kvpolicy.Error) as e:  # a host list next to device items would need a copy
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                graphed.compress(policy, seqs=seqs, budgets=[32, 24], check=False)
        assert e.value.field == "budgets" and "device array" in str(e.value)
        with pytest.raises(kvpolicy.Error) as e:  # a check inside a capture would wait for the device
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                graphed.compress(policy, seqs=seqs, budgets=32)
        assert e.value.field == "check"


def test_items_are_built_on_the_call_stream():
    case = make_case(lengths=(40, 33), window=8, seed=38)
    a, b = Twin(case, "cuda"), Twin(case, "cuda")
    policy = kvpolicy.SnapKV(window=8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seqs = torch.tensor([0, 1], device="cuda")  # int64: cast on the device, on `side`
    ra = a.compress(policy, seqs=seqs, budgets=20, history_tokens=[0, 0], return_masks=True, stream=side)
    rb = b.compress(policy, seqs=[0, 1], budgets=20, return_masks=True)
    side.synchronize()
    assert torch.equal(ra.keep_masks, rb.keep_masks) and ra.new_lengths.tolist() == [20, 20]


def test_the_op_in_a_cuda_graph_and_under_torch_compile():
    import kvpolicy.torch_ops as ops

    case = make_case(lengths=(64, 57), window=16, head_dim=64, block_size=16, seed=35)
    eager, graphed, compiled = Twin(case, "cuda"), Twin(case, "cuda"), Twin(case, "cuda")
    spec = ops.policy_spec(kvpolicy.SnapKV(window=16))  # outside the compiled function: a string
    seqs = torch.tensor([0, 1], dtype=torch.int32, device="cuda")

    def step(t):
        r = ops.compress(spec, LAYOUT, kv=t.args["kv"], block_table=t.table, lengths=t.lengths, seqs=seqs,
                         budgets=40, queries=t.queries, positions=t.positions, return_masks=True)
        return r.new_lengths, r.keep_masks

    want_lengths, want_masks = step(eager)
    step(Twin(case, "cuda"))  # warm-up outside the capture
    torch.cuda.synchronize()
    graph, (lengths, masks) = captured(lambda: step(graphed))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lengths, want_lengths) and torch.equal(masks, want_masks)
    assert np.array_equal(graphed.canonical(), eager.canonical())

    torch._dynamo.reset()
    lengths, masks = torch.compile(step, backend="aot_eager", fullgraph=True)(compiled)
    assert torch.equal(lengths, want_lengths) and torch.equal(masks, want_masks)
    assert np.array_equal(compiled.canonical(), eager.canonical())


def to_numpy(x):
    return x.get() if hasattr(x, "get") else x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def test_cupy_arrays_in_and_out():
    cupy = pytest.importorskip("cupy")
    case = make_case(lengths=(48, 41), window=8, head_dim=64, block_size=16, seed=36, dtype=np.float16)
    host_case = make_case(lengths=(48, 41), window=8, head_dim=64, block_size=16, seed=36, dtype=np.float16)
    kv = cupy.asarray(case.tensors("nano_vllm")["kv"])
    before = case.canonical("nano_vllm", {"kv": kv.get()})
    cache = kvpolicy.PagedCache("nano_vllm", kv, block_table=cupy.asarray(case.block_table),
                                lengths=cupy.asarray(case.lengths))
    assert (cache.framework, cache.device) == ("cupy", 0)
    policy, kw = kvpolicy.SnapKV(window=8), dict(seqs=[0, 1], budgets=24, return_masks=True, return_scores=True)
    r = kvpolicy.compress(policy, cache, queries=cupy.asarray(case.queries), max_tokens=48, **kw)
    assert isinstance(r.new_lengths, cupy.ndarray)
    host_cache, host_args = host_case.cache("nano_vllm")
    rh = kvpolicy.compress(policy, host_cache, queries=host_case.queries, max_tokens=48, **kw)
    rd = type(r)(**{k: to_numpy(v) if v is not None and not isinstance(v, int) else v for k, v in vars(r).items()})
    np.testing.assert_array_equal(rd.new_lengths, rh.new_lengths)
    near_tie_differences(rh, rd)
    check_moved(case, before, case.canonical("nano_vllm", {"kv": kv.get()}), [0, 1], case.lengths, rd)


class Foreign:
    """A DLPack array of a framework kvpolicy does not know (it wraps a PyTorch tensor)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, **kw):
        return self.tensor.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_any_dlpack_framework_gets_results_it_can_import():
    case = make_case(lengths=(48, 41), window=8, head_dim=64, block_size=16, seed=37)
    dev, ref = Twin(case, "cuda"), Twin(case, "cuda")
    torch.cuda.synchronize()  # the fallback runs on stream 0
    cache = kvpolicy.PagedCache(LAYOUT, [Foreign(t) for t in dev.args["kv"]], block_table=Foreign(dev.table),
                                lengths=Foreign(dev.lengths))
    assert cache.framework == "test_cuda"
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[0, 1], budgets=24, queries=Foreign(dev.queries),
                          return_masks=True)  # results and workspace from cudaMallocAsync
    want = ref.compress(kvpolicy.SnapKV(window=8), seqs=[0, 1], budgets=24, return_masks=True)
    assert hasattr(r.keep_masks, "__dlpack__") and int(r.keep_masks.__dlpack_device__()[0]) == 2  # not a capsule
    assert torch.equal(torch.from_dlpack(r.keep_masks), want.keep_masks)
    assert torch.equal(torch.from_dlpack(r.new_lengths), want.new_lengths)
    assert torch.equal(torch.from_dlpack(r.new_lengths), want.new_lengths)  # exported again: a new capsule each time
    r.check()
    assert np.array_equal(dev.canonical(), ref.canonical())
