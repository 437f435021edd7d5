# Sourced by scripts/demo.sh and scripts/test.sh: repository root, build dir, nvcc.
# shellcheck shell=bash

KVP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVP_BUILD=${KVPOLICY_BUILD_DIR:-build}  # relative to the repository root (test.sh --host-only: build-host)
cd "$KVP_ROOT" || exit 1

# The toolkit's default install location, when nvcc is not on PATH already.
if ! command -v nvcc >/dev/null 2>&1 && [[ -z ${CUDACXX:-} && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

kvp_jobs() { nproc 2>/dev/null || echo 2; }

kvp_configure() {
  "$KVP_ROOT/scripts/deps.sh"
  cmake -S . -B "$KVP_BUILD" "$@"
}
