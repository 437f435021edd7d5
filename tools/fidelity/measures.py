"""results.json (harness.py) -> the numbers the report prints: no text, no plots.

- `summarise`: per configuration, top-1 agreement and KL pooled over the steps measured
  after its first compression (a configuration not yet compressed holds the full cache and
  agrees by construction), their intervals over conversations, the memory it held at those
  steps (mean and peak tokens per head and per sequence, peak block slots) and the planted facts it
  answered, counted only where the full cache of the same conversation answered them.
- `comparisons`: each preset against the best one at the same budget, paired over the
  steps both have compressed, with conversation-bootstrap intervals and Holm-adjusted
  p-values over the whole family (every budget).
- `task_accuracy`: the exact-answer tasks' accuracy per configuration, over the tasks the
  full cache answers right.
- `repeated_share`: the share of measured tokens whose 8-gram repeats earlier text.
- `reference_sentence`: what the recorded llama.cpp comparison says, from its numbers.
"""

from __future__ import annotations

import numpy as np

import stats


def _conv_arrays(res: dict, i: int, key: str, compressed_only: bool = True) -> list[np.ndarray]:
    """Config i's per-step values of `key` in every conversation, at the steps after its
    first compression (all steps for the reference, or for runs that did not record it)."""
    out = []
    for s in res["sessions"]:
        x = np.asarray(s[key][i], dtype=float) if key in s else np.zeros(0)
        if compressed_only and "compressed" in s and res["configs"][i]["preset"] is not None:
            x = x[np.asarray(s["compressed"][i], dtype=bool)] if x.size else x
        out.append(x)
    return out


def _mask(res: dict, i: int) -> list[np.ndarray]:
    out = []
    for s in res["sessions"]:
        n = len(s["agree"][i])
        if "compressed" in s and res["configs"][i]["preset"] is not None:
            out.append(np.asarray(s["compressed"][i], dtype=bool))
        else:
            out.append(np.ones(n, dtype=bool))
    return out


def summarise(res: dict, seed: int = 0, draws: int = 4000) -> dict:
    rng = np.random.default_rng(seed)
    names = [c["name"] for c in res["configs"]]
    out = {}
    for i, n in enumerate(names):
        ag, kl = _conv_arrays(res, i, "agree"), _conv_arrays(res, i, "kl")
        cache = _conv_arrays(res, i, "cache_tokens")
        all_steps = sum(len(s["agree"][i]) for s in res["sessions"])
        m = {
            "agree": stats.pooled_mean(ag),
            "kl": stats.pooled_mean(kl),
            "agree_ci": stats.conversation_bootstrap(ag, rng, draws)[1:],
            "kl_ci": stats.conversation_bootstrap(kl, rng, draws)[1:],
            "steps": sum(len(x) for x in ag),
            "excluded": all_steps - sum(len(x) for x in ag),
            "conversations": sum(len(x) > 0 for x in ag),
            "agree_conv": ag,
            "kl_conv": kl,
            "agree_steps": np.concatenate(ag) if ag else np.zeros(0),
            "kl_steps": np.concatenate(kl) if kl else np.zeros(0),
            "cache": stats.pooled_mean(cache) if sum(len(x) for x in cache) else None,
        }
        # Memory: means and peaks over the measured steps after the first compression (the
        # prompt before it is the same for every configuration), what the step's attention read.
        seq = _conv_arrays(res, i, "sequence_tokens")

        def peak(key):
            xs = [x for x in _conv_arrays(res, i, key) if x.size]
            return float(max(x.max() for x in xs)) if xs else None
        m["sequence_mean"] = stats.pooled_mean(seq) if sum(len(x) for x in seq) else None
        m["peak_head"] = peak("peak_head_tokens")
        m["sequence_peak"] = peak("sequence_tokens")
        m["peak_slots"] = peak("block_slots")
        # Probes the full cache answered right, in the same conversation.
        right = asked = 0
        per = {}
        for s in res["sessions"]:
            r = sum(p["right"][i] for p in s["probes"] if p["right"][0])
            a = sum(1 for p in s["probes"] if p["right"][0])
            right, asked = right + r, asked + a
            k = s["name"]
            mask = np.asarray(s["compressed"][i], dtype=bool) if ("compressed" in s and res["configs"][i]["preset"]) \
                else np.ones(len(s["agree"][i]), dtype=bool)
            a_s, k_s = np.asarray(s["agree"][i], float)[mask], np.asarray(s["kl"][i], float)[mask]
            c_s = np.asarray(s["cache_tokens"][i], float)[mask] if "cache_tokens" in s else np.zeros(0)
            per[k] = {"agree": float(a_s.mean()) if a_s.size else float("nan"),
                      "kl": float(k_s.mean()) if k_s.size else float("nan"),
                      "right": r, "asked": a, "compressions": s["compressions"][i],
                      "cache": float(c_s.mean()) if c_s.size else None,
                      "final_length": s["final_lengths"][i] if "final_lengths" in s else None}
        m["right"], m["asked"], m["sessions"] = right, asked, per
        out[n] = m
    return out


def comparisons(res: dict, summ: dict, presets: list[str], metric: str = "agree", seed: int = 1,
                draws: int = 4000) -> dict[int, dict]:
    """Per budget: the best preset by `metric` (highest agreement, lowest KL) and each other
    preset's paired difference from it (other - best) over the steps both had compressed,
    with a conversation-bootstrap interval and p-value; p_holm adjusts the p-values of
    every comparison on the page for this metric (all budgets) together."""
    rng = np.random.default_rng(seed)
    out, flat = {}, []
    for b in res["budgets"]:
        names = [f"{p}@{b}" for p in presets if f"{p}@{b}" in summ and summ[f"{p}@{b}"]["steps"]]
        if not names:
            continue
        key = (lambda n: -summ[n][metric]) if metric == "agree" else (lambda n: summ[n][metric])
        order = sorted(names, key=key)
        best = order[0]
        ib = [c["name"] for c in res["configs"]].index(best)
        rows = []
        for n in order[1:]:
            i = [c["name"] for c in res["configs"]].index(n)
            a, bb = [], []
            for s, mi, mb in zip(res["sessions"], _mask(res, i), _mask(res, ib)):
                both = mi & mb
                a.append(np.asarray(s[metric][i], dtype=float)[both])
                bb.append(np.asarray(s[metric][ib], dtype=float)[both])
            r = stats.paired_conversation_bootstrap(a, bb, rng, draws)
            r["name"] = n
            rows.append(r)
            flat.append(r)
        out[b] = {"best": best, "rows": rows}
    adj = stats.holm([r["p"] for r in flat])
    for r, p in zip(flat, adj):
        r["p_holm"] = float(p)
    return out


def task_accuracy(res: dict) -> dict:
    """{'kinds': {kind: {config: (right, kept)}}, 'by_length': {kind: {length: {config: (right, kept)}}},
    'dropped': {kind: tasks the full cache got wrong}}."""
    tasks = res.get("tasks", [])
    kinds: dict = {}
    by_length: dict = {}
    dropped: dict = {}
    for t in tasks:
        k = t["kind"]
        if not t["right"][0]:
            dropped[k] = dropped.get(k, 0) + 1
            continue
        for name, r in zip(t["configs"], t["right"]):
            for table in (kinds.setdefault(k, {}), by_length.setdefault(k, {}).setdefault(t["context_tokens"], {})):
                right, kept = table.get(name, (0, 0))
                table[name] = (right + int(r), kept + 1)
    return {"kinds": kinds, "by_length": by_length, "dropped": dropped, "total": len(tasks)}


def repeated_share(res: dict) -> float:
    """The repeated 8-gram share over every conversation's measured tokens (each
    conversation's share weighted by its measured steps)."""
    num = den = 0.0
    for s in res["sessions"]:
        if "repeated_8gram_share" in s and np.isfinite(s["repeated_8gram_share"]):
            num += s["repeated_8gram_share"] * s["measured_steps"]
            den += s["measured_steps"]
    return num / den if den else float("nan")


def reference_sentence(measured: dict) -> str:
    """How the NumPy model's distance from llama.cpp compares with llama.cpp's distance
    from itself (flash attention off / on), read from the recorded numbers."""
    ours, own = measured["numpy_vs_llama_cpp"], measured["llama_cpp_vs_llama_cpp_flash_attn"]

    def rel(a, b, what):
        if a < b:
            return f"a lower {what} ({a:.4g} against {b:.4g})"
        if a > b:
            return f"a higher {what} ({a:.4g} against {b:.4g})"
        return f"the same {what} ({a:.4g})"

    parts = [rel(ours["mean_abs_diff"], own["mean_abs_diff"], "mean absolute logit difference"),
             rel(ours["kl_mean"], own["kl_mean"], "mean KL"),
             rel(ours["max_abs_diff"], own["max_abs_diff"], "largest difference")]
    close = ours["mean_abs_diff"] <= own["mean_abs_diff"] and ours["kl_mean"] <= own["kl_mean"]
    head = ("The NumPy model is no farther from llama.cpp than llama.cpp is from itself when it only changes how "
            "it computes attention" if close else
            "The NumPy model is farther from llama.cpp than llama.cpp is from itself when it only changes how it "
            "computes attention")
    return f"{head}: against llama.cpp it has " + ", ".join(parts[:-1]) + " and " + parts[-1] + \
        f" than llama.cpp's two runs; top-1 agreement {ours['top1_agree']} against {own['top1_agree']}."


def nearest_by_size(summ: dict, names: list[str], size: float, key: str = "cache") -> str | None:
    """The configuration among `names` whose mean held tokens are closest to `size`."""
    have = [n for n in names if summ[n].get(key) is not None]
    return min(have, key=lambda n: abs(summ[n][key] - size)) if have else None
