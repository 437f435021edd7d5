"""kvpolicy.compress (and run, workspace_bytes): one call, host or device, on the caller's own tensors."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import numpy as np

from . import _core
from ._frameworks import DeviceAllocator, device_items, host_result, is_device_array
from ._streams import stream_handle
from .errors import Error

# The five columns of a batch item, in kvp::batch_item's memory order (csrc/items.hpp
# asserts it): one int32 row per item. _device_items keeps the same order. window_begin
# is compress's window_begins: 0 unless the preset compresses a window (Kara).
_ITEM_COLUMNS = ("seq", "query_slot", "budget", "history_tokens", "window_begin")


@dataclasses.dataclass
class CompressResult:
    """What a compression returns, per batch item ``i`` (arrays of the cache's framework).

    new_lengths[i]          tokens the sequence now holds (set ``lengths[seq]`` to it)
    released_counts[i]      how many blocks it released
    released_blocks[i, j]   the released physical block ids, ``j < released_counts[i]``;
                            -1 after them (width ``ceil(max_tokens / block_size)``)
    kept_counts[i, l, h]    tokens each (layer, KV head) keeps (layers of the call)
    nonfinite_scores[i]     NaN or infinite candidate scores seen
    keep_masks[i, l, h, t]  1 where token t was kept, 0 past the sequence's length
                            (only with ``return_masks=True``; width ``max_tokens``)
    scores[i, l, h, t]      final scores after protect (only with ``return_scores=True``)
    status                  the device path's 8 status words (None on the host)

    A window-only preset (Kara) returns masks and scores over the item's window only:
    entry t is token ``window_begins[i] + t`` of the sequence, for t < T - window_begins[i],
    0 after (the width stays the same); new_lengths and kept_counts count from the
    sequence's start, the tokens before the window included.

    On the device these are device arrays written asynchronously on the call's stream;
    read them after it (``check()`` waits for it and raises what the status holds).
    """

    new_lengths: Any
    released_counts: Any
    released_blocks: Any
    kept_counts: Any
    nonfinite_scores: Any
    keep_masks: Any = None
    scores: Any = None
    status: Any = None
    stream: Optional[int] = None

    def check(self) -> "CompressResult":
        """Raises the kvpolicy.Error a device validation found (waits for the stream).

        On the host every error was raised by ``compress`` already: nothing to do.
        """
        if self.status is not None:
            stream = self.stream
            if stream is None:  # from torch_ops: the stream current when checking
                stream = stream_handle(None, "torch", self.status.device.index)
            _core.check_device_status(self.status, stream)
        return self

    def released(self, i: int):
        """Item ``i``'s released blocks (reads its count: waits for a device result)."""
        return self.released_blocks[i, : int(self.released_counts[i])]


def _column(name: str, value, n: Optional[int]):
    """One item column as int64 host values (a scalar broadcast to n)."""
    if value is None:
        raise Error(f"kvpolicy: {name}: is None; an int or one per item is needed", name)
    if is_device_array(value):
        raise Error(f"kvpolicy: {name}: lives on a CUDA device; the host path reads host memory", name)
    a = np.asarray(value)
    if a.dtype.kind not in "iu":
        raise Error(f"kvpolicy: {name}: has element type {a.dtype}; expected integers", name)
    if a.ndim > 1:
        raise Error(f"kvpolicy: {name}: has shape {a.shape}; expected an int or a vector", name)
    if a.ndim == 1 and n is not None and a.shape[0] != n:
        raise Error(f"kvpolicy: {name}: has {a.shape[0]} entries; seqs has {n}", name)
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise Error(f"kvpolicy: {name}: holds {a.max() if a.max() > 0 else a.min()}; out of the int32 range", name)
    return a.astype(np.int64)


def _host_items(seqs, budgets, history_tokens, query_slots, window_begins=0) -> np.ndarray:
    seq = _column("seqs", seqs, None)
    if seq.ndim == 0:
        seq = seq.reshape(1)
    n = seq.shape[0]
    columns = {
        "seq": seq,
        "query_slot": seq if query_slots is None else _column("query_slots", query_slots, n),
        "budget": _column("budgets", budgets, n),
        "history_tokens": _column("history_tokens", history_tokens, n),
        "window_begin": _column("window_begins", window_begins, n),
    }
    items = np.empty((n, len(_ITEM_COLUMNS)), dtype=np.int32)
    for j, name in enumerate(_ITEM_COLUMNS):
        items[:, j] = np.broadcast_to(columns[name], (n,))
    return items


def _device_items(seqs, budgets, history_tokens, query_slots, device: int, stream: int, window_begins=0):
    """Items built on the device by the framework of the device arrays among them, on
    the call's stream (no host round trip: a captured graph reads them at each replay;
    device_items says what each kind of argument becomes)."""
    named = {"seqs": seqs, "budgets": budgets, "history_tokens": history_tokens,
             "query_slots": seqs if query_slots is None else query_slots, "window_begins": window_begins}
    framework, xp, array = device_items(named, device, stream, "int32")
    # Every kernel (casts, fills, the stack) on the call's stream: ordered with the
    # compression, and recorded by a capture of that stream.
    with DeviceAllocator(framework, device, stream).on_stream():
        columns = {name: array(x) for name, x in named.items()}
        n = columns["seqs"].reshape(-1).shape[0]
        for name, x in columns.items():
            if x.ndim > 1 or (x.ndim == 1 and x.shape[0] != n):
                raise Error(f"kvpolicy: {name}: has shape {tuple(x.shape)}; expected an int or {n} values", name)
        rows = [xp.broadcast_to(columns[name].reshape(-1) if columns[name].ndim else columns[name], (n,))
                for name in ("seqs", "query_slots", "budgets", "history_tokens", "window_begins")]
        return xp.stack(rows, 1)  # a new, contiguous [n, 5]


def _items(seqs, budgets, history_tokens, query_slots, cache, stream, window_begins=0):
    if cache.device is not None and any(
        is_device_array(x) for x in (seqs, budgets, history_tokens, query_slots, window_begins)
    ):
        return _device_items(seqs, budgets, history_tokens, query_slots, cache.device,
                             stream_handle(stream, cache.framework, cache.device), window_begins)
    return _host_items(seqs, budgets, history_tokens, query_slots, window_begins)


def compress(
    policy,
    cache: _core.PagedCache,
    *,
    seqs,
    budgets,
    history_tokens=0,
    query_slots=None,
    window_begins=0,
    queries=None,
    scores=None,
    layer_begin: int = 0,
    layer_count: int = 0,
    max_tokens: Optional[int] = None,
    return_masks: bool = False,
    return_scores: bool = False,
    stream=None,
    workspace=None,
    check: bool = True,
    communicator=None,
) -> CompressResult:
    """Compresses the sequences ``seqs`` of ``cache`` in place with ``policy``.

    policy          a preset: ``kvpolicy.Zipage(window=8)``, ``kvpolicy.preset("snapkv")``, ...
    cache           a ``kvpolicy.PagedCache`` over the engine's tensors (host or CUDA)
    seqs            the sequences (rows of the block table) to compress: int or [n]
    budgets         tokens each (layer, KV head) keeps: int or [n]
    history_tokens  leading tokens whose F holds an earlier score (0: never compressed)
    query_slots     each item's slot of ``queries`` (default: its seq)
    window_begins   a window-only preset (Kara): each item's window starts at this token,
                    a multiple of the block size: int or [n] (default 0). The pipeline
                    runs over [window_begins[i], T): budgets and history_tokens count
                    within the window, the slot holds the window's own |W| queries
                    (positions window_begins[i] to window_begins[i] + |W| - 1, oldest
                    first), nothing before the window is read or written. Any other
                    preset needs 0 (kvpolicy.Error, field ``batch[i].window_begin``).
    queries         the observation queries [L, slots, window, h_q, d] (attention presets)
    scores          F, float32 [L, num_blocks, block_size, h_kv] (Zipage, G-KV, H2O)
    layer_begin, layer_count   the layers to compress (0: all from layer_begin on)
    max_tokens      width of the per-token results; on the device an upper bound of the
                    batch's lengths (default ``cache.max_tokens``: the table's room)
    return_masks, return_scores   also return keep masks / final scores; a window-only
                    preset's cover the window: entry t is token window_begins[i] + t
                    (shape [n, L, h_kv, max_tokens] as for every preset, 0 past the
                    window's T - window_begins[i] entries)
    stream          device: the CUDA stream (default: the framework's current stream)
    workspace       device: a contiguous device array of at least ``workspace_bytes(...)``
                    bytes (default: allocated by the cache's framework)
    check           device: wait for the stream and raise the error a device-side
                    validation found. ``False`` returns without waiting (needed under
                    CUDA graph capture); call ``result.check()`` later.
    communicator    tensor parallelism (host caches): ``cache``, ``queries`` and
                    ``scores`` hold this rank's KV heads, and ``communicator`` (an object
                    with ``all_reduce(array, "max" | "sum")`` reducing a NumPy array in
                    place over every rank, e.g.
                    ``kvpolicy.integrations.torch_distributed.TorchDistributed()``)
                    makes the new lengths and released blocks those of all heads. Every
                    rank makes the same call; each head ends as one call over all heads
                    leaves it.

    Items may be device arrays (PyTorch or CuPy) on the device path, and are then
    read there; host values are baked into the launch (and into a captured graph).
    Under CUDA graph capture, items next to device ones must be device arrays or ints
    (a host list or NumPy array there raises kvpolicy.Error: it would need a copy).

    Raises kvpolicy.Error (``.field`` names the argument) before anything is written.
    The cache's lengths and block table are the engine's to update afterwards.
    """
    items = _items(seqs, budgets, history_tokens, query_slots, cache, stream, window_begins)
    return run(
        policy,
        cache,
        items,
        queries=queries,
        scores=scores,
        layer_begin=layer_begin,
        layer_count=layer_count,
        max_tokens=max_tokens,
        return_masks=return_masks,
        return_scores=return_scores,
        stream=stream,
        workspace=workspace,
        check=check,
        communicator=communicator,
    )


def run(
    policy,
    cache: _core.PagedCache,
    items,
    *,
    queries=None,
    scores=None,
    layer_begin: int = 0,
    layer_count: int = 0,
    max_tokens: Optional[int] = None,
    return_masks: bool = False,
    return_scores: bool = False,
    stream=None,
    workspace=None,
    check: bool = True,
    communicator=None,
) -> CompressResult:
    """``compress`` with the items as one int32 array [n, 5] of rows (seq, query_slot,
    budget, history_tokens, window_begin), host or device: what the torch op passes."""
    with _naming_keywords():
        return _run(policy, cache, items, queries, scores, layer_begin, layer_count, max_tokens, return_masks,
                    return_scores, stream, workspace, check, communicator)


# The library names a missing view by its field (scores.base); a Python caller needs the
# keyword that supplies it.
_KEYWORD_FOR_FIELD = {
    "scores.base": "pass scores=F, float32 [L, num_blocks, block_size, h_kv] beside the cache (zeros until a "
    "sequence's first compression, then kept: the library updates it)",
    "queries.base": "pass queries=, the observation queries [L, slots, window, h_q, d] (each sequence's last "
    "window post-RoPE queries, in its query slot)",
}


@contextlib.contextmanager
def _naming_keywords():
    try:
        yield
    except Error as e:
        hint = _KEYWORD_FOR_FIELD.get(e.field)
        if hint is None:
            raise
        raise Error(f"{e}: {hint}", e.field) from None


def _run(policy, cache, items, queries, scores, layer_begin, layer_count, max_tokens, return_masks, return_scores,
         stream, workspace, check, communicator=None) -> CompressResult:
    if communicator is not None and not callable(getattr(communicator, "all_reduce", None)):
        raise Error(f"kvpolicy: communicator: is a {type(communicator).__name__}; expected an object with "
                    "all_reduce(array, op)", "communicator")
    if cache.device is None:
        out = _core.host_compress(
            policy, cache, items, queries, scores, layer_begin, layer_count, max_tokens or 0, return_masks,
            return_scores, communicator
        )
        return CompressResult(**{name: host_result(a, cache.framework) for name, a in out.items()})

    if communicator is not None:
        raise Error("kvpolicy: communicator: the CUDA path takes no communicator yet (tensor parallelism runs on "
                    "the host executor so far): compress each rank's heads on the host, or wait for the device "
                    "path", "communicator")
    h = stream_handle(stream, cache.framework, cache.device)
    if check and _core.stream_is_capturing(h):
        raise Error(
            "kvpolicy: check: is True while the stream is being captured into a CUDA graph; a check waits for the "
            "device: pass check=False and call result.check() after a replay",
            "check",
        )
    width = max_tokens or cache.max_tokens
    # Sizing runs every host-side check (shapes, layers, policy) before any allocation.
    need = _core.device_workspace_bytes(
        policy, cache, items, queries, scores, layer_begin, layer_count, width, return_masks
    )
    alloc = DeviceAllocator(cache.framework, cache.device, h)
    n = int(items.shape[0])
    rows = (n, layer_count or cache.num_layers - layer_begin, cache.num_kv_heads)
    out = {
        "status": alloc.empty((8,), "int32"),
        "new_lengths": alloc.empty((n,), "int32"),
        "released_counts": alloc.empty((n,), "int32"),
        "released_blocks": alloc.empty((n, -(-width // cache.block_size)), "int32"),
        "kept_counts": alloc.empty(rows, "int32"),
        "nonfinite_scores": alloc.empty((n,), "int32"),
        "keep_masks": alloc.empty(rows + (width,), "uint8") if return_masks else None,
        "scores": alloc.empty(rows + (width,), "float32") if return_scores else None,
    }
    if workspace is None:
        workspace = alloc.empty((need,), "uint8")
    _core.device_compress(
        policy, cache, items, queries, scores, layer_begin, layer_count, width, out, workspace, h, check
    )
    return CompressResult(**out, stream=h)


def workspace_bytes(
    policy,
    cache: _core.PagedCache,
    *,
    num_items: int,
    queries=None,
    scores=None,
    layer_begin: int = 0,
    layer_count: int = 0,
    max_tokens: Optional[int] = None,
    return_masks: bool = False,
) -> int:
    """Bytes of ``workspace`` a device ``compress`` of ``num_items`` items needs (host: 0).

    Allocate it once for the largest batch and pass it to every call (and to a captured
    one: the graph then reads the same buffer on each replay).
    """
    if cache.device is None:
        return 0
    items = np.zeros((num_items, len(_ITEM_COLUMNS)), dtype=np.int32)
    with _naming_keywords():
        return _core.device_workspace_bytes(
            policy, cache, items, queries, scores, layer_begin, layer_count, max_tokens or cache.max_tokens,
            return_masks
        )
