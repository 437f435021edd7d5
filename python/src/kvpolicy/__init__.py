"""kvpolicy: composable KV-cache compression policies on an engine's own paged cache.

    import kvpolicy
    cache = kvpolicy.PagedCache("vllm_flash", kv_layers, block_table=tables, lengths=lens)
    r = kvpolicy.compress(kvpolicy.SnapKV(), cache, seqs=[0, 3], budgets=256, queries=q)
    # r.new_lengths, r.released_blocks: the engine updates its lengths and block table

Arrays are any DLPack arrays (NumPy, PyTorch, CuPy, ...), read and written in place:
host memory runs on the C++ host executor, CUDA memory on the CUDA executor on the
caller's stream. ``kvpolicy.torch_ops`` registers the call as a PyTorch custom op.
"""

from . import errors  # first: the compiled core raises kvpolicy.errors.Error
from ._core import (GKV, H2O, LAYOUTS, RKV, HardKV, HardKVRKV, Kara, PagedCache, SnapKV, StreamingLLM, Zipage,
                    has_cuda)
from ._compress import CompressResult, compress, workspace_bytes
from .errors import Error

__version__ = "0.1.0"

PRESETS = {cls.name: cls for cls in (Zipage, RKV, GKV, SnapKV, H2O, StreamingLLM, HardKV, HardKVRKV, Kara)}


def preset(name: str, **overrides):
    """The preset called ``name`` ("zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm",
    "hard_kv", "hard_kv_rkv", "kara"),
    its published parameters overridden by keyword: ``preset("zipage", window=8)``."""
    try:
        cls = PRESETS[name]
    except KeyError:
        raise Error(f"kvpolicy: preset: is {name!r}; expected one of {', '.join(map(repr, PRESETS))}", "preset") from None
    return cls(**overrides)


__all__ = [
    "CompressResult",
    "Error",
    "GKV",
    "H2O",
    "HardKV",
    "HardKVRKV",
    "Kara",
    "LAYOUTS",
    "PRESETS",
    "PagedCache",
    "RKV",
    "SnapKV",
    "StreamingLLM",
    "Zipage",
    "compress",
    "has_cuda",
    "preset",
    "workspace_bytes",
]
