"""PyTorch SDPA decode over the same tokens as kvpolicy_bench's decode/* rows: the
reference an engine without a paged kernel would run, timed against the copy bandwidth
measured in the same process.

SDPA reads a dense cache, so each configuration's K and V are one contiguous
[seqs, h_kv, tokens, d] tensor each (the paged rows read the same bytes through a
block table); the query is [seqs, h_q, 1, d] with enable_gqa. Every configuration is
checked against an fp32 attention on a few sequences before it is timed.

Run on the GPU machine:
  python3 bench/reference/sdpa_decode.py --json out.json
  python3 bench/reference/sdpa_decode.py --configs 16x8192,64x4096,256x2048
"""

from __future__ import annotations

import math
import sys

import decode_common as common


def run_config(torch, seqs, tokens, args, copy_gbs):
    F = torch.nn.functional
    dtype = common.dtype(torch, args)
    h_q, h_kv, d = args.h_q, args.h_kv, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seqs * tokens)
    k = torch.rand(seqs, h_kv, tokens, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
    v = torch.rand(seqs, h_kv, tokens, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
    q = torch.rand(seqs, h_q, 1, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1
    scale = 1.0 / math.sqrt(d)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    check = slice(0, min(seqs, 4))
    g = h_q // h_kv
    kf = k[check].float().repeat_interleave(g, dim=1)
    vf = v[check].float().repeat_interleave(g, dim=1)
    ref = ((q[check].float() @ kf.transpose(-1, -2)) * scale).softmax(-1) @ vf
    rel = float((out[check].float() - ref).norm() / ref.norm())
    if not math.isfinite(rel) or rel > 1e-2:
        raise SystemExit(f"sdpa_decode: {seqs}x{tokens}: relative error {rel:.3g} against fp32")
    ms = common.median_ms(torch, lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), args.reps)
    kv_bytes = 2 * seqs * tokens * h_kv * d * k.element_size()
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    row = {"seqs": seqs, "tokens": tokens, "h_q": h_q, "h_kv": h_kv, "head_dim": d, "dtype": args.dtype, "ms": ms,
           "kv_bytes": kv_bytes, "kv_gbs": gbs, "copy_fraction": gbs / copy_gbs, "rel_error_fp32": rel}
    del k, v, q, out, kf, vf, ref
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    args = common.parser(__doc__, "16x8192,64x4096,256x2048", 30).parse_args(argv)
    import torch

    copy_gbs = common.copy_bandwidth(torch, args.reps)
    rows = []
    for seqs, tokens in common.configs(args):
        r = run_config(torch, seqs, tokens, args, copy_gbs)
        rows.append(r)
        print(f"sdpa {seqs:4d} x {tokens:5d}: {r['ms']:.3f} ms, {r['kv_gbs']:.0f} GB/s of K/V, "
              f"{r['copy_fraction']:.3f} of copy ({copy_gbs:.0f} GB/s), rel err {r['rel_error_fp32']:.1e}", flush=True)
    common.write_json(args, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "copy_gbs": copy_gbs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
