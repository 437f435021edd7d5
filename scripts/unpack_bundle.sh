#!/usr/bin/env bash
# Unpacks the xz-compressed files of a bundle made by scripts/gpu_bundle.sh, in place
# (once: files already unpacked are left alone). scripts/gpu_check.sh and
# bench/run_gpu.sh --prebuilt call it; by hand:
#
#   scripts/unpack_bundle.sh [DIR]          # default DIR: .gpu-bundle
set -euo pipefail

DIR=${1:-.gpu-bundle}
shopt -s nullglob
for f in "$DIR"/bin/*.xz "$DIR"/lib/*.xz; do
  xz --decompress --force "$f"
done
