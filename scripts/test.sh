#!/usr/bin/env bash
# Installs, builds and runs the whole test suite. GPU tests skip (and are reported as skipped)
# where no GPU is present.
#   scripts/test.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
scripts/build.sh "$build_dir"
# The Python interoperability checks of the checkpoint format need Python's safetensors reader.
python3 -m pip install --quiet --disable-pip-version-check safetensors numpy 2>/dev/null ||
  echo "test.sh: python safetensors not installed; the interoperability tests will skip"
cd "$build_dir"
ctest --output-on-failure -j "$(nproc)" --timeout 900
