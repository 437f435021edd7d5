"""The transformers adapter's own attention (``Adapter(..., attention="torch" | "flashinfer" | "kvpolicy")``).

The torch backend runs everywhere (the CPU in CI), and so does kvpolicy's (its host reference
on the CPU, its CUDA kernel on a GPU); FlashInfer's only where a CUDA device and
flashinfer-python 0.7.2 are present (the GPU machine: scripts/gpu_wheels.sh install). Each is
held to the formula or to the torch backend on the same plan.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/common.sh installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/common.sh)")
if not transformers.__version__.startswith("5.17."):
    pytest.skip(f"transformers {transformers.__version__}: the adapter is tested with 5.17.x", allow_module_level=True)

import kvpolicy  # noqa: E402
from kvpolicy.integrations import paged_attention  # noqa: E402
from kvpolicy.integrations.paged_attention import KvpolicyPagedAttention, TorchPagedAttention  # noqa: E402
from kvpolicy.integrations.transformers import Adapter  # noqa: E402
from kvpolicy.integrations.triggers import Interval  # noqa: E402
from test_transformers_adapter import BLOCK, VOCAB, prompts, refused, run, small_window, tiny_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs  # noqa: E402

try:
    paged_attention.import_flashinfer()
    HAVE_FLASHINFER = torch.cuda.is_available()
except kvpolicy.Error:
    HAVE_FLASHINFER = False
HAVE_KVPOLICY_CUDA = torch.cuda.is_available() and kvpolicy.has_cuda
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER, reason="needs a CUDA device and flashinfer-python 0.7.2 "
                                      "(the GPU machine: scripts/gpu_wheels.sh install)")


def dense_reference(query, k_cache, v_cache, batch, b, scale, live=None):
    """Each request's query token t (position past + t) over its keys 0 .. past + t, one head at a time."""
    rows, h_q, d = query.shape
    h_kv = k_cache.shape[1]
    out = torch.zeros(rows, h_q, d, dtype=torch.float64)
    start = 0
    for blocks, past, q in batch:
        slots = [blocks[p // b] * b + p % b for p in range(past + q)]
        for t in range(q):
            for h in range(h_q):
                kv = h // (h_q // h_kv)
                cols = [s for s in slots[: past + t + 1] if live is None or live[s, kv]]
                logits = scale * k_cache[cols, kv].double() @ query[start + t, h].double()
                out[start + t, h] = torch.softmax(logits, 0) @ v_cache[cols, kv].double()
        start += q
    return out


def random_case(device, dtype, seed=0, h_q=8, h_kv=2, d=32, b=16, num_blocks=40):
    g = torch.Generator().manual_seed(seed)
    slots = (num_blocks + 2) * b
    k = torch.randn(slots, h_kv, d, generator=g).to(device, dtype)
    v = torch.randn(slots, h_kv, d, generator=g).to(device, dtype)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    # A decode, a prompt chunk after a cached prefix, a first chunk, a request ending on a block edge.
    shapes = [(37, 1), (20, 12), (0, 9), (31, 1)]
    batch = []
    for past, q in shapes:
        n = -(-(past + q) // b)
        batch.append((pool[:n], past, q))
        pool = pool[n:]
    rows = sum(q for _, _, q in batch) + 3  # padding rows, as the engine's padded forward has
    query = torch.randn(rows, h_q, d, generator=g).to(device, dtype)
    new_k = torch.randn(rows, h_kv, d, generator=g).to(device, dtype)
    new_v = torch.randn(rows, h_kv, d, generator=g).to(device, dtype)
    return dict(k=k, v=v, batch=batch, rows=rows, query=query, new_k=new_k, new_v=new_v, b=b,
                trash=(num_blocks + 1) * b, scale=d ** -0.5)


def run_backend(backend, case, live=None):
    backend.plan(case["batch"], case["rows"])
    k, v = case["k"].clone(), case["v"].clone()
    backend.write(k, v, case["new_k"], case["new_v"])
    return backend.run(case["query"], k, v, live), k, v


def test_torch_backend_equals_the_formula_with_and_without_a_live_mask():
    case = random_case("cpu", torch.float32)
    backend = TorchPagedAttention(case["b"], case["trash"], "cpu", case["scale"])
    out, k, v = run_backend(backend, case)
    tokens = sum(q for _, _, q in case["batch"])
    # The new K/V sit in their slots; padding rows went to the trash block; no other byte changed.
    cursor = 0
    written = set()
    for blocks, past, q in case["batch"]:
        for t in range(q):
            s = blocks[(past + t) // case["b"]] * case["b"] + (past + t) % case["b"]
            assert torch.equal(k[s], case["new_k"][cursor + t]) and torch.equal(v[s], case["new_v"][cursor + t])
            written.add(s)
        cursor += q
    untouched = [s for s in range(k.shape[0]) if s not in written and s < case["trash"]]
    assert torch.equal(k[untouched], case["k"][untouched]) and torch.equal(v[untouched], case["v"][untouched])
    expected = dense_reference(case["query"], k, v, case["batch"], case["b"], case["scale"])
    torch.testing.assert_close(out[:tokens].double(), expected[:tokens], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))

    g = torch.Generator().manual_seed(5)
    live = (torch.rand(k.shape[0], k.shape[1], generator=g) > 0.4).to(torch.uint8)
    for blocks, past, q in case["batch"]:  # every query's own token is held (the engine just wrote it)
        for t in range(past, past + q):
            live[blocks[t // case["b"]] * case["b"] + t % case["b"]] = 1
    out = backend.run(case["query"], k, v, live)
    expected = dense_reference(case["query"], k, v, case["batch"], case["b"], case["scale"], live)
    torch.testing.assert_close(out[:tokens].double(), expected[:tokens], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_only", [False, True])
def test_kvpolicy_backend_equals_the_formula_with_and_without_a_live_mask(decode_only):
    """kvpolicy's decode attention for one-token requests (the host reference on the CPU), the torch
    SDPA for prompt chunks; the dropped slots of a live mask are not read."""
    case = random_case("cpu", torch.float32, seed=3)
    if decode_only:
        case["batch"] = [(blocks, past + q - 1, 1) for blocks, past, q in case["batch"]]
        case["rows"] = len(case["batch"])
    backend = KvpolicyPagedAttention(case["b"], case["trash"], "cpu", case["scale"])
    tokens = sum(q for _, _, q in case["batch"])
    g = torch.Generator().manual_seed(6)
    for live in (None, (torch.rand(case["k"].shape[0], case["k"].shape[1], generator=g) > 0.4).to(torch.uint8)):
        backend.plan(case["batch"], case["rows"])
        k, v = case["k"].clone(), case["v"].clone()
        backend.write(k, v, case["new_k"][: case["rows"]], case["new_v"][: case["rows"]])
        if live is not None:
            live.index_fill_(0, backend.slots, 1)  # the new tokens are held, as the adapter marks them
        out = backend.run(case["query"][: case["rows"]], k, v, live)
        expected = dense_reference(case["query"], k, v, case["batch"], case["b"], case["scale"], live)
        torch.testing.assert_close(out[:tokens].double(), expected[:tokens], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))
        assert (backend.decoding == tokens) == decode_only


@pytest.mark.skipif(not HAVE_KVPOLICY_CUDA, reason="needs a CUDA device and kvpolicy's CUDA path")
def test_kvpolicy_backend_on_cuda_equals_the_torch_backend():
    case = random_case("cuda", torch.bfloat16, seed=4, h_q=32, h_kv=8, d=128, b=16)
    g = torch.Generator().manual_seed(7)
    live = (torch.rand(case["k"].shape[0], 8, generator=g) > 0.3).to(torch.uint8).cuda()
    ours = KvpolicyPagedAttention(case["b"], case["trash"], "cuda", case["scale"])
    ref = TorchPagedAttention(case["b"], case["trash"], "cuda", case["scale"])
    for backend in (ours, ref):
        backend.plan(case["batch"], case["rows"])
    k, v = case["k"].clone(), case["v"].clone()
    ours.write(k, v, case["new_k"], case["new_v"])
    live.index_fill_(0, ours.slots, 1)
    out = ours.run(case["query"], k, v, live)
    expected = ref.run(case["query"].float(), k.float(), v.float(), live)
    ours.check()  # the device status of the step's calls: no error
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@needs_flashinfer
@pytest.mark.parametrize("decode_only", [False, True])
def test_flashinfer_backend_equals_the_torch_backend(decode_only):
    case = random_case("cuda", torch.bfloat16, seed=2, h_q=32, h_kv=8, d=128, b=16)
    if decode_only:
        case["batch"] = [(blocks, past + q - 1, 1) for blocks, past, q in case["batch"]]
        case["rows"] = len(case["batch"]) + 2
        for name in ("query", "new_k", "new_v"):
            case[name] = case[name][: case["rows"]]
    h_q, h_kv, d = 32, 8, 128
    fi = paged_attention.FlashInferPagedAttention(case["b"], case["trash"], "cuda", case["scale"], h_q, h_kv, d,
                                                  torch.bfloat16)
    ref = TorchPagedAttention(case["b"], case["trash"], "cuda", case["scale"])
    out, k, v = run_backend(fi, case)
    expected, k_ref, v_ref = run_backend(ref, case)
    assert (fi.wrapper is fi.decode) == decode_only
    # Every slot but the trash block (padding rows all write there, in no set order) holds the same bytes.
    trash = slice(case["trash"], case["trash"] + case["b"])
    k[trash], v[trash], k_ref[trash], v_ref[trash] = 0, 0, 0, 0
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


class Calls:
    """What the engine handed the forward each step, and how often each backend ran."""

    def __init__(self, monkeypatch):
        self.steps, self.runs = [], {"torch": 0, "flashinfer": 0, "kvpolicy": 0}
        shipped = ContinuousBatchingIOs.get_model_kwargs

        def get_model_kwargs(io, use_padding=False):
            kwargs = shipped(io, use_padding)
            self.steps.append(dict(decode_only=all(fs.query_length == 1 for fs in io.requests_in_batch),
                                   fast_path=kwargs["block_table"] is not None,
                                   mask=kwargs["attention_mask"] is not None,
                                   read=sum(int(r.numel()) for r in kwargs["read_index"])))
            return kwargs

        monkeypatch.setattr(ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)
        for cls in (TorchPagedAttention, paged_attention.FlashInferPagedAttention, KvpolicyPagedAttention):
            monkeypatch.setattr(cls, "run", self._counting(cls.run, cls.name))

    def _counting(self, run, name):
        def counted(backend, *args, **kwargs):
            self.runs[name] += 1
            return run(backend, *args, **kwargs)
        return counted


def attentions():
    """(attention, device): every backend on the CPU where it runs there, and on CUDA where it can."""
    return ([("torch", "cpu"), ("kvpolicy", "cpu")] + ([("flashinfer", "cuda")] if HAVE_FLASHINFER else [])
            + ([("kvpolicy", "cuda")] if HAVE_KVPOLICY_CUDA else []))


@pytest.mark.parametrize("attention,device", attentions())
def test_engine_with_the_adapters_attention_gives_the_engines_tokens(attention, device, monkeypatch):
    if device == "cuda":  # the CUDA kernels take head dim 64 (and others), bf16
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
        model.set_attn_implementation("sdpa")
    else:
        model = tiny_model(device)
    inputs = prompts()
    alone = run(model, inputs, 40)
    calls = Calls(monkeypatch)
    errors = []
    if device == "cuda":
        # Each layer's attention beside the torch backend's over the same plan and cache, in fp32.
        fi = paged_attention.FlashInferPagedAttention if attention == "flashinfer" else KvpolicyPagedAttention
        plan, run_fi = fi.plan, fi.run

        def plan_both(backend, batch, rows):
            plan(backend, batch, rows)
            backend.reference = TorchPagedAttention(backend.block_size, backend.trash_slot, backend.device,
                                                    backend.scale)
            backend.reference.plan(batch, rows)

        def run_both(backend, query, k_cache, v_cache, live=None):
            out = run_fi(backend, query, k_cache, v_cache, live)
            ref = backend.reference.run(query.float(), k_cache.float(), v_cache.float())
            errors.append(float((out.float() - ref).abs().max()))
            return out

        monkeypatch.setattr(fi, "plan", plan_both)
        monkeypatch.setattr(fi, "run", run_both)
    watched = Adapter(None, attention=attention)
    out = run(model, inputs, 40, watched)
    layers = model.config.num_hidden_layers
    assert watched.stats.steps == len(calls.steps) and calls.runs[attention] == layers * len(calls.steps)
    # Decode-only steps took the engine's fast path (no read indices); no step built the mask.
    decode = [s for s in calls.steps if s["decode_only"]]
    assert decode and all(s["fast_path"] and s["read"] == 0 for s in decode)
    assert not any(s["mask"] for s in calls.steps)
    tokens = {k: o.generated_tokens for k, o in out.items()}
    expected = {k: o.generated_tokens for k, o in alone.items()}
    if device == "cpu":
        assert tokens == expected
    else:
        # bf16 tokens of a random model flip at near ties under any change of summation order, so the
        # check is each attention call against fp32 over the same cache (decode and prefill steps).
        assert len(errors) == layers * len(calls.steps) and max(errors) < 2e-2, max(errors)
    # Detached: the engine runs as shipped again (its mask and slow path back).
    calls.steps.clear()
    again = run(model, inputs, 40)
    assert {k: o.generated_tokens for k, o in again.items()} == expected
    assert all(s["mask"] and not s["fast_path"] for s in calls.steps)


@pytest.mark.parametrize("name", ["snapkv", "zipage", "streaming_llm", "hard_kv"])
def test_compression_gives_the_same_tokens_with_either_attention(name, monkeypatch):
    """The adapter's attention reads exactly the tokens the engine's would: after compressions too."""
    calls = Calls(monkeypatch)
    model = tiny_model()
    inputs = prompts(count=4)
    outs = {}
    for attention in ("engine", "torch", "kvpolicy"):
        calls.runs = dict.fromkeys(calls.runs, 0)
        trigger = Interval(budget=48, period=16) if name == "hard_kv" else None
        adapter = Adapter(small_window(name), budget=None if trigger else 32, trigger=trigger, attention=attention)
        outs[attention] = run(model, inputs, 70, adapter, num_blocks=48)
        assert adapter.stats.compressions > 0 and adapter.stats.tokens_evicted > 0
        assert (calls.runs["torch"] > 0) == (attention == "torch")
        assert (calls.runs["kvpolicy"] > 0) == (attention == "kvpolicy")
    tokens = {a: {k: o.generated_tokens for k, o in out.items()} for a, out in outs.items()}
    assert tokens["torch"] == tokens["engine"] and tokens["kvpolicy"] == tokens["engine"]


@pytest.mark.skipif(not HAVE_KVPOLICY_CUDA, reason="needs a CUDA device and kvpolicy's CUDA path")
def test_kvpolicy_attention_refuses_models_its_kernel_cannot_run_at_attach():
    from test_transformers_adapter import manager_with

    refused("attention", lambda: Adapter(None, attention="kvpolicy").attach(manager_with(tiny_model("cuda"))),
            "dtype")
    cuda16 = tiny_model("cuda").to(torch.bfloat16)
    refused("attention", lambda: Adapter(None, attention="kvpolicy").attach(manager_with(cuda16)), "head dim is 16")


def test_refused_attention_arguments():
    refused("attention", lambda: Adapter(None, attention="sdpa"), "expected one of")
    refused("attention", lambda: Adapter(kvpolicy.HardKV(), budget=64, attention="flashinfer"), "per KV head")
    if not HAVE_FLASHINFER:
        try:
            paged_attention.import_flashinfer()
        except kvpolicy.Error as e:
            assert e.field == "attention"
        else:  # flashinfer imports but no device: the backend refuses the CPU
            refused("device", lambda: paged_attention.FlashInferPagedAttention(16, 0, "cpu", 1.0, 4, 2, 16,
                                                                                torch.float32))
    backend = TorchPagedAttention(BLOCK, 0, "cpu", 1.0)
    refused("rows", lambda: backend.plan([([0, 1], 10, 8)], 4), "8 query tokens")


@needs_flashinfer
def test_flashinfer_refuses_models_it_cannot_run_at_attach():
    from test_transformers_adapter import manager_with

    cpu = tiny_model()  # on the CPU, float32, head dim 16: each refused in turn
    refused("attention", lambda: Adapter(None, attention="flashinfer").attach(manager_with(cpu)), "CUDA")
    cuda32 = tiny_model("cuda")
    refused("attention", lambda: Adapter(None, attention="flashinfer").attach(manager_with(cuda32)), "dtype")
    cuda16 = tiny_model("cuda").to(torch.bfloat16)
    refused("attention", lambda: Adapter(None, attention="flashinfer").attach(manager_with(cuda16)), "head dim is 16")
