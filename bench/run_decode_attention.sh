#!/usr/bin/env bash
# Decode attention on the GPU machine in one command: builds its GPU test and
# kvpolicy_bench (nvcc directly, one translation unit each), runs the test, the test under
# compute-sanitizer (memcheck; racecheck and synccheck on the per-head and graph
# cases), the decode/* rows with the copy row, and the PyTorch SDPA reference. Logs and
# JSON go to $OUT (logs tarred: the device tool returns at most 8 files).
#
#   OUT=/path/to/out bash bench/run_decode_attention.sh
#
# Run from the repository root. Uses fmt, doctest and Google Benchmark unpacked under
# .deps/root/usr. Environment: BUILD_DIR (default build-decode).
set -uo pipefail
: "${OUT:?set OUT to the output directory}"
ROOT=$(pwd)
BUILD=${BUILD_DIR:-$ROOT/build-decode}
DEPS=$ROOT/.deps/root/usr
LOGS=$OUT/logs
mkdir -p "$BUILD" "$LOGS"
export LD_LIBRARY_PATH="$DEPS/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
FAILED=()
log() { echo "[decode $(date +%H:%M:%S) +$SECONDS s] $*" | tee -a "$LOGS/run.log"; }
step() {  # step NAME LIMIT_S CMD...: output to logs/NAME.log
  local name=$1 limit=$2
  shift 2
  log "$name: $*"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc"
  tail -n 25 "$LOGS/$name.log"
  [[ $rc -eq 0 ]] || FAILED+=("$name")
  return $rc
}

nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
# Both binaries by nvcc directly (one translation unit each, no configure step); the
# bench compiles on the CPU while the tests run on the GPU.
NVCC=(nvcc -std=c++20 -O3 -arch=sm_90a -lineinfo -DFMT_USE_CONSTEXPR=1 -I"$ROOT/include" -I"$DEPS/include")
LIBS=(-L"$DEPS/lib/x86_64-linux-gnu" -lfmt)
TEST=$BUILD/decode_attention_test
BENCH=$BUILD/kvpolicy_bench
step build_bench 400 "${NVCC[@]}" "$ROOT/bench/compress_bench.cu" "${LIBS[@]}" -lbenchmark -lpthread -o "$BENCH" &
BENCH_PID=$!
step build_test 400 "${NVCC[@]}" -I"$ROOT/tests" "$ROOT/tests/doctest_main.cpp" "$ROOT/tests/gpu/decode_attention_test.cu" \
  "${LIBS[@]}" -o "$TEST"

if [[ -x $TEST ]]; then
  step test 300 "$TEST" --no-version
  step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$TEST" --no-version
  step racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 1 "$TEST" --no-version \
    --test-case='*per-head caches*,*captured graph*'
  step synccheck 200 compute-sanitizer --tool synccheck --error-exitcode 1 "$TEST" --no-version \
    --test-case='*captured graph*'
fi
step sdpa 200 python3 "$ROOT/bench/reference/sdpa_decode.py" --json "$OUT/sdpa_decode.json"
wait "$BENCH_PID"
if [[ -x $BENCH ]]; then
  step bench 300 "$BENCH" --benchmark_filter='^(copy|decode/|decode_staged/)' --benchmark_out="$OUT/bench_decode_attention.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true
else
  FAILED+=(build_bench)
fi
[[ -x $TEST ]] || FAILED+=(build_test)
log "failed: ${FAILED[*]:-none}"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"
[[ ${#FAILED[@]} -eq 0 ]]
