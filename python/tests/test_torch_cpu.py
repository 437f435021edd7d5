"""PyTorch on the CPU: tensors in and out, bfloat16 caches, and the custom op
(torch.library's own checks, torch.compile). Skipped without PyTorch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpolicy  # noqa: E402
import kvpolicy.torch_ops as ops  # noqa: E402
from checks import check_moved  # noqa: E402
from paged_case import make_case  # noqa: E402


def torch_case(layout="vllm_flash", dtype=torch.bfloat16, seed=21):
    """A case whose tensors are PyTorch tensors of `dtype` (values exact in bf16)."""
    case = make_case(lengths=(40, 0, 33), window=8, seed=seed)
    args = {name: [torch.from_numpy(x).to(dtype) for x in value] if isinstance(value, list)
            else torch.from_numpy(value).to(dtype) for name, value in case.tensors(layout).items()}
    return case, args


def canonical(case, layout, args):
    return case.canonical(layout, {k: [x.float().numpy() for x in v] if isinstance(v, list) else v.float().numpy()
                                   for k, v in args.items()})


def test_torch_tensors_in_and_out():
    case, args = torch_case()
    before = canonical(case, "vllm_flash", args)
    cache = kvpolicy.PagedCache("vllm_flash", **args, block_table=torch.from_numpy(case.block_table),
                                lengths=torch.from_numpy(case.lengths))
    assert (cache.framework, cache.dtype) == ("torch", "bfloat16")
    q = torch.from_numpy(case.queries).to(torch.bfloat16)
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=torch.tensor([0, 2]), budgets=20, queries=q,
                          return_masks=True)
    assert isinstance(r.new_lengths, torch.Tensor) and r.new_lengths.tolist() == [20, 20]
    check_moved(case, before, canonical(case, "vllm_flash", args), [0, 2], case.lengths,
                type(r)(**{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in vars(r).items()}))


def op_args(case, args, layout="vllm_flash", policy=None, return_masks=True):
    policy = policy or kvpolicy.SnapKV(window=8)
    items = torch.tensor([[0, 0, 20, 0, 0], [2, 2, 16, 0, 0]], dtype=torch.int32)  # kvp::batch_item rows
    return (ops.policy_spec(policy), layout, args.get("kv", []), args.get("k", []), args.get("v", []),
            torch.from_numpy(case.block_table), None, None, torch.from_numpy(case.lengths),
            torch.from_numpy(case.queries).to(torch.bfloat16), None, None, None, items, 0, 0, 40, return_masks)


def test_the_op_passes_torch_library_checks():
    case, args = torch_case()
    # Schema and mutation declarations, the fake implementation and AOT dispatch, each
    # against real calls on fresh clones of the arguments.
    results = torch.library.opcheck(torch.ops.kvpolicy.compress.default, op_args(case, args))
    assert set(results.values()) == {"SUCCESS"}, results


def test_the_op_equals_compress_and_mutates_in_place():
    case, args = torch_case()
    eager_case, eager_args = torch_case()
    cache = kvpolicy.PagedCache("vllm_flash", **eager_args, block_table=torch.from_numpy(case.block_table),
                                lengths=torch.from_numpy(case.lengths))
    q = torch.from_numpy(case.queries).to(torch.bfloat16)
    eager = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[0, 2], budgets=[20, 16], queries=q,
                              return_masks=True)
    r = ops.compress(kvpolicy.SnapKV(window=8), "vllm_flash", **args, block_table=torch.from_numpy(case.block_table),
                     lengths=torch.from_numpy(case.lengths), seqs=[0, 2], budgets=[20, 16], queries=q,
                     return_masks=True, max_tokens=40)
    assert torch.equal(r.keep_masks, eager.keep_masks) and torch.equal(r.new_lengths, eager.new_lengths)
    for a, b in zip(args["kv"], eager_args["kv"]):
        assert torch.equal(a, b)


def test_the_op_takes_window_begins():
    """Kara through the op: window_begins reach the items' fifth column; masks cover the window."""
    case = make_case(lengths=(45, 0, 37), window=24, block_size=4, seed=23)

    def run(through_op):
        args = {name: torch.from_numpy(x.copy()) for name, x in case.tensors("nano_vllm").items()}
        kw = dict(block_table=torch.from_numpy(case.block_table), lengths=torch.from_numpy(case.lengths))
        q, policy = torch.from_numpy(case.queries), kvpolicy.Kara(window=24, buffer=4, gamma=4, alpha=4)
        items = dict(seqs=[0, 2], budgets=[12, 9], window_begins=torch.tensor([20, 12]), queries=q, return_masks=True)
        if through_op:
            return ops.compress(policy, "nano_vllm", **args, **kw, max_tokens=48, **items), args
        cache = kvpolicy.PagedCache("nano_vllm", **args, **kw)
        return kvpolicy.compress(policy, cache, max_tokens=48, **items), args

    (r, args), (eager, eager_args) = run(True), run(False)
    assert r.new_lengths.tolist() == eager.new_lengths.tolist() == [20 + 16 + 1, 12 + 13 + 1]
    assert torch.equal(r.keep_masks, eager.keep_masks) and not r.keep_masks[0, :, :, 45 - 20 :].any()
    assert torch.equal(args["kv"], eager_args["kv"])
    with pytest.raises(kvpolicy.Error) as e:
        ops.compress(kvpolicy.SnapKV(window=8), "nano_vllm", **args, block_table=torch.from_numpy(case.block_table),
                     lengths=torch.from_numpy(case.lengths), seqs=[0], budgets=20, window_begins=4,
                     queries=torch.from_numpy(case.queries))
    assert e.value.field == "batch[0].window_begin"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_the_op(backend):
    case, args = torch_case()
    eager_case, eager_args = torch_case()
    table, lengths = torch.from_numpy(case.block_table), torch.from_numpy(case.lengths)
    q = torch.from_numpy(case.queries).to(torch.bfloat16)
    policy = ops.policy_spec(kvpolicy.Zipage(window=8))  # a string: made outside the compiled function
    scores = torch.zeros(case.scores.shape)
    eager_scores = torch.zeros(case.scores.shape)

    def step(kv, scores, seqs):
        r = ops.compress(policy, "vllm_flash", kv=kv, block_table=table, lengths=lengths, seqs=seqs, budgets=20,
                         queries=q, scores=scores, return_masks=True)
        return r.new_lengths + 0, r.keep_masks

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    seqs = torch.tensor([0, 2], dtype=torch.int32)
    new_lengths, masks = compiled(args["kv"], scores, seqs)
    eager_lengths, eager_masks = step(eager_args["kv"], eager_scores, seqs)
    assert torch.equal(new_lengths, eager_lengths) and torch.equal(masks, eager_masks)
    assert torch.equal(scores, eager_scores) and scores.count_nonzero() > 0  # F written in place
    for a, b in zip(args["kv"], eager_args["kv"]):
        assert torch.equal(a, b)


def test_a_preset_inside_torch_compile_is_refused_with_what_to_do():
    case, args = torch_case()
    table, lengths = torch.from_numpy(case.block_table), torch.from_numpy(case.lengths)
    q = torch.from_numpy(case.queries).to(torch.bfloat16)
    policy = kvpolicy.SnapKV(window=8)

    def step(kv):
        return ops.compress(policy, "vllm_flash", kv=kv, block_table=table, lengths=lengths, seqs=[0], budgets=20,
                            queries=q).new_lengths + 0

    torch._dynamo.reset()
    with pytest.raises(Exception, match="policy_spec"):
        torch.compile(step, backend="eager", fullgraph=True)(args["kv"])


def test_policy_spec_round_trips_and_checks_a_spec():
    spec = ops.policy_spec(kvpolicy.Zipage(window=8, alpha=0.25))
    assert ops.policy_spec(spec) == spec and ops._policy(spec) == kvpolicy.Zipage(window=8, alpha=0.25)
    with pytest.raises(kvpolicy.Error) as e:
        ops.policy_spec('["zipage", {"windw": 8}]')
    assert e.value.field == "policy"
    with pytest.raises(kvpolicy.Error):
        ops.policy_spec("not json")


def test_errors_pass_through_the_op():
    case, args = torch_case()
    with pytest.raises(kvpolicy.Error) as e:
        ops.compress(kvpolicy.SnapKV(window=8), "vllm_flash", **args, block_table=torch.from_numpy(case.block_table),
                     lengths=torch.from_numpy(case.lengths), seqs=[0], budgets=41,
                     queries=torch.from_numpy(case.queries).to(torch.bfloat16))
    assert e.value.field == "batch[0].budget"
