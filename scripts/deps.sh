#!/usr/bin/env bash
# Installs the Debian packages kvpolicy builds with, if any is missing:
#   cmake make g++ doctest-dev libfmt-dev libbenchmark-dev
# (make: cmake only recommends it, and --no-install-recommends skips it)
# As root it runs apt-get; otherwise it prints the apt-get line and exits 1.
# The CUDA toolkit (nvcc) is not a Debian package here: without it, everything
# but the CUDA targets still builds and tests.
set -euo pipefail

packages=(cmake make g++ doctest-dev libfmt-dev libbenchmark-dev)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} > 0)); then
  if [[ $(id -u) -eq 0 ]]; then
    echo "deps.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  else
    echo "deps.sh: missing packages: ${missing[*]}" >&2
    echo "deps.sh: run as root, or install them with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi

# CMake looks for nvcc on PATH (or $CUDACXX); say where it is when it is not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [[ -z ${CUDACXX:-} ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo "deps.sh: nvcc is not on PATH; scripts/demo.sh and scripts/test.sh use /usr/local/cuda/bin/nvcc"
  else
    echo "deps.sh: no CUDA toolkit found (nvcc); the CUDA targets will be skipped" >&2
  fi
fi
