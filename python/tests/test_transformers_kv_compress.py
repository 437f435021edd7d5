"""KV-Compress inside transformers' continuous batching (``Adapter(kvpolicy.KVCompress(), ...,
attention="kvpolicy")``): per-head blocks carved out of the engine's blocks.

The pool alone (``per_head_pool.PerHeadPool``) under random growth and compression; then the
tiny random Llama of test_transformers_adapter.py through ``generate_batch``: the tokens of the
engine alone while nothing is compressed; after compressions the attention and the metric
update equal their formulas over each head's held tokens, the prompt's metric is computed
from the prompt's own last queries, gathering a request's heads into fewer engine blocks
moves no byte of a held token, the engine gets blocks back and runs more requests at once
in the same pool, and positions stay logical.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/common.sh installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/common.sh)")
if not transformers.__version__.startswith("5.17."):
    pytest.skip(f"transformers {transformers.__version__}: the adapter is tested with 5.17.x", allow_module_level=True)

import kvpolicy  # noqa: E402
from kvpolicy.integrations import transformers_kv_compress as kvc  # noqa: E402
from kvpolicy.integrations.per_head_pool import PerHeadPool  # noqa: E402
from kvpolicy.integrations.transformers import Adapter  # noqa: E402
from kvpolicy.integrations.triggers import Buffer  # noqa: E402
import test_transformers_adapter as adapter_test  # noqa: E402
from test_transformers_adapter import DEVICES, VOCAB, Recorder, prompts, refused, tiny_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# Blocks of 4 tokens: KV-Compress evicts whole blocks per head, and on the tiny random model's
# short rows blocks of 16 leave every head the same count.
BLOCK = 4


def run(model, inputs, new_tokens, adapter, num_blocks=160):
    return adapter_test.run(model, inputs, new_tokens, adapter, num_blocks=num_blocks, block_size=BLOCK)


def model_for(device):
    """The tiny float32 Llama on the CPU; on CUDA a bfloat16 one of head dim 64 (what kvpolicy's CUDA
    decode attention takes)."""
    if device == "cpu":
        return tiny_model()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    return model


def kv_compress(**overrides):
    # Windows that fit the tiny prompts (the defaults: 32 metric queries, 64 protected tokens).
    return kvpolicy.KVCompress(**{"metric_window": 8, "protected_window": 16, **overrides})


def adapter(budget=32, size=16, **overrides):
    return Adapter(kv_compress(**overrides), trigger=Buffer(budget=budget, size=size), attention="kvpolicy")


def head_tokens(pool: PerHeadPool, row: int, tensor=None) -> dict:
    """Every head's held tokens of ``row`` read through its table: (layer, head) -> rows."""
    tensor = pool.k if tensor is None else tensor
    b = pool.b
    out = {}
    for layer in range(pool.L):
        for head in range(pool.h):
            n = int(pool.lengths[layer, row, head])
            ids = [int(pool.tables[layer, row, head, t // b]) for t in range(n)]
            out[layer, head] = torch.stack([tensor[i, t % b] for t, i in enumerate(ids)]) if n else None
    return out


def assert_same_tokens(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert torch.equal(a[key], b[key]), key


# -- the pool alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_pool_keeps_every_block_in_its_rows_engine_blocks_under_random_growth_and_compression(device):
    L, E, b, h, d = 3, 24, 4, 2, 8
    k_layers = [torch.zeros(E * b, h, d, device=device) for _ in range(L)]
    v_layers = [torch.zeros(E * b, h, d, device=device) for _ in range(L)]
    pool = PerHeadPool(k_layers, v_layers, E, b, h, d, trash_block=E - 1, rows=2, width=2)
    # The engine's tensors are views of the pool: the same shapes, one allocation.
    assert [t.shape for t in k_layers] == [(E * b, h, d)] * L
    assert all(t.data_ptr() == pool.k_all[i].data_ptr() for i, t in enumerate(k_layers))
    rng = np.random.default_rng(0)
    free_engine = list(range(E - 1))
    engine = {}
    for step in range(200):
        row = int(rng.integers(0, 3))
        if row not in engine:
            engine[row] = (pool.take_row(), [])
        r, blocks = engine[row]
        # As the adapter: the engine gives the block the next token needs, then every head grows.
        while pool.engine_blocks_next(r) > len(blocks):
            blocks.append(free_engine.pop())
        pool.sync_blocks(r, blocks)
        first = pool.lengths[:, r].copy()
        pool.grow(r, 1)
        slots = pool.slots(r, first, 1)[:, 0]  # [L, h]
        for layer in range(L):
            for head in range(h):
                pool.k.view(-1, d)[slots[layer, head]] = step * 100 + layer * 10 + head
        if rng.random() < 0.15 and pool.lengths[:, r].min() > b:
            before = head_tokens(pool, r)
            new = (pool.lengths[:, r] * rng.uniform(0.2, 1.0, (L, h))).astype(np.int32)
            have, keep = -(-pool.lengths[:, r] // b), -(-new // b)
            counts = (have - keep).astype(np.int32)
            freed = np.full((L, h, pool.width), -1, np.int32)
            for layer in range(L):
                for head in range(h):
                    freed[layer, head, : counts[layer, head]] = pool.tables[layer, r, head,
                                                                            keep[layer, head]:have[layer, head]]
            pool.shrink(r, new, counts, freed)
            src, dst, released = pool.defragment(r)
            pool.move(src, dst)
            for e in released:
                blocks.remove(e)
                free_engine.append(e)
            after = head_tokens(pool, r)
            for key, rows in before.items():  # the first new-length tokens of each head, byte for byte
                n = int(new[key])
                assert (after[key] is None) == (n == 0)
                if n:
                    assert torch.equal(after[key], rows[:n]), key
            held = int((-(-pool.lengths[:, r].astype(np.int64) // b)).sum())
            assert len(blocks) == -(-held // (L * h))  # no engine block more than the heads need
        if rng.random() < 0.03:  # the request finishes: the engine has its blocks back
            pool.give_row(r)
            free_engine.extend(blocks)
            del engine[row]
            continue
        # Invariants: every held block lies in the row's engine blocks, no block twice; free and
        # held blocks together are exactly the row's engine blocks' per-head blocks.
        held_ids = [int(pool.tables[layer, r, head, i]) for layer in range(L) for head in range(h)
                    for i in range(-(-int(pool.lengths[layer, r, head]) // b))]
        assert len(set(held_ids)) == len(held_ids)
        everything = {int(x) for e in pool.owned[r] for x in pool.ids_of_engine_block(e)}
        assert set(held_ids) | set(pool.free[r]) == everything and not set(held_ids) & set(pool.free[r])
        assert pool.owned[r] == blocks
    pool.upload()
    assert torch.equal(pool.tables_dev.cpu(), torch.from_numpy(pool.tables))
    assert torch.equal(pool.lengths_dev.cpu(), torch.from_numpy(pool.lengths))


# -- inside the engine ------------------------------------------------------------------------


def test_tokens_identical_when_the_budget_covers_every_length():
    # On the CPU both attentions are kvpolicy's host reference (fp64 sums): the same tokens. (On
    # CUDA the per-head and the paged kernel round bf16 differently; the formula test below holds
    # the CUDA path to the float64 attention instead.)
    model = tiny_model()
    inputs = prompts(count=4)
    alone = run(model, inputs, 40, Adapter(None, attention="kvpolicy"))
    watcher = Adapter(kv_compress(), budget=4096, attention="kvpolicy")
    out = run(model, inputs, 40, watcher)
    assert watcher.stats.compressions == 0
    assert {k: o.generated_tokens for k, o in out.items()} == {k: o.generated_tokens for k, o in alone.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_compression_returns_engine_blocks_and_more_requests_run(device, monkeypatch):
    model = model_for(device)
    inputs = prompts(count=10)
    watcher = Adapter(None, attention="kvpolicy")
    run(model, inputs, 120, watcher, num_blocks=160)
    checked = []
    shipped = kvc.PerHeadRun._compress

    def compress(self, due):
        shipped(self, due)
        for rec in due:
            blocks = self.manager_of_blocks.block_table[rec.state.request_id]
            held = int((-(-self.pool.lengths[:, rec.row].astype(np.int64) // self.block_size)).sum())
            # The engine holds exactly the blocks the heads need, and knows it.
            assert rec.state.allocated_blocks == len(blocks) == -(-held // (self.pool.L * self.pool.h))
            assert self.pool.owned[rec.row] == blocks
            checked.append(len(set(self.pool.lengths[:, rec.row].reshape(-1).tolist())) > 1)

    monkeypatch.setattr(kvc.PerHeadRun, "_compress", compress)
    recorder = Recorder(monkeypatch)
    kvc_adapter = adapter()
    out = run(model, inputs, 120, kvc_adapter, num_blocks=160)
    s = kvc_adapter.stats
    assert s.compressions > 0 and s.blocks_freed > 0 and s.tokens_evicted > 0
    assert any(checked)  # heads of one request hold different lengths
    assert s.mean_running_requests > watcher.stats.mean_running_requests
    assert s.peak_blocks <= 160
    for rid, seen in recorder.positions().items():  # each token once, at its logical position
        assert seen == list(range(len(out[rid].prompt_ids) + 120 - 1)), rid


def test_a_prompt_longer_than_the_budget_is_compressed_once_it_is_complete(monkeypatch):
    """KV-Compress compresses after a prefill: a prompt over the budget is compressed at the step
    its prompt is complete (one generated token), not after the buffer trigger's 128 tokens."""
    model = tiny_model()
    first = {}  # request -> (generated tokens, mean held tokens per head) at its first compression
    shipped = kvc.PerHeadRun._compress

    def compress(self, due):
        shipped(self, due)
        for rec in due:
            first.setdefault(rec.state.request_id, (rec.state.generated_len(), rec.seq.length))

    monkeypatch.setattr(kvc.PerHeadRun, "_compress", compress)
    inputs = prompts(count=3, low=40, high=60)
    run(model, inputs, 20, adapter(budget=24, size=128))
    assert set(first) == {f"req_{i}" for i in range(3)}
    for rid, (generated, held) in first.items():
        assert generated == 1, rid
        assert held <= 24 + BLOCK, rid  # the budget, rounded up to whole blocks per head


def test_a_request_the_engine_resets_starts_again_with_a_new_row(monkeypatch):
    """A pool too small for the requests between compressions: the engine soft-resets a starved
    request (frees its blocks, re-prefills its tokens). The adapter gives its table row back and
    the request starts again from position 0 in a new one; every request still finishes."""
    model = tiny_model()
    recorder = Recorder(monkeypatch)
    given_back = []
    shipped = kvc.PerHeadPool.give_row

    def give_row(self, row):
        given_back.append(row)
        shipped(self, row)

    monkeypatch.setattr(kvc.PerHeadPool, "give_row", give_row)
    kvc_adapter = adapter(budget=32, size=48)
    out = run(model, prompts(count=4, low=30, high=40), 90, kvc_adapter, num_blocks=64)
    assert kvc_adapter.stats.compressions > 0
    restarted = 0
    for rid, seen in recorder.positions().items():
        starts = [i for i, p in enumerate(seen) if p == 0] + [len(seen)]
        segments = [seen[a:b] for a, b in zip(starts, starts[1:])]
        for segment in segments:
            assert segment == list(range(len(segment))), rid
        assert segments[-1][-1] == len(out[rid].prompt_ids) + 90 - 2, rid
        restarted += len(segments) > 1
    assert restarted and len(given_back) >= 4 + restarted  # a row back for each reset and each end


@pytest.mark.parametrize("device", DEVICES)
def test_gathering_heads_into_fewer_engine_blocks_moves_no_held_byte(device, monkeypatch):
    model = model_for(device)
    seen = []
    shipped_defragment, shipped_move = kvc.PerHeadPool.defragment, kvc.PerHeadPool.move
    state = {}

    def defragment(self, row):
        state["row"] = row
        state["before"] = [head_tokens(self, row, t) for t in (self.k, self.v, self.metric, self.positions)]
        return shipped_defragment(self, row)

    def move(self, src, dst):
        shipped_move(self, src, dst)
        after = [head_tokens(self, state["row"], t) for t in (self.k, self.v, self.metric, self.positions)]
        for a, b in zip(state["before"], after):
            assert_same_tokens(a, b)
        seen.append(len(src))

    monkeypatch.setattr(kvc.PerHeadPool, "defragment", defragment)
    monkeypatch.setattr(kvc.PerHeadPool, "move", move)
    run(model, prompts(count=4), 80, adapter())
    assert seen and max(seen) > 0  # some compression moved blocks


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_and_metric_update_equal_their_formulas(device, monkeypatch):
    """Each one-token request's output equals softmax attention over its heads' held tokens, and
    the metric of those tokens grows by the group's summed squared probabilities (KV-Compress's
    decode update), before and after compressions: float64 over the cache's values (bf16 on
    CUDA: outputs within the bf16 rounding of the result, metrics within fp32 sums)."""
    model = model_for(device)
    out_tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    metric_tol = dict(rtol=1e-4, atol=1e-6) if device == "cpu" else dict(rtol=1e-3, atol=1e-5)
    checked = {"before": 0, "after": 0}
    shipped = kvc.PerHeadAttention.run

    def run_layer(self, layer, query, key, value):
        pool = self.pool
        metric_before = pool.metric.clone()
        out = shipped(self, layer, query, key, value)
        if not self.decoding:
            return out
        rows = list(range(self.decoding)) if self.decode_rows is None else self.decode_rows.tolist()
        b, d = pool.b, pool.d
        h_q, group = query.shape[1], query.shape[1] // pool.h
        for i, (qrow, row) in enumerate(zip(rows, self.table_rows.tolist())):
            for head in range(pool.h):
                n = int(pool.lengths[layer, row, head])
                flat = torch.tensor([int(pool.tables[layer, row, head, t // b]) * b + t % b for t in range(n)],
                                    device=pool.device)
                k = pool.k.view(-1, d)[flat].double()
                v = pool.v.view(-1, d)[flat].double()
                squares = torch.zeros(n, dtype=torch.float64, device=pool.device)
                for g in range(group):
                    qh = head * group + g
                    p = torch.softmax(self.scale * (k @ query[qrow, qh].double()), 0)
                    torch.testing.assert_close(out[qrow, qh].double(), p @ v, **out_tol)
                    squares += p * p
                grew = pool.metric.view(-1)[flat].double() - metric_before.view(-1)[flat].double()
                torch.testing.assert_close(grew, squares, **metric_tol)
            compressed = len(set(pool.lengths[:, row].reshape(-1).tolist())) > 1
            checked["after" if compressed else "before"] += 1
        assert h_q == pool.h * group
        return out

    monkeypatch.setattr(kvc.PerHeadAttention, "run", run_layer)
    run(model, prompts(count=3), 50, adapter())
    assert checked["before"] > 0 and checked["after"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_metric_is_computed_from_the_prompts_last_queries(device, monkeypatch):
    """The prompt's metric (KV-Compress's prefill metric) equals kvpolicy.per_head_metric over the
    queries the model computed for the prompt's last metric_window tokens, read at the attention
    call (not from the adapter's ring)."""
    model = model_for(device)
    w = 8
    queries = {}  # (pool row, layer) -> the prompt's last w queries [w, h_q, d]
    shipped_run, shipped_metric = kvc.PerHeadAttention.run, kvc.PerHeadRun._prefill_metric
    compared = []

    def run_layer(self, layer, query, key, value):
        for start, q, _, _ in self.prefills:
            row = self._rows_of_prefill[start]
            queries[row, layer] = query[start + q - w:start + q].clone()
        return shipped_run(self, layer, query, key, value)

    shipped_plan = kvc.PerHeadAttention.plan

    def plan(self, requests, rows):
        shipped_plan(self, requests, rows)
        starts, cursor = {}, 0
        for row, q, _ in requests:
            starts[cursor] = row
            cursor += q
        self._rows_of_prefill = starts

    def prefill_metric(self, recs):
        shipped_metric(self, recs)
        pool = self.pool
        for rec in recs:
            q = torch.stack([queries[rec.row, layer] for layer in range(pool.L)])[:, None]  # [L, 1, w, h_q, d]
            metric = pool.metric.clone()
            kvpolicy.per_head_metric(self.policy, q, pool.k, metric, pool.tables_dev, pool.lengths_dev,
                                     seqs=[rec.row], mode="prefill", positions=pool.positions, query_slots=[0])
            for layer in range(pool.L):
                for head in range(pool.h):
                    n = int(pool.lengths[layer, rec.row, head])
                    flat = [int(pool.tables[layer, rec.row, head, t // pool.b]) * pool.b + t % pool.b
                            for t in range(n)]
                    torch.testing.assert_close(pool.metric.view(-1)[flat], metric.view(-1)[flat], rtol=1e-6, atol=0)
                    assert bool((metric.view(-1)[flat] > 0).any())
            compared.append(rec.row)

    monkeypatch.setattr(kvc.PerHeadAttention, "run", run_layer)
    monkeypatch.setattr(kvc.PerHeadAttention, "plan", plan)
    monkeypatch.setattr(kvc.PerHeadRun, "_prefill_metric", prefill_metric)
    run(model, prompts(count=3), 20, adapter())
    assert len(compared) == 3


def test_refused_arguments():
    for attention in ("engine", "torch"):
        refused("attention", lambda: Adapter(kv_compress(), budget=64, attention=attention), "per-head decode")
    refused("budget", lambda: Adapter(kv_compress(max_cache_tokens=64), budget=128, attention="kvpolicy"),
            "own budget")
    refused("budget", lambda: Adapter(kv_compress(), attention="kvpolicy"), "pass budget=")
    # The policy's own budget is used as it is: budget= then only drives the trigger.
    own = Adapter(kv_compress(max_cache_tokens=64), budget=64, attention="kvpolicy")
    assert own.policy.params()["max_cache_tokens"] == 64
    made = Adapter(kv_compress(), budget=48, attention="kvpolicy")
    assert made.policy.params()["max_cache_tokens"] == 48 and made.policy.params()["metric_window"] == 8
