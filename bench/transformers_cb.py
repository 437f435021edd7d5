#!/usr/bin/env python3
"""Throughput at fixed memory in transformers' continuous batching, spread over the GPUs of one host.

Each job is one run of examples/transformers_continuous_batching.py (one shape, one of
``none`` / ``preset@budget``) in its own process on its own GPU, so that runs of the same
comparison never share a device; the longest jobs (``none``) start first. Every process
builds the same random weights from the same seed and the same prompts. A deadline stops
what is still running (its JSON keeps nothing of the cut run) and starts nothing new;
then the results merge into one JSON, one table and one plot per shape.

    python3 bench/transformers_cb.py --shapes 1b,8b --out bench/results/transformers_cb \\
        -- --prompt-len 512 --max-new-tokens 4096 --requests 128 --full-requests 16 \\
           --presets zipage,snapkv,rkv --budget 1024,2048 --block-size 64
    python3 bench/transformers_cb.py --merge-only --out bench/results/transformers_cb   # table + plot again

Arguments after ``--`` go to every example process. ``--gpus`` (default: every visible GPU).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "transformers_continuous_batching.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1b", help="comma-separated model shapes of the example")
    p.add_argument("--gpus", default=None, help="GPU indices to use (default: all visible)")
    p.add_argument("--jobs", default=None, help="only these jobs, e.g. 1b:snapkv@2048,8b:none (default: every shape "
                   "x none and every preset at every budget); --merge-only merges whatever run_*.json --out holds")
    p.add_argument("--out", required=True, help="folder for the per-job logs and JSON, the merged JSON and plots")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds after which nothing new starts and "
                   "running jobs are stopped")
    p.add_argument("--merge-only", action="store_true", help="only merge the JSON already in --out")
    argv = sys.argv[1:] if argv is None else argv
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    args.example_args = rest
    return args


def example_option(rest, name, default):
    return rest[rest.index(name) + 1] if name in rest else default


def jobs_for(args):
    presets = example_option(args.example_args, "--presets", "zipage,snapkv").split(",")
    budgets = example_option(args.example_args, "--budget", "256").split(",")
    jobs = []
    for shape in args.shapes.split(","):
        jobs.append((shape, "none"))
        jobs.extend((shape, f"{p}@{b}") for p in presets for b in budgets)
    # Longest first: the engine alone runs fewest requests at once; bigger shapes take longer.
    order = {shape: i for i, shape in enumerate(["8b", "1b", "smollm2", "tiny"])}
    if args.jobs:
        wanted = [tuple(j.split(":", 1)) for j in args.jobs.split(",")]
        missing = [j for j in wanted if j not in jobs]
        if missing:
            raise SystemExit(f"--jobs: {missing} are not among --shapes x (none, --presets x --budget)")
        jobs = wanted
    return sorted(jobs, key=lambda j: (j[1] != "none", order.get(j[0], 9)))


def run_jobs(args):
    import torch

    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
    if not gpus:
        raise SystemExit("transformers_cb.py: no GPU visible")
    os.makedirs(args.out, exist_ok=True)
    started_at = time.time()
    queue = jobs_for(args)
    running = {}  # gpu -> (process, job, log file)
    identity_done = set()
    failed = []
    while queue or running:
        for gpu, (proc, job, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                print(f"[{time.time() - started_at:6.0f} s] gpu {gpu}: {job[0]} {job[1]} exited {proc.returncode}",
                      flush=True)
                if proc.returncode != 0:
                    failed.append(job)
                    with open(log.name) as f:
                        print("".join(f.readlines()[-25:]), flush=True)
                del running[gpu]
        late = time.time() - started_at > args.deadline
        if late:
            for gpu, (proc, job, log) in running.items():
                proc.terminate()
                failed.append(job)
                print(f"deadline: stopped {job[0]} {job[1]} on gpu {gpu}", flush=True)
            for proc, _, log in running.values():
                proc.wait()
                log.close()
            running.clear()
            for job in queue:
                print(f"deadline: not started {job[0]} {job[1]}", flush=True)
            failed.extend(queue)
            break
        for gpu in gpus:
            if gpu in running or not queue:
                continue
            shape, name = queue.pop(0)
            tag = f"{shape}_{name.replace('@', '_')}"
            cmd = [sys.executable, EXAMPLE, "--shape", shape, "--runs", name, "--json",
                   os.path.join(args.out, f"run_{tag}.json"), *args.example_args]
            if shape in identity_done or name == "none":
                cmd.append("--skip-identity")  # one process per shape checks identity (its first preset job)
            else:
                identity_done.add(shape)
            log = open(os.path.join(args.out, f"run_{tag}.log"), "w")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), PYTHONUNBUFFERED="1")
            running[gpu] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), (shape, name), log)
            print(f"[{time.time() - started_at:6.0f} s] gpu {gpu}: {shape} {name}", flush=True)
        time.sleep(1.0)
    return failed


def merge(args):
    runs, identity, meta = {}, {}, {}
    for path in sorted(glob.glob(os.path.join(args.out, "run_*.json"))):
        with open(path) as f:
            r = json.load(f)
        shape = r["args"]["shape"]
        meta.setdefault(shape, {k: r[k] for k in ("num_blocks", "device", "torch", "transformers") if k in r}
                        | {"args": {k: v for k, v in r["args"].items() if k not in ("runs", "json", "skip_identity")}})
        identity.setdefault(shape, {}).update(r.get("identity", {}))
        for run in r["runs"]:
            runs.setdefault(shape, []).append(run)
    merged = {}
    lines = []
    for shape, rows in runs.items():
        base = next((r for r in rows if r["preset"] == "none"), None)
        rows.sort(key=lambda r: (r["preset"] != "none", r["preset"], r["budget"] or 0))
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        merged[shape] = dict(meta[shape], identity=identity.get(shape, {}), runs=rows)
        a = meta[shape]["args"]
        lines.append(f"\n{shape}: {meta[shape].get('device')}, attention {a.get('attention')}, pool "
                     f"{meta[shape]['num_blocks']} blocks of {a['block_size']} ({a['full_requests']} full requests), "
                     f"{a['requests']} requests, prompt {a['prompt_len']}, {a['max_new_tokens']} generated; "
                     f"identity {identity.get(shape, {})}")
        lines.append(f"{'run':<16}{'tokens/s':>10}{'speedup':>9}{'seconds':>9}{'mean running':>14}"
                     f"{'peak blocks':>13}{'compress share':>16}")
        for r in rows:
            label = r["preset"] if r["budget"] is None else f"{r['preset']}@{r['budget']}"
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            lines.append(f"{label:<16}{r['tokens_per_s']:>10.0f}{speed:>9}{r['seconds']:>9.1f}"
                         f"{r['mean_running_requests']:>14.1f}{r['peak_blocks']:>13}{100 * r['compress_share']:>15.2f}%")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "transformers_cb.json"), "w") as f:
        json.dump(merged, f, indent=1)
    with open(os.path.join(args.out, "transformers_cb.txt"), "w") as f:
        f.write(text.lstrip("\n") + "\n")
    plot(args, merged)


def plot(args, merged):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(merged), figsize=(6 * len(merged), 4), squeeze=False)
    for ax, (shape, m) in zip(axes[0], merged.items()):
        rows = m["runs"]
        labels = [r["preset"] if r["budget"] is None else f"{r['preset']}\n@{r['budget']}" for r in rows]
        rates = [r["tokens_per_s"] for r in rows]
        bars = ax.bar(range(len(rows)), rates, color=["0.5" if r["budget"] is None else "C0" for r in rows])
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['mean_running_requests']:.0f} run.\n{100 * r['compress_share']:.1f}%",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        a = m["args"]
        ax.set_title(f"{shape}: pool of {a['full_requests']} full requests, {a['requests']} queued,\n"
                     f"prompt {a['prompt_len']} + {a['max_new_tokens']} generated ({m.get('device', '')})", fontsize=9)
        ax.set_ylabel("generated tokens / s")
        ax.set_ylim(0, 1.18 * max(rates))
    fig.text(0.01, 0.01, "bar labels: mean running requests, compression's share of step time", fontsize=7)
    fig.tight_layout()
    path = os.path.join(args.out, "transformers_cb.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    failed = [] if args.merge_only else run_jobs(args)
    merge(args)
    if failed:
        print(f"not finished: {', '.join(f'{s} {n}' for s, n in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
