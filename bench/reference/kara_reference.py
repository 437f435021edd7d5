#!/usr/bin/env python3
"""Kara (kvpolicy's `kara` preset) in plain PyTorch, against kvpolicy's CUDA executor.

KvLLM's setting (Kara B.1, C.4): at a compression event, 30 sequences each compress
their trailing window of |W| = 768 uncompressed tokens (3 blocks of 256; the last,
possibly partial, block is not part of it), every layer (32) and KV head (8) at once.
What a user writes today without a fused library, vectorised over the (sequence,
layer, KV head) rows, no Python loop over tokens, rows or blocks:

1. scores (Kara eq. 4, SPEC.md "Bidirectional window"): the window's 768 queries of
   every query head against the keys of the window's first 736 tokens (W \\ U; the
   buffer U is the last 32), gathered through the block table from window_begin on;
   `torch.matmul` in the cache's dtype, fp32 softmax over the keys per (query, query
   head), no causal mask; the sum over the G query heads of the KV head and the 768
   queries. Chunked over layers so that the logits fit (`--layer-chunk`);
2. Token2Chunk (SPEC.md "Token2Chunk"; include/kvpolicy/select/token2chunk.hpp is the
   law): anchors = the top max(k - alpha, 0) by score, in position order; consecutive
   anchors with 2 <= gap < gamma enclose a chunk scored (A_lo + A_hi) * (gap - 1), the
   interiors of the top floor(alpha / (gamma - 2)) kept; the best remaining single
   tokens fill the region to exactly min(k, 736). Every ranking is kvpolicy's: larger
   first, NaN as -inf, ties to the later token / the later chunk. torch.topk does not
   specify its tie order, so ranks are taken on one int64 per entry, (score bits,
   index), unique within a row, as rank_bits does;
3. window compaction: the window's kept tokens, then the buffer and every token after
   the window, gathered and scattered (K and V) from window_begin on, in order,
   through the block table; nothing before window_begin is read or written.

Both run on identical copies of the same inputs (nano-vllm `[2, L, num_blocks, b,
h_kv, d]`, queries `[L, slots, 768, h_q, d]`, items `[I, 5]` = seq, slot, budget,
history 0, window_begin) through libkvp_capi.so's KVP_CAPI_KARA (ctypes, torch's
current stream). Checks, before any timing: Token2Chunk of this file on kvpolicy's own
final scores against kvpolicy's mask (the selection alone, exact: must be 0); the
scores of both (max |diff|); the keep masks of both, mismatches counted, and the
mismatched rows split by whether the reference's scores have a near-tie at one of
Token2Chunk's cuts (anchor, chunk, fill): a relative gap within twice the largest
relative difference between the two's scores (or --tie-rel), where rounding may
decide either way; K and V at [window_begin, new length) of rows whose masks
agree; the blocks before the window untouched on both sides; new lengths.

Timing: torch.cuda.Event around each call, the cache restored before each run
(untimed), warm-up, then the median; end to end, and per stage from separate runs
(the reference's three phases between events; kvpolicy's through
kvp_capi_compress_staged, the executor's stage marks).

    python3 bench/reference/kara_reference.py --lib build/bench/libkvp_capi.so --out kara_reference.json

`--device cpu --dtype float32 --seqs 2 --layers 2 --kv-heads 2 --q-heads 8 --head-dim 64
--block-size 32` checks the reference against libkvp_capi_host.so (the window stays 768).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zipage_reference as zr  # noqa: E402  (the C API, DTYPES, timing)

# kara's parameters (include/kvpolicy/pipeline/presets.hpp); the C API runs the preset.
WINDOW = 768  # |W|: the window's tokens and queries
BUFFER = 32  # |U|: the window's newest tokens, kept, not scored
GAMMA = 8  # longest chunk, both endpoints included
ALPHA = 16  # tokens chunks and fill may add
KARA_BUDGET = 225  # kept of W \ U: 257 of the window with the buffer
KVP_CAPI_KARA = 3
INT64_MIN = -(2**63)


@dataclass(frozen=True)
class Config:
    seqs: int = 30
    layers: int = 32
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    block_size: int = 256
    prefix_blocks: int = 1  # compressed context before the window (never read): any count does
    tail: int = 128  # tokens after the window, in the last (partial) block
    budget: int = KARA_BUDGET
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def window_begin(self) -> int:
        return self.prefix_blocks * self.block_size

    @property
    def tokens(self) -> int:  # T of every sequence
        return self.window_begin + WINDOW + self.tail

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.seqs * self.blocks_per_seq + max(8, self.seqs)  # spare blocks owned by nobody

    @property
    def region(self) -> int:  # n: the candidates, W \ U
        return WINDOW - BUFFER

    @property
    def new_length(self) -> int:
        return self.window_begin + min(self.budget, self.region) + (self.tokens - self.window_begin - self.region)


@dataclass
class Inputs:
    kv: torch.Tensor  # [2, L, NB, b, H, d]
    q: torch.Tensor  # [L, seqs, 768, Hq, d]: the window's queries, oldest first
    f: torch.Tensor  # [L, NB, b, H] fp32 (unused by kara; the C API takes a pointer)
    table: torch.Tensor  # [seqs, blocks_per_seq] int32
    lengths: torch.Tensor  # [seqs] int32
    items: torch.Tensor  # [seqs, 5] int32: seq, slot, budget, history 0, window_begin


def make_inputs(cfg: Config, device: torch.device) -> Inputs:
    dtype = zr.DTYPES[cfg.dtype][0]
    g = torch.Generator(device=device)
    g.manual_seed(cfg.seed)
    L, NB, b, H, d = cfg.layers, cfg.num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim
    kv = torch.empty(2, L, NB, b, H, d, dtype=dtype, device=device).uniform_(-1.0, 1.0, generator=g)
    q = torch.empty(L, cfg.seqs, WINDOW, cfg.q_heads, d, dtype=dtype, device=device).uniform_(-1.0, 1.0, generator=g)
    f = torch.zeros(L, NB, b, H, dtype=torch.float32, device=device)
    nblk = cfg.blocks_per_seq
    perm = torch.randperm(NB, device=device, generator=g)[: cfg.seqs * nblk]
    table = perm.view(cfg.seqs, nblk).to(torch.int32).contiguous()
    lengths = torch.full((cfg.seqs,), cfg.tokens, dtype=torch.int32, device=device)
    ids = torch.arange(cfg.seqs, dtype=torch.int32, device=device)
    full = lambda v: torch.full_like(ids, v)  # noqa: E731
    items = torch.stack([ids, ids, full(cfg.budget), full(0), full(cfg.window_begin)], dim=1).contiguous()
    return Inputs(kv, q, f, table, lengths, items)


# ---------------------------------------------------------------------------
# Token2Chunk, vectorised over rows
# ---------------------------------------------------------------------------


def rank_key(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rank_bits as one int64: larger x first, NaN as -inf, -0 as +0, ties to the larger index."""
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # float order as int order
    return ordered * (1 << 32) + index


def rel_gap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y| relative to the larger magnitude; inf where either is not finite."""
    g = (x - y).abs() / torch.maximum(x.abs(), y.abs()).clamp_min(1e-30)
    return torch.where(torch.isfinite(x) & torch.isfinite(y), g, torch.full_like(g, float("inf")))


def token2chunk(a: torch.Tensor, k: int, gamma: int = GAMMA, alpha: int = ALPHA, margins: bool = False):
    """Keep mask [R, n] of Token2Chunk over rows a [R, n] fp32 with budget k (every row).

    With margins, also [R]: the smallest relative score gap at a cut the rule made in
    the row (the a-th / (a+1)-th anchor, the last kept / first left chunk, the last /
    first fill); inf where the row has no such cut.
    """
    R, n = a.shape
    dev = a.device
    pos = torch.arange(n, device=dev).expand(R, n)
    n_anchor = min(max(k - alpha, 0), n)
    n_keep = min(k, n)
    max_chunks = alpha // (gamma - 2)
    key = rank_key(a, pos)
    keep = torch.zeros(R, n, dtype=torch.bool, device=dev)
    margin = torch.full((R,), float("inf"), device=dev)
    clean = torch.where(torch.isnan(a), torch.full_like(a, float("-inf")), a)

    # 1. Anchors: the top n_anchor keys (unique per row), in position order.
    if n_anchor > 0:
        top = torch.topk(key, n_anchor, dim=-1, sorted=False).indices
        anchors = torch.sort(top, dim=-1).values  # [R, n_anchor]
        keep.scatter_(1, anchors, True)
        if margins and n_anchor < n:
            v = torch.gather(clean, 1, torch.topk(key, n_anchor + 1, dim=-1).indices)
            margin = torch.minimum(margin, rel_gap(v[:, -2], v[:, -1]))

    # 2. Chunks between consecutive anchors with 2 <= gap < gamma, ranked by
    #    (A_lo + A_hi) * (gap - 1), ties to the later chunk (the larger j).
    added = torch.zeros(R, dtype=torch.long, device=dev)
    if n_anchor >= 2 and max_chunks > 0:
        lo, hi = anchors[:, :-1], anchors[:, 1:]
        gap = hi - lo
        valid = (gap >= 2) & (gap < gamma)
        score = (torch.gather(a, 1, lo) + torch.gather(a, 1, hi)) * (gap - 1).to(a.dtype)
        j = torch.arange(n_anchor - 1, device=dev).expand_as(lo)
        ckey = torch.where(valid, rank_key(score, j), torch.full_like(j, INT64_MIN))
        m = min(max_chunks, n_anchor - 1)
        ctop = torch.topk(ckey, m, dim=-1).indices  # sorted: best first
        chosen = torch.gather(valid, 1, ctop)  # fewer valid chunks than m: the rest are not chunks
        clo, chi = torch.gather(lo, 1, ctop), torch.gather(hi, 1, ctop)
        inner = clo.unsqueeze(-1) + torch.arange(1, gamma - 1, device=dev)  # [R, m, gamma - 2]
        inside = (inner < chi.unsqueeze(-1)) & chosen.unsqueeze(-1)
        grown = torch.zeros_like(keep).scatter_(1, torch.where(inside, inner, clo.unsqueeze(-1)).view(R, -1),
                                                inside.view(R, -1))
        keep |= grown
        added = ((chi - clo - 1) * chosen).sum(-1)
        if margins:
            cclean = torch.where(torch.isnan(score), torch.full_like(score, float("-inf")), score)
            cval = torch.where(valid, cclean, torch.full_like(cclean, float("nan")))
            if n_anchor - 1 > m:  # the m-th kept chunk against the best chunk left, both valid
                order = torch.topk(ckey, m + 1, dim=-1).indices
                cv = torch.gather(cval, 1, order)
                margin = torch.minimum(margin, torch.nan_to_num(rel_gap(cv[:, -2], cv[:, -1]), nan=float("inf")))

    # 3. Fill: the best tokens left, as many as the region still lacks (per row).
    fill = n_keep - n_anchor - added  # [R]
    fmax = int(fill.max()) if R else 0
    if fmax > 0:
        rest = torch.where(keep, torch.full_like(key, INT64_MIN), key)
        width = min(fmax + 1, n)
        order = torch.topk(rest, width, dim=-1).indices  # best first
        take = torch.arange(width, device=dev) < fill.unsqueeze(-1)
        keep |= torch.zeros_like(keep).scatter_(1, order, take)  # scatter onto zeros: a row's kept stay kept
        if margins:
            v = torch.gather(clean, 1, order)
            has = (fill > 0) & (fill < n - n_anchor - added)
            f = fill.clamp(1, width - 1)
            g = rel_gap(torch.gather(v, 1, (f - 1).unsqueeze(1)).squeeze(1), torch.gather(v, 1, f.unsqueeze(1)).squeeze(1))
            margin = torch.minimum(margin, torch.where(has, g, torch.full_like(g, float("inf"))))
    return (keep, margin) if margins else keep


# ---------------------------------------------------------------------------
# The PyTorch reference
# ---------------------------------------------------------------------------


def auto_layer_chunk(cfg: Config, device: torch.device, reserve: int) -> int:
    """Layers per chunk of the score phase: its temporaries in half the memory left free
    once `reserve` more bytes are allocated (the check's two copies of the cache)."""
    if device.type != "cuda":
        return cfg.layers
    es = zr.DTYPES[cfg.dtype][0].itemsize
    G, n = cfg.q_heads // cfg.kv_heads, cfg.region
    cells = cfg.seqs * cfg.kv_heads * G * WINDOW * n  # logits of one layer
    per_layer = cells * (es + 4 + 4) + cfg.seqs * cfg.q_heads * WINDOW * cfg.head_dim * es * 2
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's cached blocks
    return max(1, min(cfg.layers, int(0.5 * max(free - reserve, 0) // per_layer)))


def kara_reference(kv, q, table, seq_ids, slot_ids, window_begin, T, budget, layer_chunk, want_outputs=False,
                   mark=None):
    """Compresses, in place, the window [window_begin, window_begin + 768) of `seq_ids`
    (all holding T tokens) and the tokens after it, every layer and KV head.

    Returns (keep [I, L, H, T - window_begin] bool over the window and what follows,
    scores [I, L, H, 736] fp32, new length) when want_outputs. mark(i), if given, is
    called after the scores (1), the selection (2) and the compaction (3).
    """
    dev = kv.device
    _, L, _, b, H, d = kv.shape
    Wq, Hq = q.shape[2], q.shape[3]
    G, I, n = Hq // H, seq_ids.numel(), WINDOW - BUFFER
    Tw = T - window_begin
    blk = table[seq_ids].long()  # [I, blocks]
    scale = 1.0 / math.sqrt(d)

    # 1. Scores: the keys of W \ U through the block table, the window's queries.
    tok = window_begin + torch.arange(n, device=dev)
    kblk, kslot = blk[:, tok // b], (tok % b).view(1, n)  # [I, n], [1, n]
    scores = torch.empty(I, L, H, n, dtype=torch.float32, device=dev)
    for l0 in range(0, L, layer_chunk):
        l1 = min(L, l0 + layer_chunk)
        Lc = l1 - l0
        K = kv[0, l0:l1][:, kblk, kslot].permute(1, 0, 3, 2, 4)  # [I, Lc, H, n, d]
        Q = q[l0:l1][:, slot_ids, Wq - WINDOW :]  # [Lc, I, 768, Hq, d]
        Q = Q.reshape(Lc, I, WINDOW, H, G, d).permute(1, 0, 3, 4, 2, 5).reshape(I, Lc, H, G * WINDOW, d)
        z = torch.matmul(Q, K.transpose(-1, -2))  # [I, Lc, H, G*768, n], the cache's dtype
        del Q, K
        z = z.float().mul_(scale)
        p = torch.softmax(z, dim=-1)  # per (query, query head); no causal mask
        del z
        scores[:, l0:l1] = p.sum(dim=3)  # group sum and colsum over the window's queries
        del p
    if mark:
        mark(1)

    # 2. Token2Chunk over every row of W \ U.
    keep_region = token2chunk(scores.view(-1, n), budget).view(I, L, H, n)
    if mark:
        mark(2)

    # 3. Compaction: the region's kept tokens in order, then the buffer and the tail,
    #    to window_begin + i. Every row keeps min(k, n) of the region.
    c = min(budget, n)
    pos = torch.arange(n, device=dev)
    kept = torch.sort(torch.where(keep_region, pos, n), dim=-1).values[..., :c]  # [I, L, H, c]
    after = torch.arange(n, Tw, device=dev).expand(I, L, H, Tw - n)
    src = window_begin + torch.cat([kept, after], dim=-1)  # [I, L, H, m] tokens
    m = src.shape[-1]
    dst = window_begin + torch.arange(m, device=dev)
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    src_blk = torch.gather(blk.view(I, 1, 1, -1).expand(I, L, H, blk.shape[1]), 3, src // b)
    src_slot = src % b
    dst_blk = blk[:, dst // b].view(I, 1, 1, m)
    dst_slot = (dst % b).view(1, 1, 1, m)
    for part in (0, 1):
        moved = kv[part][l_idx, src_blk, src_slot, h_idx]  # gathered before any write
        kv[part][l_idx, dst_blk, dst_slot, h_idx] = moved
        del moved
    if mark:
        mark(3)
    if not want_outputs:
        return None
    keep = torch.ones(I, L, H, Tw, dtype=torch.bool, device=dev)
    keep[..., :n] = keep_region
    return keep, scores, window_begin + m


# ---------------------------------------------------------------------------
# kvpolicy, its staged call, and the byte model
# ---------------------------------------------------------------------------


class Kvpolicy(zr.Kvpolicy):
    """zipage_reference's binding, plus kvp_capi_compress_staged."""

    def __init__(self, path: str, device: torch.device):
        super().__init__(path, device)
        vp = ctypes.c_void_p
        self.lib.kvp_capi_compress_staged.argtypes = [ctypes.POINTER(zr.KvpShape), vp, vp, vp, vp, vp, vp, vp,
                                                      ctypes.c_size_t, ctypes.POINTER(ctypes.c_float),
                                                      ctypes.c_size_t]
        self.lib.kvp_capi_compress_staged.restype = ctypes.c_int

    def kara_shape(self, cfg: Config, inp: Inputs) -> zr.KvpShape:
        return zr.KvpShape(
            num_layers=cfg.layers, num_blocks=cfg.num_blocks, block_size=cfg.block_size, num_kv_heads=cfg.kv_heads,
            num_q_heads=cfg.q_heads, head_dim=cfg.head_dim, num_seqs=cfg.seqs, max_blocks_per_seq=inp.table.shape[1],
            query_slots=inp.q.shape[1], query_window=inp.q.shape[2], num_items=inp.items.shape[0],
            max_tokens=cfg.tokens, layer_begin=0, layer_count=cfg.layers, dtype=zr.DTYPES[cfg.dtype][1],
            policy=KVP_CAPI_KARA)

    def compress_staged(self, shape, kv, q, f, table, lengths, items, ws) -> list[float]:
        out = (ctypes.c_float * 4)()
        rc = self.lib.kvp_capi_compress_staged(
            ctypes.byref(shape), kv.data_ptr(), q.data_ptr(), f.data_ptr(), table.data_ptr(), lengths.data_ptr(),
            items.data_ptr(), ws.data_ptr(), ws.numel(), out, self._stream())
        self._ok(rc, "kvp_capi_compress_staged")
        return list(out)


def byte_model(cfg: Config, moved_tokens: int) -> dict:
    """bench/README.md's kara byte model: queries and keys of W \\ U read by the scorer,
    K and V of every kept token whose slot changes read and written."""
    es = zr.DTYPES[cfg.dtype][0].itemsize
    L, I, d = cfg.layers, cfg.seqs, cfg.head_dim
    q = L * I * WINDOW * cfg.q_heads * d * es
    k = L * I * cfg.kv_heads * cfg.region * d * es
    moved = moved_tokens * 2 * 2 * d * es
    return {"queries": q, "keys": k, "moved": moved, "total": q + k + moved, "moved_tokens": moved_tokens}


def moved_tokens(keep: torch.Tensor) -> int:
    """Kept tokens whose destination (their rank among the kept) is not their position."""
    rank = torch.cumsum(keep.to(torch.int32), dim=-1) - 1
    pos = torch.arange(keep.shape[-1], device=keep.device)
    return int((keep & (rank != pos)).sum())


# ---------------------------------------------------------------------------
# Check and timing
# ---------------------------------------------------------------------------


def compare(cfg: Config, inp: Inputs, kvp: Kvpolicy, layer_chunk: int, tie_rel: float | None = None) -> dict:
    dev = inp.kv.device
    I, L, H, T, n = cfg.seqs, cfg.layers, cfg.kv_heads, cfg.tokens, cfg.region
    wb, Tw, b = cfg.window_begin, cfg.tokens - cfg.window_begin, cfg.block_size
    seq_ids, slot_ids = inp.items[:, 0].long(), inp.items[:, 1].long()

    kv_ref = inp.kv.clone()
    keep_ref, s_ref, len_ref = kara_reference(kv_ref, inp.q, inp.table, seq_ids, slot_ids, wb, T, cfg.budget,
                                              layer_chunk, want_outputs=True)
    kv_kvp = inp.kv.clone()
    shape = kvp.kara_shape(cfg, inp)
    ws = kvp.workspace(shape, dev)
    keep_out = torch.zeros(I, L, H, T, dtype=torch.uint8, device=dev)
    s_out = torch.zeros(I, L, H, T, dtype=torch.float32, device=dev)
    kvp.compress(shape, kv_kvp, inp.q, inp.f, inp.table, inp.lengths, inp.items, ws, keep_out, s_out)
    kvp.check_status(shape, ws)
    new_lengths = kvp.new_lengths(shape, ws)
    keep_kvp, s_kvp = keep_out[..., :Tw].bool(), s_out[..., :n]

    # The selection alone: this file's Token2Chunk on kvpolicy's own scores.
    keep_sel = token2chunk(s_kvp.reshape(-1, n), cfg.budget).view(I, L, H, n)
    selection_mismatches = int((keep_sel != keep_kvp[..., :n]).sum())

    # Whole pipeline: masks, split by near-ties at the reference's cuts: a cut whose
    # two scores lie closer than the two computations' largest disagreement (twice
    # the largest relative score difference, unless --tie-rel says) may go either way.
    finite = torch.isfinite(s_ref) & torch.isfinite(s_kvp)
    score_diff = (s_ref - s_kvp).abs()[finite]
    score_rel = score_diff / s_ref.abs()[finite].clamp_min(1e-30)
    max_rel = float(score_rel.max()) if score_rel.numel() else 0.0
    tie_rel = 2.0 * max_rel if tie_rel is None else tie_rel
    _, margin = token2chunk(s_ref.reshape(-1, n), cfg.budget, margins=True)
    margin = margin.view(I, L, H)
    mism = keep_ref != keep_kvp
    row_mism = mism.any(-1)
    near = margin <= tie_rel
    rows_agree = ~row_mism

    # K and V: the compacted range of rows whose masks agree; the prefix on both sides.
    blk = inp.table[seq_ids].long()
    m = len_ref - wb
    dst = wb + torch.arange(m, device=dev)
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    dst_blk, dst_slot = blk[:, dst // b].view(I, 1, 1, m), (dst % b).view(1, 1, 1, m)
    kv_differ = 0
    for part in (0, 1):
        a = kv_ref[part][l_idx, dst_blk, dst_slot, h_idx]
        c = kv_kvp[part][l_idx, dst_blk, dst_slot, h_idx]
        kv_differ += int((((a != c).flatten(3).any(-1)) & rows_agree).sum())
        del a, c
    pre = blk[:, : cfg.prefix_blocks].reshape(-1)
    prefix_ok = bool(torch.equal(kv_ref[:, :, pre], inp.kv[:, :, pre]) and torch.equal(kv_kvp[:, :, pre], inp.kv[:, :, pre]))
    released = [cfg.blocks_per_seq - (x + b - 1) // b for x in new_lengths]
    out = {
        "rows": I * L * H,
        "region_tokens": n,
        "tokens_compared": I * L * H * Tw,
        "selection_on_kvpolicy_scores_mismatches": selection_mismatches,
        "score_max_abs_diff": float(score_diff.max()) if score_diff.numel() else 0.0,
        "score_max_rel_diff": max_rel,
        "score_max_abs": float(s_ref.abs()[finite].max()) if score_diff.numel() else 0.0,
        "score_nonfinite_agree": bool(torch.equal(torch.isfinite(s_ref), torch.isfinite(s_kvp))),
        "scores_past_region_inf": bool(torch.isinf(s_out[..., n:Tw]).all()),
        "mask_mismatches": int(mism.sum()),
        "rows_with_mismatch": int(row_mism.sum()),
        "near_tie_rel": tie_rel,
        "rows_with_mismatch_near_tie": int((row_mism & near).sum()),
        "rows_with_mismatch_not_near_tie": int((row_mism & ~near).sum()),
        "rows_with_near_tie": int(near.sum()),
        "kept_per_row_reference": int(keep_ref[0, 0, 0].sum()),
        "kept_counts_equal": bool(torch.equal(keep_ref.sum(-1), keep_kvp.sum(-1))),
        "kv_rows_differing_where_masks_agree": kv_differ,
        "prefix_untouched": prefix_ok,
        "new_length_reference": len_ref,
        "new_lengths_kvpolicy": sorted(set(new_lengths)),
        "new_lengths_ok": all(x == len_ref for x in new_lengths),
        "released_blocks_per_window": sorted(set(released)),
        "released_blocks_total": sum(released),
        "moved_tokens": moved_tokens(keep_kvp),
    }
    del kv_ref, kv_kvp
    return out


def measure(cfg: Config, inp: Inputs, kvp: Kvpolicy, layer_chunk: int, warmup: int, iters: int) -> dict:
    dev = inp.kv.device
    cuda = dev.type == "cuda"
    kv0 = inp.kv.clone()
    kv = inp.kv

    def restore():
        kv.copy_(kv0)

    seq_ids, slot_ids = inp.items[:, 0].long(), inp.items[:, 1].long()
    wb, T = cfg.window_begin, cfg.tokens
    shape = kvp.kara_shape(cfg, inp)
    ws = kvp.workspace(shape, dev)

    def reference(mark=None):
        kara_reference(kv, inp.q, inp.table, seq_ids, slot_ids, wb, T, cfg.budget, layer_chunk, mark=mark)

    def kvpolicy():
        kvp.compress(shape, kv, inp.q, inp.f, inp.table, inp.lengths, inp.items, ws)

    ref_ms = zr.time_runs(reference, restore, warmup, iters, dev)
    kvp_ms = zr.time_runs(kvpolicy, restore, warmup, iters, dev)
    kvp.check_status(shape, ws)

    # Per stage, separate runs: the reference's phases between events, kvpolicy's marks.
    ref_stages, kvp_stages = [], []
    for _ in range(iters):
        restore()
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
            reference(lambda i: ev[i].record())
            ev[3].synchronize()
            ref_stages.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])
        else:
            t = [time.perf_counter()]
            reference(lambda i: t.append(time.perf_counter()))
            ref_stages.append([(t[i + 1] - t[i]) * 1e3 for i in range(3)])
        restore()
        kvp_stages.append(kvp.compress_staged(shape, kv, inp.q, inp.f, inp.table, inp.lengths, inp.items, ws))
    kvp.check_status(shape, ws)
    restore()
    del kv0
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    ref, kvm = statistics.median(ref_ms), statistics.median(kvp_ms)
    return {
        "seqs": cfg.seqs, "layers": cfg.layers, "tokens": T, "window_begin": wb,
        "reference_ms": ref, "kvpolicy_ms": kvm, "speedup": ref / kvm if kvm > 0 else None,
        "reference_ms_all": ref_ms, "kvpolicy_ms_all": kvp_ms,
        "reference_stage_ms": {name: med(ref_stages, i) for i, name in enumerate(("score", "select", "layout"))},
        # The executor's marks in the order its stages run (kvp_capi.h): kara has no
        # redundancy stage, so its interval is about 0.
        "kvpolicy_stage_ms": {name: med(kvp_stages, i)
                              for i, name in enumerate(("score", "redundancy", "epilogue", "layout"))},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--dtype", choices=sorted(zr.DTYPES), default="bfloat16")
    ap.add_argument("--seqs", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--prefix-blocks", type=int, default=1, help="blocks before the window (never read)")
    ap.add_argument("--tail", type=int, default=128, help="tokens after the window (the last, partial block)")
    ap.add_argument("--budget", type=int, default=KARA_BUDGET)
    ap.add_argument("--layer-chunk", type=int, default=0, help="layers per score chunk; 0: from the free memory")
    ap.add_argument("--tie-rel", type=float, default=None,
                    help="relative score gap counted as a near-tie; default twice the largest relative score "
                         "difference measured between the two")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-time", action="store_true", help="the check only")
    ap.add_argument("--out", default="kara_reference.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kara_reference: no CUDA device (--device cpu checks against the host executor)", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    kvp = Kvpolicy(args.lib or zr.default_lib(args.device), dev)
    cfg = Config(seqs=args.seqs, layers=args.layers, kv_heads=args.kv_heads, q_heads=args.q_heads,
                 head_dim=args.head_dim, block_size=args.block_size, prefix_blocks=args.prefix_blocks,
                 tail=args.tail, budget=args.budget, dtype=args.dtype, seed=args.seed)
    inp = make_inputs(cfg, dev)
    chunk = args.layer_chunk or auto_layer_chunk(cfg, dev, 2 * inp.kv.numel() * inp.kv.element_size())
    t0 = time.time()
    check = compare(cfg, inp, kvp, chunk, args.tie_rel)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(f"[check] {args.dtype} {cfg.seqs} windows x {cfg.layers} layers: selection on kvpolicy's scores "
          f"{check['selection_on_kvpolicy_scores_mismatches']} mismatches; score max |diff| "
          f"{check['score_max_abs_diff']:.3g} (rel {check['score_max_rel_diff']:.3g}); mask mismatches "
          f"{check['mask_mismatches']} in {check['rows_with_mismatch']} of {check['rows']} rows "
          f"({check['rows_with_mismatch_not_near_tie']} not near a tie); K/V rows differing where masks agree "
          f"{check['kv_rows_differing_where_masks_agree']}; prefix untouched {check['prefix_untouched']}; "
          f"new lengths equal {check['new_lengths_ok']} ({check['new_length_reference']}); released "
          f"{check['released_blocks_total']} blocks", flush=True)
    out = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": args.dtype, "policy": "kara (KvLLM: |W| 768, |U| 32, gamma 8, alpha 16)",
           "config": {**asdict(cfg), "tokens": cfg.tokens, "window_begin": cfg.window_begin,
                      "region": cfg.region, "layer_chunk": chunk},
           "check": check, "bytes": byte_model(cfg, check["moved_tokens"]),
           "timing": "median of iters runs, torch.cuda.Event, cache restored before each run (untimed); "
                     "stages from separate runs"}
    if not args.no_time:
        run = measure(cfg, inp, kvp, chunk, args.warmup, args.iters)
        out["run"] = run
        rs, ks = run["reference_stage_ms"], run["kvpolicy_stage_ms"]
        print(f"[time] {args.dtype}: reference {run['reference_ms']:.3f} ms (score {rs['score']:.3f}, select "
              f"{rs['select']:.3f}, layout {rs['layout']:.3f}), kvpolicy {run['kvpolicy_ms']:.3f} ms (score "
              f"{ks['score']:.3f}, epilogue {ks['epilogue']:.3f}, layout {ks['layout']:.3f}), speedup "
              f"{run['speedup']:.1f}x", flush=True)
    out["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
