#!/usr/bin/env bash
# Installs the Debian packages, configures and builds towers (Release) into BUILD_DIR.
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]     (default BUILD_DIR: build)
# TOWERS_CUDA=AUTO|ON|OFF (environment) is passed to CMake; AUTO builds the CUDA kernels
# whenever nvcc is found (/usr/local/cuda/bin/nvcc included).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
shift || true
scripts/install-deps.sh
jobs=$(nproc)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTOWERS_CUDA="${TOWERS_CUDA:-AUTO}" "$@"
cmake --build "$build_dir" -j "$jobs"
