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
from ._core import (GKV, H2O, LAYOUTS, RKV, HardKV, HardKVRKV, Kara, KVCompress, PagedCache, SnapKV, StreamingLLM,
                    Zipage, has_cuda)
from ._compress import CompressResult, compress, workspace_bytes
from ._decode_attention import (DecodeAttentionResult, decode_attention, decode_attention_per_head,
                                decode_attention_per_head_workspace_bytes, decode_attention_workspace_bytes)
from ._per_head import (MetricResult, PerHeadResult, blocks_to_free, compress_per_head, per_head_metric,
                        per_head_metric_workspace_bytes, per_head_workspace_bytes)
from .errors import Error

__version__ = "0.1.0"

PRESETS = {cls.name: cls for cls in (Zipage, RKV, GKV, SnapKV, H2O, StreamingLLM, HardKV, HardKVRKV, Kara)}
# Policies over a per-head block cache (compress_per_head), not a PagedCache.
PER_HEAD_PRESETS = {KVCompress.name: KVCompress}


def preset(name: str, **overrides):
    """The preset called ``name`` ("zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm",
    "hard_kv", "hard_kv_rkv", "kara", or "kv_compress" for compress_per_head),
    its published parameters overridden by keyword: ``preset("zipage", window=8)``."""
    cls = PRESETS.get(name) or PER_HEAD_PRESETS.get(name)
    if cls is None:
        names = ", ".join(map(repr, [*PRESETS, *PER_HEAD_PRESETS]))
        raise Error(f"kvpolicy: preset: is {name!r}; expected one of {names}", "preset")
    return cls(**overrides)


__all__ = [
    "CompressResult",
    "DecodeAttentionResult",
    "Error",
    "GKV",
    "H2O",
    "HardKV",
    "HardKVRKV",
    "Kara",
    "KVCompress",
    "LAYOUTS",
    "MetricResult",
    "PER_HEAD_PRESETS",
    "PRESETS",
    "PerHeadResult",
    "PagedCache",
    "RKV",
    "SnapKV",
    "StreamingLLM",
    "Zipage",
    "blocks_to_free",
    "compress",
    "compress_per_head",
    "decode_attention",
    "decode_attention_per_head",
    "decode_attention_per_head_workspace_bytes",
    "decode_attention_workspace_bytes",
    "has_cuda",
    "per_head_metric",
    "per_head_metric_workspace_bytes",
    "per_head_workspace_bytes",
    "preset",
    "workspace_bytes",
]
