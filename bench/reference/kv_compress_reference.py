#!/usr/bin/env python3
"""KV-Compress (issue 31) in plain PyTorch, against kvpolicy's per-head executors.

Configuration B, KV-Compress's setting: 16 sequences of 8192 tokens, 32 layers, 8 KV
heads, d 128, blocks of 16 tokens each holding one KV head of one layer (the unified
cache: K and V `[num_blocks, 16, 128]`, one pool for every layer), bf16, a budget of
25%: the sequence keeps 2048 tokens per head on average over its 256 (layer, KV head)
rows, blocks_to_free = held blocks - rows x ceil(2048 / 16) (kvpolicy's
select::blocks_to_free_for_tokens, the authors' `max_cache_tokens` conversion),
protected window 64, no sinks. The metric is random fp32 (torch.rand ** 4: positive,
heavy at 0, as squared attention is, with exact ties among its 2^24 levels); each slot
carries its token's position (`--positions slot`: the slot index; `shuffled`: each
head a random order of a random subset of [0, tokens), as after earlier compressions;
`none`: no positions array, slot t is position t).

What a user writes today without a fused library (include/kvpolicy/select/
head_adaptive_blocks.hpp and exec/host/move_cache.hpp are the law), vectorised over
every (item, layer, KV head) row at once, no Python loop over tokens, heads or blocks:

1. schedule: each row's metric and positions gathered through its block table; one
   int64 key per token, (metric key bits << 32 | position): the metric as an
   order-preserving integer (NaN as -inf, -0 as +0), so ties are exact; protected
   tokens (position < sinks or >= logical_length - protected_window) and slots past
   the row's length get INT64_MAX; torch.sort per row (stable: equal keys stay in
   slot order, as the host's (key, slot) tuples) gives the eviction order. Block e of
   a row costs the key at offset (e - 1) b + hanging - 1 of the order (hanging = T mod
   b, or b), possible while that offset lies among the row's evictable tokens and e
   does not exceed its blocks. Per budget group (the sequence, or with --per-layer
   each (sequence, layer)) one sort of all candidate blocks by the composite key
   (cost << 32 | row x max_blocks + e - 1), i.e. by (cost, row, e); the first
   blocks_to_free are freed. A row evicts the prefix of its order its blocks cover:
   (blocks - 1) b + hanging tokens;
2. moves (MoveCache): per row, the evicted slots below the new length (ascending) and
   the kept slots at or past it (from the tail) pair up in order; K, V, the metric and
   the positions of each source are gathered, then scattered to its destination,
   through the block tables (one flat index per slot). Tables and lengths are not
   written; the new lengths and the freed blocks (each row's last `blocks` table
   entries) are results.

Both run on identical copies of the same inputs through libkvp_capi.so's
kvp_capi_compress_per_head (kvp::cuda_per_head_executor; ctypes, torch's current
stream). Checks, before any timing, all exact: new lengths, freed counts, freed block
ids (in table order), evicted counts, blocks freed and non-finite metrics per item;
the bytes of K, V, the metric and the positions of every head's kept range [0, new
length) (mismatching (head, slot) rows counted per array), and the slots differing
anywhere in the pools.

Timing: the cache (K, V, metric, positions) restored before each run, untimed; warm-up,
then the median of --iters runs between torch.cuda.Event marks; end to end and per
stage from separate runs (the reference's schedule and moves between events;
kvpolicy's through kvp_capi_compress_per_head_staged, the executor's stage marks:
schedule = validation + histograms + group selects, moves = each head's evicted tokens
+ MoveCache). Byte model (stated in the JSON): the schedule reads the metric and the
positions of every row of the batch (T x (4 + 4) bytes per row; tables and lengths not
counted); the moves read and write K and V rows and the metric and position of each
moved token: moves x (2 x 2 x d x elem + 2 x (4 + 4)) bytes. Achieved bytes/s are set
against a device copy measured in the same run (torch copy_ of a --copy-mib tensor, 1
GiB, read + write counted, the best of 10 or --iters runs: kvpolicy_bench's roof).

    python3 bench/reference/kv_compress_reference.py --lib build/bench/libkvp_capi.so --out kv_compress_reference.json

Memory (configuration B): K and V are 16.1 GiB; the check holds three copies (48 GiB),
the timing two (32 GiB), plus the reference's temporaries (about 5 GiB).

`--device cpu --dtype float32 --seqs 3 --tokens 1024 --layers 3 --kv-heads 4 --head-dim 8
--metric-levels 64 --no-time` checks the reference against libkvp_capi_host.so
(kvp::host::compress_per_head); --metric-levels makes exact metric ties common at small
sizes (configuration B's 33 M draws of 2^24 levels have them anyway), so that the tie
rules (older position first, lower row, earlier block) decide blocks. Add --ragged,
--positions shuffled|none, --per-layer, --sinks 4, --nonfinite 0.05, --items 2,
--block-size 1 / 3 / 32, --dtype bfloat16 / float16 for the other cases.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zipage_reference as zr  # noqa: E402  (DTYPES, time_runs, default_lib)

INT64_MAX = 2**63 - 1
STATUS_WORDS = 8  # kvp_capi.h's KVP_CAPI_STATUS_WORDS (checked against the library when it loads)


# ---------------------------------------------------------------------------
# Configuration and inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    seqs: int = 16
    tokens: int = 8192  # logical length of every sequence; each head's length (without --ragged)
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    budget: float = 0.25  # tokens kept per head on average, as a fraction of `tokens`
    protected_window: int = 64
    sinks: int = 0
    per_layer: bool = False  # one count of blocks per (sequence, layer) instead of per sequence
    ragged: bool = False  # head lengths uniform in [tokens / 2, tokens]
    positions: str = "slot"  # slot | shuffled | none
    metric_power: float = 4.0  # metric = rand ** power
    metric_levels: int = 0  # > 0: rand quantised to this many levels first (many exact ties)
    nonfinite: float = 0.0  # fraction of metrics made NaN, +inf or -inf
    items: int = 0  # sequences compressed (a random subset in random order); 0: all
    spare_blocks: int = 256  # blocks held by nobody
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def max_blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def tokens_per_head(self) -> int:
        return int(round(self.budget * self.tokens))

    @property
    def num_items(self) -> int:
        return self.items if 0 < self.items <= self.seqs else self.seqs


@dataclass
class Inputs:
    k: torch.Tensor  # [NB, b, d]
    v: torch.Tensor  # [NB, b, d]
    metric: torch.Tensor  # [NB, b] fp32
    positions: torch.Tensor | None  # [NB, b] int32
    tables: torch.Tensor  # [L, S, H, MB] int32 (-1 past a head's blocks)
    lengths: torch.Tensor  # [L, S, H] int32
    items: torch.Tensor  # [I, 3] or [I, 3 + L] int64: seq, blocks_to_free, logical_length (, per layer)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]


def blocks_to_free_for_tokens(held, tokens_per_head: int, rows: int, b: int):
    """select::blocks_to_free_for_tokens on a tensor of held block counts."""
    budget_blocks = -(-tokens_per_head // b) * rows
    return (held - budget_blocks).clamp_min(0)


def make_inputs(cfg: Config, device: torch.device) -> Inputs:
    dtype = zr.DTYPES[cfg.dtype][0]
    g = torch.Generator(device=device)
    g.manual_seed(cfg.seed)
    L, S, H, b, d, MB = cfg.layers, cfg.seqs, cfg.kv_heads, cfg.block_size, cfg.head_dim, cfg.max_blocks
    W = MB * b
    if cfg.ragged:
        lengths = torch.randint(cfg.tokens // 2, cfg.tokens + 1, (L, S, H), generator=g, device=device)
    else:
        lengths = torch.full((L, S, H), cfg.tokens, device=device)
    lengths = lengths.to(torch.int32)
    nb = (lengths.long() + b - 1) // b
    held_total = int(nb.sum())
    NB = held_total + cfg.spare_blocks
    assert NB < 2**31, "block ids must fit int32"
    perm = torch.randperm(NB, generator=g, device=device)[:held_total].to(torch.int32)
    tables = torch.full((L, S, H, MB), -1, dtype=torch.int32, device=device)
    tables[torch.arange(MB, device=device) < nb.unsqueeze(-1)] = perm  # row-major: each head its blocks in order
    k = torch.empty(NB, b, d, dtype=dtype, device=device).uniform_(-1.0, 1.0, generator=g)
    v = torch.empty(NB, b, d, dtype=dtype, device=device).uniform_(-1.0, 1.0, generator=g)
    metric = torch.rand(NB, b, generator=g, device=device)
    if cfg.metric_levels > 0:
        metric = torch.floor(metric * cfg.metric_levels) / cfg.metric_levels
    metric = metric.pow_(cfg.metric_power)
    if cfg.nonfinite > 0:
        u = torch.rand(NB, b, generator=g, device=device)
        kind = torch.randint(0, 3, (NB, b), generator=g, device=device)
        special = torch.tensor([float("nan"), float("inf"), float("-inf")], device=device)[kind]
        metric = torch.where(u < cfg.nonfinite, special, metric)

    positions = None
    if cfg.positions != "none":
        t = torch.arange(W, device=device)
        flat = tables.long().clamp_min(0)[..., t // b] * b + t % b  # [L, S, H, W]
        valid = t < lengths.long().unsqueeze(-1)
        if cfg.positions == "slot":
            pos = t.expand(L, S, H, W)
        elif cfg.positions == "shuffled":  # a random subset of [0, tokens), in random order
            order = torch.rand(L * S * H, cfg.tokens, generator=g, device=device).argsort(dim=-1)
            pos = torch.zeros(L * S * H, W, dtype=torch.long, device=device)
            pos[:, : cfg.tokens] = order
            pos = pos.view(L, S, H, W)
        else:
            raise ValueError(f"--positions {cfg.positions}")
        positions = torch.zeros(NB * b, dtype=torch.int32, device=device)
        positions[flat[valid]] = pos[valid].to(torch.int32)
        positions = positions.view(NB, b)

    # The batch: every sequence, or a random subset in random order; blocks to free
    # from the token budget (the authors' conversion), per sequence or per layer.
    seqs = torch.arange(S, device=device) if cfg.num_items == S else \
        torch.randperm(S, generator=g, device=device)[: cfg.num_items]
    held = nb[:, seqs]  # [L, I, H]
    per_layer = blocks_to_free_for_tokens(held.sum(-1), cfg.tokens_per_head, H, b).t()  # [I, L]
    per_seq = blocks_to_free_for_tokens(held.sum((0, 2)), cfg.tokens_per_head, L * H, b)  # [I]
    logical = torch.full_like(seqs, cfg.tokens)
    cols = [seqs, per_layer.sum(-1) if cfg.per_layer else per_seq, logical]
    items = torch.stack(cols, dim=1)
    if cfg.per_layer:
        items = torch.cat([items, per_layer], dim=1)
    return Inputs(k, v, metric, positions, tables, lengths, items.to(torch.int64).contiguous())


# ---------------------------------------------------------------------------
# The PyTorch reference
# ---------------------------------------------------------------------------


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [-2^31, 2^31) whose integer order is the float order (NaN as -inf,
    -0 as +0): rank_bits' high word, minus 2^31."""
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def kv_compress_reference(k, v, metric, positions, tables, lengths, items, block_size: int, protected_window: int,
                          sinks: int, per_layer: bool, want_outputs: bool = False, mark=None):
    """KV-Compress's schedule and MoveCache, in place on k, v, metric, positions.

    Returns, when want_outputs, a dict of [I, L, H] new_lengths, blocks (freed
    counts), evicted, moved; freed_ids [I, L, H, MB] (-1 past blocks); freed and nonfinite
    per item; moves (tokens moved) and the move pairs' row check. mark(i), if given,
    is called after the schedule (1) and after the moves (2).
    """
    dev = k.device
    L, _, H, MB = tables.shape
    b = block_size
    W = MB * b
    I = items.shape[0]
    R = I * L * H
    seq = items[:, 0]
    logical = items[:, 2]

    # 1. Schedule. Rows (item, layer, head), row = (i L + l) H + h.
    tbl = tables[:, seq].permute(1, 0, 2, 3).reshape(R, MB).long()
    T = lengths[:, seq].permute(1, 0, 2).reshape(R).long()
    t = torch.arange(W, device=dev)
    valid = t < T.unsqueeze(1)  # [R, W]
    flat = torch.where(valid, tbl[:, t // b], 0) * b + t % b  # each slot's index in the [NB * b] pools
    m = metric.view(-1)[flat]
    p = positions.view(-1)[flat].long() if positions is not None else t.expand(R, W)
    length = logical.repeat_interleave(L * H)
    length = torch.where(length >= 0, length, T)  # -1: the row's own length
    evictable = valid & (p >= sinks) & (p < (length - protected_window).unsqueeze(1))
    key = torch.where(evictable, ordered_bits(m) * (1 << 32) + p, INT64_MAX)
    skey, order = torch.sort(key, dim=-1, stable=True)  # the eviction order, evictable tokens first
    E = evictable.sum(-1)
    rem = T % b
    hang = torch.where(rem == 0, b, rem)
    held = (T + b - 1) // b
    possible = torch.where((T > 0) & (E >= hang), torch.minimum(1 + (E - hang).clamp_min(0) // b, held), 0)
    e0 = torch.arange(MB, device=dev)  # e - 1
    at = (e0 * b + (hang - 1).unsqueeze(1)).clamp_max(W - 1)  # [R, MB]
    cost = torch.gather(skey, 1, at) >> 32  # the metric's ordered bits at the block's last token
    ok = e0 < possible.unsqueeze(1)
    rows_per_group = H if per_layer else L * H
    groups = R // rows_per_group
    row_in_group = torch.arange(R, device=dev) % rows_per_group
    ck = torch.where(ok, cost * (1 << 32) + row_in_group.unsqueeze(1) * MB + e0, INT64_MAX)
    sck, sidx = torch.sort(ck.view(groups, rows_per_group * MB), dim=-1)  # by (cost, row, e)
    asked = items[:, 3 : 3 + L].reshape(groups) if per_layer else items[:, 1]
    rank = torch.arange(rows_per_group * MB, device=dev)
    take_sorted = (rank < asked.unsqueeze(1)) & (sck != INT64_MAX)
    take = torch.zeros_like(take_sorted).scatter_(1, sidx, take_sorted)
    blocks = take.view(R, MB).sum(-1)
    evicted = torch.where(blocks > 0, (blocks - 1) * b + hang, 0)
    new_len = T - evicted
    if mark:
        mark(1)

    # 2. Moves. A row evicts the prefix of its order; the evicted slots below the new
    #    length take, lowest first, the kept tokens at or past it, from the tail.
    gone = torch.zeros(R, W, dtype=torch.bool, device=dev).scatter_(1, order, t < evicted.unsqueeze(1))
    below = t < new_len.unsqueeze(1)
    holes = gone & below
    movers = valid & ~gone & ~below
    dst_r, dst_t = holes.nonzero(as_tuple=True)  # row-major: per row, ascending slots
    src_r, src_t = movers.flip(1).nonzero(as_tuple=True)  # per row, from the tail
    src_t = W - 1 - src_t
    # The walk meets as many survivors as there are holes in every row (move_cache.hpp),
    # so the two lists pair up row by row.
    src, dst = flat[src_r, src_t], flat[dst_r, dst_t]
    moved = holes.sum(-1) if want_outputs else None
    d = k.shape[-1]
    for pool in (k.view(-1, d), v.view(-1, d), metric.view(-1)) + ((positions.view(-1),) if positions is not None else ()):
        pool[dst] = pool[src]  # gathered before the scatter; sources and destinations are disjoint
    if mark:
        mark(2)
    if not want_outputs:
        return None

    nf = (valid & ~torch.isfinite(m)).view(I, L * H * W).sum(-1)
    # The freed ids in table order, left-aligned: the row's entries [held - blocks, held).
    shift = (e0 + (held - blocks).unsqueeze(1)).clamp_max(MB - 1)
    freed_ids = torch.where(e0 < blocks.unsqueeze(1), torch.gather(tbl, 1, shift), -1)
    return {
        "new_lengths": new_len.view(I, L, H),
        "blocks": blocks.view(I, L, H),
        "evicted": evicted.view(I, L, H),
        "moved": moved.view(I, L, H),
        "freed_ids": freed_ids.view(I, L, H, MB),
        "freed": blocks.view(I, L * H).sum(-1),
        "nonfinite": nf,
        "moves": int(src.numel()),
        "pairs_by_row": bool(torch.equal(src_r, dst_r)),
        "evicted_tokens": int(evicted.sum()),
    }


# ---------------------------------------------------------------------------
# kvpolicy through the C API (kvp_capi.h, per-head entry points)
# ---------------------------------------------------------------------------


class PerHeadShape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in (
        "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "num_seqs", "max_blocks", "num_items",
        "dtype", "protected_window", "sinks", "per_layer_budget")]


class PerHeadOut(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "status", "new_lengths", "freed_counts", "freed_blocks", "evicted", "moved", "freed", "nonfinite")]


class Outputs:
    """The result arrays kvp_capi_compress_per_head writes (torch tensors on the device)."""

    def __init__(self, I: int, L: int, H: int, MB: int, device):
        i32, i64 = torch.int32, torch.int64
        self.status = torch.zeros(STATUS_WORDS, dtype=i32, device=device)
        self.new_lengths = torch.full((I, L, H), -7, dtype=i32, device=device)
        self.freed_counts = torch.full((I, L, H), -7, dtype=i32, device=device)
        self.freed_blocks = torch.full((I, L, H, MB), -7, dtype=i32, device=device)
        self.evicted = torch.full((I, L, H), -7, dtype=i32, device=device)
        self.moved = torch.full((I, L, H), -7, dtype=i32, device=device)
        self.freed = torch.full((I,), -7, dtype=i64, device=device)
        self.nonfinite = torch.full((I,), -7, dtype=i64, device=device)
        self.c = PerHeadOut(*(x.data_ptr() for x in (self.status, self.new_lengths, self.freed_counts,
                                                      self.freed_blocks, self.evicted, self.moved, self.freed,
                                                      self.nonfinite)))


class Kvpolicy:
    """libkvp_capi.so (CUDA, device tensors) or libkvp_capi_host.so (host, CPU tensors)."""

    def __init__(self, path: str, device: torch.device):
        self.device = device
        self.lib = lib = ctypes.CDLL(path)
        vp, sp = ctypes.c_void_p, ctypes.POINTER(PerHeadShape)
        lib.kvp_capi_last_error.restype = ctypes.c_char_p
        lib.kvp_capi_per_head_shape_size.restype = ctypes.c_int
        lib.kvp_capi_per_head_workspace_size.argtypes = [sp, ctypes.POINTER(ctypes.c_size_t)]
        args = [sp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t, ctypes.POINTER(PerHeadOut)]
        lib.kvp_capi_compress_per_head.argtypes = args + [ctypes.c_size_t]
        lib.kvp_capi_compress_per_head_staged.argtypes = args + [ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]
        lib.kvp_capi_per_head_status.argtypes = [vp, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t]
        for fn in (lib.kvp_capi_per_head_workspace_size, lib.kvp_capi_compress_per_head,
                   lib.kvp_capi_compress_per_head_staged, lib.kvp_capi_per_head_status):
            fn.restype = ctypes.c_int
        if lib.kvp_capi_per_head_shape_size() != ctypes.sizeof(PerHeadShape):
            raise RuntimeError(f"{path}: struct kvp_capi_per_head_shape is {lib.kvp_capi_per_head_shape_size()} "
                               f"bytes, PerHeadShape {ctypes.sizeof(PerHeadShape)}: rebuild kvp_capi")
        if lib.kvp_capi_status_words() != STATUS_WORDS:  # the device status tensor is sized from it
            raise RuntimeError(f"{path}: {lib.kvp_capi_status_words()} status words, {STATUS_WORDS} expected: rebuild "
                               "kvp_capi")

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.device.type == "cuda" else 0

    def _ok(self, rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.kvp_capi_last_error().decode()} (code {rc})")

    def shape(self, cfg: Config, inp: Inputs) -> PerHeadShape:
        return PerHeadShape(
            num_layers=cfg.layers, num_blocks=inp.num_blocks, block_size=cfg.block_size, num_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, num_seqs=cfg.seqs, max_blocks=inp.tables.shape[-1], num_items=inp.items.shape[0],
            dtype=zr.DTYPES[cfg.dtype][1], protected_window=cfg.protected_window, sinks=cfg.sinks,
            per_layer_budget=int(cfg.per_layer))

    def workspace(self, shape: PerHeadShape) -> torch.Tensor:
        n = ctypes.c_size_t(0)
        self._ok(self.lib.kvp_capi_per_head_workspace_size(ctypes.byref(shape), ctypes.byref(n)),
                 "kvp_capi_per_head_workspace_size")
        return torch.empty(max(int(n.value), 256), dtype=torch.uint8, device=self.device)

    def _args(self, shape, k, v, metric, positions, inp: Inputs, ws, out: Outputs):
        return (ctypes.byref(shape), k.data_ptr(), v.data_ptr(), metric.data_ptr(),
                positions.data_ptr() if positions is not None else None, inp.tables.data_ptr(),
                inp.lengths.data_ptr(), inp.items.data_ptr(), ws.data_ptr(), ws.numel(), ctypes.byref(out.c))

    def compress(self, shape, k, v, metric, positions, inp: Inputs, ws, out: Outputs):
        rc = self.lib.kvp_capi_compress_per_head(*self._args(shape, k, v, metric, positions, inp, ws, out),
                                                 self._stream())
        self._ok(rc, "kvp_capi_compress_per_head")

    def compress_staged(self, shape, k, v, metric, positions, inp: Inputs, ws, out: Outputs) -> list[float]:
        ms = (ctypes.c_float * 3)()
        rc = self.lib.kvp_capi_compress_per_head_staged(*self._args(shape, k, v, metric, positions, inp, ws, out),
                                                        ms, self._stream())
        self._ok(rc, "kvp_capi_compress_per_head_staged")
        return list(ms)

    def check_status(self, out: Outputs) -> list[int]:
        words = (ctypes.c_int32 * self.lib.kvp_capi_status_words())()  # the words the library copies
        self._ok(self.lib.kvp_capi_per_head_status(out.status.data_ptr(), words, self._stream()), "device status")
        return list(words)


# ---------------------------------------------------------------------------
# Check
# ---------------------------------------------------------------------------


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers, so that NaN == NaN and -0 != +0."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def slot_differs(a: torch.Tensor, c: torch.Tensor, chunk_blocks: int) -> torch.Tensor:
    """[NB * b] bool: slots whose bytes differ between two pools [NB, b(, d)]. In chunks of
    blocks so that the elementwise comparison's temporary stays small (a loop over
    memory chunks, not over tokens, heads or blocks of the algorithm)."""
    NB = a.shape[0]
    out = torch.empty(NB, a.shape[1], dtype=torch.bool, device=a.device)
    for b0 in range(0, NB, chunk_blocks):
        x, y = as_bits(a[b0 : b0 + chunk_blocks]), as_bits(c[b0 : b0 + chunk_blocks])
        ne = x != y
        out[b0 : b0 + chunk_blocks] = ne.flatten(2).any(-1) if ne.dim() == 3 else ne
    return out.view(-1)


def compare(cfg: Config, inp: Inputs, kvp: Kvpolicy) -> dict:
    dev = inp.k.device
    L, H, b = cfg.layers, cfg.kv_heads, cfg.block_size
    MB = inp.tables.shape[-1]
    I = inp.items.shape[0]
    pos0 = inp.positions

    def copies():
        return (inp.k.clone(), inp.v.clone(), inp.metric.clone(), pos0.clone() if pos0 is not None else None)

    ref_pools = copies()
    ref = kv_compress_reference(*ref_pools, inp.tables, inp.lengths, inp.items, b, cfg.protected_window, cfg.sinks,
                                cfg.per_layer, want_outputs=True)
    kvp_pools = copies()
    shape = kvp.shape(cfg, inp)
    ws = kvp.workspace(shape)
    out = Outputs(I, L, H, MB, dev)
    kvp.compress(shape, *kvp_pools, inp, ws, out)
    status = kvp.check_status(out)

    counts = out.freed_counts.long()
    j = torch.arange(MB, device=dev)
    listed = j < counts.unsqueeze(-1)
    freed_ids_mismatch = int((listed & (out.freed_blocks.long() != ref["freed_ids"])).flatten(3).any(-1).sum())

    # Bytes: every slot compared in the pools; the kept range [0, new length) of every
    # row of the batch counted per (head, slot).
    seq = inp.items[:, 0]
    R = I * L * H
    tbl = inp.tables[:, seq].permute(1, 0, 2, 3).reshape(R, MB).long()
    t = torch.arange(MB * b, device=dev)
    new_len = ref["new_lengths"].reshape(R, 1).long()
    kept = t < new_len
    flat = torch.where(kept, tbl[:, t // b], 0) * b + t % b
    chunk = max(1, (256 << 20) // max(1, inp.k[0].numel() * inp.k.element_size()))
    names = ("k", "v", "metric", "positions")
    bytes_check = {}
    for name, a, c in zip(names, ref_pools, kvp_pools):
        if a is None:
            continue
        diff = slot_differs(a, c, chunk)
        bytes_check[name] = {"kept_slots_differing": int((diff[flat] & kept).sum()),
                             "pool_slots_differing": int(diff.sum())}
        del diff
    result = {
        "rows": R,
        "items": I,
        "status": status,
        "new_length_mismatches": int((out.new_lengths.long() != ref["new_lengths"]).sum()),
        "freed_count_mismatches": int((counts != ref["blocks"]).sum()),
        "freed_id_rows_mismatching": freed_ids_mismatch,
        "evicted_mismatches": int((out.evicted.long() != ref["evicted"]).sum()),
        "moved_mismatches": int((out.moved.long() != ref["moved"]).sum()),
        "freed_per_item_mismatches": int((out.freed != ref["freed"]).sum()),
        "nonfinite_per_item_mismatches": int((out.nonfinite != ref["nonfinite"]).sum()),
        "bytes": bytes_check,
        "reference_pairs_by_row": ref["pairs_by_row"],
        "moves": ref["moves"],
        "evicted_tokens": ref["evicted_tokens"],
        "freed_blocks": int(ref["freed"].sum()),
        "asked_blocks": int(inp.items[:, 3:].sum() if cfg.per_layer else inp.items[:, 1].sum()),
        "tokens_before": int(inp.lengths[:, seq].long().sum()),
        "nonfinite_metrics": int(ref["nonfinite"].sum()),
    }
    result["exact"] = (result["new_length_mismatches"] == 0 and result["freed_count_mismatches"] == 0
                       and freed_ids_mismatch == 0 and result["evicted_mismatches"] == 0
                       and result["moved_mismatches"] == 0
                       and result["freed_per_item_mismatches"] == 0 and result["nonfinite_per_item_mismatches"] == 0
                       and all(x["kept_slots_differing"] == 0 for x in bytes_check.values())
                       and ref["pairs_by_row"])
    del ref_pools, kvp_pools
    return result


# ---------------------------------------------------------------------------
# Timing and the byte model
# ---------------------------------------------------------------------------


def byte_model(cfg: Config, inp: Inputs, moves: int) -> dict:
    es = zr.DTYPES[cfg.dtype][0].itemsize
    per_slot = 4 + (4 if inp.positions is not None else 0)  # metric (+ position)
    tokens = int(inp.lengths[:, inp.items[:, 0]].long().sum())
    schedule = tokens * per_slot
    moved = moves * (2 * 2 * cfg.head_dim * es + 2 * per_slot)
    return {
        "model": "schedule: metric (+ positions) of every token of the batch's rows read once; moves: per moved "
                 "token, K and V rows read and written (2 x 2 x d x elem) and its metric (+ position) read and "
                 "written; tables and lengths not counted",
        "tokens_of_batch": tokens, "moves": moves,
        "schedule": schedule, "moves_bytes": moved, "total": schedule + moved,
    }


def copy_bandwidth(device: torch.device, mib: int, warmup: int, iters: int) -> dict:
    """The roof, as kvpolicy_bench's copy row: the best of `iters` device copies (torch
    copy_ of one contiguous tensor, a device-to-device memcpy), read + write counted."""
    n = mib << 20
    src = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    ms = zr.time_runs(lambda: dst.copy_(src), lambda: None, warmup, iters, device)
    del src, dst
    best, med = min(ms), statistics.median(ms)
    return {"bytes": n, "ms_best": best, "ms_median": med, "bytes_per_s": 2 * n / (best * 1e-3),
            "bytes_per_s_median": 2 * n / (med * 1e-3),
            "model": "read + write of the tensor; the fractions divide by the best run (bytes_per_s)"}


def measure(cfg: Config, inp: Inputs, kvp: Kvpolicy, warmup: int, iters: int) -> dict:
    dev = inp.k.device
    cuda = dev.type == "cuda"
    work = (inp.k, inp.v, inp.metric, inp.positions)
    backup = tuple(x.clone() if x is not None else None for x in work)

    def restore():
        for w, s in zip(work, backup):
            if w is not None:
                w.copy_(s)

    shape = kvp.shape(cfg, inp)
    ws = kvp.workspace(shape)
    out = Outputs(inp.items.shape[0], cfg.layers, cfg.kv_heads, inp.tables.shape[-1], dev)
    b = cfg.block_size

    def reference(mark=None):
        kv_compress_reference(*work, inp.tables, inp.lengths, inp.items, b, cfg.protected_window, cfg.sinks,
                              cfg.per_layer, mark=mark)

    def kvpolicy():
        kvp.compress(shape, *work, inp, ws, out)

    ref_ms = zr.time_runs(reference, restore, warmup, iters, dev)
    kvp_ms = zr.time_runs(kvpolicy, restore, warmup, iters, dev)
    kvp.check_status(out)

    ref_stages, kvp_stages = [], []
    for _ in range(iters):
        restore()
        if cuda:
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            reference(lambda i: ev[i].record())
            ev[2].synchronize()
            ref_stages.append([ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])])
        else:
            tt = [time.perf_counter()]
            reference(lambda i: tt.append(time.perf_counter()))
            ref_stages.append([(tt[1] - tt[0]) * 1e3, (tt[2] - tt[1]) * 1e3])
        restore()
        if cuda:
            torch.cuda.synchronize()
        kvp_stages.append(kvp.compress_staged(shape, *work, inp, ws, out))
    kvp.check_status(out)
    restore()
    del backup
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    ref, kvm = statistics.median(ref_ms), statistics.median(kvp_ms)
    return {
        "reference_ms": ref, "kvpolicy_ms": kvm, "speedup": ref / kvm if kvm > 0 else None,
        "reference_ms_all": ref_ms, "kvpolicy_ms_all": kvp_ms,
        "reference_stage_ms": {"schedule": med(ref_stages, 0), "moves": med(ref_stages, 1)},
        # kvp_capi.h: schedule = validation + histograms + group selects; moves = each
        # head's evicted tokens + MoveCache; call = the staged call from before the items'
        # conversion (host library: schedule and call are the whole call, moves 0).
        "kvpolicy_stage_ms": {"schedule": med(kvp_stages, 0), "moves": med(kvp_stages, 1),
                              "call": med(kvp_stages, 2)},
    }


def rates(bytes_: dict, run: dict, copy: dict) -> dict:
    def rate(nbytes, ms):
        if not ms or ms <= 0:
            return None
        bps = nbytes / (ms * 1e-3)
        return {"bytes_per_s": bps, "fraction_of_copy": bps / copy["bytes_per_s"]}

    rs, ks = run["reference_stage_ms"], run["kvpolicy_stage_ms"]
    return {
        "kvpolicy_end_to_end": rate(bytes_["total"], run["kvpolicy_ms"]),
        "kvpolicy_schedule": rate(bytes_["schedule"], ks["schedule"]),
        "kvpolicy_moves": rate(bytes_["moves_bytes"], ks["moves"]),
        "reference_end_to_end": rate(bytes_["total"], run["reference_ms"]),
        "reference_schedule": rate(bytes_["schedule"], rs["schedule"]),
        "reference_moves": rate(bytes_["moves_bytes"], rs["moves"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: CPU tensors against libkvp_capi_host.so (kvp::host::compress_per_head)")
    ap.add_argument("--lib", default=None, help="libkvp_capi.so (cuda) or libkvp_capi_host.so (cpu); "
                    "default: build/bench/ of the repository")
    ap.add_argument("--dtype", choices=sorted(zr.DTYPES), default="bfloat16")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of every sequence (its logical length)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="tokens kept per head on average, fraction of --tokens")
    ap.add_argument("--protected-window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--per-layer", action="store_true", help="one count of blocks per (sequence, layer)")
    ap.add_argument("--ragged", action="store_true", help="head lengths uniform in [tokens / 2, tokens]")
    ap.add_argument("--positions", choices=["slot", "shuffled", "none"], default="slot")
    ap.add_argument("--metric-power", type=float, default=4.0)
    ap.add_argument("--metric-levels", type=int, default=0,
                    help="quantise the metric to this many levels (exact ties across tokens and heads)")
    ap.add_argument("--nonfinite", type=float, default=0.0, help="fraction of metrics NaN / +inf / -inf")
    ap.add_argument("--items", type=int, default=0, help="sequences compressed (random subset); 0: all")
    ap.add_argument("--spare-blocks", type=int, default=256)
    ap.add_argument("--copy-mib", type=int, default=0, help="copy-bandwidth tensor; 0: 1024 (cuda), 64 (cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-time", action="store_true", help="the check only")
    ap.add_argument("--no-check", action="store_true", help="the timing only")
    ap.add_argument("--out", default="kv_compress_reference.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kv_compress_reference: no CUDA device (--device cpu checks against the host executor)",
              file=sys.stderr)
        return 1
    dev = torch.device(args.device)
    lib = args.lib or zr.default_lib(args.device)
    kvp = Kvpolicy(lib, dev)
    cfg = Config(seqs=args.seqs, tokens=args.tokens, layers=args.layers, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, block_size=args.block_size, budget=args.budget,
                 protected_window=args.protected_window, sinks=args.sinks, per_layer=args.per_layer,
                 ragged=args.ragged, positions=args.positions, metric_power=args.metric_power,
                 metric_levels=args.metric_levels,
                 nonfinite=args.nonfinite, items=args.items, spare_blocks=args.spare_blocks, dtype=args.dtype,
                 seed=args.seed)
    assert cfg.layers * cfg.kv_heads * cfg.max_blocks < 2**31, "candidate block keys need 31 bits"
    t0 = time.perf_counter()
    inp = make_inputs(cfg, dev)
    out = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "device": args.device,
           "torch": torch.__version__, "cuda": torch.version.cuda, "lib": os.path.abspath(lib), "dtype": args.dtype,
           "policy": "kv_compress (head_adaptive_blocks + MoveCache, unified per-head cache)",
           "config": {**asdict(cfg), "max_blocks": cfg.max_blocks, "tokens_per_head": cfg.tokens_per_head,
                      "num_blocks": inp.num_blocks, "num_items": inp.items.shape[0]},
           "warmup": args.warmup, "iters": args.iters}
    moves = None
    if not args.no_check:
        check = compare(cfg, inp, kvp)
        out["check"] = check
        moves = check["moves"]
        bc = ", ".join(f"{n} {x['kept_slots_differing']}/{x['pool_slots_differing']}" for n, x in check["bytes"].items())
        print(f"[check] {args.dtype} {check['items']} items x {cfg.layers} layers x {cfg.kv_heads} heads: "
              f"new lengths {check['new_length_mismatches']}, freed counts {check['freed_count_mismatches']}, "
              f"freed id rows {check['freed_id_rows_mismatching']}, evicted {check['evicted_mismatches']}, "
              f"moved {check['moved_mismatches']}, "
              f"freed/item {check['freed_per_item_mismatches']}, nonfinite/item "
              f"{check['nonfinite_per_item_mismatches']} mismatches; bytes differing (kept slots/pool slots) {bc}; "
              f"{check['moves']} moves, {check['evicted_tokens']} evicted of {check['tokens_before']} tokens, "
              f"{check['freed_blocks']} of {check['asked_blocks']} blocks asked freed; exact {check['exact']}",
              flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_time:
        if moves is None:  # the move count for the byte model, from one untimed reference run on copies
            pools = (inp.k.clone(), inp.v.clone(), inp.metric.clone(),
                     inp.positions.clone() if inp.positions is not None else None)
            moves = kv_compress_reference(*pools, inp.tables, inp.lengths, inp.items, cfg.block_size,
                                          cfg.protected_window, cfg.sinks, cfg.per_layer, want_outputs=True)["moves"]
            del pools
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        bytes_ = byte_model(cfg, inp, moves)
        copy = copy_bandwidth(dev, args.copy_mib or (1024 if dev.type == "cuda" else 64), args.warmup,
                              max(args.iters, 10))
        run = measure(cfg, inp, kvp, args.warmup, args.iters)
        out.update({"bytes": bytes_, "copy": copy, "run": run, "rates": rates(bytes_, run, copy),
                    "timing": "median of iters runs, torch.cuda.Event (cpu: perf_counter), K, V, metric and "
                              "positions restored before each run (untimed); stages from separate runs"})
        rs, ks, r = run["reference_stage_ms"], run["kvpolicy_stage_ms"], out["rates"]
        frac = lambda x: f"{x['fraction_of_copy']:.2f}" if x else "-"  # noqa: E731
        print(f"[time] {args.dtype}: reference {run['reference_ms']:.3f} ms (schedule {rs['schedule']:.3f}, moves "
              f"{rs['moves']:.3f}), kvpolicy {run['kvpolicy_ms']:.3f} ms (schedule {ks['schedule']:.3f}, moves "
              f"{ks['moves']:.3f}), speedup {run['speedup']:.1f}x; copy {copy['bytes_per_s'] / 1e9:.0f} GB/s; "
              f"kvpolicy fraction of copy: end to end {frac(r['kvpolicy_end_to_end'])}, schedule "
              f"{frac(r['kvpolicy_schedule'])}, moves {frac(r['kvpolicy_moves'])}", flush=True)
    out["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}", flush=True)
    return 0 if out.get("check", {}).get("exact", True) else 3


if __name__ == "__main__":
    sys.exit(main())
