"""Arrays in the caller's framework: device allocations and host results.

Device buffers (results, workspace) are allocated by the framework the cache comes
from, so that its allocator owns them: PyTorch's caching allocator (a captured
``torch.cuda.graph`` then takes them from the graph's pool), CuPy's memory pool.
Any other DLPack framework gets memory from ``cudaMallocAsync`` on the call's
stream, freed on that stream, as arrays that support ``__dlpack__``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import _core
from .errors import Error


def is_device_array(x) -> bool:
    """Whether `x` is a DLPack array in CUDA memory (device or managed)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        kind = dev()[0]
    except Exception:  # a framework that cannot say: treat it as host
        return False
    return int(kind) in (2, 13)


class DeviceAllocator:
    """Allocates on `device`, ordered on the call's stream, with `framework`."""

    def __init__(self, framework: str, device: int, stream: int):
        self.framework, self.device, self.stream = framework, device, stream

    @contextlib.contextmanager
    def on_stream(self):
        # The framework's allocator ties a block to its current stream: make that the
        # call's stream while allocating, so a block is not reused before the call ends
        # (and the framework's kernels, e.g. building the items, run on that stream).
        if self.framework == "torch":
            import torch

            if int(torch.cuda.current_stream(self.device).cuda_stream) == self.stream:
                yield
            else:
                with torch.cuda.stream(torch.cuda.ExternalStream(self.stream, device=self.device)):
                    yield
        elif self.framework == "cupy":
            import cupy

            with cupy.cuda.Device(self.device):
                if int(cupy.cuda.get_current_stream().ptr) == self.stream:
                    yield
                else:
                    with cupy.cuda.ExternalStream(self.stream):
                        yield
        else:
            yield

    def empty(self, shape, dtype: str):
        shape = tuple(int(s) for s in shape)
        with self.on_stream():
            if self.framework == "torch":
                import torch

                return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{self.device}")
            if self.framework == "cupy":
                import cupy

                return cupy.empty(shape, dtype=dtype)
        return _core.device_empty(list(shape), dtype, self.device, self.stream)


def host_result(array: np.ndarray, framework: str):
    """A NumPy result in the cache's framework (PyTorch CPU tensors share the memory)."""
    if framework == "torch":
        import torch

        return torch.from_numpy(array)
    return array


def device_items(named: dict, device: int, stream: int, dtype: str):
    """For a call's item arguments (`named`: name -> value), some of them device arrays:
    the framework they come from, its array module, and a function that turns each
    argument into a device array of `dtype` ("int32" or "int64") on `device`, without
    a host round trip. Device arrays are cast on the device; a Python int is a fill
    (no copy: under capture its value is part of the graph). Host vectors (lists,
    NumPy) are copied, which a CUDA graph capture cannot do from pageable memory:
    while the stream is capturing they raise kvpolicy.Error. Call the function inside
    DeviceAllocator(framework, device, stream).on_stream()."""
    kinds = {type(x).__module__.split(".")[0] for x in named.values() if is_device_array(x)}
    if kinds not in ({"torch"}, {"cupy"}):
        raise Error(
            f"kvpolicy: seqs: device item arrays come from {sorted(kinds)}; they may be PyTorch or CuPy arrays "
            "(one of them), or host values (ints, lists, NumPy)",
            "seqs",
        )
    capturing = None
    for name, x in named.items():
        if is_device_array(x) or isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            continue
        if capturing is None:
            capturing = _core.stream_is_capturing(stream)
        if capturing:
            raise Error(
                f"kvpolicy: {name}: is a host array ({type(x).__name__}) while the stream is being captured into a "
                "CUDA graph, next to items on the device; a capture cannot copy it there: pass it as a device array "
                "(PyTorch or CuPy) or an int",
                name,
            )
    framework = kinds.pop()
    if framework == "torch":
        import torch as xp

        kind = getattr(xp, dtype)

        def array(x):
            if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
                return xp.full((), int(x), dtype=kind, device=f"cuda:{device}")
            return xp.as_tensor(x, device=f"cuda:{device}").to(kind)
    else:
        import cupy as xp

        kind = getattr(xp, dtype)

        def array(x):
            if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
                return xp.full((), int(x), dtype=kind)
            return xp.asarray(x).astype(kind)

    return framework, xp, array
