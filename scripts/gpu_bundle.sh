#!/usr/bin/env bash
# Builds everything the GPU machine runs, here (nvcc needs no GPU), and gathers it
# with the shared libraries it needs into one folder that travels to that machine:
#
#   scripts/gpu_bundle.sh [DIR]          # default DIR: .gpu-bundle (git-ignored)
#
# DIR/bin: kvpolicy_gpu_tests, kvpolicy_gpu_unit_tests, kvpolicy_bench, kvpolicy_demo,
# kvpolicy_custom_scorer, kvpolicy_decode_loop;
# DIR/lib: libkvp_capi.so (the PyTorch reference's C API) and the libraries the
# binaries load that a bare CUDA machine lacks (Google Benchmark, fmt, the CUDA
# runtime); DIR/BUILD_INFO: commit, architecture, date. scripts/gpu_check.sh and
# bench/run_gpu.sh --prebuilt DIR run it there, so no device time goes on a build.
# Binaries and libraries are xz-compressed (a sixth of their size: the device tool
# carries at most 64 MiB); those two scripts unpack them (scripts/unpack_bundle.sh).
# Environment: KVPOLICY_BUILD_DIR (default build-gpu), CUDA_ARCH (default 90a),
# KVP_BUNDLE_XZ (default 1; 0 leaves the files unpacked).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DIR=${1:-.gpu-bundle}
ARCH=${CUDA_ARCH:-90a}
BUILD=${KVPOLICY_BUILD_DIR:-build-gpu}
if ! command -v nvcc >/dev/null 2>&1; then
  echo "gpu_bundle.sh: nvcc not found; the GPU targets need the CUDA toolkit" >&2
  exit 1
fi

KVP_BUILD=$BUILD kvp_configure -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DKVPOLICY_BUILD_TESTS=ON -DKVPOLICY_BUILD_EXAMPLES=ON -DKVPOLICY_BUILD_BENCHMARKS=ON \
  -DKVPOLICY_BUILD_GPU_UNIT_TESTS=ON
cmake --build "$BUILD" -j "$(kvp_jobs)" \
  --target kvpolicy_gpu_tests kvpolicy_gpu_unit_tests kvpolicy_bench kvpolicy_demo kvpolicy_custom_scorer kvpolicy_decode_loop kvp_capi

rm -rf "$DIR"
mkdir -p "$DIR/bin" "$DIR/lib"
for exe in kvpolicy_gpu_tests kvpolicy_gpu_unit_tests kvpolicy_bench kvpolicy_demo kvpolicy_custom_scorer kvpolicy_decode_loop; do
  cp "$BUILD/bin/$exe" "$DIR/bin/"
done
cp "$(find "$BUILD" -name libkvp_capi.so -type f -print -quit)" "$DIR/lib/"

# Shared libraries outside the C/C++ runtime that every Linux machine has.
for f in "$DIR"/bin/* "$DIR"/lib/libkvp_capi.so; do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libgcc_s.so* | libstdc++.so* | ld-linux*) ;;
    *) cp -L "$lib" "$DIR/lib/" ;;
  esac
done

if [[ ${KVP_BUNDLE_XZ:-1} != 0 ]]; then
  xz --threads=0 -3 "$DIR"/bin/* "$DIR"/lib/*
fi

{
  echo "commit $(git -C "$KVP_ROOT" rev-parse HEAD)$(git -C "$KVP_ROOT" diff --quiet HEAD -- include tests bench examples || echo ' (with uncommitted changes)')"
  echo "cuda_arch $ARCH"
  echo "nvcc $(nvcc --version | tail -n 1)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
} >"$DIR/BUILD_INFO"
du -sh "$DIR"
cat "$DIR/BUILD_INFO"
