#!/usr/bin/env bash
# Runs a bundle made by scripts/gpu_bundle.sh on the GPU machine: the GPU tests, the
# same under compute-sanitizer, the benchmarks, a profile. The last lines printed are
# one summary line per step. $OUT gets few files (the device tool returns at most 8):
# summary.txt, gpu_check.tgz (every log and output), and, when their steps ran,
# bench.json, reference.json, reference_fp32.json, profile.txt.
#
#   OUT=/path/to/out bash scripts/gpu_check.sh [--bundle DIR] STEP...
#
# Steps (any order, run in the order given):
#   tests      kvpolicy_gpu_tests and kvpolicy_gpu_unit_tests, every case
#   sanitize   compute-sanitizer: memcheck, racecheck and synccheck on the parity and
#              graph tests (KVP_PARITY_SCALE=0.03), memcheck and racecheck on the unit
#              cases in shards of SHARD cases, JOBS processes at a time (racecheck with
#              RACECHECK_PROPERTY_CASES, default 200, of each property case's 1000)
#   bench      bench/run_gpu.sh --quick on the bundle (copy, A end to end and per stage)
#   bench-full bench/run_gpu.sh on the bundle (every row, the reference at 3 sizes)
#   profile    Nsight Compute (--set full) of the four stage kernels of stage/zipage/A:
#              $OUT/profile.ncu-rep and its details page, $OUT/profile.txt
#   demo       the demo on the GPU (--device cuda) beside the host,
#              examples/custom_scorer (its policies on both executors) and
#              examples/decode_loop on the GPU and on the host
# Environment: JOBS (default 4), SHARD (default 12), STEP_TIMEOUT seconds (default 540),
# RACECHECK_PROPERTY_CASES (default 200).
set -uo pipefail

BUNDLE=.gpu-bundle
STEPS=()
while (($#)); do
  case $1 in
    --bundle) BUNDLE=$2; shift 2 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    tests | sanitize | bench | bench-full | profile | demo) STEPS+=("$1"); shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the output directory}"
((${#STEPS[@]})) || { echo "gpu_check.sh: name at least one step (--help)" >&2; exit 2; }
[[ -d $BUNDLE/bin ]] || { echo "gpu_check.sh: no bundle at $BUNDLE (scripts/gpu_bundle.sh)" >&2; exit 2; }
bash "$(dirname "${BASH_SOURCE[0]}")/unpack_bundle.sh" "$BUNDLE" || exit 2
[[ -x $BUNDLE/bin/kvpolicy_gpu_tests ]] || { echo "gpu_check.sh: $BUNDLE/bin has no kvpolicy_gpu_tests" >&2; exit 2; }
BUNDLE=$(cd "$BUNDLE" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
FINAL=$(cd "$OUT" && pwd)
OUT=$(mktemp -d)/gpu_check  # every log; packed into $FINAL/gpu_check.tgz at the end
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin
JOBS=${JOBS:-4}
SHARD=${SHARD:-12}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
BIN=$BUNDLE/bin
SUMMARY=()

# run_logged LOG CMD...: CMD's output to $OUT/LOG, bounded by STEP_TIMEOUT; its exit code.
run_logged() {
  local log=$1
  shift
  timeout "$STEP_TIMEOUT" "$@" >"$OUT/$log" 2>&1
}
# The line of a log that says how it ended (doctest's status, a sanitizer's summary).
verdict() {
  grep -hE '^\[doctest\] (test cases|Status)|(ERROR|RACECHECK|SYNCCHECK) SUMMARY' "$OUT/$1" | tr '\n' ' '
}
note() {
  SUMMARY+=("$*")
  echo "[gpu_check $(date +%H:%M:%S)] $*"
}

step_tests() {
  local exe rc
  for exe in kvpolicy_gpu_tests kvpolicy_gpu_unit_tests; do
    run_logged "$exe.log" "$BIN/$exe"
    rc=$?
    note "tests $exe: exit $rc; $(verdict "$exe.log")"
  done
}

# One sanitizer run per line of $OUT/sanitize.jobs ("LOG TOOL EXE [ARGS]"), JOBS at a time.
step_sanitize() {
  local tool cases first jobs=$OUT/sanitize.jobs
  : >"$jobs"
  : >"$OUT/sanitize.exits"
  echo "sanitize_memcheck_gpu_tests.log memcheck kvpolicy_gpu_tests" >>"$jobs"
  # racecheck spends some 90 s on the 60000-token rows alone: a job of their own.
  echo "sanitize_racecheck_gpu_tests.log racecheck kvpolicy_gpu_tests --test-case-exclude=*60000*" >>"$jobs"
  echo "sanitize_racecheck_gpu_tests_long_rows.log racecheck kvpolicy_gpu_tests --test-case=*60000*" >>"$jobs"
  echo "sanitize_synccheck_gpu_tests.log synccheck kvpolicy_gpu_tests" >>"$jobs"
  cases=$("$BIN/kvpolicy_gpu_unit_tests" --list-test-cases --no-version | sed -n 's/.*current filters: \([0-9]*\).*/\1/p')
  for tool in memcheck racecheck; do
    for ((first = 1; first <= cases; first += SHARD)); do
      echo "sanitize_${tool}_gpu_unit_$first.log $tool kvpolicy_gpu_unit_tests --first=$first --last=$((first + SHARD - 1))" >>"$jobs"
    done
  done
  export BIN OUT STEP_TIMEOUT
  # racecheck runs RACECHECK_PROPERTY_CASES of each property case's 1000 random cases.
  export RACECHECK_PROPERTY_CASES=${RACECHECK_PROPERTY_CASES:-200}
  # shellcheck disable=SC2016
  KVP_PARITY_SCALE=0.03 xargs -P "$JOBS" -L 1 bash -c \
    '[[ $1 == racecheck ]] && export KVP_PROPERTY_CASES=$RACECHECK_PROPERTY_CASES
    timeout "$STEP_TIMEOUT" compute-sanitizer --tool "$1" --error-exitcode 9 "$BIN/$2" "${@:3}" >"$OUT/$0" 2>&1; echo "$0 exit $?" >>"$OUT/sanitize.exits"' \
    <"$jobs"
  while read -r log _; do
    # A shard of host-only cases makes no CUDA call: the sanitizer then exits 255
    # with "terminated before first instrumented API call", which is no finding.
    local idle=
    grep -q 'terminated before first instrumented API call' "$OUT/$log" && idle=' (no CUDA call in this shard)'
    note "sanitize $log: $(grep -h "^$log exit" "$OUT/sanitize.exits" | awk '{print $2, $3}')$idle; $(verdict "$log")"
  done <"$jobs"
}

step_bench() {
  local rc
  OUT=$OUT/$1 bash "$ROOT/bench/run_gpu.sh" --prebuilt "$BUNDLE" "${@:2}" >"$OUT/$1.log" 2>&1
  rc=$?
  note "$1: exit $rc; $(tail -n 1 "$OUT/$1.log")"
}

step_profile() {
  local ncu rc c
  ncu=$(command -v ncu)
  for c in /opt/nvidia/nsight-compute/*/ncu; do [[ -z $ncu && -x $c ]] && ncu=$c; done
  [[ -n $ncu ]] || { note "profile: ncu not found"; return; }
  run_logged profile.log "$ncu" --set full -k 'regex:attention_score_mma|lightning_mma|epilogue_kernel|compact_kernel' \
    -c 4 -f -o "$OUT/profile" "$BIN/kvpolicy_bench" --benchmark_filter='^stage/zipage/A/'
  rc=$?
  "$ncu" -i "$OUT/profile.ncu-rep" --page details >"$OUT/profile.txt" 2>&1
  note "profile: exit $rc; $(grep -c 'Duration' "$OUT/profile.txt") kernels in profile.txt"
}

step_demo() {
  local rc
  run_logged demo.log "$BIN/kvpolicy_demo" --device cuda
  rc=$?
  note "demo: exit $rc; $(grep -ciE 'gpu|cuda' "$OUT/demo.log") lines on the GPU path"
  # The custom-policy example runs each of its pipelines on both executors and exits
  # non-zero if their keep masks differ.
  if [[ -x $BIN/kvpolicy_custom_scorer ]]; then
    run_logged custom_scorer.log "$BIN/kvpolicy_custom_scorer"
    rc=$?
    note "custom_scorer: exit $rc; $(grep -c 'CUDA executor: the same keep mask' "$OUT/custom_scorer.log") pipelines agree"
  fi
  # The decode loop exits non-zero if a compression's outcome differs from what the
  # engine expected; its output is the figure docs/integration.md records.
  if [[ -x $BIN/kvpolicy_decode_loop ]]; then
    local d
    for d in cuda host; do
      run_logged "decode_loop_$d.log" "$BIN/kvpolicy_decode_loop" --device "$d"
      rc=$?
      note "decode_loop --device $d: exit $rc; $(grep -h 'compression' "$OUT/decode_loop_$d.log" | tr '\n' ' ')"
    done
  fi
}

{
  nvidia-smi
  echo
  cat "$BUNDLE/BUILD_INFO"
} >"$OUT/gpu_check_info.txt" 2>&1
for s in "${STEPS[@]}"; do
  case $s in
    tests) step_tests ;;
    sanitize) step_sanitize ;;
    bench) step_bench bench --quick ;;
    bench-full) step_bench bench_full ;;
    profile) step_profile ;;
    demo) step_demo ;;
  esac
done
{
  echo "== gpu_check summary ($(head -n 1 "$BUNDLE/BUILD_INFO"))"
  printf '%s\n' "${SUMMARY[@]}"
} >"$OUT/summary.txt"
# bench-full's files, or else bench's (both steps name their folder after themselves).
for f in summary.txt bench_full/bench.json bench_full/reference.json bench_full/reference_fp32.json \
  bench/bench.json bench/reference.json bench/reference_fp32.json profile.txt; do
  [[ -f $OUT/$f && ! -f $FINAL/$(basename "$f") ]] && cp "$OUT/$f" "$FINAL/"
done
tar -czf "$FINAL/gpu_check.tgz" -C "$(dirname "$OUT")" gpu_check
echo
cat "$OUT/summary.txt"
