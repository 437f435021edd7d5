#!/usr/bin/env python3
"""Hard-KV (kvpolicy's `hard_kv` preset) in plain PyTorch, against kvpolicy's CUDA executor.

What a user writes today without a fused library, vectorised over the (sequence,
layer, KV head) rows: gather the paged keys, window attention with the group's max
logit (w 8, causal inside the window), softmax, window mean (the raw scores), max pool
7, protect (window 32, one sink), then calibrated top-p as Hard-KV's authors compute it
(SPEC.md "Calibrated top-p"; include/kvpolicy/select/calibrated_top_p.hpp is the law):
n_p from the raw scores' top-p mass over the whole row (sinks and window included, not
renormalised), the pooled scores as they are (the protected tokens' own) in one softmax
over the whole row, a bisection on T in [1e-3, 1] (bounds checked first, at most 30
halvings, stopping rows that reach tolerance 1e-2), the calibrated top-p set union the
top (budget - protected) by score, union the protected tokens, capped at 2048; then
each row compacts its own count of tokens to the front, in order, and the sequence
keeps the largest count.

The temperatures are solved at every call, as kvpolicy does without a state view:
the calibration's worst case, the first compression of a request. kvpolicy is called
through kvp_capi_compress_calibrated with kvp_capi_calibration_defaults' options.

Inputs, timing and the C API are those of zipage_reference.py (imported from beside
this file). Checks: kept counts per row, keep masks (mismatches counted; the two
calibrate in fp32 with different summation orders, so a count may differ where a
mass lies within rounding of its target), new lengths.

    python3 bench/reference/hard_kv_reference.py --lib build/bench/libkvp_capi.so --out hard_kv_reference.json

`--device cpu --dtype float32 --seqs 2 --layers 2 --kv-heads 2 --q-heads 8 --head-dim 64
--block-size 32 --nmax 9` checks the reference against libkvp_capi_host.so.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zipage_reference as zr  # noqa: E402  (Config, inputs, the C API, timing)

# hard_kv's parameters (include/kvpolicy/pipeline/presets.hpp).
SCORER_WINDOW = 8
POOL_KERNEL = 7
PROTECT_WINDOW = 32
SINKS = 1
P = 0.9
TOLERANCE = 1e-2
T_MIN, T_MAX = 1e-3, 1.0
ITERATIONS = 30
UPPER = 2048
KVP_CAPI_HARD_KV = 2


class KvpCalibration(ctypes.Structure):
    """kvp_capi_calibration (kvp_capi.h), field for field."""
    _fields_ = [("p", ctypes.c_float), ("tolerance", ctypes.c_float), ("t_min", ctypes.c_float),
                ("t_max", ctypes.c_float), ("search", ctypes.c_int32), ("iterations", ctypes.c_int32),
                ("steps", ctypes.c_int32), ("learning_rate", ctypes.c_float), ("t_start", ctypes.c_float),
                ("upper", ctypes.c_int32), ("lower", ctypes.c_int32), ("union_top_k", ctypes.c_int32),
                ("scope", ctypes.c_int32), ("divide_by_row_max", ctypes.c_int32)]


def calibration_defaults(kvp) -> KvpCalibration:
    """hard_kv's options from the library, checked against this file's constants."""
    lib = kvp.lib
    lib.kvp_capi_calibration_size.restype = ctypes.c_int
    if lib.kvp_capi_calibration_size() != ctypes.sizeof(KvpCalibration):
        raise RuntimeError(f"struct calibration is {lib.kvp_capi_calibration_size()} bytes, KvpCalibration "
                           f"{ctypes.sizeof(KvpCalibration)}: rebuild kvp_capi")
    lib.kvp_capi_calibration_defaults.argtypes = [ctypes.POINTER(KvpCalibration)]
    c = KvpCalibration()
    kvp._ok(lib.kvp_capi_calibration_defaults(ctypes.byref(c)), "kvp_capi_calibration_defaults")
    want = {"p": P, "tolerance": TOLERANCE, "t_min": T_MIN, "t_max": T_MAX, "search": 0, "iterations": ITERATIONS,
            "upper": UPPER, "lower": 0, "union_top_k": 1, "scope": 0, "divide_by_row_max": 0}
    got = {k: getattr(c, k) for k in want}
    if any(abs(got[k] - v) > 1e-6 * max(1.0, abs(v)) for k, v in want.items()):
        raise RuntimeError(f"kvp_capi_calibration_defaults {got} differ from this reference's {want}")
    return c


def compress_calibrated(kvp, calib, shape, kv, q, f, table, lengths, items, ws, keep=None, scores=None):
    """kvp_capi_compress_calibrated (Kvpolicy.compress with the calibration options)."""
    vp = ctypes.c_void_p
    fn = kvp.lib.kvp_capi_compress_calibrated
    fn.argtypes = [ctypes.POINTER(type(shape)), ctypes.POINTER(KvpCalibration), vp, vp, vp, vp, vp, vp, vp,
                   ctypes.c_size_t, vp, vp, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    rc = fn(ctypes.byref(shape), ctypes.byref(calib), kv.data_ptr(), q.data_ptr(), f.data_ptr(), table.data_ptr(),
            lengths.data_ptr(), items.data_ptr(), ws.data_ptr(), ws.numel(),
            keep.data_ptr() if keep is not None else None, scores.data_ptr() if scores is not None else None,
            kvp._stream())
    kvp._ok(rc, "kvp_capi_compress_calibrated")


def order_key(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(value, position) as one int64 whose order is the value's, ties to the larger position."""
    bits = x.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + pos


def fewest_reaching(key: torch.Tensor, weight: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Per row: the fewest tokens, by descending key, whose weights reach `mass`."""
    order = torch.argsort(key, dim=-1, descending=True)
    csum = torch.cumsum(torch.gather(weight, -1, order), dim=-1)
    reached = csum >= mass.unsqueeze(-1)
    n = key.shape[-1]
    first = torch.where(reached.any(-1), reached.float().argmax(-1), torch.full_like(mass, n - 1, dtype=torch.long))
    return torch.where(mass > 0, first + 1, torch.zeros_like(first))


def hard_kv_reference(kv, q, table, seq_ids, slot_ids, budgets, T, want_outputs=False):
    """Compresses, in place, every layer and KV head of `seq_ids` (each item's budget in
    `budgets`, for the top-k union); returns the new lengths."""
    dev = kv.device
    _, L, _, b, H, d = kv.shape
    Hq = q.shape[3]
    G = Hq // H
    I = seq_ids.numel()
    w = SCORER_WINDOW
    blk = table[seq_ids].long()  # [I, n_max]
    pos = torch.arange(T, device=dev)
    # 1. Keys [I, L, H, T, d] and the last w queries [I, L, Hq, w, d], in fp32.
    keys = kv[0][:, blk[:, pos // b], (pos % b)].permute(1, 0, 3, 2, 4).float()  # [I, L, H, T, d]
    qw = q[:, slot_ids, q.shape[2] - w :].permute(1, 0, 3, 2, 4).float()  # [I, L, Hq, w, d]
    qw = qw.reshape(I, L, H, G, w, d)  # query head h * G + g belongs to KV head h
    z = torch.matmul(qw, keys.unsqueeze(3).transpose(-1, -2)) / (d**0.5)  # [I, L, H, G, w, T]
    # Causal inside the window: query j (position T - w + j) sees keys t <= T - w + j.
    qpos = (T - w + torch.arange(w, device=dev)).view(w, 1)
    z = z.masked_fill(pos.view(1, T) > qpos, float("-inf"))
    # 2. Group max of the logits, one softmax per window query, window mean: the raw scores.
    raw = torch.softmax(z.amax(dim=3), dim=-1).mean(dim=3)  # [I, L, H, T]
    # 3. Max pool 7 (clipped windows), then protect.
    pooled = F.max_pool1d(raw.view(-1, 1, T), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2).view(I, L, H, T)
    protected = (pos >= T - PROTECT_WINDOW) | (pos < SINKS)
    s = pooled.masked_fill(protected, float("inf"))
    must = int(protected.sum())

    # 4. Calibrated top-p over the whole row: n_p from the raw scores of every token,
    # the calibrated softmax over every token's pooled score (the protected ones' own).
    pos64 = pos.view(1, 1, 1, T).expand_as(s)
    raw_w = raw.clamp_min(0)
    n_p = fewest_reaching(order_key(raw, pos64), raw_w, P * raw_w.sum(-1))
    value_key = order_key(pooled, pos64)
    rank = torch.argsort(torch.argsort(value_key, dim=-1, descending=True), dim=-1)  # 0 = the largest score
    in_cut = rank < n_p.unsqueeze(-1)
    x = pooled - pooled.amax(-1, keepdim=True)  # (s - max); T divides the scores as they are

    def mass(T_):
        e = torch.exp(x / T_.unsqueeze(-1))
        return (e * in_cut).sum(-1) / e.sum(-1)

    shape = n_p.shape
    lo = torch.full(shape, T_MIN, device=dev)
    hi = torch.full(shape, T_MAX, device=dev)
    temp = torch.zeros(shape, device=dev)
    m_hi, m_lo = mass(hi), mass(lo)
    upper_hit = m_hi > P + TOLERANCE
    lower_hit = ~upper_hit & (m_lo < P - TOLERANCE)
    temp = torch.where(upper_hit, hi, torch.where(lower_hit, lo, temp))
    done = upper_hit | lower_hit
    mid = 0.5 * (lo + hi)
    for _ in range(ITERATIONS):
        mid = torch.where(done, mid, 0.5 * (lo + hi))
        m = mass(mid)
        hit = ~done & ((m - P).abs() <= TOLERANCE)
        temp = torch.where(hit, mid, temp)
        done = done | hit
        lo = torch.where(~done & (m > P), mid, lo)
        hi = torch.where(~done & (m <= P), mid, hi)
    temp = torch.where(done, temp, mid)
    e = torch.exp(x / temp.unsqueeze(-1))
    top_p = fewest_reaching(value_key, e, P * e.sum(-1))
    # The union with the top (budget - protected) by score, over the whole row as the
    # top-p set; the protected tokens among either are counted once.
    k = (budgets.view(I, 1, 1).to(top_p.dtype) - must).clamp(min=0)
    m_kept = torch.minimum(torch.maximum(top_p, k), torch.full_like(top_p, T))
    selected = ((rank < m_kept.unsqueeze(-1)) & ~protected).sum(-1)
    count = (must + selected).clamp(max=UPPER)  # [I, L, H]

    # 5. Keep the top `count` of each row by the final scores (protected first); compact
    # them to the front, in order.
    keep_rank = torch.argsort(torch.argsort(order_key(s, pos64), dim=-1, descending=True), dim=-1)
    keep = keep_rank < count.unsqueeze(-1)
    new_len = count.flatten(1).amax(-1)  # [I]
    maxc = int(count.max())
    # The i-th kept token of a row, for i < maxc (rows with fewer repeat their last: masked below).
    kept_pos = torch.sort(torch.where(keep, pos64, torch.full_like(pos64, T)), dim=-1).values[..., :maxc]
    valid = kept_pos < T
    kept_pos = kept_pos.clamp(max=T - 1)
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    src_blk = torch.gather(blk, 1, (kept_pos // b).view(I, -1)).view(I, L, H, maxc)
    src_slot = kept_pos % b
    dst = torch.arange(maxc, device=dev)
    full = (I, L, H, maxc)
    dst_blk = blk[:, dst // b].view(I, 1, 1, maxc).expand(full)[valid]
    dst_slot = (dst % b).view(1, 1, 1, maxc).expand(full)[valid]
    li, hi_ = l_idx.expand(full)[valid], h_idx.expand(full)[valid]
    for part in (0, 1):
        moved = kv[part][l_idx, src_blk, src_slot, h_idx]  # gathered before any write
        kv[part][li, dst_blk, dst_slot, hi_] = moved[valid]
    if not want_outputs:
        return None
    return keep, count, new_len


def compare(cfg, inp, kvp) -> dict:
    dev = inp.kv.device
    I, L, H, T = cfg.seqs, cfg.layers, cfg.kv_heads, cfg.tokens
    seq_ids, slot_ids = inp.items[:, 0].long(), inp.items[:, 1].long()
    kv_ref = inp.kv.clone()
    budgets = inp.items[:, 2].long()
    keep_ref, count_ref, len_ref = hard_kv_reference(kv_ref, inp.q, inp.table, seq_ids, slot_ids, budgets, T, True)

    kv_kvp, f_kvp = inp.kv.clone(), inp.f.clone()
    shape = kvp.shape(cfg, inp, KVP_CAPI_HARD_KV)
    ws = kvp.workspace(shape, dev)
    keep_kvp = torch.zeros(I, L, H, T, dtype=torch.uint8, device=dev)
    s_kvp = torch.zeros(I, L, H, T, dtype=torch.float32, device=dev)
    compress_calibrated(kvp, calibration_defaults(kvp), shape, kv_kvp, inp.q, f_kvp, inp.table, inp.lengths,
                        inp.items, ws, keep_kvp, s_kvp)
    kvp.check_status(shape, ws)
    new_lengths = kvp.new_lengths(shape, ws)
    count_kvp = keep_kvp.sum(-1)
    mism = keep_ref != keep_kvp.bool()
    rows_agree = ~mism.any(-1)
    # Bytes: in rows whose masks agree, the first `count` slots hold the same K and V.
    b = cfg.block_size
    blk = inp.table[seq_ids].long()
    maxc = int(count_ref.max())
    dst = torch.arange(maxc, device=dev)
    l_idx = torch.arange(L, device=dev).view(1, L, 1, 1)
    h_idx = torch.arange(H, device=dev).view(1, 1, H, 1)
    dst_blk, dst_slot = blk[:, dst // b].view(I, 1, 1, maxc), (dst % b).view(1, 1, 1, maxc)
    in_count = dst.view(1, 1, 1, maxc) < count_ref.unsqueeze(-1)
    bytes_differ = 0
    for part in (0, 1):
        a = kv_ref[part][l_idx, dst_blk, dst_slot, h_idx]
        c = kv_kvp[part][l_idx, dst_blk, dst_slot, h_idx]
        differ = ((a != c).any(-1) & in_count).any(-1)
        bytes_differ += int((differ & rows_agree).sum())
    counts = count_ref.flatten()
    return {
        "rows": I * L * H,
        "tokens_compared": I * L * H * T,
        "kept_count_min": int(counts.min()),
        "kept_count_max": int(counts.max()),
        "kept_count_mean": float(counts.float().mean()),
        "rows_count_differs": int((count_ref != count_kvp).sum()),
        "mask_mismatches": int(mism.sum()),
        "rows_with_mismatch": int((~rows_agree).sum()),
        "kv_rows_differing_where_masks_agree": bytes_differ,
        "new_lengths_reference": len_ref.tolist(),
        "new_lengths_kvpolicy": new_lengths,
        "new_lengths_ok": len_ref.tolist() == new_lengths,
    }


def measure(cfg, inp, kvp, warmup, iters) -> dict:
    dev = inp.kv.device
    kv0 = inp.kv.clone()
    kv, f = inp.kv, inp.f

    def restore():
        kv.copy_(kv0)

    seq_ids, slot_ids = inp.items[:, 0].long(), inp.items[:, 1].long()

    budgets = inp.items[:, 2].long()

    def reference():
        hard_kv_reference(kv, inp.q, inp.table, seq_ids, slot_ids, budgets, cfg.tokens)

    shape = kvp.shape(cfg, inp, KVP_CAPI_HARD_KV)
    ws = kvp.workspace(shape, dev)
    calib = calibration_defaults(kvp)

    def kvpolicy():
        compress_calibrated(kvp, calib, shape, kv, inp.q, f, inp.table, inp.lengths, inp.items, ws)

    ref_ms = zr.time_runs(reference, restore, warmup, iters, dev)
    kvp_ms = zr.time_runs(kvpolicy, restore, warmup, iters, dev)
    kvp.check_status(shape, ws)
    restore()
    ref, kvm = statistics.median(ref_ms), statistics.median(kvp_ms)
    return {"tokens": cfg.tokens, "seqs": cfg.seqs, "reference_ms": ref, "kvpolicy_ms": kvm,
            "speedup": ref / kvm if kvm > 0 else None, "reference_ms_all": ref_ms, "kvpolicy_ms_all": kvp_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--dtype", choices=sorted(zr.DTYPES), default="bfloat16")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--nmax", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=None,
                    help="every item's budget (the top-k union's floor); default the configuration's, (nmax - 1) * "
                         "block size, which at configuration A makes every head keep 2048 (L_upper)")
    ap.add_argument("--out", default="hard_kv_reference.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("hard_kv_reference: no CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    kvp = zr.Kvpolicy(args.lib or zr.default_lib(args.device), dev)
    cfg = zr.Config(seqs=args.seqs, layers=args.layers, kv_heads=args.kv_heads, q_heads=args.q_heads,
                    head_dim=args.head_dim, block_size=args.block_size, n_max=args.nmax, dtype=args.dtype,
                    seed=args.seed, dup_fraction=0.0)
    inp = zr.make_inputs(cfg, dev)
    if args.budget is not None:
        inp.items[:, 2] = args.budget
    t0 = time.time()
    check = compare(cfg, inp, kvp)
    print(f"[check] {args.dtype} T={cfg.tokens}: kept per row {check['kept_count_min']}..{check['kept_count_max']} "
          f"(mean {check['kept_count_mean']:.1f}), rows whose count differs {check['rows_count_differs']} of "
          f"{check['rows']}, mask mismatches {check['mask_mismatches']}, K/V rows differing where masks agree "
          f"{check['kv_rows_differing_where_masks_agree']}, new lengths equal {check['new_lengths_ok']}", flush=True)
    run = measure(cfg, inp, kvp, args.warmup, args.iters)
    print(f"[time] {args.dtype} seqs={cfg.seqs} T={cfg.tokens}: reference {run['reference_ms']:.3f} ms, kvpolicy "
          f"{run['kvpolicy_ms']:.3f} ms, speedup {run['speedup']:.1f}x", flush=True)
    out = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": args.dtype, "budget": int(inp.items[0, 2]), "policy": "hard_kv, the authors' rule (temperatures solved at every call)",
           "config": {**asdict(cfg), "tokens": cfg.tokens}, "check": check, "run": run,
           "timing": "median of iters runs, torch.cuda.Event, cache restored before each run (untimed)",
           "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
