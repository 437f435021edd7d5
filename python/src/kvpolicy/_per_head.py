"""kvpolicy.compress_per_head: KV-Compress over a per-head block cache, host or device."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from . import _core
from ._frameworks import DeviceAllocator, device_items, host_result, is_device_array
from ._streams import stream_handle
from .errors import Error


@dataclasses.dataclass
class PerHeadResult:
    """What a per-head compression returns, per batch item ``i``, layer ``l`` and KV head
    ``h`` (arrays of the cache's framework: NumPy for NumPy, PyTorch for PyTorch, ...).

    new_lengths[i, l, h]       tokens the head now holds (set ``lengths[l, seq, h]`` to it)
    freed_counts[i, l, h]      blocks the head gives up: its last ones in table order
    freed_blocks[i, l, h, j]   their physical ids, ``j < freed_counts[i, l, h]``; -1 after
                               (width ``max_blocks``, the tables' last axis)
    evicted[i, l, h]           tokens the head evicted
    moved[i, l, h]             tokens MoveCache copied into evicted slots
    freed[i]                   blocks the item freed in all (int64)
    nonfinite_metrics[i]       NaN or infinite metrics seen, protected ones included (int64)
    status                     the device path's 8 status words (None on the host)
    """

    new_lengths: Any
    freed_counts: Any
    freed_blocks: Any
    evicted: Any
    moved: Any
    freed: Any
    nonfinite_metrics: Any
    status: Any = None
    stream: Optional[int] = None

    def check(self) -> "PerHeadResult":
        """Raises the kvpolicy.Error a device validation found (waits for the stream)."""
        if self.status is not None:
            stream = self.stream
            if stream is None:
                stream = stream_handle(None, "torch", self.status.device.index)
            _core.check_device_status(self.status, stream)
        return self

    def released(self, i: int):
        """Every block item ``i`` freed (all its layers and heads, in (layer, head, table)
        order): the ids the engine returns to its pool. Reads a device result."""
        blocks = self.freed_blocks[i].reshape(-1)
        return blocks[blocks >= 0]


def _framework(x) -> str:
    return type(x).__module__.split(".")[0]


def _host_ints(name: str, value, n: Optional[int], allow_2d: bool = False) -> np.ndarray:
    if is_device_array(value):
        value = _to_host(value)
    a = np.asarray(value)
    if a.dtype.kind not in "iu":
        raise Error(f"kvpolicy: {name}: has element type {a.dtype}; expected integers", name)
    if a.ndim > (2 if allow_2d else 1):
        raise Error(f"kvpolicy: {name}: has shape {a.shape}; expected an int or one per item", name)
    if a.ndim >= 1 and n is not None and a.shape[0] != n and not (allow_2d and a.ndim == 1):
        raise Error(f"kvpolicy: {name}: has {a.shape[0]} entries; seqs has {n}", name)
    return a.astype(np.int64)


def _to_host(x) -> np.ndarray:
    """A device array's values on the host (waits for the framework's stream)."""
    if _framework(x) == "torch":
        return x.detach().cpu().numpy()
    if _framework(x) == "cupy":
        return x.get()
    raise Error(f"kvpolicy: {type(x).__name__}: a device array of this framework cannot be read back here", "seqs")


def _items(policy, lengths, block_size: int, seqs, blocks_to_free, logical_lengths, capturing) -> np.ndarray:
    """The int64 rows (seq, blocks_to_free, logical_length[, per-layer counts]) on the host."""
    seq = _host_ints("seqs", seqs, None).reshape(-1)
    n = seq.shape[0]
    logical = np.broadcast_to(_host_ints("logical_lengths", -1 if logical_lengths is None else logical_lengths, n),
                              (n,)).astype(np.int64)
    L = int(lengths.shape[0])
    per_layer = policy.budget == "layer"
    groups = L if per_layer else 1
    if blocks_to_free is None:
        if policy.max_cache_tokens < 0 and policy.compression_rate == 1.0:
            raise Error(
                "kvpolicy: blocks_to_free: is None and the policy has no budget (max_cache_tokens -1, "
                "compression_rate 1): set one of them or pass blocks_to_free",
                "blocks_to_free",
            )
        if is_device_array(lengths):
            if capturing():
                raise Error(
                    "kvpolicy: blocks_to_free: is None while the stream is being captured into a CUDA graph; the "
                    "policy's budget reads the lengths on the host: pass blocks_to_free (ints or a device array)",
                    "blocks_to_free",
                )
            host_lengths = np.ascontiguousarray(_to_host(lengths))
        else:
            host_lengths = np.asarray(lengths)
        counts = _core.kv_compress_blocks_to_free(policy, host_lengths, block_size,
                                                  np.ascontiguousarray(seq), np.ascontiguousarray(logical))
    else:
        b = _host_ints("blocks_to_free", blocks_to_free, n, allow_2d=True)
        if not per_layer and b.ndim == 2 and b.shape[1] != 1:  # [n, 1] is what blocks_to_free() returns
            raise Error(f"kvpolicy: blocks_to_free: has shape {b.shape}; the policy's budget is per sequence: an "
                        f"int, [{n}] or [{n}, 1]", "blocks_to_free")
        if not per_layer:
            b = b.reshape(-1, 1) if b.ndim else b.reshape(1, 1)
        try:
            counts = np.broadcast_to(b, (n, groups))
        except ValueError:
            want = f"[n, layers] = [{n}, {L}] (or an int, or [layers])" if per_layer else f"an int or [{n}]"
            raise Error(f"kvpolicy: blocks_to_free: has shape {b.shape}; expected {want}", "blocks_to_free") from None
    items = np.empty((n, 3 + (L if per_layer else 0)), dtype=np.int64)
    items[:, 0] = seq
    items[:, 1] = counts.sum(axis=1) if per_layer else counts[:, 0]
    items[:, 2] = logical
    if per_layer:
        items[:, 3:] = counts
    return items


def _device_items(policy, num_layers: int, seqs, blocks_to_free, logical_lengths, device: int, stream: int):
    """The rows built on the device by the framework of the device arrays among the item
    arguments, on the call's stream (a captured graph reads them at each replay)."""
    per_layer = policy.budget == "layer"
    named = {"seqs": seqs, "blocks_to_free": blocks_to_free,
             "logical_lengths": -1 if logical_lengths is None else logical_lengths}
    framework, xp, array = device_items(named, device, stream, "int64")

    with DeviceAllocator(framework, device, stream).on_stream():
        seq = array(seqs).reshape(-1)
        n = seq.shape[0]
        logical = array(named["logical_lengths"])
        counts = array(blocks_to_free)
        if logical.ndim > 1 or (logical.ndim == 1 and logical.shape[0] != n):
            raise Error(f"kvpolicy: logical_lengths: has shape {tuple(logical.shape)}; expected an int or {n} values",
                        "logical_lengths")
        groups = num_layers if per_layer else 1
        if not per_layer:
            if counts.ndim == 2 and counts.shape[1] == 1:  # [n, 1], as blocks_to_free() returns
                counts = counts.reshape(-1)
            if counts.ndim > 1 or (counts.ndim == 1 and counts.shape[0] != n):
                raise Error(f"kvpolicy: blocks_to_free: has shape {tuple(counts.shape)}; expected an int or {n} "
                            "values", "blocks_to_free")
            counts = counts.reshape(-1, 1) if counts.ndim else counts.reshape(1, 1)
        try:
            counts = xp.broadcast_to(counts, (n, groups))
        except (ValueError, RuntimeError):
            raise Error(f"kvpolicy: blocks_to_free: has shape {tuple(counts.shape)}; expected [n, layers] = "
                        f"[{n}, {num_layers}]", "blocks_to_free") from None
        logical = xp.broadcast_to(logical.reshape(-1) if logical.ndim else logical, (n,))
        columns = [seq, counts.sum(1) if per_layer else counts[:, 0], logical]
        rows = xp.stack(columns, 1)
        if per_layer:
            rows = xp.concatenate([rows, counts], 1)
        return xp.ascontiguousarray(rows) if framework == "cupy" else rows.contiguous()


def compress_per_head(
    policy,
    k,
    v,
    metric,
    tables,
    lengths,
    *,
    seqs,
    blocks_to_free=None,
    logical_lengths=None,
    positions=None,
    stream=None,
    workspace=None,
    check: bool = True,
    communicator=None,
    heads=None,
) -> PerHeadResult:
    """KV-Compress (``kvpolicy.KVCompress``) over a per-head block cache, in place.

    k, v            the block pool: [num_blocks, b, d] shared by every layer and KV head
                    (KV-Compress's unified cache: a block id names one block whatever its
                    layer), or [layers, num_blocks, b, d] with a pool per layer. float16,
                    bfloat16 or float32; any block and token strides, rows contiguous.
    metric          float32 [num_blocks, b] (or [layers, num_blocks, b]): each slot's
                    eviction metric, moved with its token (the engine writes it)
    tables          int32 [layers, seqs, h_kv, max_blocks]: each head's block ids
    lengths         int32 [layers, seqs, h_kv]: tokens each head holds
    seqs            the sequences to compress: int or [n]
    blocks_to_free  the most blocks each item frees: an int or [n] (budget "sequence"), or
                    per layer [n, layers] (budget "layer"; an int or [layers] broadcast).
                    No head frees a block holding a protected token (the last
                    protected_window positions, the first sinks), so an item asked for
                    more frees all it can (``r.freed[i]`` says how many), as KV-Compress
                    does before a preemption.
                    None: from the policy's max_cache_tokens or compression_rate and
                    the lengths (read on the host: a device call copies them back, which
                    a CUDA graph capture cannot do).
    logical_lengths each sequence's position count (int or [n]); needed with positions.
                    Default -1: each head's own length (slot t is position t, true until
                    a first MoveCache: pass positions to compress a sequence again),
                    and for the policy's budget the longest head's length
    positions       optional int32, the metric's shape: each slot's original position
                    (moved with it; the protected window is read off it)
    stream, workspace, check   as for ``compress`` (``per_head_workspace_bytes``)
    communicator, heads   tensor parallelism (host caches): the tensors hold this rank's
                    KV heads, ``heads = (first, total)`` says which of all ranks' heads,
                    and ``communicator`` (as for ``compress``) makes the block cut global:
                    each head frees what one call over all heads frees it. Pass
                    ``blocks_to_free`` (the whole sequence's, from every rank's lengths).

    Returns a PerHeadResult. Raises kvpolicy.Error (``.field`` names the argument)
    before anything is written. Tables and lengths are not written: the engine sets
    ``lengths[l, seqs[i], h] = r.new_lengths[i, l, h]`` and frees ``r.released(i)``.
    """
    if not isinstance(policy, _core.KVCompress):
        raise Error(f"kvpolicy: policy: is a {type(policy).__name__}; compress_per_head runs kvpolicy.KVCompress",
                    "policy")
    if is_device_array(k) and not _core.has_cuda:
        raise Error("kvpolicy: k: lives on CUDA device; this kvpolicy was built without its CUDA path "
                    "(KVPOLICY_PYTHON_CUDA=OFF or no nvcc)", "k")
    for name, x in (("k", k), ("v", v), ("metric", metric), ("tables", tables), ("lengths", lengths)):
        if not hasattr(x, "shape") or not hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
            raise Error(f"kvpolicy: {name}: is {type(x).__name__}; expected an array (NumPy, PyTorch, CuPy or another "
                        "DLPack array)", name)
    if len(lengths.shape) != 3:
        raise Error(f"kvpolicy: lengths: has shape {tuple(lengths.shape)}; expected 3 axes [layers, seqs, kv_heads]",
                    "lengths")
    if len(tables.shape) != 4:
        raise Error(f"kvpolicy: tables: has shape {tuple(tables.shape)}; expected 4 axes [layers, seqs, kv_heads, "
                    "max_blocks]", "tables")
    device = is_device_array(k)
    block_size = int(k.shape[-2]) if hasattr(k, "shape") and len(k.shape) >= 2 else 0
    first, total = _ranks(communicator, heads, blocks_to_free, device, int(lengths.shape[2]))
    if not device:
        items = _items(policy, lengths, block_size, seqs, blocks_to_free, logical_lengths, lambda: False)
        out = _core.host_compress_per_head(policy, k, v, metric, tables, lengths, positions, items, communicator,
                                           first, total)
        framework = _framework(k)
        return PerHeadResult(**{name: host_result(a, framework) for name, a in out.items()})

    framework = _framework(k)
    index = int(k.__dlpack_device__()[1])
    h = stream_handle(stream, framework, index)
    capturing = _core.stream_is_capturing(h)
    if check and capturing:
        raise Error(
            "kvpolicy: check: is True while the stream is being captured into a CUDA graph; a check waits for the "
            "device: pass check=False and call result.check() after a replay",
            "check",
        )
    if any(is_device_array(x) for x in (seqs, blocks_to_free, logical_lengths)):
        if blocks_to_free is None:
            raise Error("kvpolicy: blocks_to_free: is None next to device item arrays; pass the counts "
                        "(blocks_to_free(policy, ...) computes them on the host)", "blocks_to_free")
        items = _device_items(policy, int(tables.shape[0]), seqs, blocks_to_free, logical_lengths, index, h)
    else:
        items = _items(policy, lengths, block_size, seqs, blocks_to_free, logical_lengths, lambda: capturing)
    need = _core.device_per_head_workspace_bytes(policy, k, v, metric, tables, lengths, positions, items)
    alloc = DeviceAllocator(framework, index, h)
    n = int(items.shape[0])
    rows = (n, int(tables.shape[0]), int(tables.shape[2]))
    out = {
        "status": alloc.empty((8,), "int32"),
        "new_lengths": alloc.empty(rows, "int32"),
        "freed_counts": alloc.empty(rows, "int32"),
        "freed_blocks": alloc.empty(rows + (int(tables.shape[3]),), "int32"),
        "evicted": alloc.empty(rows, "int32"),
        "moved": alloc.empty(rows, "int32"),
        "freed": alloc.empty((n,), "int64"),
        "nonfinite_metrics": alloc.empty((n,), "int64"),
    }
    if workspace is None:
        workspace = alloc.empty((need,), "uint8")
    _core.device_compress_per_head(policy, k, v, metric, tables, lengths, positions, items, out, workspace, h, check)
    return PerHeadResult(**out, stream=h)


def _ranks(communicator, heads, blocks_to_free, device: bool, kv_heads: int):
    """(first, total) of this rank's heads; (0, 0) without a communicator."""
    if communicator is None:
        if heads is not None:
            raise Error("kvpolicy: heads: is given without a communicator; tensor parallelism needs both", "heads")
        return 0, 0
    if not callable(getattr(communicator, "all_reduce", None)):
        raise Error(f"kvpolicy: communicator: is a {type(communicator).__name__}; expected an object with "
                    "all_reduce(array, op)", "communicator")
    if device:
        raise Error("kvpolicy: communicator: the CUDA path takes no communicator yet (tensor parallelism runs on the "
                    "host executor so far)", "communicator")
    if blocks_to_free is None:
        raise Error("kvpolicy: blocks_to_free: is None with a communicator; the policy's budget would count only "
                    "this rank's heads: pass the whole sequence's count", "blocks_to_free")
    try:
        first, total = (int(x) for x in heads)
    except (TypeError, ValueError):
        raise Error(f"kvpolicy: heads: is {heads!r}; expected (first, total): this rank's first KV head and every "
                    "rank's KV heads", "heads") from None
    if first < 0 or first + kv_heads > total:
        raise Error(f"kvpolicy: heads: ({first}, {total}) does not hold this rank's {kv_heads} KV heads", "heads")
    return first, total


def per_head_workspace_bytes(policy, k, v, metric, tables, lengths, *, num_items: int, positions=None) -> int:
    """Bytes of ``workspace`` a device ``compress_per_head`` of ``num_items`` items needs
    (host: 0). Allocate it once for the largest batch and pass it to every call."""
    if not is_device_array(k):
        return 0
    columns = 3 + (int(tables.shape[0]) if policy.budget == "layer" else 0)
    items = np.zeros((num_items, columns), dtype=np.int64)
    return _core.device_per_head_workspace_bytes(policy, k, v, metric, tables, lengths, positions, items)


def blocks_to_free(policy, lengths, block_size: int, seqs, logical_lengths=None) -> np.ndarray:
    """The blocks the policy's budget frees for each of ``seqs``, read off ``lengths``
    (int32 [layers, seqs, h_kv], host; a device array is copied back): int64 [n, 1]
    (budget "sequence") or [n, layers] (budget "layer"). ``logical_lengths``: each
    sequence's position count (default -1: its longest head's length)."""
    if not isinstance(policy, _core.KVCompress):
        raise Error(f"kvpolicy: policy: is a {type(policy).__name__}; expected kvpolicy.KVCompress", "policy")
    seq = _host_ints("seqs", seqs, None).reshape(-1)
    n = seq.shape[0]
    logical = np.broadcast_to(_host_ints("logical_lengths", -1 if logical_lengths is None else logical_lengths, n),
                              (n,)).astype(np.int64)
    host = np.ascontiguousarray(_to_host(lengths)) if is_device_array(lengths) else np.asarray(lengths)
    return _core.kv_compress_blocks_to_free(policy, host, int(block_size), np.ascontiguousarray(seq),
                                            np.ascontiguousarray(logical))


@dataclasses.dataclass
class MetricResult:
    """What ``per_head_metric`` returns: on the device its 8 status words (``check()``
    waits for the stream and raises what they hold); on the host nothing to check."""

    status: Any = None
    stream: Optional[int] = None

    def check(self) -> "MetricResult":
        if self.status is not None:
            _core.check_device_status(self.status, self.stream)
        return self


def _metric_items(seqs, query_slots, query_positions):
    for name, x in (("seqs", seqs), ("query_slots", query_slots), ("query_positions", query_positions)):
        if is_device_array(x):
            raise Error(f"kvpolicy: {name}: lives on a CUDA device; per_head_metric takes host values (ints, lists, "
                        "NumPy), passed to the kernels as arguments", name)
    seq = _host_ints("seqs", seqs, None).reshape(-1)
    n = seq.shape[0]
    columns = []
    for name, x in (("seqs", seq), ("query_slots", seq if query_slots is None else query_slots),
                    ("query_positions", -1 if query_positions is None else query_positions)):
        a = np.broadcast_to(_host_ints(name, x, n), (n,))
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise Error(f"kvpolicy: {name}: holds a value out of the int32 range", name)
        if name == "query_positions" and query_positions is not None and a.size and a.min() < 0:
            raise Error(f"kvpolicy: query_positions: holds {a.min()}; positions are not negative (None: each "
                        "head's last token)", name)
        columns.append(np.ascontiguousarray(a, dtype=np.int32))
    return columns


def _mode(mode: str) -> bool:
    if mode not in ("prefill", "decode"):
        raise Error(f"kvpolicy: mode: is {mode!r}; expected 'prefill' or 'decode'", "mode")
    return mode == "prefill"


def per_head_metric(
    policy,
    queries,
    k,
    metric,
    tables,
    lengths,
    *,
    seqs,
    query_slots=None,
    mode: str = "prefill",
    positions=None,
    query_positions=None,
    stream=None,
    workspace=None,
    check: bool = True,
) -> MetricResult:
    """KV-Compress's metric (``policy.metric_window``, ``pool_kernel``,
    ``excluded_distance``) written into ``metric`` for every head of ``seqs``.

    queries         [layers, slots, window, h_q, d] (h_q a multiple of h_kv; query head
                    h * G + g belongs to KV head h): each item's slot holds its newest
                    queries, oldest first (entry window - 1 is the newest)
    k, metric, tables, lengths, positions   as for compress_per_head
    mode            "prefill": each head's metric is overwritten from the slot's last
                    min(metric_window, length) queries (causal softmax, squared, summed,
                    max-pooled per query head, summed over the group); "decode": the
                    slot's newest query's squared probabilities, summed over the group,
                    are added (its key must already be in the cache)
    seqs, query_slots (default seqs), query_positions (decode: the query's position per
                    item, for the excluded distance; None: each head's last token): host
                    values (ints, lists, NumPy), fixed at a CUDA graph capture
    stream, workspace (per_head_metric_workspace_bytes), check   as for compress

    Host arrays run scorer::squared_attention_metric row by row, CUDA arrays
    kvp::cuda_per_head_metric. Raises kvpolicy.Error naming the field before writing.
    """
    if not isinstance(policy, _core.KVCompress):
        raise Error(f"kvpolicy: policy: is a {type(policy).__name__}; per_head_metric runs kvpolicy.KVCompress",
                    "policy")
    prefill = _mode(mode)
    if is_device_array(k) and not _core.has_cuda:
        raise Error("kvpolicy: k: lives on CUDA device; this kvpolicy was built without its CUDA path "
                    "(KVPOLICY_PYTHON_CUDA=OFF or no nvcc)", "k")
    seq, slots, qpos = _metric_items(seqs, query_slots, query_positions)
    if not is_device_array(k):
        _core.host_per_head_metric(policy, queries, k, metric, tables, lengths, positions, seq, slots, qpos, prefill)
        return MetricResult()
    framework = _framework(k)
    index = int(k.__dlpack_device__()[1])
    h = stream_handle(stream, framework, index)
    if check and _core.stream_is_capturing(h):
        raise Error(
            "kvpolicy: check: is True while the stream is being captured into a CUDA graph; a check waits for the "
            "device: pass check=False and call result.check() after a replay",
            "check",
        )
    need = _core.device_per_head_metric_workspace_bytes(policy, queries, k, metric, tables, lengths, positions,
                                                        int(seq.shape[0]), prefill)
    alloc = DeviceAllocator(framework, index, h)
    status = alloc.empty((8,), "int32")
    if workspace is None:
        workspace = alloc.empty((need,), "uint8")
    _core.device_per_head_metric(policy, queries, k, metric, tables, lengths, positions, seq, slots, qpos, prefill,
                                 status, workspace, h, check)
    return MetricResult(status=status, stream=h)


def per_head_metric_workspace_bytes(policy, queries, k, metric, tables, lengths, *, num_items: int,
                                    mode: str = "prefill", positions=None) -> int:
    """Bytes of ``workspace`` a device ``per_head_metric`` of ``num_items`` items needs (host: 0)."""
    if not is_device_array(k):
        return 0
    return _core.device_per_head_metric_workspace_bytes(policy, queries, k, metric, tables, lengths, positions,
                                                        int(num_items), _mode(mode))
