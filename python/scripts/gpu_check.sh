#!/usr/bin/env bash
# On a GPU machine (no network; PyTorch with CUDA, nanobind, scikit-build-core, numpy,
# pytest, cmake and nvcc already there): builds the kvpolicy Python package with its
# CUDA path (sm_90a unless CUDAARCHS says otherwise) and runs every Python test, the
# CUDA ones required (python/tests/test_cuda.py: device against host for every preset,
# device-side errors, streams and workspaces, a compress inside a captured
# torch.cuda.CUDAGraph, the torch op under torch.compile and in a graph).
# Logs go to $OUT (if set, else python/build/gpu_check): build.log, pytest.log,
# junit.xml, environment.txt. Exits non-zero when the build or a test fails.
# fmt: the copy python/scripts/gpu_prepare.sh puts in .deps/fmt (carry .deps along)
# when it is there, else the machine's own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LOG=${OUT:-$PWD/python/build/gpu_check}
mkdir -p "$LOG"

if ! command -v nvcc >/dev/null 2>&1 && [[ -z ${CUDACXX:-} && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  nvcc --version 2>&1 | tail -1 || echo "nvcc: not found"
  cmake --version 2>&1 | head -1 || echo "cmake: not found"
  python3 - <<'PY'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "numpy", "nanobind", "scikit_build_core", "pytest"):
    try:
        m = importlib.import_module(name)
        extra = f" (CUDA {m.version.cuda}, device available: {m.cuda.is_available()})" if name == "torch" else ""
        print(name, m.__version__ + extra)
    except Exception as e:  # report every missing piece, not only the first
        print(name, "MISSING:", e)
PY
} 2>&1 | tee "$LOG/environment.txt"

missing=$(python3 -c "
import importlib
print(' '.join(n for n in ('torch', 'numpy', 'nanobind', 'scikit_build_core', 'pytest') if importlib.util.find_spec(n) is None))")
if [[ -n $missing ]]; then
  echo "gpu_check.sh: missing Python packages: $missing (this script installs nothing: no network)" >&2
  exit 2
fi
for tool in cmake nvcc; do
  command -v "$tool" >/dev/null 2>&1 || { echo "gpu_check.sh: $tool not found" >&2; exit 2; }
done
fmt_args=()
if [[ -d .deps/fmt ]]; then
  fmt_lib=$PWD/.deps/fmt/lib/x86_64-linux-gnu
  fmt_args=(-C "cmake.define.fmt_DIR=$fmt_lib/cmake/fmt")
  export LD_LIBRARY_PATH=$fmt_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # the extension links libfmt.so.9
  echo "== fmt from .deps/fmt"
fi

# ON, not AUTO: a build that silently dropped the CUDA path would only skip the tests.
echo "== building (log: $LOG/build.log)"
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  python3 -m pip install --no-build-isolation --no-deps -v ./python \
  -C cmake.define.KVPOLICY_PYTHON_CUDA=ON "${fmt_args[@]}" >"$LOG/build.log" 2>&1 || {
  tail -50 "$LOG/build.log"
  echo "gpu_check.sh: the build failed; see $LOG/build.log" >&2
  exit 1
}
echo "== built in $(($(date +%s) - start)) s"
(cd /tmp && python3 -c "import kvpolicy; assert kvpolicy.has_cuda, 'built without CUDA'; print('kvpolicy', kvpolicy.__version__, 'has_cuda', kvpolicy.has_cuda)")

# KVPOLICY_REQUIRE_CUDA: test_cuda.py fails instead of skipping when it cannot run.
echo "== testing (log: $LOG/pytest.log)"
# KVP_PYTEST_PATHS: the test files to run (default: all of python/tests).
# shellcheck disable=SC2086
KVPOLICY_REQUIRE_CUDA=1 python3 -m pytest ${KVP_PYTEST_PATHS:-python/tests} -v -rs -p no:cacheprovider --junitxml="$LOG/junit.xml" \
  2>&1 | tee "$LOG/pytest.log"
exit "${PIPESTATUS[0]}"
