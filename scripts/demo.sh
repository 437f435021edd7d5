#!/usr/bin/env bash
# Builds and runs the compression demo (examples/compress_demo.cpp), passing its
# arguments through: scripts/demo.sh --help
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

kvp_configure -DKVPOLICY_BUILD_EXAMPLES=ON
cmake --build "$KVP_BUILD" --target kvpolicy_demo -j "$(kvp_jobs)"

demo=$KVP_BUILD/bin/kvpolicy_demo
if [[ ! -x $demo ]]; then
  demo=$(find "$KVP_BUILD" -type f -name kvpolicy_demo -perm -u+x -print -quit)
fi
if [[ -z $demo ]]; then
  echo "demo.sh: kvpolicy_demo was not built (is there an examples/CMakeLists.txt?)" >&2
  exit 1
fi
exec "$demo" "$@"
