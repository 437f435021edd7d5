"""torch.distributed as kvpolicy's communicator for tensor parallelism.

An engine that shards the KV heads over ranks (each rank holding its heads of every layer
and the same block tables) passes ``TorchDistributed(group)`` to ``kvpolicy.compress``
on each rank, with that rank's heads as the cache: the items' new lengths are reduced
(max) over the group before blocks are released, so every rank frees the same blocks and
each head keeps what one call over all heads would keep it (docs/integration.md, "Tensor
parallelism").

    import torch.distributed as dist
    from kvpolicy.integrations.torch_distributed import TorchDistributed
    r = kvpolicy.compress(kvpolicy.HardKV(), my_heads_cache, seqs=seqs, budgets=512,
                          queries=my_query_heads, communicator=TorchDistributed())
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..errors import Error

_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


class TorchDistributed:
    """``all_reduce(values, op)`` over ``group`` (default: the world), in place on a NumPy
    array. Gloo reduces host tensors directly; NCCL reduces on ``device`` (default the
    current CUDA device), the values copied there and back."""

    def __init__(self, group=None, device=None):
        if not dist.is_available() or not dist.is_initialized():
            raise Error("kvpolicy.integrations.torch_distributed: group: torch.distributed is not initialised "
                        "(call dist.init_process_group first)", "group")
        self.group = group
        self.on_device = dist.get_backend(group) == "nccl"
        if self.on_device and device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def all_reduce(self, values: np.ndarray, op: str) -> None:
        if op not in _OPS:
            raise Error(f"kvpolicy.integrations.torch_distributed: op: is {op!r}; expected 'max' or 'sum'", "op")
        host = torch.from_numpy(values)  # the executor's own buffer: reduced in place
        if not self.on_device:
            dist.all_reduce(host, op=_OPS[op], group=self.group)
            return
        on_device = host.to(self.device)
        dist.all_reduce(on_device, op=_OPS[op], group=self.group)
        host.copy_(on_device.cpu())
