#!/usr/bin/env bash
# kvpolicy benchmarks on the GPU machine: configure, build, run kvpolicy_bench and the
# PyTorch reference, everything logged to $OUT.
#
#   OUT=/path/to/out bash bench/run_gpu.sh [--quick] [--prebuilt DIR]
#
# Run from the repository root. Uses fmt and Google Benchmark unpacked under
# .deps/root/usr (Debian's libfmt-dev / libbenchmark-dev) when present.
#   --quick   only the copy, e2e/zipage/A, e2e_overlap4/zipage/A, stage/zipage/A,
#             scale_tokens/zipage/2304 and redundancy/*/2304 rows, and the reference
#             at T = 2304 only
#   --prebuilt DIR  run the binaries of a bundle made by scripts/gpu_bundle.sh
#             (DIR/bin/kvpolicy_bench, DIR/lib/libkvp_capi.so): no configure, no build
# Environment: BUILD_DIR (default build), JOBS (default 16), CUDA_ARCH (default 90a).
# Writes: bench.json, reference.json (bf16), reference_fp32.json (fp32 mask check),
#         hard_kv_reference.json (bf16), hard_kv_reference_fp32.json (fp32 counts and masks),
#         kara_reference.json (bf16), kara_reference_fp32.json (fp32 masks and counts),
#         configure.log, build.log, bench.log, reference*.log, run.log, nvidia-smi.txt
set -uo pipefail

QUICK=0
PREBUILT=
while (($#)); do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --prebuilt) PREBUILT=$(cd "${2:?--prebuilt needs a folder}" && pwd) || exit 2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"

ROOT=$(pwd)
if [[ ! -f "$ROOT/bench/compress_bench.cu" ]]; then
  echo "run_gpu.sh: run from the repository root" >&2
  exit 2
fi
BUILD=${BUILD_DIR:-$ROOT/build}
JOBS=${JOBS:-16}
ARCH=${CUDA_ARCH:-90a}
DEPS=$ROOT/.deps/root/usr
PREFIX_ARGS=()
if [[ -d "$DEPS" ]]; then
  PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$DEPS")
  export LD_LIBRARY_PATH="$DEPS/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
export PYTHONUNBUFFERED=1

FAILED=()
log() { echo "[run_gpu $(date +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }
# step NAME LOGFILE CMD...: runs CMD, tees its output to $OUT/LOGFILE, records a failure.
step() {
  local name=$1 logfile=$2
  shift 2
  log "$name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$logfile"
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc after $((SECONDS - t0)) s"
  [[ $rc -eq 0 ]] || FAILED+=("$name")
  return "$rc"
}

START=$SECONDS
log "repo $ROOT, build $BUILD, out $OUT, quick $QUICK"
{ nvidia-smi; nvcc --version; cmake --version; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  > "$OUT/nvidia-smi.txt" 2>&1 || true

if [[ -n $PREBUILT ]]; then
  bash "$ROOT/scripts/unpack_bundle.sh" "$PREBUILT"
  log "prebuilt: $(head -n 2 "$PREBUILT/BUILD_INFO" 2>/dev/null | tr '\n' ' ')"
  export LD_LIBRARY_PATH="$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  BENCH=$PREBUILT/bin/kvpolicy_bench
  CAPI=$PREBUILT/lib/libkvp_capi.so
  [[ -x $BENCH ]] || BENCH=
  [[ -f $CAPI ]] || CAPI=
else
  step configure configure.log cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DKVPOLICY_BUILD_BENCHMARKS=ON -DKVPOLICY_BUILD_TESTS=OFF -DKVPOLICY_BUILD_EXAMPLES=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" "${PREFIX_ARGS[@]}" || { log "configure failed"; exit 1; }
  step build build.log cmake --build "$BUILD" -j"$JOBS" --target kvpolicy_bench kvp_capi || { log "build failed"; exit 1; }
  BENCH=$(find "$BUILD" -type f -name kvpolicy_bench -perm -u+x | head -n 1)
  CAPI=$(find "$BUILD" -type f -name libkvp_capi.so | head -n 1)
fi

# Google Benchmark: every row has explicit iterations (gkv/rkv and full redundancy few).
BENCH_ARGS=(--benchmark_out="$OUT/bench.json" --benchmark_out_format=json --benchmark_counters_tabular=true)
if [[ $QUICK -eq 1 ]]; then
  BENCH_ARGS+=(--benchmark_filter='^(copy|e2e/zipage/A|e2e_overlap4/zipage/A|stage/zipage/A|scale_tokens/zipage/2304|redundancy/(lightning|lightning_batched|full)/2304)/')
fi
if [[ -n "$BENCH" ]]; then
  step bench bench.log "$BENCH" "${BENCH_ARGS[@]}"
else
  log "kvpolicy_bench not found under ${PREBUILT:-$BUILD}"; FAILED+=(bench)
fi

# The PyTorch reference: fp32 (the mask check; timed too), then bf16 (the timing).
REF=(python3 "$ROOT/bench/reference/zipage_reference.py" --lib "$CAPI")
if [[ -n "$CAPI" ]]; then
  step reference_fp32 reference_fp32.log "${REF[@]}" --dtype float32 --nmax 9 --iters 10 \
    --out "$OUT/reference_fp32.json"
  if [[ $QUICK -eq 1 ]]; then
    step reference_bf16 reference.log "${REF[@]}" --dtype bfloat16 --nmax 9 --iters 10 --out "$OUT/reference.json"
  else
    step reference_bf16 reference.log "${REF[@]}" --dtype bfloat16 --nmax 9,18,36 --iters 10 \
      --out "$OUT/reference.json"
  fi
  # hard_kv in PyTorch: fp32 (counts and masks against kvpolicy), then bf16 (the timing).
  HK=(python3 "$ROOT/bench/reference/hard_kv_reference.py" --lib "$CAPI" --iters 10)
  step hard_kv_reference_fp32 hard_kv_reference_fp32.log "${HK[@]}" --dtype float32 \
    --out "$OUT/hard_kv_reference_fp32.json"
  step hard_kv_reference_bf16 hard_kv_reference.log "${HK[@]}" --dtype bfloat16 --out "$OUT/hard_kv_reference.json"
  # kara in PyTorch at a KvLLM event (30 windows of 768, 32 layers): fp32 (selection,
  # masks and counts against kvpolicy), then bf16 (the timing); end to end and per stage.
  KR=(python3 "$ROOT/bench/reference/kara_reference.py" --lib "$CAPI" --iters 10)
  step kara_reference_fp32 kara_reference_fp32.log "${KR[@]}" --dtype float32 --out "$OUT/kara_reference_fp32.json"
  step kara_reference_bf16 kara_reference.log "${KR[@]}" --dtype bfloat16 --out "$OUT/kara_reference.json"
else
  log "libkvp_capi.so not found under ${PREBUILT:-$BUILD}"; FAILED+=(reference)
fi

log "done in $((SECONDS - START)) s; failed: ${FAILED[*]:-none}"
[[ ${#FAILED[@]} -eq 0 ]]
