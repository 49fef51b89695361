#!/usr/bin/env bash
# Builds the GPU binaries into build-gpu/ (Hopper, sm_90 by default) and copies the non-CUDA
# shared libraries they need into build-gpu/devlibs, so that build-gpu/ can be carried to a
# GPU machine that lacks the Debian packages and run there with bench/run-gpu.sh.
#   bench/pack-gpu.sh [CUDA_ARCH]   (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTOWERS_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DTOWERS_NATIVE=OFF >/dev/null
cmake --build build-gpu -j"$(nproc)" --target towers towers_tests gpu_bench
git rev-parse --short HEAD > build-gpu/COMMIT 2>/dev/null || true
# Every shared library the binaries load, except the C/C++ runtime and the CUDA/NVIDIA
# libraries (driver, cudart, cuBLAS, NCCL), which a GPU machine brings itself.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libgcc_s\.|libstdc\+\+\.|libcuda|libcudart|libcublas|libnccl|libnvidia)'
mkdir -p build-gpu/devlibs
for bin in build-gpu/towers build-gpu/tests/towers_tests build-gpu/bench/gpu_bench; do
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -f "$path" ] || { echo "missing: $name (needed by $bin)" >&2; continue; }
    cp -uL "$path" "build-gpu/devlibs/$name"
  done
done
du -sh build-gpu/devlibs
