"""What the decode references (sdpa_decode.py, flashinfer_decode.py) share: their shape
arguments, CUDA-event timing, and the device copy bandwidth measured in the same process
(bytes read + written), so that their fractions of it compare with kvpolicy_bench's."""

from __future__ import annotations

import argparse
import json
import statistics


def parser(doc: str, configs: str, reps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=configs, help="SEQSxTOKENS,... (tokens per sequence)")
    p.add_argument("--h-q", type=int, default=32)
    p.add_argument("--h-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    p.add_argument("--reps", type=int, default=reps, help="timed repetitions (median reported)")
    p.add_argument("--json", help="write the results here")
    return p


def configs(args) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) of --configs."""
    return [tuple(int(x) for x in c.lower().split("x")) for c in args.configs.split(",")]


def dtype(torch, args):
    return torch.bfloat16 if args.dtype == "bf16" else torch.float16


def median_ms(torch, fn, reps: int, warmup: int = 5) -> float:
    """Median of `reps` timings of fn() between CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth(torch, reps: int, gib: int = 2) -> float:
    """Device-to-device copy of `gib` GiB (several times the L2), bytes read + written per
    second (GB/s)."""
    n = gib << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * n / (median_ms(torch, lambda: dst.copy_(src), reps) * 1e-3) / 1e9


def write_json(args, result: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
