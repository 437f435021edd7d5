#!/usr/bin/env bash
# On the GPU machine: transformers' continuous batching with and without kvpolicy at a fixed KV
# pool, FlashInfer's paged decode as the attention of every run (bench/transformers_cb.py,
# one run per GPU at a time). Carry .whl (scripts/gpu_wheels.sh fetch) and .deps.
#
#   OUT=$OUT bash bench/run_transformers_cb.sh [--build] [--tests] --shapes 1b,8b [--deadline S]
#       [--gpus 0,1] [--jobs 1b:none,1b:snapkv@2048] [-- EXAMPLE ARGS]
#
# --build: build and install the kvpolicy Python package with CUDA first (a fresh machine);
# --tests: then run the transformers adapter's Python tests on the GPU (FlashInfer's included).
# Example arguments default to the long-generation workload of the engine issue: prompt 512,
# 4096 generated, 128 requests queued, a pool of 16 full requests, zipage/snapkv/rkv at budgets
# 1024 and 2048, blocks of 64. Results: $OUT/cb.tar.gz (per-run logs and JSON), and
# $OUT/transformers_cb.{json,txt,png} merged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/build/transformers_cb}
mkdir -p "$OUT/cb"
build=0 tests=0 shapes=1b deadline=540 driver=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) build=1 ;;
    --tests) tests=1 ;;
    --shapes) shapes=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    --gpus | --jobs) driver+=("$1" "$2"); shift ;;
    --) shift; break ;;
    *) echo "run_transformers_cb.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
example=("$@")
if [[ ${#example[@]} -eq 0 ]]; then
  example=(--prompt-len 512 --max-new-tokens 4096 --requests 128 --full-requests 16
           --presets zipage,snapkv,rkv --budget 1024,2048 --block-size 64)
fi

export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a
site=/tmp/flashinfer-site
[[ -d $site/flashinfer ]] || bash scripts/gpu_wheels.sh install "$site" >/dev/null
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
if [[ -d .deps/fmt ]]; then
  export LD_LIBRARY_PATH=$PWD/.deps/fmt/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"

if [[ $build == 1 ]]; then
  if [[ $tests == 1 ]]; then
    KVP_PYTEST_PATHS=${KVP_PYTEST_PATHS:-"python/tests/test_transformers_attention.py python/tests/test_transformers_adapter.py"} \
      OUT=$OUT/cb/check bash python/scripts/gpu_check.sh >"$OUT/gpu_check.log" 2>&1 || {
      tail -40 "$OUT/gpu_check.log"; tar -czf "$OUT/cb.tar.gz" -C "$OUT" cb; exit 1; }
    grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/gpu_check.log" | tail -40
  else
    (export KVP_PYTEST_PATHS=python/tests/test_host_only_build.py; OUT=$OUT/cb/check bash python/scripts/gpu_check.sh \
      >"$OUT/gpu_check.log" 2>&1) || { tail -40 "$OUT/gpu_check.log"; exit 1; }
  fi
fi

start=$(date +%s)
status=0
python3 bench/transformers_cb.py --shapes "$shapes" --out "$OUT/cb" --deadline "$deadline" "${driver[@]}" \
  -- "${example[@]}" \
  2>&1 | tee "$OUT/driver.log" || status=$?
echo "== throughput runs: $(($(date +%s) - start)) s"
cp "$OUT"/cb/transformers_cb.* "$OUT/" 2>/dev/null || true
tar -czf "$OUT/cb.tar.gz" -C "$OUT" cb && rm -rf "$OUT/cb"
exit $status
