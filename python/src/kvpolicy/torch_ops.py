"""kvpolicy.compress, kvpolicy.compress_per_head and decode attention as PyTorch custom
ops: ``torch.ops.kvpolicy.compress``, ``compress_per_head``, ``decode_attention`` and
``decode_attention_per_head``.

Importing this module registers them (PyTorch needed). Each compresses the cache
tensors in place (declared as mutated, so functionalization and torch.compile see
the writes), has a fake implementation (shapes only, for tracing), and on CUDA runs
on the current stream without waiting for it, so it can be captured into a CUDA
graph (decode attention writes a new output and, with ``update``, the metric or F).
``compress``, ``compress_per_head``, ``decode_attention`` and ``decode_attention_per_head``
below are the calls to use; the ops' schemas take only tensors, ints, bools and strings (the policy travels as its JSON spec).

    import kvpolicy, kvpolicy.torch_ops as ops
    r = ops.compress(kvpolicy.SnapKV(), "vllm_flash", kv=layers, block_table=bt, lengths=lens,
                     seqs=torch.tensor([0, 2]), budgets=256, queries=q)
    r = ops.compress_per_head(kvpolicy.KVCompress(), k, v, metric, tables, lengths,
                              seqs=torch.tensor([0, 2]), blocks_to_free=torch.tensor([4, 1]))

Under torch.compile pass the policy as its spec, made outside the compiled function:
``spec = ops.policy_spec(kvpolicy.SnapKV())``, then ``ops.compress(spec, ...)`` inside
it (likewise ``compress_per_head``). A preset is an extension object Dynamo cannot read
(torch 2.11 stops on it; newer releases bake it in by identity, so a later change of
its fields would go unseen); a spec is a string, which Dynamo guards by value: another
spec recompiles.
"""

from __future__ import annotations

import json
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._compress import CompressResult, run
from ._decode_attention import DecodeAttentionResult
from ._decode_attention import decode_attention as _decode_attention
from ._decode_attention import decode_attention_per_head as _decode_attention_per_head
from ._per_head import PerHeadResult
from ._per_head import compress_per_head as _compress_per_head
from .errors import Error

_OUTPUTS = ("status", "new_lengths", "released_counts", "released_blocks", "kept_counts", "nonfinite_scores", "keep_masks")
_PER_HEAD_OUTPUTS = ("status", "new_lengths", "freed_counts", "freed_blocks", "evicted", "moved", "freed",
                     "nonfinite_metrics")


def policy_spec(policy) -> str:
    """The policy as the op's string argument: its preset name and every parameter.

    Call it outside a torch.compile'd function and pass the string to ``compress``
    there (Dynamo cannot step into the extension's methods). A spec is returned as is.
    """
    if isinstance(policy, str):
        _policy(policy)  # checked now, not inside the op
        return policy
    if not (hasattr(policy, "name") and hasattr(policy, "params")):
        raise Error(f"kvpolicy: policy: is a {type(policy).__name__}; expected a preset or its spec", "policy")
    return json.dumps([policy.name, policy.params()], sort_keys=True)


def _policy(spec: str):
    # Built anew per call (microseconds): a cached instance would outlive the
    # extension at interpreter exit.
    import kvpolicy

    try:
        name, params = json.loads(spec)
        return kvpolicy.preset(name, **params)
    except (ValueError, TypeError) as e:
        if isinstance(e, Error):
            raise
        raise Error(f"kvpolicy: policy: the spec {spec!r} is not one policy_spec made ({e})", "policy") from None


def _spec(policy, call: str) -> str:
    """A wrapper's policy argument as the op's spec string."""
    if isinstance(policy, str):
        return policy  # checked when the op builds it (no host work while tracing)
    if torch.compiler.is_compiling():
        # A builtin exception: Dynamo traces its construction (not kvpolicy.Error's).
        raise TypeError(
            f"kvpolicy.torch_ops.{call}: policy: is a preset inside a torch.compile'd function; make its spec "
            "outside it (spec = kvpolicy.torch_ops.policy_spec(preset)) and pass the spec"
        )
    return policy_spec(policy)


def _cache_arg(layout: str, tensors: List[Tensor]):
    """The op's tensor list as PagedCache takes it: one tensor, or the per-layer list."""
    axes, _, per_layer, _ = _core.LAYOUTS[layout]
    if not per_layer or (len(tensors) == 1 and tensors[0].dim() == len(axes) + 1):
        return tensors[0]
    return list(tensors)


def _paged_cache(layout, kv, k, v, block_table, block_indptr, block_indices, lengths, positions, live):
    """The PagedCache an op's tensor arguments describe: kv=..., or k=... and v=..."""
    split = bool(k)
    return _core.PagedCache(
        layout,
        None if split else _cache_arg(layout, kv),
        k=_cache_arg(layout, k) if split else None,
        v=_cache_arg(layout, v) if split else None,
        block_table=block_table,
        block_indptr=block_indptr,
        block_indices=block_indices,
        lengths=lengths,
        positions=positions,
        live=live,
    )


def _sizes(layout: str, tensors: List[Tensor]):
    """(layers, block_size, KV heads) read off the cache tensors' shapes."""
    axes, _, per_layer, _ = _core.LAYOUTS[layout]
    t = tensors[0]
    if per_layer and t.dim() == len(axes) + 1:
        axes, layers = "L" + axes, t.shape[0]
    elif per_layer:
        layers = len(tensors)
    else:
        layers = t.shape[axes.index("L")]
    block = t.shape[axes.index("T")] if "T" in axes else 1
    return layers, block, t.shape[axes.index("H")]


@torch.library.custom_op("kvpolicy::compress", mutates_args=("kv", "k", "v", "scores", "positions", "live"))
def _compress_op(
    policy: str,
    layout: str,
    kv: List[Tensor],
    k: List[Tensor],
    v: List[Tensor],
    block_table: Optional[Tensor],
    block_indptr: Optional[Tensor],
    block_indices: Optional[Tensor],
    lengths: Tensor,
    queries: Optional[Tensor],
    scores: Optional[Tensor],
    positions: Optional[Tensor],
    live: Optional[Tensor],
    items: Tensor,
    layer_begin: int,
    layer_count: int,
    max_tokens: int,
    return_masks: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cache = _paged_cache(layout, kv, k, v, block_table, block_indptr, block_indices, lengths, positions, live)
    r = run(
        _policy(policy),
        cache,
        items.contiguous(),
        queries=queries,
        scores=scores,
        layer_begin=layer_begin,
        layer_count=layer_count,
        max_tokens=max_tokens,
        return_masks=return_masks,
        check=False,
    )
    device = (k or kv)[0].device
    status = r.status if r.status is not None else torch.zeros(8, dtype=torch.int32, device=device)
    masks = r.keep_masks if r.keep_masks is not None else torch.empty(0, dtype=torch.uint8, device=device)
    return status, r.new_lengths, r.released_counts, r.released_blocks, r.kept_counts, r.nonfinite_scores, masks


@_compress_op.register_fake
def _(policy, layout, kv, k, v, block_table, block_indptr, block_indices, lengths, queries, scores, positions, live,
      items, layer_begin, layer_count, max_tokens, return_masks):
    tensors = k or kv
    layers, block, heads = _sizes(layout, tensors)
    n, rows = items.shape[0], layer_count or layers - layer_begin
    device = tensors[0].device

    def empty(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device=device)

    masks = empty(n, rows, heads, max_tokens, dtype=torch.uint8) if return_masks else empty(0, dtype=torch.uint8)
    return (empty(8), empty(n), empty(n), empty(n, -(-max_tokens // block)), empty(n, rows, heads), empty(n), masks)


def compress(
    policy,  # a preset, or its spec (policy_spec): under torch.compile, the spec
    layout: str,
    *,
    kv=None,
    k=None,
    v=None,
    block_table: Optional[Tensor] = None,
    block_indptr: Optional[Tensor] = None,
    block_indices: Optional[Tensor] = None,
    lengths: Tensor,
    seqs,
    budgets,
    history_tokens=0,
    query_slots=None,
    window_begins=0,
    queries: Optional[Tensor] = None,
    scores: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
    live: Optional[Tensor] = None,
    layer_begin: int = 0,
    layer_count: int = 0,
    max_tokens: Optional[int] = None,
    return_masks: bool = False,
) -> CompressResult:
    """``kvpolicy.compress`` through ``torch.ops.kvpolicy.compress``, on the cache tensors
    themselves (arguments as ``kvpolicy.PagedCache`` and ``kvpolicy.compress`` take them).

    Traceable by torch.compile and capturable in a CUDA graph: it never waits for the
    device, so device-side validation errors are in ``result.status`` (``result.check()``).
    ``policy`` is a preset or its spec string (``policy_spec(preset)``); under
    torch.compile it must be the spec, made outside the compiled function.
    Items: ints, tensors, or lists; while a CUDA graph is captured with ``seqs`` on
    the device, the others must be ints or device tensors (a list would need a copy).
    ``window_begins`` (default 0) is a window-only preset's (Kara's) first token of each
    item's window, as in ``kvpolicy.compress``; its keep masks then cover the window.
    ``live`` (uint8 or bool ``[L, num_blocks, b, h_kv]``, written in place) turns on
    cautious update, as ``kvpolicy.PagedCache(live=...)``.
    """
    spec = _spec(policy, "compress")

    def listed(x):
        return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

    tensors = listed(k) or listed(kv)
    if not tensors:
        raise ValueError("kvpolicy.torch_ops.compress: pass the cache as kv=..., or as k=... and v=...")
    device = tensors[0].device
    seq = torch.as_tensor(seqs, dtype=torch.int32).reshape(-1)
    on = seq.device if seq.device.type != "cpu" else torch.device("cpu")
    n = seq.shape[0]

    def col(x, name):
        if isinstance(x, Tensor):
            return x.to(device=on, dtype=torch.int32).expand(n)
        if isinstance(x, int):  # a fill where the items are: no copy (capturable)
            return torch.full((n,), x, dtype=torch.int32, device=on)
        if on.type == "cuda" and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            raise Error(
                f"kvpolicy.torch_ops.compress: {name}: is a host {type(x).__name__} while a CUDA graph is being "
                "captured and seqs is on the device; a capture cannot copy it: pass a device tensor or an int",
                name,
            )
        return torch.as_tensor(x, dtype=torch.int32, device=on).expand(n)

    items = torch.stack(
        [col(seq, "seqs"), col(seq if query_slots is None else query_slots, "query_slots"), col(budgets, "budgets"),
         col(history_tokens, "history_tokens"), col(window_begins, "window_begins")],
        dim=1,
    ).contiguous()
    _, block, _ = _sizes(layout, tensors)
    if max_tokens is None:
        room = block_table.shape[1] if block_table is not None else block_indices.shape[0]
        max_tokens = int(room) * block
    out = torch.ops.kvpolicy.compress(
        spec, layout, listed(kv), listed(k), listed(v), block_table, block_indptr, block_indices,
        lengths, queries, scores, positions, live, items, layer_begin, layer_count, max_tokens, return_masks,
    )
    fields = dict(zip(_OUTPUTS, out))
    if not return_masks:
        fields["keep_masks"] = None
    if device.type != "cuda":
        fields["status"] = None  # the host raised any error already
    return CompressResult(**fields)  # on CUDA, check() waits for the stream current then


@torch.library.custom_op("kvpolicy::compress_per_head", mutates_args=("k", "v", "metric", "positions"))
def _compress_per_head_op(
    policy: str,
    k: Tensor,
    v: Tensor,
    metric: Tensor,
    tables: Tensor,
    lengths: Tensor,
    positions: Optional[Tensor],
    seqs: Tensor,
    blocks_to_free: Optional[Tensor],
    logical_lengths: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # Tables and lengths are only read (the engine updates them from the results), so
    # they are not declared mutated. blocks_to_free None reads the lengths on the host
    # here, where their values exist (while tracing they do not).
    r = _compress_per_head(_policy(policy), k, v, metric, tables, lengths, seqs=seqs, blocks_to_free=blocks_to_free,
                           logical_lengths=logical_lengths, positions=positions, check=False)
    status = r.status if r.status is not None else torch.zeros(8, dtype=torch.int32, device=k.device)
    return (status, *(getattr(r, name) for name in _PER_HEAD_OUTPUTS[1:]))


@_compress_per_head_op.register_fake
def _(policy, k, v, metric, tables, lengths, positions, seqs, blocks_to_free, logical_lengths):
    if tables.dim() != 4:  # the shapes below come from it
        raise Error(f"kvpolicy: tables: has shape {tuple(tables.shape)}; expected 4 axes [layers, seqs, kv_heads, "
                    "max_blocks]", "tables")
    layers, _, heads, width = tables.shape
    n = seqs.numel()  # an int or [n], as kvpolicy.compress_per_head takes it

    def empty(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device=k.device)

    rows = (n, layers, heads)
    return (empty(8), empty(*rows), empty(*rows), empty(*rows, width), empty(*rows), empty(*rows),
            empty(n, dtype=torch.int64), empty(n, dtype=torch.int64))


def compress_per_head(
    policy,  # a KVCompress preset, or its spec (policy_spec): under torch.compile, the spec
    k: Tensor,
    v: Tensor,
    metric: Tensor,
    tables: Tensor,
    lengths: Tensor,
    *,
    seqs,
    blocks_to_free=None,
    logical_lengths=None,
    positions: Optional[Tensor] = None,
) -> PerHeadResult:
    """``kvpolicy.compress_per_head`` through ``torch.ops.kvpolicy.compress_per_head``, on the
    per-head cache tensors themselves (arguments as ``kvpolicy.compress_per_head`` takes them).

    K, V, metric and positions are written in place; tables and lengths are not (the
    engine sets ``lengths[l, seqs[i], h] = r.new_lengths[i, l, h]``). Traceable by
    torch.compile and capturable in a CUDA graph: it never waits for the device, so
    device-side validation errors are in ``result.status`` (``result.check()``).
    ``policy`` is a ``kvpolicy.KVCompress`` or its spec string (``policy_spec(preset)``);
    under torch.compile it must be the spec, made outside the compiled function.
    Items (``seqs``, ``blocks_to_free``, ``logical_lengths``): ints, tensors, or lists.
    While a CUDA graph is captured with an item on the device, the others must be ints
    or device tensors (a list would need a copy). ``blocks_to_free=None`` takes the
    policy's budget off the lengths on the host: on CUDA a wait, refused while capturing.
    """
    spec = _spec(policy, "compress_per_head")
    on = torch.device("cpu")
    for x in (seqs, blocks_to_free, logical_lengths):
        if isinstance(x, Tensor) and x.device.type != "cpu":
            on = x.device

    def tensor(x):
        if x is None or isinstance(x, Tensor):
            return x
        if isinstance(x, int) and not isinstance(x, bool):  # a fill where the device items are: no copy (capturable)
            return torch.full((), x, dtype=torch.int64, device=on)
        # A host vector: the op copies it next to device items, or refuses it (naming it)
        # while a CUDA graph is captured; with host items it reaches the kernels as arguments.
        return torch.as_tensor(x)

    out = torch.ops.kvpolicy.compress_per_head(spec, k, v, metric, tables, lengths, positions, tensor(seqs),
                                               tensor(blocks_to_free), tensor(logical_lengths))
    fields = dict(zip(_PER_HEAD_OUTPUTS, out))
    if k.device.type != "cuda":
        fields["status"] = None  # the host raised any error already
    return PerHeadResult(**fields)  # on CUDA, check() waits for the stream current then


@torch.library.custom_op("kvpolicy::decode_attention_per_head", mutates_args=("metric",))
def _decode_attention_per_head_op(
    queries: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tensor,
    lengths: Tensor,
    metric: Optional[Tensor],
    positions: Optional[Tensor],
    seqs: Optional[Tensor],
    query_positions: Optional[Tensor],
    layer: int,
    scale: float,
    update: str,
    excluded_distance: int,
    max_tokens: int,
) -> Tuple[Tensor, Tensor]:
    r = _decode_attention_per_head(queries, k, v, tables, lengths, layer=layer, seqs=seqs, scale=scale,
                                   update=None if update == "none" else update, metric=metric, positions=positions,
                                   excluded_distance=excluded_distance, query_positions=query_positions,
                                   max_tokens=max_tokens, check=False)
    status = r.status if r.status is not None else torch.zeros(8, dtype=torch.int32, device=k.device)
    return r.out, status


@_decode_attention_per_head_op.register_fake
def _(queries, k, v, tables, lengths, metric, positions, seqs, query_positions, layer, scale, update,
      excluded_distance, max_tokens):
    return torch.empty_like(queries, memory_format=torch.contiguous_format), torch.empty(8, dtype=torch.int32,
                                                                                         device=k.device)


def decode_attention_per_head(
    queries: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tensor,
    lengths: Tensor,
    *,
    layer: int = 0,
    seqs: Optional[Tensor] = None,
    scale: Optional[float] = None,
    update: Optional[str] = None,
    metric: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
    excluded_distance: int = 0,
    query_positions: Optional[Tensor] = None,
    max_tokens: int = 0,
) -> DecodeAttentionResult:
    """``kvpolicy.decode_attention_per_head`` through ``torch.ops.kvpolicy.decode_attention_per_head``
    (arguments as it takes them; ``seqs`` and ``query_positions`` int32 tensors where the
    cache is). ``metric`` is written in place when ``update`` is given. Traceable by
    torch.compile and capturable in a CUDA graph: it never waits for the device, so
    device-side validation errors are in ``result.status`` (``result.check()``)."""
    if update not in (None, "squared", "probability"):
        raise Error(f"kvpolicy: update: is {update!r}; expected None, 'squared' or 'probability'", "update")
    scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else float(scale)
    out, status = torch.ops.kvpolicy.decode_attention_per_head(
        queries, k, v, tables, lengths, metric, positions, seqs, query_positions, layer, scale, update or "none",
        excluded_distance, max_tokens)
    if k.device.type != "cuda":
        return DecodeAttentionResult(out=out)  # the host raised any error already
    return DecodeAttentionResult(out=out, status=status, stream=int(torch.cuda.current_stream(k.device).cuda_stream))


@torch.library.custom_op("kvpolicy::decode_attention", mutates_args=("scores",))
def _decode_attention_op(
    queries: Tensor,
    layout: str,
    kv: List[Tensor],
    k: List[Tensor],
    v: List[Tensor],
    block_table: Optional[Tensor],
    block_indptr: Optional[Tensor],
    block_indices: Optional[Tensor],
    lengths: Tensor,
    live: Optional[Tensor],
    counts: Optional[Tensor],
    tail_from: Optional[Tensor],
    scores: Optional[Tensor],
    seqs: Optional[Tensor],
    query_positions: Optional[Tensor],
    layer: int,
    scale: float,
    update: str,
    excluded_distance: int,
    max_tokens: int,
) -> Tuple[Tensor, Tensor]:
    cache = _paged_cache(layout, kv, k, v, block_table, block_indptr, block_indices, lengths, None, live)
    r = _decode_attention(queries, cache, layer=layer, seqs=seqs, scale=scale, counts=counts, tail_from=tail_from,
                          update=None if update == "none" else update, scores=scores,
                          excluded_distance=excluded_distance, query_positions=query_positions,
                          max_tokens=max_tokens, check=False)
    status = r.status if r.status is not None else torch.zeros(8, dtype=torch.int32, device=queries.device)
    return r.out, status


@_decode_attention_op.register_fake
def _(queries, layout, kv, k, v, block_table, block_indptr, block_indices, lengths, live, counts, tail_from, scores,
      seqs, query_positions, layer, scale, update, excluded_distance, max_tokens):
    return torch.empty_like(queries, memory_format=torch.contiguous_format), torch.empty(8, dtype=torch.int32,
                                                                                         device=queries.device)


def decode_attention(
    queries: Tensor,
    layout: str,
    *,
    kv=None,
    k=None,
    v=None,
    block_table: Optional[Tensor] = None,
    block_indptr: Optional[Tensor] = None,
    block_indices: Optional[Tensor] = None,
    lengths: Tensor,
    live: Optional[Tensor] = None,
    counts: Optional[Tensor] = None,
    tail_from: Optional[Tensor] = None,
    layer: int = 0,
    seqs: Optional[Tensor] = None,
    scale: Optional[float] = None,
    update: Optional[str] = None,
    scores: Optional[Tensor] = None,
    excluded_distance: int = 0,
    query_positions: Optional[Tensor] = None,
    max_tokens: int = 0,
) -> DecodeAttentionResult:
    """``kvpolicy.decode_attention`` through ``torch.ops.kvpolicy.decode_attention``, on the
    cache tensors themselves (as ``compress`` takes them; ``live`` turns on cautious
    update, ``counts``/``tail_from`` the heads' own counts). Never waits for the device:
    traceable and capturable; device-side errors are in ``result.status``."""
    if update not in (None, "squared", "probability"):
        raise Error(f"kvpolicy: update: is {update!r}; expected None, 'squared' or 'probability'", "update")

    def listed(x):
        return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

    if not (listed(k) or listed(kv)):
        raise ValueError("kvpolicy.torch_ops.decode_attention: pass the cache as kv=..., or as k=... and v=...")
    scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else float(scale)
    out, status = torch.ops.kvpolicy.decode_attention(
        queries, layout, listed(kv), listed(k), listed(v), block_table, block_indptr, block_indices, lengths, live,
        counts, tail_from, scores, seqs, query_positions, layer, scale, update or "none", excluded_distance,
        max_tokens)
    if queries.device.type != "cuda":
        return DecodeAttentionResult(out=out)
    return DecodeAttentionResult(out=out, status=status,
                                 stream=int(torch.cuda.current_stream(queries.device).cuda_stream))
