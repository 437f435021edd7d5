"""Two results.json of the same protocol (e.g. the NumPy reference and a GPU backend) side
by side: whether the references said the same, and how far each configuration's measures
moved.

Run: python compare_runs.py A/results.json B/results.json [--kl-tolerance 0.01] [--agree-tolerance 0.01]
Exit status 0 when the conversations' reference answers are equal and every configuration's
agreement and KL are within the tolerances; 1 otherwise (each difference is printed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import measures


def compare(a: dict, b: dict, agree_tol: float = 0.01, kl_tol: float = 0.01) -> dict:
    """{'answers_differ': [conversation names whose reference answers differ], 'missing':
    [conversations or configurations in one run only], 'configs': {name: {'agree': (a, b),
    'kl': (a, b), 'ok': bool}}, 'tasks_differ': [task keys whose reference answers differ],
    'ok': bool}."""
    sa = {s["name"]: s for s in a["sessions"]}
    sb = {s["name"]: s for s in b["sessions"]}
    missing = sorted(set(sa) ^ set(sb))
    differ = [n for n in sa if n in sb and sa[n]["assistant_answers"] != sb[n]["assistant_answers"]]
    ca = [c["name"] for c in a["configs"]]
    cb = [c["name"] for c in b["configs"]]
    missing += sorted(set(ca) ^ set(cb))
    ma, mb = measures.summarise(a, draws=10), measures.summarise(b, draws=10)
    configs = {}
    for n in ca:
        if n not in cb:
            continue
        ag, kl = (ma[n]["agree"], mb[n]["agree"]), (ma[n]["kl"], mb[n]["kl"])
        configs[n] = {"agree": ag, "kl": kl,
                      "ok": abs(ag[0] - ag[1]) <= agree_tol and abs(kl[0] - kl[1]) <= kl_tol}

    def key(t):
        return (t["kind"], t["seed"], t["context_tokens"], tuple(t["depths"]))
    ta = {key(t): t for t in a.get("tasks", [])}
    tb = {key(t): t for t in b.get("tasks", [])}
    tasks_differ = [k for k in ta if k in tb and ta[k]["answers"][0] != tb[k]["answers"][0]]
    missing += [str(k) for k in sorted(set(ta) ^ set(tb))]
    ok = not missing and not differ and not tasks_differ and all(c["ok"] for c in configs.values())
    return {"answers_differ": differ, "missing": missing, "configs": configs, "tasks_differ": tasks_differ,
            "ok": ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--agree-tolerance", type=float, default=0.01)
    ap.add_argument("--kl-tolerance", type=float, default=0.01)
    args = ap.parse_args(argv)
    a = json.loads(pathlib.Path(args.a).read_text())
    b = json.loads(pathlib.Path(args.b).read_text())
    r = compare(a, b, args.agree_tolerance, args.kl_tolerance)
    for n in r["missing"]:
        print(f"in one run only: {n}")
    for n in r["answers_differ"]:
        print(f"{n}: the reference answers differ")
    for k in r["tasks_differ"]:
        print(f"task {k}: the reference answers differ")
    for n, c in r["configs"].items():
        if not c["ok"]:
            print(f"{n}: agreement {c['agree'][0]:.4f} vs {c['agree'][1]:.4f}, KL {c['kl'][0]:.4f} vs {c['kl'][1]:.4f}")
    print("the runs agree" if r["ok"] else "the runs differ")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
