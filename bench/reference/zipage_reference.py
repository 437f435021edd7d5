#!/usr/bin/env python3
"""Zipage compression in plain PyTorch, against kvpolicy's CUDA executor.

The reference is what a user writes today without a fused library: gather the
paged keys through the block table, attention logits of the window queries with
torch.matmul, softmax, group max, window mean, the global score through F, max
pooling on a first compression, lightning redundancy with per-block bmm, the
combine, protect, top-k, and a gather/scatter compaction through the block table.
It follows SPEC.md (the host executor in include/kvpolicy/exec/host/*.hpp is the
law), vectorised over the (sequence, layer, KV head) rows: no Python loop over
tokens, rows or blocks.

Both run on identical copies of the same inputs (nano-vllm layout
`[2, L, num_blocks, b, h_kv, d]`, queries `[L, slots, w, h_q, d]`, F
`[L, num_blocks, b, h_kv]` fp32). kvpolicy is called through libkvp_capi.so
(bench/reference/kvp_capi.cu) with ctypes, on torch's current stream.

Checks: the keep masks of both (every mismatch counted; in fp32 mode the only
expected ones are near-ties, mismatched tokens whose score lies within 1e-3
relative of the row's k-th score), the compacted K/V bytes of rows whose masks
agree, and F. Timing: torch.cuda.Event around each call, warm-up runs, then the
median of N runs; the cache and F are restored before every run, outside the
timed region.

    python3 bench/reference/zipage_reference.py --lib build/bench/libkvp_capi.so \\
        --dtype bfloat16 --nmax 9,18,36 --out reference.json

Without a GPU, `--device cpu` runs the same check on CPU tensors against
libkvp_capi_host.so (the host executor, the library's definition), on a small
configuration, e.g. `--device cpu --dtype float32 --seqs 2 --layers 2 --kv-heads 2
--q-heads 8 --head-dim 64 --block-size 32 --nmax 5`.
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
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

DTYPES = {"float16": (torch.float16, 0), "bfloat16": (torch.bfloat16, 1), "float32": (torch.float32, 2)}


@dataclass(frozen=True)
class Config:
    seqs: int = 16
    layers: int = 8
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    block_size: int = 256
    n_max: int = 9
    window: int = 16  # w: observation queries per slot = zipage's scorer and protected window
    dtype: str = "bfloat16"
    history: int = -1  # history_tokens of every item; -1 = budget (Zipage's steady state)
    seed: int = 0
    dup_fraction: float = 0.125  # keys made near-duplicates of an earlier key of their block

    @property
    def tokens(self) -> int:  # T: N_max blocks, the last one full
        return self.n_max * self.block_size

    @property
    def budget(self) -> int:  # (N_max - 1) * b
        return (self.n_max - 1) * self.block_size

    @property
    def history_tokens(self) -> int:
        return self.budget if self.history < 0 else self.history

    @property
    def num_blocks(self) -> int:
        return self.seqs * self.n_max + max(8, self.seqs)  # spare blocks owned by nobody


# Zipage's parameters (SPEC.md, Presets; include/kvpolicy/pipeline/presets.hpp).
ALPHA = 0.8  # global score: S <- max(alpha F, S) for tokens with history
POOL_KERNEL = 5  # max pool, first compression only
THETA = 0.5  # redundancy: similarity threshold of the newest near-duplicate
TAU = 0.4  # R = softmax(red / tau)
LAMBDA = 0.2  # S <- lambda S - (1 - lambda) R
EPS = 1e-8  # k / (||k|| + eps)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclass
class Inputs:
    kv: torch.Tensor  # [2, L, NB, b, H, d]
    q: torch.Tensor  # [L, slots, w, Hq, d]
    f: torch.Tensor  # [L, NB, b, H] fp32
    table: torch.Tensor  # [seqs, n_max] int32
    lengths: torch.Tensor  # [seqs] int32
    items: torch.Tensor  # [seqs, 4] int32: seq, query slot, budget, history


def make_inputs(cfg: Config, device: torch.device) -> Inputs:
    dtype = DTYPES[cfg.dtype][0]
    g = torch.Generator(device=device)
    g.manual_seed(cfg.seed)
    L, NB, b, H, d = cfg.layers, cfg.num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim
    kv = torch.empty(2, L, NB, b, H, d, dtype=dtype, device=device)
    kv.uniform_(-1.0, 1.0, generator=g)
    if cfg.dup_fraction > 0:
        # Near-duplicate keys (cosine ~0.99 > theta) so the "drop the newest similar
        # token" path of the redundancy is exercised: key t copies a key s < t of
        # its block, plus a little noise.
        k = kv[0]
        slot = torch.arange(b, device=device).view(1, 1, b, 1)
        src = (torch.rand(L, NB, b, H, device=device, generator=g) * slot).long()  # in [0, t)
        dup = (torch.rand(L, NB, b, H, device=device, generator=g) < cfg.dup_fraction) & (slot > 0)
        copied = torch.gather(k, 2, src.unsqueeze(-1).expand(L, NB, b, H, d))
        noise = torch.empty_like(copied).uniform_(-0.1, 0.1, generator=g)
        k.copy_(torch.where(dup.unsqueeze(-1), copied + noise, k))
    q = torch.empty(L, cfg.seqs, cfg.window, cfg.q_heads, d, dtype=dtype, device=device)
    q.uniform_(-1.0, 1.0, generator=g)
    f = torch.empty(L, NB, b, H, dtype=torch.float32, device=device)
    f.uniform_(0.0, 2.0 / cfg.tokens, generator=g)  # scores of an earlier round
    perm = torch.randperm(NB, device=device, generator=g)[: cfg.seqs * cfg.n_max]
    table = perm.view(cfg.seqs, cfg.n_max).to(torch.int32).contiguous()
    lengths = torch.full((cfg.seqs,), cfg.tokens, dtype=torch.int32, device=device)
    ids = torch.arange(cfg.seqs, dtype=torch.int32, device=device)
    items = torch.stack(
        [ids, ids, torch.full_like(ids, cfg.budget), torch.full_like(ids, cfg.history_tokens)], dim=1
    ).contiguous()
    return Inputs(kv, q, f, table, lengths, items)


# ---------------------------------------------------------------------------
# The PyTorch reference
# ---------------------------------------------------------------------------


def zipage_reference(kv, q, f, table, seq_ids, slot_ids, history, T, budget, window, want_outputs=False):
    """Compresses, in place, every layer and KV head of the sequences `seq_ids`.

    kv [2, L, NB, b, H, d], q [L, slots, Wq, Hq, d], f [L, NB, b, H] fp32 (all
    modified in place but q), table [seqs, max_blocks] int32 (device); seq_ids,
    slot_ids: int64 device tensors [I]; history: host list of history_tokens per
    item. All items hold T tokens and keep `budget`. Returns (keep mask [I, L, H, T]
    bool, final scores [I, L, H, T] fp32) when want_outputs, else None.
    """
    _, L, NB, b, H, d = kv.shape
    Wq, Hq = q.shape[2], q.shape[3]
    G, w, I = Hq // H, window, seq_ids.numel()
    nb = (T + b - 1) // b
    dev = kv.device
    native = kv.dtype  # matmuls run in the cache's dtype (as model code does), softmax in fp32

    blk = table[seq_ids, :nb].long()  # [I, nb] physical blocks
    # 1. Keys of every row, gathered through the block table: [I, L, H, nb*b, d].
    keys = kv[0][:, blk].permute(1, 0, 4, 2, 3, 5).reshape(I, L, H, nb * b, d)
    if nb * b > T:
        keys[..., T:, :] = 0  # slots past the length: zero keys have similarity 0 to every key
    K = keys[..., :T, :]

    # 2. Window attention: logits of the last w queries of each query head, causal
    #    inside the window, softmax over the keys, max over the G query heads of the
    #    KV head, mean over the window.
    Q = q[:, slot_ids, Wq - w :]  # [L, I, w, Hq, d]
    Q = Q.reshape(L, I, w, H, G, d).permute(1, 0, 3, 4, 2, 5).reshape(I, L, H, G * w, d)
    logits = torch.matmul(Q, K.transpose(-1, -2)).float().mul_(1.0 / math.sqrt(d))  # [I, L, H, G*w, T]
    pos = torch.arange(T, device=dev)
    causal = pos.view(1, T) > (T - w + torch.arange(w, device=dev)).view(w, 1)  # key t after query j
    logits = logits.view(I, L, H, G, w, T).masked_fill_(causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    del logits
    S = probs.amax(dim=3).sum(dim=3).mul_(1.0 / w)  # [I, L, H, T]
    del probs

    # 3. Global score: S <- max(alpha F, S) for tokens with a history; F <- S.
    f_rows = f[:, blk].permute(1, 0, 4, 2, 3).reshape(I, L, H, nb * b)[..., :T]
    hist = torch.tensor(history, device=dev).view(I, 1, 1, 1)
    S = torch.where(pos.view(1, 1, 1, T) < hist, torch.maximum(ALPHA * f_rows, S), S)
    f_new = S  # F keeps the score before pooling

    # 4. Max pool, kernel 5, only on a sequence's first compression.
    first = [h == 0 for h in history]
    if any(first):
        pooled = F.max_pool1d(S.reshape(-1, 1, T), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2).view(I, L, H, T)
        S = pooled if all(first) else torch.where(torch.tensor(first, device=dev).view(I, 1, 1, 1), pooled, S)

    # 5. Lightning redundancy: cosine similarity within each block of b keys,
    #    diagonal 0; each token u drops its newest (largest index) neighbour with
    #    similarity > theta from that neighbour's sum; red = sum / b; R = softmax(red / tau).
    kb = keys.reshape(I * L * H * nb, b, d)
    if native == torch.float32:
        inv = 1.0 / (kb.norm(dim=-1) + EPS)
        C = torch.bmm(kb, kb.transpose(1, 2)).mul_(inv.unsqueeze(2) * inv.unsqueeze(1))
    else:
        kn = kb / (kb.norm(dim=-1, keepdim=True) + EPS)
        C = torch.bmm(kn, kn.transpose(1, 2))
    C.diagonal(dim1=1, dim2=2).zero_()
    similar = (C > THETA).to(torch.uint8)  # [rows*nb, u, v]
    last = b - 1 - torch.argmax(similar.flip(-1), dim=-1)  # newest v with C(u, v) > theta
    has = similar.amax(dim=-1) > 0
    del similar
    newest = torch.where(has, last, torch.zeros_like(last))
    dropped = torch.gather(C, 2, newest.unsqueeze(-1)).squeeze(-1).float() * has  # C(u, r(u))
    colsum = C.sum(dim=1, dtype=torch.float32)  # sum over u of C(u, v)
    del C
    red = colsum.scatter_add_(1, newest, -dropped)  # leave out every u with r(u) = v
    red = red.view(I, L, H, nb * b)[..., :T].mul(1.0 / b).div_(TAU)
    R = torch.softmax(red, dim=-1)

    # 6. Combine, protect the window, top-k with ties to the more recent token.
    S = LAMBDA * S - (1.0 - LAMBDA) * R
    S[..., T - w :] = float("inf")
    S = torch.nan_to_num(S, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    bits = S.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # float order as int order
    key = ordered * (1 << 32) + pos.view(1, 1, 1, T)  # (score, position): equal scores -> newer first
    top = torch.topk(key, budget, dim=-1, sorted=False).indices
    kept = torch.sort(top, dim=-1).values  # [I, L, H, k] positions in order

    # 7. Compaction: the i-th kept token (with its V and F) moves to position i.
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    src_blk = torch.gather(blk, 1, (kept // b).view(I, -1)).view(I, L, H, budget)
    src_slot = kept % b
    k_kept = kv[0][l_idx, src_blk, src_slot, h_idx]  # [I, L, H, k, d]
    v_kept = kv[1][l_idx, src_blk, src_slot, h_idx]
    f_kept = torch.gather(f_new, 3, kept)
    # F <- S for every token, then the moved entries.
    all_blk = blk[:, pos // b].view(I, 1, 1, T)
    f[l_idx, all_blk, (pos % b).view(1, 1, 1, T), h_idx] = f_new
    dst = torch.arange(budget, device=dev)
    dst_blk = blk[:, dst // b].view(I, 1, 1, budget)
    dst_slot = (dst % b).view(1, 1, 1, budget)
    kv[0][l_idx, dst_blk, dst_slot, h_idx] = k_kept
    kv[1][l_idx, dst_blk, dst_slot, h_idx] = v_kept
    f[l_idx, dst_blk, dst_slot, h_idx] = f_kept

    if not want_outputs:
        return None
    keep = torch.zeros(I, L, H, T, dtype=torch.bool, device=dev).scatter_(3, top, True)
    return keep, S


# ---------------------------------------------------------------------------
# kvpolicy through libkvp_capi.so
# ---------------------------------------------------------------------------


class KvpShape(ctypes.Structure):
    # Must match `struct shape` in kvp_capi.cu, field for field.
    _fields_ = [
        (name, ctypes.c_int32)
        for name in (
            "num_layers", "num_blocks", "block_size", "num_kv_heads", "num_q_heads", "head_dim",
            "num_seqs", "max_blocks_per_seq", "query_slots", "query_window", "num_items", "max_tokens",
            "layer_begin", "layer_count", "dtype", "policy",
        )
    ]


class Kvpolicy:
    """libkvp_capi.so (CUDA executor, device tensors) or libkvp_capi_host.so (host
    executor, CPU tensors): the same C API, kvp_capi.h."""

    def __init__(self, path: str, device: torch.device):
        self.device = device
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        vp, i32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)
        lib.kvp_capi_shape_size.restype = ctypes.c_int
        lib.kvp_capi_last_error.restype = ctypes.c_char_p
        lib.kvp_capi_workspace_size.argtypes = [ctypes.POINTER(KvpShape), ctypes.POINTER(ctypes.c_size_t)]
        lib.kvp_capi_compress.argtypes = [ctypes.POINTER(KvpShape), vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t,
                                          vp, vp, ctypes.c_size_t]
        lib.kvp_capi_status.argtypes = [ctypes.POINTER(KvpShape), vp, i32p, ctypes.c_size_t]
        lib.kvp_capi_new_lengths.argtypes = [ctypes.POINTER(KvpShape), vp, i32p, ctypes.c_size_t]
        for fn in (lib.kvp_capi_workspace_size, lib.kvp_capi_compress, lib.kvp_capi_status, lib.kvp_capi_new_lengths):
            fn.restype = ctypes.c_int
        if lib.kvp_capi_shape_size() != ctypes.sizeof(KvpShape):
            raise RuntimeError(f"{path}: struct shape is {lib.kvp_capi_shape_size()} bytes, KvpShape "
                               f"{ctypes.sizeof(KvpShape)}: rebuild kvp_capi")

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.device.type == "cuda" else 0

    def _ok(self, rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.kvp_capi_last_error().decode()} (code {rc})")

    def shape(self, cfg: Config, inp: Inputs, policy: int = 0) -> KvpShape:
        return KvpShape(
            num_layers=cfg.layers, num_blocks=cfg.num_blocks, block_size=cfg.block_size, num_kv_heads=cfg.kv_heads,
            num_q_heads=cfg.q_heads, head_dim=cfg.head_dim, num_seqs=cfg.seqs, max_blocks_per_seq=inp.table.shape[1],
            query_slots=inp.q.shape[1], query_window=inp.q.shape[2], num_items=inp.items.shape[0],
            max_tokens=cfg.tokens, layer_begin=0, layer_count=cfg.layers, dtype=DTYPES[cfg.dtype][1], policy=policy,
        )

    def workspace(self, shape: KvpShape, device) -> torch.Tensor:
        n = ctypes.c_size_t(0)
        self._ok(self.lib.kvp_capi_workspace_size(ctypes.byref(shape), ctypes.byref(n)), "kvp_capi_workspace_size")
        return torch.empty(max(int(n.value), 256), dtype=torch.uint8, device=device)

    def compress(self, shape, kv, q, f, table, lengths, items, ws, keep=None, scores=None):
        stream = self._stream()
        rc = self.lib.kvp_capi_compress(
            ctypes.byref(shape), kv.data_ptr(), q.data_ptr(), f.data_ptr(), table.data_ptr(), lengths.data_ptr(),
            items.data_ptr(), ws.data_ptr(), ws.numel(), keep.data_ptr() if keep is not None else None,
            scores.data_ptr() if scores is not None else None, stream)
        self._ok(rc, "kvp_capi_compress")

    def check_status(self, shape, ws):
        words = (ctypes.c_int32 * self.lib.kvp_capi_status_words())()  # the words the library copies
        rc = self.lib.kvp_capi_status(ctypes.byref(shape), ws.data_ptr(), words, self._stream())
        self._ok(rc, "device status")
        return list(words)

    def new_lengths(self, shape, ws):
        out = (ctypes.c_int32 * shape.num_items)()
        rc = self.lib.kvp_capi_new_lengths(ctypes.byref(shape), ws.data_ptr(), out, self._stream())
        self._ok(rc, "new lengths")
        return list(out)


# ---------------------------------------------------------------------------
# Check and timing
# ---------------------------------------------------------------------------


def compare(cfg: Config, inp: Inputs, kvp: Kvpolicy, history: int) -> dict:
    """Runs both on copies of the same inputs; compares masks, scores, bytes and F."""
    dev = inp.kv.device
    items = inp.items.clone()
    items[:, 3] = history
    I, L, H, T, k = cfg.seqs, cfg.layers, cfg.kv_heads, cfg.tokens, cfg.budget
    seq_ids = items[:, 0].long()
    slot_ids = items[:, 1].long()

    kv_ref, f_ref = inp.kv.clone(), inp.f.clone()
    keep_ref, s_ref = zipage_reference(kv_ref, inp.q, f_ref, inp.table, seq_ids, slot_ids, [history] * I, T, k,
                                       cfg.window, want_outputs=True)

    kv_kvp, f_kvp = inp.kv.clone(), inp.f.clone()
    shape = kvp.shape(cfg, inp)
    ws = kvp.workspace(shape, dev)
    keep_kvp = torch.zeros(I, L, H, T, dtype=torch.uint8, device=dev)
    s_kvp = torch.zeros(I, L, H, T, dtype=torch.float32, device=dev)
    kvp.compress(shape, kv_kvp, inp.q, f_kvp, inp.table, inp.lengths, items, ws, keep_kvp, s_kvp)
    kvp.check_status(shape, ws)
    new_lengths = kvp.new_lengths(shape, ws)
    keep_kvp = keep_kvp.bool()

    mism = keep_ref != keep_kvp
    n_mism = int(mism.sum())
    rows_mism = int(mism.any(dim=-1).sum())
    # Near-ties: mismatched tokens whose (reference) score lies within 1e-3 relative of
    # the row's k-th score: both sides agree up to fp32 rounding there.
    kth = torch.topk(s_ref, k, dim=-1).values[..., -1:]
    rel = (s_ref - kth).abs() / kth.abs().clamp_min(1e-30)
    near = int((mism & (rel <= 1e-3)).sum())
    finite = torch.isfinite(s_ref) & torch.isfinite(s_kvp)
    score_abs = (s_ref - s_kvp).abs()[finite]
    score_scale = s_ref.abs()[finite].max().item() if finite.any() else 0.0
    inf_agree = bool(torch.equal(torch.isinf(s_ref), torch.isinf(s_kvp)))

    # Compacted K and V of the rows whose masks agree must be equal to the bit.
    b = cfg.block_size
    blk = inp.table[seq_ids].long()
    dst = torch.arange(k, device=dev)
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    dst_blk = blk[:, dst // b].view(I, 1, 1, k)
    dst_slot = (dst % b).view(1, 1, 1, k)
    row_agree = ~mism.any(dim=-1)
    bytes_differ = 0
    for part in (0, 1):
        a = kv_ref[part][l_idx, dst_blk, dst_slot, h_idx]
        c = kv_kvp[part][l_idx, dst_blk, dst_slot, h_idx]
        differ = (a != c).flatten(3).any(dim=-1)  # [I, L, H]
        bytes_differ += int((differ & row_agree).sum())
    f_diff = (f_ref - f_kvp).abs().max().item()
    f_scale = f_ref.abs().max().item()
    return {
        "history_tokens": history,
        "tokens_compared": I * L * H * T,
        "rows": I * L * H,
        "mask_mismatches": n_mism,
        "rows_with_mismatch": rows_mism,
        "mismatches_near_tie_1e-3": near,
        "mismatches_not_near_tie": n_mism - near,
        "score_max_abs_diff": score_abs.max().item() if score_abs.numel() else 0.0,
        "score_max_abs": score_scale,
        "score_inf_positions_agree": inf_agree,
        "kv_rows_differing_where_masks_agree": bytes_differ,
        "kv_equal_everywhere": bool(torch.equal(kv_ref, kv_kvp)),
        "f_max_abs_diff": f_diff,
        "f_max_abs": f_scale,
        "new_lengths_ok": all(n == k for n in new_lengths),
        "masks_match": n_mism == 0,
    }


def time_runs(fn, restore, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` runs of fn, after `warmup` runs; restore()
    before every run, outside the timed region. CUDA: events on the current stream."""
    cuda = device.type == "cuda"
    if cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        restore()
        fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        restore()  # outside the timed region
        if cuda:
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            out.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(cfg: Config, inp: Inputs, kvp: Kvpolicy, warmup: int, iters: int) -> dict:
    dev = inp.kv.device
    kv0, f0 = inp.kv.clone(), inp.f.clone()
    kv, f = inp.kv, inp.f

    def restore():  # F first, as kvpolicy_bench: what stays in L2 is the cache's tail, not F
        f.copy_(f0)
        kv.copy_(kv0)

    seq_ids = inp.items[:, 0].long()
    slot_ids = inp.items[:, 1].long()
    history = inp.items[:, 3].tolist()  # host-side batch description, as an engine has it

    def reference():
        zipage_reference(kv, inp.q, f, inp.table, seq_ids, slot_ids, history, cfg.tokens, cfg.budget, cfg.window)

    shape = kvp.shape(cfg, inp)
    ws = kvp.workspace(shape, dev)

    def kvpolicy():
        kvp.compress(shape, kv, inp.q, f, inp.table, inp.lengths, inp.items, ws)

    ref_ms = time_runs(reference, restore, warmup, iters, dev)
    kvp_ms = time_runs(kvpolicy, restore, warmup, iters, dev)
    kvp.check_status(shape, ws)
    restore()
    del kv0, f0
    ref, kvm = statistics.median(ref_ms), statistics.median(kvp_ms)
    return {
        "tokens": cfg.tokens,
        "n_max": cfg.n_max,
        "seqs": cfg.seqs,
        "history_tokens": cfg.history_tokens,
        "reference_ms": ref,
        "kvpolicy_ms": kvm,
        "speedup": ref / kvm if kvm > 0 else None,
        "reference_ms_all": ref_ms,
        "kvpolicy_ms_all": kvp_ms,
        "reference_ms_min": min(ref_ms),
        "kvpolicy_ms_min": min(kvp_ms),
    }


def default_lib(device: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    name = "libkvp_capi.so" if device == "cuda" else "libkvp_capi_host.so"
    for d in ("build/bench", "build", "build/lib"):
        p = os.path.join(root, d, name)
        if os.path.exists(p):
            return p
    return os.path.join(root, "build/bench", name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: CPU tensors against the host executor (libkvp_capi_host.so), to check the reference")
    ap.add_argument("--lib", default=None, help="libkvp_capi.so (cuda) or libkvp_capi_host.so (cpu); "
                    "default: build/bench/ of the repository")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--nmax", default="9", help="comma-separated N_max values to time (T = N_max * b); first = checked")
    ap.add_argument("--history", type=int, default=-1, help="history_tokens of the timed runs; -1 = budget")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-all", action="store_true", help="check masks at every N_max, not only the first")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default="reference.json")
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("zipage_reference: no CUDA device (--device cpu checks against the host executor)", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 mode means fp32 (it is the default)
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    lib = args.lib or default_lib(args.device)
    kvp = Kvpolicy(lib, dev)
    nmaxes = [int(x) for x in args.nmax.split(",") if x]
    base = Config(seqs=args.seqs, layers=args.layers, kv_heads=args.kv_heads, q_heads=args.q_heads,
                  head_dim=args.head_dim, block_size=args.block_size, n_max=nmaxes[0],
                  dtype=args.dtype, history=args.history, seed=args.seed)
    result = {
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "device": args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lib": os.path.abspath(lib),
        "dtype": args.dtype,
        "config": {**asdict(base), "tokens": base.tokens, "budget": base.budget,
                   "history_tokens": base.history_tokens},
        "policy": "zipage",
        "warmup": args.warmup,
        "iters": args.iters,
        "timing": "median of iters runs, torch.cuda.Event, cache and F restored before each run (untimed)",
        "runs": [],
        "mask_check": {},
    }
    t_start = time.time()
    for i, n_max in enumerate(nmaxes):
        cfg = replace(base, n_max=n_max)
        inp = make_inputs(cfg, dev)
        if not args.no_check and (i == 0 or args.check_all):
            for hist in sorted({0, cfg.budget}):
                r = compare(cfg, inp, kvp, hist)
                result["mask_check"][f"T={cfg.tokens},history={hist}"] = r
                print(f"[check] {args.dtype} T={cfg.tokens} history={hist}: {r['mask_mismatches']} mismatches of "
                      f"{r['tokens_compared']} tokens ({r['mismatches_near_tie_1e-3']} near ties), "
                      f"score max |diff| {r['score_max_abs_diff']:.3g} (max |s| {r['score_max_abs']:.3g}), "
                      f"K/V rows differing where masks agree {r['kv_rows_differing_where_masks_agree']}, "
                      f"F max |diff| {r['f_max_abs_diff']:.3g}", flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        run = measure(cfg, inp, kvp, args.warmup, args.iters)
        result["runs"].append(run)
        print(f"[time] {args.dtype} seqs={cfg.seqs} T={cfg.tokens}: reference {run['reference_ms']:.3f} ms, "
              f"kvpolicy {run['kvpolicy_ms']:.3f} ms, speedup {run['speedup']:.1f}x", flush=True)
        del inp
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    first = result["runs"][0]
    result.update(reference_ms=first["reference_ms"], kvpolicy_ms=first["kvpolicy_ms"], speedup=first["speedup"])
    result["masks_match"] = all(v["masks_match"] for v in result["mask_check"].values()) if result["mask_check"] else None
    result["mismatches_not_near_tie"] = sum(v["mismatches_not_near_tie"] for v in result["mask_check"].values())
    result["wall_s"] = time.time() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
