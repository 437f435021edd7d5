"""kvpolicy.integrations.transformers: the adapter inside transformers' continuous batching.

A tiny random Llama runs ``generate_batch`` (the engine's own loop, scheduler and paged
cache) on the CPU, and on CUDA where a device is present. PyTorch and transformers 5.17 are
installed by scripts/common.sh for CI (torch's wheel with its CUDA libraries: about 90 s);
without them these tests skip, saying why.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/common.sh installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/common.sh)")
if not transformers.__version__.startswith("5.17."):
    pytest.skip(f"transformers {transformers.__version__}: the adapter is tested with 5.17.x", allow_module_level=True)

import kvpolicy  # noqa: E402
from kvpolicy.integrations import transformers as adapter_module  # noqa: E402
from kvpolicy.integrations.transformers import Adapter, check_version  # noqa: E402
from kvpolicy.integrations.triggers import Buffer, Interval, SequenceState, Threshold, default_trigger  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kvpolicy.has_cuda else [])
BLOCK = 16
VOCAB = 97


def tiny_model(device="cpu", **overrides):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         **overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("sdpa")
    return model


def cb_config(num_blocks=64, **overrides):
    kwargs = dict(block_size=BLOCK, num_blocks=num_blocks, max_batch_tokens=256, allow_block_sharing=False,
                  use_cuda_graph=False, use_async_batching=False)
    kwargs.update(overrides)
    return ContinuousBatchingConfig(**kwargs)


def prompts(count=6, low=20, high=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in lengths]


def run(model, inputs, new_tokens, adapter=None, num_blocks=64, block_size=BLOCK):
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = cb_config(num_blocks, block_size=block_size)
    if adapter is None:
        out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
    else:
        with adapter.attach(model):
            out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
    assert len(out) == len(inputs)
    for o in out.values():
        assert o.error is None, o.error
        assert len(o.generated_tokens) == new_tokens
    return out


def small_window(name):
    # Windows that fit the tiny prompts (the defaults' 16 or 32 queries would too, but leave less to drop).
    return kvpolicy.preset(name) if name == "streaming_llm" else kvpolicy.preset(name, window=8)


class Recorder:
    """Every forward's batch as the model sees it: request ids, query lengths, position ids,
    key lengths, and the block tables at that moment (ContinuousBatchingIOs.get_model_kwargs)."""

    def __init__(self, monkeypatch):
        self.steps = []
        shipped = ContinuousBatchingIOs.get_model_kwargs
        recorder = self

        def get_model_kwargs(io, use_padding=False):
            kwargs = shipped(io, use_padding)
            n = len(io.requests_in_batch)
            cu_k = kwargs["cu_seq_lens_k"].tolist()
            recorder.steps.append(dict(
                requests=[(fs.state.request_id, fs.query_length) for fs in io.requests_in_batch],
                positions=kwargs["position_ids"][0].tolist(),
                key_lengths=[cu_k[i + 1] - cu_k[i] for i in range(n)],
                tables={rid: list(blocks) for rid, blocks in io.cache.group_cache_managers[0].block_table.items()}))
            return kwargs

        monkeypatch.setattr(ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)

    def positions(self):
        """Per request, the position ids of each of its tokens, in processing order."""
        out = {}
        for step in self.steps:
            cursor = 0
            for rid, q in step["requests"]:
                out.setdefault(rid, []).extend(step["positions"][cursor:cursor + q])
                cursor += q
        return out

    def key_lengths(self):
        out = {}
        for step in self.steps:
            for (rid, _), k in zip(step["requests"], step["key_lengths"]):
                out.setdefault(rid, []).append(k)
        return out


# -- the triggers ---------------------------------------------------------------------------


def test_triggers_follow_the_cpp_rules():
    s = SequenceState(length=48)
    t = Threshold(block_size=16, max_blocks=3)
    assert t.due(s, 1) and t.budget_of(s) == 32
    assert not t.due(SequenceState(length=47), 1) and not t.due(SequenceState(length=49), 1)
    b = Buffer(budget=40, size=4)
    s = SequenceState(length=60)
    assert not b.due(s, 1)
    s.append(4)
    assert b.due(s, 1) and b.budget_of(s) == 40
    s.record_compression(40, 2)
    assert s.history_tokens == 40 and s.generated_since_compression == 0 and not b.due(s, 3)
    i = Interval(budget=50, period=8, min_length=10)
    assert i.due(SequenceState(length=11), 16) and not i.due(SequenceState(length=11), 15)
    assert not i.due(SequenceState(length=10), 16) and i.budget_of(SequenceState(length=30)) == 30
    assert default_trigger("snapkv", 64, 16) == Threshold(block_size=16, max_blocks=5)
    assert default_trigger("rkv", 70, 16) == Buffer(budget=70)
    assert default_trigger("hard_kv", 70, 16) == Interval(budget=70)
    with pytest.raises(kvpolicy.Error, match="multiple of the block size 16") as e:
        default_trigger("zipage", 70, 16)
    assert e.value.field == "budget"
    with pytest.raises(kvpolicy.Error, match="at least 2"):
        Threshold(block_size=16, max_blocks=1).validate()


# -- identity: nothing due, nothing changed ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_identical_when_the_budget_covers_every_length(device):
    model = tiny_model(device)
    inputs = prompts()
    alone = run(model, inputs, 40)
    big = 128  # every request ends below 50 + 40 tokens
    for name in ("zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm", "hard_kv", "hard_kv_rkv"):
        trigger = Interval(budget=big, min_length=big) if name.startswith("hard_kv") else None
        adapter = Adapter(small_window(name), budget=None if trigger else big, trigger=trigger)
        out = run(model, inputs, 40, adapter)
        assert adapter.stats.compressions == 0 and adapter.stats.steps > 0
        tokens = {k: o.generated_tokens for k, o in out.items()}
        assert tokens == {k: o.generated_tokens for k, o in alone.items()}, name
    # Detached: the shipped attention functions are back.
    from transformers.modeling_utils import AttentionInterface
    for name in adapter_module.WRAPPED_ATTENTION:
        assert not hasattr(AttentionInterface._global_mapping[name], "__wrapped__")


# -- compression: blocks, positions, bytes ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_compression_frees_blocks_that_later_requests_reuse(device, monkeypatch):
    model = tiny_model(device)
    inputs = prompts(count=10)
    watcher = Adapter(None)
    run(model, inputs, 120, watcher, num_blocks=40)
    freed_by = {}  # block -> request whose compression returned it
    shipped = adapter_module._Run._compress

    def compress(self, due):
        before = {rec.state.request_id: list(self.manager_of_blocks.block_table[rec.state.request_id]) for rec in due}
        shipped(self, due)
        for rid, blocks in before.items():
            for block in set(blocks) - set(self.manager_of_blocks.block_table[rid]):
                freed_by[block] = rid

    monkeypatch.setattr(adapter_module._Run, "_compress", compress)
    recorder = Recorder(monkeypatch)
    adapter = Adapter(small_window("snapkv"), budget=32)
    run(model, inputs, 120, adapter, num_blocks=40)
    s = adapter.stats
    assert s.compressions > 0 and s.blocks_freed >= len(freed_by) > 0
    # Freed blocks went back to the engine, which handed them to other requests.
    reused = {block for step in recorder.steps for rid, blocks in step["tables"].items() for block in blocks
              if block in freed_by and rid != freed_by[block]}
    assert reused
    # More requests ran at once in the same pool, and the pool's peak is lower per request.
    assert s.mean_running_requests > watcher.stats.mean_running_requests
    assert s.peak_blocks <= 40


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["snapkv", "rkv", "hard_kv"])
def test_positions_stay_logical_while_the_cache_shrinks(device, name, monkeypatch):
    model = tiny_model(device)
    inputs = prompts(count=4)
    recorder = Recorder(monkeypatch)
    trigger = Interval(budget=32, period=24) if name == "hard_kv" else Buffer(budget=32, size=16)
    adapter = Adapter(small_window(name), trigger=trigger)
    out = run(model, inputs, 80, adapter, num_blocks=64)
    assert adapter.stats.compressions > 0
    prompt_len = {k: len(o.prompt_ids) for k, o in out.items()}
    positions, key_lengths = recorder.positions(), recorder.key_lengths()
    for rid, seen in positions.items():
        # Each token once, at its logical position: the prompt, then every generated token but the last.
        assert seen == list(range(prompt_len[rid] + 80 - 1)), rid
    # The keys read are the physical length: shorter than the logical one once compressed.
    shorter = [rid for rid, lengths in key_lengths.items() if lengths[-1] < prompt_len[rid] + 80 - 1]
    assert shorter


def test_a_request_the_engine_resets_starts_again_from_position_zero(monkeypatch):
    # A pool too small for the requests between compressions: the engine soft-resets a starved
    # request (re-prefills its prompt and generated tokens); the adapter forgets its shift.
    model = tiny_model()
    recorder = Recorder(monkeypatch)
    compressed = set()
    shipped = adapter_module._Run._compress

    def compress(self, due):
        shipped(self, due)
        compressed.update(rec.state.request_id for rec in due if rec.delta > 0)

    monkeypatch.setattr(adapter_module._Run, "_compress", compress)
    adapter = Adapter(small_window("snapkv"), trigger=Buffer(budget=32, size=48))
    out = run(model, prompts(count=4, low=30, high=40), 90, adapter, num_blocks=16)
    assert adapter.stats.compressions > 0
    restarted = set()
    for rid, seen in recorder.positions().items():
        starts = [i for i, p in enumerate(seen) if p == 0] + [len(seen)]
        segments = [seen[a:b] for a, b in zip(starts, starts[1:])]
        for segment in segments:
            assert segment == list(range(len(segment))), rid
        assert segments[-1][-1] == len(out[rid].prompt_ids) + 90 - 2, rid
        if len(segments) > 1:
            restarted.add(rid)
    assert restarted & compressed  # a request compressed (shifted), reset, and right again


def test_streaming_llm_keeps_the_sinks_and_the_newest_tokens(monkeypatch):
    model = tiny_model()
    policy = kvpolicy.StreamingLLM(sinks=4, window=16)
    checked = []
    shipped = adapter_module._Run._compress

    def rows(run, rid, length):
        b = run.block_size
        blocks = run.manager_of_blocks.block_table[rid]
        return torch.stack([run.k[0][blocks[t // b], t % b] for t in range(length)]).clone()

    def compress(self, due):
        before = {rec.state.request_id: (rec.seq.length, rows(self, rec.state.request_id, rec.seq.length))
                  for rec in due}
        shipped(self, due)
        for rec in due:
            rid = rec.state.request_id
            length, old = before[rid]
            new = rec.seq.length
            assert rec.state.position_offset == new and new < length
            kept = rows(self, rid, new)
            assert torch.equal(kept[:4], old[:4])  # the sinks
            assert torch.equal(kept[4:], old[length - (new - 4):])  # the newest tokens, in order
            checked.append(rid)

    monkeypatch.setattr(adapter_module._Run, "_compress", compress)
    run(model, prompts(count=3), 60, Adapter(policy, budget=32))
    assert checked


def test_hard_kv_drops_tokens_per_head_and_attention_skips_them():
    model = tiny_model()
    # Counts from calibrated top-p alone (no union with the budget's top-k): half the attention mass
    # takes a different number of tokens in each head of the random model.
    adapter = Adapter(kvpolicy.HardKV(window=8, p=0.5, union_top_k=False), trigger=Interval(budget=48, period=16))
    seen = []
    shipped = adapter_module._Run._compress

    def compress(self, due):
        shipped(self, due)
        b = self.block_size
        for rec in due:
            blocks = self.manager_of_blocks.block_table[rec.state.request_id]
            live = torch.stack([self.live[:, blocks[t // b], t % b] for t in range(rec.seq.length)], dim=1)
            seen.append(live)  # [layers, length, kv heads]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(adapter_module._Run, "_compress", compress)
        run(model, prompts(count=3), 60, adapter)
    assert adapter.stats.compressions > 0 and seen
    # Heads keep different counts: some slots below the length are dropped for one head only.
    assert any(bool((live == 0).any()) and bool((live == 1).any()) for live in seen)


def test_hard_kv_holds_at_most_its_budget():
    """The trigger's budget is Hard-KV's L_upper: no head keeps more, so no request holds more
    (the preset's own upper, 2048, would let the calibrated top-p sets keep whole rows)."""
    model = tiny_model()
    adapter = Adapter(kvpolicy.HardKV(window=8), trigger=Interval(budget=48, period=16))
    lengths = []
    shipped = adapter_module._Run._compress

    def compress(self, due):
        shipped(self, due)
        lengths.extend(rec.seq.length for rec in due)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(adapter_module._Run, "_compress", compress)
        run(model, prompts(count=3), 60, adapter)
    assert lengths and max(lengths) <= 48, lengths
    assert adapter.stats.tokens_evicted > 0


def test_masked_attention_equals_attention_over_each_heads_held_keys():
    torch.manual_seed(3)
    h_q, h_kv, d, q_len, keys = 4, 2, 8, 3, 10
    query = torch.randn(1, h_q, q_len, d)
    k, v = torch.randn(keys, h_kv, d), torch.randn(keys, h_kv, d)
    held = torch.rand(keys, h_kv) > 0.3
    held[0] = True
    mask = torch.zeros(1, 1, q_len, keys)
    mask[..., 7:] = torch.finfo(torch.float32).min  # the engine's mask: the last keys belong to no query
    live = torch.zeros(1, keys + 4, 1, h_kv, dtype=torch.uint8)
    read = torch.arange(keys)
    live[0, :keys, 0] = held.to(torch.uint8)
    write = torch.tensor([keys + 2])  # a write marks its row held for every head
    cache = types.SimpleNamespace(update=lambda **_: (k, v))
    fake = types.SimpleNamespace(live=live, cache=types.SimpleNamespace(num_key_value_heads=h_kv))
    module = types.SimpleNamespace(layer_idx=0)
    out, _ = adapter_module._Run._attention_over_live(fake, module, query, None, None, mask, cache=cache,
                                                      read_index=[read], write_index=[write], scaling=0.5)
    assert bool((live[0, keys + 2, 0] == 1).all())
    group = h_q // h_kv
    for h in range(h_q):
        kv = h // group
        cols = [j for j in range(7) if held[j, kv]]
        logits = 0.5 * query[0, h] @ k[cols, kv].T
        expected = torch.softmax(logits, dim=-1) @ v[cols, kv]
        torch.testing.assert_close(out[0, :, h], expected)


@pytest.mark.parametrize("name", ["zipage", "gkv", "h2o"])
def test_presets_with_a_global_score_run_to_the_end(name):
    model = tiny_model()
    trigger = Buffer(budget=32, size=16) if name == "gkv" else None  # G-KV's own: every 128 tokens
    adapter = Adapter(small_window(name), budget=None if trigger else 32, trigger=trigger)
    run(model, prompts(count=4), 70, adapter, num_blocks=48)
    assert adapter.stats.compressions > 0 and adapter.stats.blocks_freed > 0


# -- refusals ---------------------------------------------------------------------------------


def refused(field, fn, match=None):
    with pytest.raises(kvpolicy.Error, match=match) as e:
        fn()
    assert e.value.field == field, (e.value.field, str(e.value))
    return str(e.value)


def test_refused_presets_and_arguments():
    refused("attention", lambda: Adapter(kvpolicy.KVCompress(), budget=64), "attention='kvpolicy'")
    refused("policy", lambda: Adapter(kvpolicy.Kara(), budget=64), "newest queries")
    refused("budget", lambda: Adapter(kvpolicy.SnapKV()), "pass budget=")
    refused("max_requests", lambda: Adapter(kvpolicy.SnapKV(), budget=64, max_requests=0))
    refused("target", lambda: Adapter(kvpolicy.SnapKV(), budget=64).attach(object()))
    check_version("5.17.4")
    refused("transformers", lambda: check_version("5.18.0"), "not tested")


def manager_with(model, cb=None, **gen):
    gen.setdefault("do_sample", gen.get("num_return_sequences", 1) > 1)  # greedy refuses several sequences
    config = GenerationConfig(max_new_tokens=4, eos_token_id=-1, pad_token_id=0, **gen)
    return model.init_continuous_batching(generation_config=config, continuous_batching_config=cb or cb_config())


def test_refused_engine_configurations():
    model = tiny_model()
    snap = Adapter(kvpolicy.SnapKV(window=8), budget=32)
    refused("allow_block_sharing", lambda: snap.attach(manager_with(model, ContinuousBatchingConfig(block_size=16))))
    refused("use_async_batching", lambda: snap.attach(manager_with(model, cb_config(use_async_batching=True))))
    refused("cpu_offload_space", lambda: snap.attach(manager_with(model, cb_config(cpu_offload_space=1.0))))
    refused("num_return_sequences", lambda: snap.attach(manager_with(model, num_return_sequences=2)))
    m = manager_with(model)
    m.continuous_batching_config.use_cuda_graph = (True, True)  # the CPU resolves it off: set it as CUDA would
    refused("use_cuda_graph", lambda: snap.attach(m))
    m = manager_with(model)
    m.continuous_batching_config.varlen_compile_config = transformers.CompileConfig()
    refused("compile", lambda: snap.attach(m))
    refused("budget", lambda: Adapter(kvpolicy.SnapKV(window=8), budget=40).attach(manager_with(model)),
            "multiple of the block size")
    refused("budget", lambda: Adapter(kvpolicy.SnapKV(), budget=16).attach(manager_with(model)), "protected")
    m = manager_with(model)
    m.distributed_helper = types.SimpleNamespace(tp_size=2)
    refused("tensor_parallel", lambda: snap.attach(m))
    m = manager_with(model)
    m.model = types.SimpleNamespace(config=model.config, device=model.device)
    original = model.config._attn_implementation
    try:
        model.config._attn_implementation = "paged|flash_attention_2"
        refused("attn_implementation", lambda: snap.attach(m), "paged.sdpa")
    finally:
        model.config._attn_implementation = original
    sliding = tiny_model()
    sliding.config.sliding_window = 32
    refused("model.config", lambda: snap.attach(sliding), "sliding-window")
    assert not snap._managers  # nothing was attached by a refused call


def test_refused_second_adapter():
    model = tiny_model()
    first = Adapter(kvpolicy.SnapKV(window=8), budget=32)
    manager = manager_with(model)
    first.attach(manager)
    refused("manager", lambda: Adapter(kvpolicy.Zipage(window=8), budget=32).attach(manager), "already")
    first.detach()
    Adapter(kvpolicy.Zipage(window=8), budget=32).attach(manager).detach()  # free again once detached
    with Adapter(kvpolicy.SnapKV(window=8), budget=32).attach(model):
        refused("target", lambda: Adapter(kvpolicy.H2O(window=8), budget=32).attach(model), "already")
    assert "init_continuous_batching" not in model.__dict__


def test_refused_while_running():
    model = tiny_model()
    adapter = Adapter(kvpolicy.SnapKV(window=8), budget=32)
    manager = manager_with(model)
    adapter.attach(manager)
    manager.start()
    try:
        refused("manager", lambda: Adapter(kvpolicy.SnapKV(window=8), budget=32).attach(manager), "start")
        refused("detach", adapter.detach, "stop")
    finally:
        manager.stop(block=True)
    adapter.detach()
