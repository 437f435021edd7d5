#!/usr/bin/env bash
# Configures, builds everything (header tests, unit tests, GPU tests when nvcc is
# there, examples, benchmarks) and runs every test that needs no GPU.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# shellcheck disable=SC2119
kvp_configure
cmake --build "$KVP_BUILD" -j "$(kvp_jobs)"
ctest --test-dir "$KVP_BUILD" -LE gpu --output-on-failure -j2
