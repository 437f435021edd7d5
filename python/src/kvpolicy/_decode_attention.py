"""Decode attention over head-adaptive caches: kvpolicy.decode_attention_per_head (a
per-head block cache, KV-Compress's) and kvpolicy.decode_attention (a PagedCache whose
heads attend their own counts, Hard-KV's, or skip cautious update's dropped tokens)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from . import _core
from ._frameworks import DeviceAllocator, is_device_array
from ._streams import stream_handle
from .errors import Error

_UPDATES = (None, "squared", "probability")


@dataclasses.dataclass
class DecodeAttentionResult:
    """``out[i, q, :]``: item ``i``'s attention output for query head ``q`` (the cache's
    dtype). ``status``: the device path's 8 status words (None on the host); ``check()``
    waits for the stream and raises the kvpolicy.Error they hold."""

    out: Any
    status: Any = None
    stream: Optional[int] = None

    def check(self) -> "DecodeAttentionResult":
        if self.status is not None:
            _core.check_device_status(self.status, self.stream)
        return self


def _framework(x) -> str:
    return type(x).__module__.split(".")[0]


def _update(update) -> str:
    if update not in _UPDATES:
        raise Error(f"kvpolicy: update: is {update!r}; expected None, 'squared' (KV-Compress's metric) or "
                    "'probability' (H2O's accumulated attention)", "update")
    return update or "none"


def _scale(scale, queries) -> float:
    if scale is None:
        return 1.0 / math.sqrt(int(queries.shape[-1]))
    return float(scale)


def _empty_like(queries, framework: str):
    """A host output of the queries' shape and dtype (device outputs use DeviceAllocator)."""
    if framework == "torch":
        import torch

        return torch.empty(tuple(queries.shape), dtype=queries.dtype)
    return np.empty(queries.shape, dtype=queries.dtype)


def _ints(name: str, x, device: Optional[int], framework: str, capturing):
    """An int32 vector where the cache lives (None stays None). Host values are copied
    to a device cache, which a CUDA graph capture cannot do: refused then."""
    if x is None:
        return None
    if device is None:
        if is_device_array(x):
            raise Error(f"kvpolicy: {name}: lives on a CUDA device; the cache is in host memory", name)
        if _framework(x) == "torch":
            x = x.numpy()  # a CPU tensor: its memory, as NumPy sees it
        return np.ascontiguousarray(np.asarray(x, dtype=np.int32).reshape(-1))
    if is_device_array(x):
        if _framework(x) == "torch":
            import torch

            return x.to(dtype=torch.int32).reshape(-1).contiguous()
        return x.astype("int32").reshape(-1)
    if capturing():
        raise Error(f"kvpolicy: {name}: is a host {type(x).__name__} while the stream is being captured into a CUDA "
                    "graph; a capture cannot copy it to the device: pass a device array", name)
    if framework == "torch":
        import torch

        return torch.as_tensor(np.asarray(x, dtype=np.int32).reshape(-1), device=f"cuda:{device}")
    if framework == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            return cupy.asarray(np.asarray(x, dtype=np.int32).reshape(-1))
    raise Error(f"kvpolicy: {name}: is a host value and the cache's framework ({framework}) cannot copy it to the "
                "device here: pass a device array", name)


def _run(host_fn, device_fn, cache_args, framework: str, device: Optional[int], queries, *, layer, seqs, scale, out,
         update, excluded_distance, query_positions, max_tokens, stream, workspace, staged, check, describe,
         size_only=False):
    kind = _update(update)
    sc = _scale(scale, queries)
    if device is None:
        if size_only:
            return 0
        if describe:
            raise Error("kvpolicy: describe: the plan is the CUDA path's; the cache is in host memory", "describe")
        seq = _ints("seqs", seqs, None, framework, lambda: False)
        qpos = _ints("query_positions", query_positions, None, framework, lambda: False)
        if out is None:
            out = _empty_like(queries, framework)
        host_fn(*cache_args, queries, out, seq, int(layer), sc, kind, int(excluded_distance), qpos)
        return DecodeAttentionResult(out=out)
    if not _core.has_cuda:
        raise Error("kvpolicy: cache: lives on CUDA device; this kvpolicy was built without its CUDA path "
                    "(KVPOLICY_PYTHON_CUDA=OFF or no nvcc)", "cache")
    h = stream_handle(stream, framework, device)
    capturing = _core.stream_is_capturing(h)
    if check and capturing:
        raise Error("kvpolicy: check: is True while the stream is being captured into a CUDA graph; a check waits "
                    "for the device: pass check=False and call result.check() after a replay", "check")
    alloc = DeviceAllocator(framework, device, h)
    with alloc.on_stream():
        seq = _ints("seqs", seqs, device, framework, lambda: capturing)
        qpos = _ints("query_positions", query_positions, device, framework, lambda: capturing)
    if out is None:
        out = alloc.empty(tuple(queries.shape), str(queries.dtype).replace("torch.", ""))
    args = (*cache_args, queries, out, seq, int(layer), sc, kind, int(excluded_distance), qpos, int(max_tokens or 0))
    if describe:
        return device_fn(*args, None, None, h, bool(staged), False, True)
    if size_only:
        return device_fn(*args, None, None, h, bool(staged), False, False)
    if workspace is None:
        need = device_fn(*args, None, None, h, bool(staged), False, False)
        workspace = alloc.empty((need,), "uint8")
    status = alloc.empty((8,), "int32")
    device_fn(*args, status, workspace, h, bool(staged), bool(check), False)
    return DecodeAttentionResult(out=out, status=status, stream=h)


def decode_attention_per_head(
    queries,
    k,
    v,
    tables,
    lengths,
    *,
    layer: int = 0,
    seqs=None,
    scale: Optional[float] = None,
    out=None,
    update: Optional[str] = None,
    metric=None,
    positions=None,
    excluded_distance: int = 0,
    query_positions=None,
    max_tokens: int = 0,
    stream=None,
    workspace=None,
    staged: bool = False,
    check: bool = True,
    describe: bool = False,
):
    """One new query token per sequence attending one layer of a per-head block cache
    (each KV head its own block table and length: what ``compress_per_head`` leaves).

    queries         [items, h_q, d] (h_q a multiple of h_kv: query head h * G + g reads KV
                    head h), the cache's dtype, rows contiguous; post-RoPE
    k, v, tables, lengths, positions   as for ``compress_per_head``
    layer           the layer attended (tables' first axis)
    seqs            item i's sequence (int32 values, [items]); None: item i is sequence i
    scale           the softmax scale (default 1 / sqrt(d))
    out             [items, h_q, d] written in place (default: allocated)
    update          None; "squared": each attended token's squared probabilities,
                    summed over the group's query heads, added to ``metric``
                    (KV-Compress's decode-time metric); "probability": the plain sums
                    (H2O's accumulation)
    excluded_distance  a query at position p adds nothing to tokens at p - t <
                    excluded_distance (KV-Compress's); positions from ``positions``
                    (else the token's index), the query's from ``query_positions``
                    (else that of the head's last token)
    max_tokens      device: an upper bound of every attended head's length (sizes the
                    grid; 0: the tables' capacity); a longer head is an error
    stream, workspace, check   as for ``compress``; ``staged`` the split kernel that
                    stages K and V through shared memory (same results)
    describe        device: return the launch plan as text and run nothing

    Host arrays run the reference (kvp::host::decode_attention, fp64 accumulation), CUDA
    arrays kvp::cuda_decode_attention (bf16/f16, d 64 or 128; graph-capturable with
    device ``seqs``/``query_positions``). Returns a DecodeAttentionResult. Raises
    kvpolicy.Error naming the field before anything is written.
    """
    framework = _framework(k)
    device = int(k.__dlpack_device__()[1]) if is_device_array(k) else None
    if update is not None and metric is None:
        raise Error(f"kvpolicy: metric: is None; update={update!r} adds the probabilities to it", "metric")
    return _run(_core.host_decode_attention_per_head, getattr(_core, "device_decode_attention_per_head", None),
                (k, v, tables, lengths, metric, positions), framework, device, queries, layer=layer, seqs=seqs,
                scale=scale, out=out, update=update, excluded_distance=excluded_distance,
                query_positions=query_positions, max_tokens=max_tokens, stream=stream, workspace=workspace,
                staged=staged, check=check, describe=describe)


def decode_attention(
    queries,
    cache,
    *,
    layer: int = 0,
    seqs=None,
    scale: Optional[float] = None,
    out=None,
    counts=None,
    tail_from=None,
    update: Optional[str] = None,
    scores=None,
    excluded_distance: int = 0,
    query_positions=None,
    max_tokens: int = 0,
    stream=None,
    workspace=None,
    staged: bool = False,
    check: bool = True,
    describe: bool = False,
):
    """One new query token per sequence attending one layer of a ``kvpolicy.PagedCache``
    (one block table for every head): every head its sequence's tokens, minus those a
    ``live`` view (cautious update) marks dropped, or, with ``counts``, each head its own.

    counts          int32 [layers, seqs, h_kv]: a head-adaptive selector's kept counts
                    (Hard-KV after a compaction): head h attends tokens [0, counts) and
    tail_from       int32 [seqs]: the tokens appended since (from the compaction's new
                    length): [tail_from, length). Both or neither.
    update, scores  "probability": the group's summed probabilities added to ``scores``
                    (F, float32 [layers, num_blocks, b, h_kv]); "squared" the squares
    queries, layer, seqs, scale, out, excluded_distance, query_positions, max_tokens
    (0: the block table's capacity), stream, workspace, staged, check, describe
                    as for ``decode_attention_per_head``
    """
    if not isinstance(cache, _core.PagedCache):
        raise Error(f"kvpolicy: cache: is a {type(cache).__name__}; expected a kvpolicy.PagedCache", "cache")
    if update is not None and scores is None:
        raise Error(f"kvpolicy: scores: is None; update={update!r} adds the probabilities to it", "scores")
    return _run(_core.host_decode_attention, getattr(_core, "device_decode_attention", None),
                (cache, scores, counts, tail_from), cache.framework, cache.device, queries, layer=layer, seqs=seqs,
                scale=scale, out=out, update=update, excluded_distance=excluded_distance,
                query_positions=query_positions, max_tokens=max_tokens, stream=stream, workspace=workspace,
                staged=staged, check=check, describe=describe)


def decode_attention_workspace_bytes(queries, cache, *, max_tokens: int = 0, counts=None, tail_from=None,
                                     update: Optional[str] = None, scores=None, staged: bool = False) -> int:
    """Bytes of ``workspace`` a device ``decode_attention`` of these queries needs (host: 0):
    it depends on the items, the heads, ``max_tokens`` and whether a metric is written, so
    size it once for the largest batch and pass it to every call."""
    return _run(_core.host_decode_attention, getattr(_core, "device_decode_attention", None),
                (cache, scores, counts, tail_from), cache.framework, cache.device, queries, layer=0, seqs=None,
                scale=None, out=queries, update=update, excluded_distance=0, query_positions=None,
                max_tokens=max_tokens, stream=None, workspace=None, staged=staged, check=False, describe=False,
                size_only=True)


def decode_attention_per_head_workspace_bytes(queries, k, v, tables, lengths, *, max_tokens: int = 0,
                                              update: Optional[str] = None, metric=None, staged: bool = False) -> int:
    """Bytes of ``workspace`` a device ``decode_attention_per_head`` of these queries needs (host: 0)."""
    device = int(k.__dlpack_device__()[1]) if is_device_array(k) else None
    return _run(_core.host_decode_attention_per_head, getattr(_core, "device_decode_attention_per_head", None),
                (k, v, tables, lengths, metric, None), _framework(k), device, queries, layer=0, seqs=None,
                scale=None, out=queries, update=update, excluded_distance=0, query_positions=None,
                max_tokens=max_tokens, stream=None, workspace=None, staged=staged, check=False, describe=False,
                size_only=True)
