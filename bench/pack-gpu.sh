#!/usr/bin/env bash
# Builds the GPU binaries into build-gpu/ (Hopper, sm_90) and copies the non-CUDA shared
# libraries they need into build-gpu/devlibs, so that build-gpu/ can be carried to a GPU
# machine that lacks the Debian packages and run there with bench/run-gpu.sh.
#   bench/pack-gpu.sh [CUDA_ARCH]   (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTOWERS_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DTOWERS_NATIVE=OFF >/dev/null
cmake --build build-gpu -j"$(nproc)" --target towers towers_tests gpu_bench
git rev-parse --short HEAD > build-gpu/COMMIT 2>/dev/null || true
pack=../shared/device/pack-runtime.sh
[ -x "$pack" ] || { echo "no $pack: copy the binaries' non-CUDA libraries by hand" >&2; exit 1; }
"$pack" build-gpu/devlibs build-gpu/towers build-gpu/tests/towers_tests build-gpu/bench/gpu_bench
