"""Which CUDA stream a call runs on: the caller's, or its framework's current one."""

from __future__ import annotations


def stream_handle(stream, framework: str, device: int) -> int:
    """The cudaStream_t (as an int) of `stream`.

    None: the current stream of the cache's framework (PyTorch, CuPy), else the
    legacy default stream 0. Otherwise an int handle, or an object that names its
    handle: ``__cuda_stream__()`` (the CUDA stream protocol), ``cuda_stream``
    (``torch.cuda.Stream``) or ``ptr`` (``cupy.cuda.Stream``).
    """
    if stream is None:
        if framework == "torch":
            import torch

            return int(torch.cuda.current_stream(device).cuda_stream)
        if framework == "cupy":
            import cupy

            with cupy.cuda.Device(device):
                return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream: expected a CUDA stream or its int handle, got a bool")
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()
        return int(handle[1] if isinstance(handle, tuple) else handle)
    for attribute in ("cuda_stream", "ptr"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise TypeError(
        f"stream: expected a CUDA stream (int handle, __cuda_stream__, .cuda_stream or .ptr), got {type(stream).__name__}"
    )
