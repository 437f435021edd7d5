#!/usr/bin/env python3
"""Plots of kvpolicy_bench's Google Benchmark JSON and zipage_reference.py's JSON.

    python3 bench/plot.py --bench out/bench.json --reference out/reference.json \\
        [--reference out/reference_fp32.json] --out-dir out/plots

Writes (each only when its rows are present):
  tokens_vs_time.png       (a) compression time vs tokens held, kvpolicy (scale_tokens/zipage/T)
                           vs the PyTorch reference (where measured)
  stage_copy_fraction.png  (b) fraction of device copy bandwidth per stage, configuration A
  redundancy_scaling.png   (c) lightning vs full redundancy, time per row vs tokens, log-log
  seqs_vs_time.png         compression time vs sequences (scale_seqs/zipage/S)
  presets_e2e.png          end-to-end time of each preset, configuration A
  kv_compress_B.png        KV-Compress on configuration B: schedule, moves and end to end,
                           the PyTorch reference beside kvpolicy (--kv-compress-reference,
                           kv_compress_reference.py's JSON), with kvpolicy_bench's stage row
Needs matplotlib (not on the GPU machine: plot where the JSON was fetched to).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

TIME_SCALE_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def base_name(name: str) -> str:
    """`e2e/zipage/A/iterations:30/manual_time` -> `e2e/zipage/A`."""
    parts = [p for p in name.split("/") if not re.match(r"^(iterations|min_time|repeats|threads|real_time|"
                                                           r"manual_time|process_time|min_warmup_time)(:|$)", p)]
    return "/".join(parts)


def load_bench(path: str) -> tuple[dict, dict]:
    """Returns (context, rows by base name); each row has `ms` (manual time) and its counters."""
    with open(path) as fh:
        data = json.load(fh)
    rows = {}
    for b in data.get("benchmarks", []):
        if b.get("error_occurred") or b.get("run_type", "iteration") != "iteration":
            continue
        row = dict(b)
        row["ms"] = float(b["real_time"]) * TIME_SCALE_MS.get(b.get("time_unit", "ns"), 1e-6)
        rows[base_name(b["name"])] = row
    return data.get("context", {}), rows


def load_reference(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        if p and os.path.exists(p):
            with open(p) as fh:
                out.append(json.load(fh))
        elif p:
            print(f"plot.py: no reference JSON at {p}, skipped", file=sys.stderr)
    return out


def family(rows: dict, prefix: str) -> list[tuple[float, dict]]:
    """Rows named prefix/<number>, sorted by the number."""
    out = []
    for name, row in rows.items():
        if name.startswith(prefix + "/"):
            tail = name[len(prefix) + 1:]
            try:
                out.append((float(tail), row))
            except ValueError:
                pass
    return sorted(out, key=lambda x: x[0])


def title(ctx: dict, what: str) -> str:
    gpu = ctx.get("gpu")
    return f"{what}\n{gpu}" if gpu else what


def plot_tokens(plt, ctx, rows, refs, out_dir) -> str | None:
    kvp = family(rows, "scale_tokens/zipage")
    if not kvp and "e2e/zipage/A" in rows:
        kvp = [(rows["e2e/zipage/A"].get("tokens", 2304), rows["e2e/zipage/A"])]
    if not kvp and not refs:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if kvp:
        ax.plot([t for t, _ in kvp], [r["ms"] for _, r in kvp], "o-", label="kvpolicy (kvpolicy_bench, bf16)")
    for ref in refs:
        runs = ref.get("runs", [])
        if not runs:
            continue
        dt = ref.get("dtype", "?")
        n = ref.get("config", {}).get("seqs")
        what = f"{dt}, {n} seqs" if n else dt
        if ref.get("device", "cuda") != "cuda":
            what += f", {ref['device']}"
        tok = [r["tokens"] for r in runs]
        ax.plot(tok, [r["reference_ms"] for r in runs], "s--", label=f"PyTorch reference ({what})")
        ax.plot(tok, [r["kvpolicy_ms"] for r in runs], "^:", label=f"kvpolicy via C API ({what})")
        for t, r in zip(tok, runs):
            sp = r.get("speedup")
            if sp:
                ax.annotate(f"{sp:.1f}x", (t, r["reference_ms"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=8)
    seqs = kvp[0][1].get("seqs") if kvp else (refs[0].get("config", {}).get("seqs") if refs else None)
    ax.set_xlabel("tokens held per sequence (T)")
    ax.set_ylabel("compression time (ms)")
    ax.set_yscale("log")
    ax.set_title(title(ctx, f"Zipage compression, {int(seqs) if seqs else '?'} sequences x 8 layers"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(out_dir, "tokens_vs_time.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_stages(plt, ctx, rows, out_dir) -> str | None:
    st = rows.get("stage/zipage/A")
    if not st:
        return None
    stages = ["score", "redundancy", "epilogue", "layout"]
    labels, fracs, ms = [], [], []
    for s in stages:
        if f"{s}_copy_fraction" in st:
            labels.append(s)
            fracs.append(st[f"{s}_copy_fraction"])
            ms.append(st.get(f"{s}_ms", 0.0))
    e2e = rows.get("e2e/zipage/A", st)
    if "copy_fraction" in e2e:
        labels.append("end to end")
        fracs.append(e2e["copy_fraction"])
        ms.append(e2e["ms"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar(labels, fracs, color=["C0", "C1", "C2", "C3", "C7"][: len(labels)])
    for bar, f, m in zip(bars, fracs, ms):
        ax.annotate(f"{f:.3f}\n{m:.3f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("fraction of device copy bandwidth")
    ax.set_ylim(0, max(1.1, max(fracs) * 1.25) if fracs else 1.1)
    copy = ctx.get("copy_GB_per_s_startup")
    sub = f" (copy {float(copy):.0f} GB/s)" if copy else ""
    ax.set_title(title(ctx, f"Zipage, configuration A, per stage{sub}"), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    path = os.path.join(out_dir, "stage_copy_fraction.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_redundancy(plt, ctx, rows, out_dir) -> str | None:
    series = [("redundancy/lightning", "lightning (1 seq x 1 layer)", "o-"),
              ("redundancy/lightning_batched", "lightning (16 seqs x 8 layers)", "d-"),
              ("redundancy/full", "full (1 seq x 1 layer)", "s-")]
    data = [(family(rows, p), lab, sty) for p, lab, sty in series]
    if not any(d for d, _, _ in data):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for fam, lab, sty in data:
        if not fam:
            continue
        tok = [t for t, _ in fam]
        per_row = [r["ms"] / max(r.get("rows", 1.0), 1.0) for _, r in fam]
        ax.plot(tok, per_row, sty, label=lab)
        # Guides through the first point: slope 1 (linear) and 2 (quadratic).
        slope = 2 if "full" in lab else 1
        t0, y0 = tok[0], per_row[0]
        ax.plot(tok, [y0 * (t / t0) ** slope for t in tok], color="gray", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens held per row (T)")
    ax.set_ylabel("redundancy stage time per (seq, layer, head) row (ms)")
    ax.set_title(title(ctx, "Lightning vs full redundancy (dotted: T and T^2)"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(out_dir, "redundancy_scaling.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_seqs(plt, ctx, rows, out_dir) -> str | None:
    fam = family(rows, "scale_seqs/zipage")
    if not fam:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    s = [x for x, _ in fam]
    ax.plot(s, [r["ms"] for _, r in fam], "o-", label="time (ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences compressed in one launch (T = 2304, 8 layers)")
    ax.set_ylabel("compression time (ms)")
    ax2 = ax.twinx()
    ax2.plot(s, [r.get("copy_fraction", 0.0) for _, r in fam], "s--", color="C1", label="copy fraction")
    ax2.set_ylabel("fraction of copy bandwidth", color="C1")
    ax2.set_ylim(0, 1.1)
    ax.set_title(title(ctx, "Zipage compression vs batch size"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    path = os.path.join(out_dir, "seqs_vs_time.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_presets(plt, ctx, rows, out_dir) -> str | None:
    pre = [(n.split("/")[1], r) for n, r in rows.items() if n.startswith("e2e/") and n.endswith("/A")]
    if not pre:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar([p for p, _ in pre], [r["ms"] for _, r in pre])
    for bar, (_, r) in zip(bars, pre):
        ax.annotate(f"{r['ms']:.3g} ms\n{r.get('copy_fraction', 0):.3f} copy",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    # Room above the tallest bar for its label; plain numbers on the log axis.
    ax.set_ylim(top=max(r["ms"] for _, r in pre) * 1.35)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}" if v in (0.5, 2, 3, 5) else ""))
    ax.set_ylabel("compression time (ms)")
    ax.set_title(title(ctx, "Presets end to end, configuration A"), fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    path = os.path.join(out_dir, "presets_e2e.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_kv_compress(plt, ctx, rows, ref_path, out_dir) -> str | None:
    stage = rows.get("stage/kv_compress/B")
    if not ref_path or stage is None:
        return None
    with open(ref_path) as fh:
        ref = json.load(fh)["run"]
    parts = ["schedule", "moves", "end to end"]
    torch_ms = [ref["reference_stage_ms"]["schedule"], ref["reference_stage_ms"]["moves"], ref["reference_ms"]]
    kvp_ms = [ref["kvpolicy_stage_ms"]["schedule"], ref["kvpolicy_stage_ms"]["moves"], ref["kvpolicy_ms"]]
    bench_ms = [stage["schedule_ms"], stage["moves_ms"], stage["e2e_ms"]]
    bench_frac = [stage["schedule_copy_fraction"], stage["moves_copy_fraction"], stage["copy_fraction"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = range(len(parts))
    width = 0.27
    series = [("PyTorch reference (positions carried)", torch_ms, None),
              ("kvpolicy, same process", kvp_ms, None),
              ("kvpolicy_bench (no positions)", bench_ms, bench_frac)]
    for i, (label, ms, frac) in enumerate(series):
        bars = ax.bar([v + (i - 1) * width for v in x], ms, width, label=label)
        for j, bar in enumerate(bars):
            text = f"{ms[j]:.3g}" + (f"\n{frac[j]:.2f} copy" if frac else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(list(x))
    ax.set_xticklabels(parts)
    ax.set_yscale("log")
    ax.set_ylim(top=max(torch_ms) * 6.0)  # room for the legend above the bars
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("time (ms)")
    ax.set_title(title(ctx, f"KV-Compress, configuration B ({ref['speedup']:.1f}x end to end)"),
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    path = os.path.join(out_dir, "kv_compress_B.png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="kvpolicy_bench --benchmark_out JSON")
    ap.add_argument("--reference", action="append", default=[], help="zipage_reference.py JSON (repeatable)")
    ap.add_argument("--kv-compress-reference", default=None, help="kv_compress_reference.py JSON")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx, rows = load_bench(args.bench)
    refs = load_reference(args.reference)
    os.makedirs(args.out_dir, exist_ok=True)
    written = [p for p in (plot_tokens(plt, ctx, rows, refs, args.out_dir), plot_stages(plt, ctx, rows, args.out_dir),
                           plot_redundancy(plt, ctx, rows, args.out_dir), plot_seqs(plt, ctx, rows, args.out_dir),
                           plot_presets(plt, ctx, rows, args.out_dir),
                           plot_kv_compress(plt, ctx, rows, args.kv_compress_reference, args.out_dir)) if p]
    for p in written:
        print(f"wrote {p}")
    if not written:
        print("plot.py: nothing to plot (no known rows)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
