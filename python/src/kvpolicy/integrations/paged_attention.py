"""Paged attention over transformers' continuous-batching cache, planned once per engine step.

The transformers adapter (``Adapter(..., attention="flashinfer" | "torch")``) runs the
attention of the engine's forward itself with one of these backends, instead of the engine's
``paged|sdpa``, which gathers every running request's whole K/V into a dense tensor and
builds a [tokens, all keys] mask each step. A backend is planned once per step from the
batch (each request's blocks, its cache length before the step and its query tokens) and run
once per layer:

- ``plan(batch, rows)``: ``batch`` is a list of ``(blocks, past, q)``; ``rows`` the query rows
  of the forward (padding included). It computes the slots the step's new K/V go to and
  whatever the attention needs (FlashInfer: page indptr/indices/last-page lengths).
- ``write(k_cache, v_cache, key, value)``: the new tokens' K/V into their slots.
- ``run(query, k_cache, v_cache, live=None)``: causal attention of each request's
  query tokens over its first ``past + q`` tokens; ``live`` (``[slots, h_kv]`` bytes,
  Hard-KV's per-head counts) masks the keys a head dropped. Returns ``[rows, h_q, d]``.

The engine's cache per layer is ``[(num_blocks + 2) * b, h_kv, d]``: FlashInfer's NHD pages
once viewed as ``[num_blocks + 2, b, h_kv, d]``.

``TorchPagedAttention`` (any device, one SDPA per request) is the reference the tests hold
``FlashInferPagedAttention`` and ``KvpolicyPagedAttention`` (kvpolicy's own decode attention,
which skips the slots Hard-KV's heads dropped) to. FlashInfer is used through its documented wrappers:
``BatchDecodeWithPagedKVCacheWrapper`` when every request has one query token, else
``BatchPrefillWithPagedKVCacheWrapper`` (causal, the query aligned to the end of its keys).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..errors import Error

TESTED_FLASHINFER = ("0.7.2",)  # releases the adapter's FlashInfer path is tested with
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial results)

Batch = Sequence[Tuple[Sequence[int], int, int]]  # (blocks, past tokens, query tokens) per request


def _refuse(field: str, message: str):
    raise Error(f"kvpolicy.integrations.paged_attention: {field}: {message}", field)


def _slots(batch: Batch, block_size: int, rows: int, trash: int) -> list:
    """The cache slot of every query row: request tokens in order, padding rows to ``trash``."""
    slots = []
    for blocks, past, q in batch:
        for pos in range(past, past + q):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    if len(slots) > rows:
        _refuse("rows", f"is {rows}; the batch has {len(slots)} query tokens")
    slots.extend([trash] * (rows - len(slots)))
    return slots


class _PagedPlan:
    """What both backends share: the block size, the write trash slot, and each step's slots."""

    def __init__(self, block_size: int, trash_slot: int, device, scale: float):
        self.block_size = block_size
        self.trash_slot = trash_slot
        self.device = torch.device(device)
        self.scale = scale
        self.rows = 0
        self.slots = None

    def _plan_slots(self, batch: Batch, rows: int) -> None:
        self.rows = rows
        self.slots = torch.tensor(_slots(batch, self.block_size, rows, self.trash_slot), dtype=torch.int64,
                                  device=self.device)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key``/``value``: ``[rows, h_kv, d]``, into the step's slots."""
        k_cache.index_copy_(0, self.slots, key)
        v_cache.index_copy_(0, self.slots, value)


class TorchPagedAttention(_PagedPlan):
    """One ``scaled_dot_product_attention`` per request over its gathered blocks (reference)."""

    name = "torch"

    def __init__(self, block_size: int, trash_slot: int, device, scale: float):
        super().__init__(block_size, trash_slot, device, scale)
        self.requests: list = []  # per request: (first query row, query tokens, key index [n], causal mask [q, n])

    def plan(self, batch: Batch, rows: int) -> None:
        self._plan_requests(batch, lambda q: True)
        self._plan_slots(batch, rows)

    def _plan_requests(self, batch: Batch, wanted) -> None:
        """Each wanted request's gather index and causal mask, once per step for every layer."""
        b, dev = self.block_size, self.device
        self.requests, start = [], 0
        for blocks, past, q in batch:
            if wanted(q):
                n = past + q
                pages = torch.tensor(list(blocks[: -(-n // b)]), dtype=torch.int64, device=dev)
                index = (pages[:, None] * b + torch.arange(b, device=dev)).reshape(-1)[:n]
                # Query token t sits at position past + t: it sees keys 0 .. past + t.
                allowed = torch.arange(n, device=dev)[None, :] <= (past + torch.arange(q, device=dev))[:, None]
                self.requests.append((start, q, index, allowed))
            start += q

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            live: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``query``: ``[rows, h_q, d]``; caches ``[slots, h_kv, d]``; ``live``: ``[slots, h_kv]``."""
        return self._attend_requests(query, k_cache, v_cache, live, torch.zeros_like(query))

    def _attend_requests(self, query, k_cache, v_cache, live, out) -> torch.Tensor:
        """The planned requests' rows of ``out``, one SDPA each."""
        rows, h_q, d = query.shape
        h_kv = k_cache.shape[1]
        group = h_q // h_kv
        for start, q, index, allowed in self.requests:
            n = index.numel()
            k = k_cache.index_select(0, index).transpose(0, 1)  # [h_kv, n, d]
            v = v_cache.index_select(0, index).transpose(0, 1)
            qq = query[start:start + q].transpose(0, 1).reshape(h_kv, group, q, d)
            mask = allowed[None, None].expand(h_kv, 1, q, n)
            if live is not None:
                held = live.index_select(0, index).bool().t()  # [h_kv, n]
                mask = mask & held[:, None, None, :]
            o = torch.nn.functional.scaled_dot_product_attention(qq, k[:, None], v[:, None], attn_mask=mask,
                                                                 scale=self.scale, enable_gqa=True)
            out[start:start + q] = o.reshape(h_q, q, d).transpose(0, 1)
        return out


def import_flashinfer():
    """FlashInfer, or a kvpolicy.Error saying what is missing or untested."""
    try:
        import flashinfer
    except ImportError as e:
        _refuse("attention", f"'flashinfer' needs flashinfer-python {' or '.join(v + '.x' for v in TESTED_FLASHINFER)} "
                f"(pip install flashinfer-python; it compiles its kernels at run time with nvcc): {e}")
    version = getattr(flashinfer, "__version__", "?")
    if not any(version == v or version.startswith(v + ".") for v in TESTED_FLASHINFER):
        _refuse("attention", f"flashinfer {version} is not tested with the adapter (tested: "
                f"{', '.join(v + '.x' for v in TESTED_FLASHINFER)})")
    return flashinfer


class FlashInferPagedAttention(_PagedPlan):
    """FlashInfer's paged decode (decode-only steps) or paged prefill (steps with a prompt chunk)."""

    name = "flashinfer"

    def __init__(self, block_size: int, trash_slot: int, device, scale: float, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        device = torch.device(device)
        if device.type != "cuda":
            _refuse("device", f"is {device}; FlashInfer runs on CUDA devices")
        self.flashinfer = import_flashinfer()
        super().__init__(block_size, trash_slot, device, scale)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        # fa2: compiled at first use in under a minute; "auto" picks the sm90 kernels on Hopper,
        # whose run-time build takes minutes, for the few steps that carry a prompt chunk.
        self.prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.wrapper = None
        self.tokens = 0

    def plan(self, batch: Batch, rows: int) -> None:
        b = self.block_size
        indptr, indices, last, qo = [0], [], [], [0]
        for blocks, past, q in batch:
            n = past + q
            pages = -(-n // b)
            indices.extend(blocks[:pages])
            indptr.append(indptr[-1] + pages)
            last.append(n - (pages - 1) * b)
            qo.append(qo[-1] + q)
        self.tokens = qo[-1]
        self._plan_slots(batch, rows)
        i32 = dict(dtype=torch.int32)
        h_q, h_kv, d = self.heads
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if self.tokens == len(batch):  # one query token per request: the decode kernel
            self.wrapper = self.decode
            self.decode.plan(torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32),
                             h_q, h_kv, d, b, **common)
        else:
            self.wrapper = self.prefill
            self.prefill.plan(torch.tensor(qo, **i32), torch.tensor(indptr, **i32), torch.tensor(indices, **i32),
                              torch.tensor(last, **i32), h_q, h_kv, d, b, causal=True, **common)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            live: Optional[torch.Tensor] = None) -> torch.Tensor:
        if live is not None:
            _refuse("live", "FlashInfer reads every slot of a page for every KV head; Hard-KV's per-head counts need "
                    "attention='torch'")
        b = self.block_size
        h_kv, d = k_cache.shape[1], k_cache.shape[2]
        pages = (k_cache.view(-1, b, h_kv, d), v_cache.view(-1, b, h_kv, d))
        out = self.wrapper.run(query[: self.tokens], pages)  # the scale was fixed at plan time
        if self.rows == self.tokens:
            return out
        full = query.new_zeros(query.shape)
        full[: self.tokens] = out
        return full


class KvpolicyPagedAttention(TorchPagedAttention):
    """kvpolicy's own decode attention (``kvpolicy.decode_attention``) for the requests with one
    query token, over the engine's blocks as the ``nhd`` layout with Hard-KV's live bytes
    (cautious update: a head's dropped tokens are not read); requests with a prompt chunk take
    the torch reference's SDPA. On CUDA the library's split-K kernel (bf16/f16, head dim 64 or
    128), on the CPU its host reference (any of its dtypes)."""

    name = "kvpolicy"

    def __init__(self, block_size: int, trash_slot: int, device, scale: float):
        super().__init__(block_size, trash_slot, device, scale)
        self.decode_rows = None  # query rows of the one-token requests (None: rows 0 .. n - 1)
        self.decoding = 0
        self.table = self.lengths = None
        self.max_tokens = 0
        self.workspace = None  # sized at the step's first layer, reused by the others (same items and lengths)
        self.sized = False
        self.statuses: list = []  # the device calls' status words, checked at the next plan

    def plan(self, batch: Batch, rows: int) -> None:
        self.check()
        b = self.block_size
        rows_of, tables, lengths, start = [], [], [], 0
        for blocks, past, q in batch:
            if q == 1:
                n = past + 1
                rows_of.append(start)
                tables.append(list(blocks[: -(-n // b)]))
                lengths.append(n)
            start += q
        self.decoding = len(rows_of)
        self.workspace, self.sized = None, False
        if self.decoding:
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]  # past a row's length: never read
            self.table = torch.tensor(padded, dtype=torch.int32).to(self.device, non_blocking=True)
            self.lengths = torch.tensor(lengths, dtype=torch.int32).to(self.device, non_blocking=True)
            self.max_tokens = max(lengths)
            contiguous = rows_of == list(range(self.decoding))
            self.decode_rows = None if contiguous else torch.tensor(rows_of, dtype=torch.int64, device=self.device)
        self._plan_requests(batch, lambda q: q > 1)
        self._plan_slots(batch, rows)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            live: Optional[torch.Tensor] = None) -> torch.Tensor:
        import kvpolicy

        b = self.block_size
        h_kv, d = k_cache.shape[1], k_cache.shape[2]
        everything = self.decoding == self.rows and not self.requests
        out = None if everything else torch.zeros_like(query)
        if self.decoding:
            q = query[: self.decoding] if self.decode_rows is None else query.index_select(0, self.decode_rows)
            cache = kvpolicy.PagedCache("nhd", k=[k_cache.view(-1, b, h_kv, d)], v=[v_cache.view(-1, b, h_kv, d)],
                                        block_table=self.table, lengths=self.lengths,
                                        live=None if live is None else live.view(1, -1, b, h_kv))
            if not self.sized:  # one sizing per step, not one per layer (0 on the host: no workspace)
                need = kvpolicy.decode_attention_workspace_bytes(q, cache, max_tokens=self.max_tokens)
                self.workspace = torch.empty(need, dtype=torch.uint8, device=self.device) if need else None
                self.sized = True
            r = kvpolicy.decode_attention(q, cache, scale=self.scale, max_tokens=self.max_tokens,
                                          workspace=self.workspace, check=False)
            if r.status is not None:
                self.statuses.append(r.status)
            if everything:
                return r.out
            put_decode_rows(out, self.decode_rows, r.out)
        return self._attend_requests(query, k_cache, v_cache, live, out)

    def check(self) -> None:
        """Raises the kvpolicy.Error a device call of the last step found (one wait for them all)."""
        statuses, self.statuses = self.statuses, []
        raise_first_status(statuses)


def put_decode_rows(out: torch.Tensor, rows: Optional[torch.Tensor], decoded: torch.Tensor) -> None:
    """The one-token requests' outputs into their query rows of ``out`` (``rows`` None: the
    first ``len(decoded)`` rows)."""
    if rows is None:
        out[: decoded.shape[0]] = decoded
    else:
        out.index_copy_(0, rows, decoded)


def raise_first_status(statuses: list) -> None:
    """Raises the kvpolicy.Error the first of these device status words holds (one wait for
    them all: a stack and one read back); nothing when they are all clear or there are none."""
    if not statuses:
        return
    import kvpolicy

    words = torch.stack(statuses)
    bad = torch.nonzero(words.any(dim=1)).flatten().tolist()
    if bad:
        kvpolicy.DecodeAttentionResult(out=None, status=words[bad[0]],
                                       stream=int(torch.cuda.current_stream(words.device).cuda_stream)).check()
