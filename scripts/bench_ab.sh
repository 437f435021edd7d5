#!/usr/bin/env bash
# A/B of benchmark rows between builds, on the GPU machine: each variant's
# kvpolicy_bench runs the rows FILTER selects, variants alternating, once per entry of
# RUNS, so that drift over the session falls on every variant alike. Prints one block
# per row with each variant's times (ms; per-stage times for stage rows) in run order.
#
#   RUNS="1 2 3" OUT=<dir> bash scripts/bench_ab.sh FILTER NAME=BUNDLE[:VAR=VAL[,VAR=VAL]] ...
#
# BUNDLE: a folder made by scripts/gpu_bundle.sh (unpacked here if need be); VAR=VAL:
# environment for that variant's runs. Google Benchmark's JSON of every run goes to
# $OUT/ab/NAME.RUN.json (default OUT: /tmp).
#   e.g. RUNS="1 2" bash scripts/bench_ab.sh '^(e2e|stage)/zipage/A/' base=.gpu-bundle-base new=.gpu-bundle
set -uo pipefail

FILTER=${1:?usage: bench_ab.sh FILTER NAME=BUNDLE[:VAR=VAL,...] ...}
shift
(($#)) || { echo "bench_ab.sh: name at least one variant" >&2; exit 2; }
DIR=${OUT:-/tmp}/ab
mkdir -p "$DIR"
HERE=$(dirname "${BASH_SOURCE[0]}")

bundle_of() { local rest=${1#*=}; echo "${rest%%:*}"; }
for v in "$@"; do bash "$HERE/unpack_bundle.sh" "$(bundle_of "$v")"; done
for run in ${RUNS:-1 2}; do
  for v in "$@"; do
    name=${v%%=*} rest=${v#*=} bundle=$(bundle_of "$v") envs=
    [[ $rest == *:* ]] && envs=${rest#*:}
    (
      IFS=,
      for e in $envs; do export "${e?}"; done
      LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bundle/bin/kvpolicy_bench" \
        --benchmark_filter="$FILTER" --benchmark_out="$DIR/$name.$run.json" --benchmark_out_format=json \
        >"$DIR/$name.$run.log" 2>&1
    ) || echo "bench_ab.sh: $name, run $run failed (log: $DIR/$name.$run.log)" >&2
  done
done

python3 - "$DIR" "${RUNS:-1 2}" "$@" <<'PY'
import json, sys
folder, runs, variants = sys.argv[1], sys.argv[2].split(), [v.split("=")[0] for v in sys.argv[3:]]
stages = ("redundancy_ms", "score_ms", "epilogue_ms", "layout_ms")
table = {}
for name in variants:
    for run in runs:
        try:
            rows = json.load(open(f"{folder}/{name}.{run}.json"))["benchmarks"]
        except (OSError, ValueError):
            continue
        for b in rows:
            cell = "%.3f" % b["real_time"]
            parts = ["%s %.3f" % (k[:-3], b[k]) for k in stages if k in b]
            if parts:
                cell += " [" + ", ".join(parts) + "]"
            table.setdefault(b["name"].split("/iterations")[0], {}).setdefault(name, []).append(cell)
for row, cells in table.items():
    print(row)
    for name in variants:
        print("   %-12s %s" % (name, " / ".join(cells.get(name, ["-"]))))
PY
