"""FlashInfer's paged decode over a transformers-style paged cache: the attention an
engine would run beside kvpolicy, and the anchor its own decode attention is measured
against (same process, same device copy bandwidth).

The cache is what transformers' continuous batching keeps per layer: one K and one V
tensor of [num_blocks * b, h_kv, d], viewed as [num_blocks, b, h_kv, d] (FlashInfer's
NHD with K and V given apart). Each sequence's blocks are drawn at random from the pool.
Every configuration is checked against an fp32 PyTorch reference before it is timed.
With kvpolicy installed (its CUDA path), kvpolicy.decode_attention runs on the same cache
beside it (the plain and the staged split kernel; workspace and output allocated once, as
an engine would), the call as Python makes it: host checks and launches included.

Run on the GPU machine (FlashInfer from scripts/gpu_wheels.sh):
  python3 bench/reference/flashinfer_decode.py --json out.json
  python3 bench/reference/flashinfer_decode.py --configs 64x4096,256x2048 --block-size 16,256
"""

from __future__ import annotations

import math
import sys
import time

import decode_common as common


def reference(torch, q, k_blocks, v_blocks, tables, lengths, scale):
    """fp32 attention of each sequence's query over its own tokens (GQA by repeat)."""
    out = []
    group = q.shape[1] // k_blocks.shape[2]
    for i, (table, n) in enumerate(zip(tables, lengths)):
        k = k_blocks[table].reshape(-1, *k_blocks.shape[2:])[:n].float()  # [n, h_kv, d]
        v = v_blocks[table].reshape(-1, *v_blocks.shape[2:])[:n].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", logits.softmax(-1), v))
    return torch.stack(out)


def run_config(torch, flashinfer, seqs, tokens, b, args, copy_gbs):
    dtype = common.dtype(torch, args)
    h_q, h_kv, d = args.h_q, args.h_kv, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seqs * tokens + b)
    per_seq = math.ceil(tokens / b)
    num_blocks = seqs * per_seq + 2  # transformers keeps two spare (trash) blocks
    k = torch.randn(num_blocks * b, h_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(num_blocks * b, h_kv, d, device="cuda", dtype=dtype, generator=gen)
    k_blocks, v_blocks = k.view(num_blocks, b, h_kv, d), v.view(num_blocks, b, h_kv, d)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)[: seqs * per_seq].to(torch.int32)
    tables = perm.view(seqs, per_seq)
    lengths = [tokens] * seqs
    q = torch.randn(seqs, h_q, d, device="cuda", dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(d)

    indptr = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * per_seq
    last = torch.full((seqs,), tokens - (per_seq - 1) * b, device="cuda", dtype=torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    t0 = time.time()
    wrapper.plan(indptr, tables.reshape(-1), last, h_q, h_kv, d, b, q_data_type=dtype, kv_data_type=dtype,
                 sm_scale=scale)
    plan_s = time.time() - t0
    out = wrapper.run(q, (k_blocks, v_blocks))
    torch.cuda.synchronize()

    # Check on a few sequences (the fp32 reference over all of them would dominate).
    check = list(range(min(seqs, 8)))
    ref = reference(torch, q[check], k_blocks, v_blocks, tables[check].long(), [lengths[i] for i in check], scale)
    rel = float((out[check].float() - ref).norm() / ref.norm())
    if not math.isfinite(rel) or rel > 1e-2:
        raise SystemExit(f"flashinfer_decode: {seqs}x{tokens} b {b}: relative error {rel:.3g} against fp32")

    ms = common.median_ms(torch, lambda: wrapper.run(q, (k_blocks, v_blocks), out=out), args.reps)
    kv_bytes = 2 * seqs * tokens * h_kv * d * k.element_size()
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    row = {"seqs": seqs, "tokens": tokens, "block_size": b, "h_q": h_q, "h_kv": h_kv, "head_dim": d,
           "dtype": args.dtype, "ms": ms, "kv_bytes": kv_bytes, "kv_gbs": gbs, "copy_fraction": gbs / copy_gbs,
           "rel_error_fp32": rel, "first_plan_s": plan_s}
    row["kvpolicy"] = kvpolicy_rows(torch, q, k_blocks, v_blocks, tables, tokens, scale, ref, check, kv_bytes,
                                    copy_gbs, args.reps)
    del k, v, workspace
    torch.cuda.empty_cache()
    return row


def kvpolicy_rows(torch, q, k_blocks, v_blocks, tables, tokens, scale, ref, check, kv_bytes, copy_gbs, reps):
    """kvpolicy.decode_attention over the same NHD cache (plain and staged kernels), or None."""
    try:
        import kvpolicy
    except ImportError:
        return None
    if not kvpolicy.has_cuda:
        return None
    seqs = q.shape[0]
    lengths = torch.full((seqs,), tokens, dtype=torch.int32, device="cuda")
    cache = kvpolicy.PagedCache("nhd", k=[k_blocks], v=[v_blocks], block_table=tables, lengths=lengths)
    out = torch.empty_like(q)
    rows = {}
    for staged in (False, True):
        plan = kvpolicy.decode_attention(q, cache, scale=scale, max_tokens=tokens, staged=staged, out=out,
                                         describe=True)
        workspace = torch.empty(kvpolicy.decode_attention_workspace_bytes(q, cache, max_tokens=tokens, staged=staged),
                                dtype=torch.uint8, device="cuda")

        def call():
            return kvpolicy.decode_attention(q, cache, scale=scale, max_tokens=tokens, staged=staged,
                                             workspace=workspace, out=out, check=False)

        call().check()
        rel = float((out[check].float() - ref).norm() / ref.norm())
        if not math.isfinite(rel) or rel > 1e-2:
            raise SystemExit(f"flashinfer_decode: kvpolicy staged={staged}: relative error {rel:.3g} against fp32")
        ms = common.median_ms(torch, call, reps)
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        rows["staged" if staged else "plain"] = {"ms": ms, "kv_gbs": gbs, "copy_fraction": gbs / copy_gbs,
                                                 "rel_error_fp32": rel, "plan": plan}
    return rows


def main(argv=None) -> int:
    p = common.parser(__doc__, "64x4096,256x2048", 50)
    p.add_argument("--block-size", default="16,256", help="tokens per cache block, comma-separated")
    args = p.parse_args(argv)
    import torch

    t0 = time.time()
    import flashinfer

    import_s = time.time() - t0
    copy_gbs = common.copy_bandwidth(torch, args.reps)
    rows = []
    for seqs, tokens in common.configs(args):
        for b in (int(x) for x in args.block_size.split(",")):
            rows.append(run_config(torch, flashinfer, seqs, tokens, b, args, copy_gbs))
            r = rows[-1]
            print(f"{seqs:4d} x {tokens:5d} b {b:3d}: {r['ms']:.3f} ms, {r['kv_gbs']:.0f} GB/s of K/V, "
                  f"{r['copy_fraction']:.3f} of copy ({copy_gbs:.0f} GB/s), rel err {r['rel_error_fp32']:.1e}, "
                  f"first plan {r['first_plan_s']:.1f} s", flush=True)
            for name, k in (r["kvpolicy"] or {}).items():
                print(f"    kvpolicy {name}: {k['ms']:.3f} ms, {k['kv_gbs']:.0f} GB/s, {k['copy_fraction']:.3f} of copy "
                      f"({r['ms'] / k['ms']:.2f}x FlashInfer's speed), rel err {k['rel_error_fp32']:.1e}", flush=True)
    common.write_json(args, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "flashinfer": flashinfer.__version__, "import_s": import_s, "copy_gbs": copy_gbs,
                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
