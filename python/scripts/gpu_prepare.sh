#!/usr/bin/env bash
# Run here, before python/scripts/gpu_check.sh runs on the GPU machine: that machine
# has nvcc, CMake, PyTorch, nanobind and scikit-build-core but not fmt, and cannot
# fetch it. This copies this machine's fmt (Debian's libfmt-dev and libfmt9: headers,
# CMake package, shared library) into .deps/fmt/ (git-ignored), laid out as under
# /usr, for gpu_check.sh to build and run with; carry .deps to the GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
"$PWD/scripts/deps.sh"  # libfmt-dev among the rest
DEST=.deps/fmt
rm -rf "$DEST"
for pkg in libfmt-dev libfmt9; do
  dpkg -L "$pkg" | while read -r path; do
    [[ -f $path && $path == /usr/* && $path != /usr/share/* ]] || continue
    mkdir -p "$DEST/$(dirname "${path#/usr/}")"
    cp -L "$path" "$DEST/${path#/usr/}"  # the files, not symlinks: the copy travels as plain files
  done
done
echo "gpu_prepare.sh: fmt $(dpkg-query -W -f='${Version}' libfmt-dev) in $DEST ($(du -sh "$DEST" | cut -f1));" \
  "on the GPU machine: bash python/scripts/gpu_check.sh, carrying .deps"
