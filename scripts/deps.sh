#!/usr/bin/env bash
# Installs the Debian packages kvpolicy builds with, if any is missing:
#   cmake make g++ doctest-dev libfmt-dev libbenchmark-dev
# (make: cmake only recommends it, and --no-install-recommends skips it)
# --python: also what the Python package (python/) builds with: python3 with pip and
# its headers (Debian's python3-dev, python3-pip and python3-venv when python3 is
# Debian's own or missing; another interpreter, pyenv's say, brings its own).
# As root it runs apt-get; otherwise it prints the apt-get line and exits 1.
# The CUDA toolkit (nvcc) is not a Debian package here: without it, everything
# but the CUDA targets still builds and tests.
set -euo pipefail

packages=(cmake make g++ doctest-dev libfmt-dev libbenchmark-dev)
if [[ ${1:-} == --python ]]; then
  python=$(command -v python3 || true)
  if [[ -z $python || $(readlink -f "$python") == /usr/bin/python3* ]]; then
    packages+=(python3 python3-dev python3-pip python3-venv)
  fi
fi

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
