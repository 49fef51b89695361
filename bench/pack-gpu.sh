#!/usr/bin/env bash
# Builds the GPU binaries into build-gpu/ (Hopper, sm_90 by default) and packs them, with the
# non-CUDA shared libraries they need, into build-gpu/pack/ (towers, tests/towers_tests,
# bench/gpu_bench, bench/remote_bench, devlibs/, COMMIT): a few tens of MB that can be carried to a GPU machine
# that lacks the Debian packages, and run there with `bench/run-gpu.sh build-gpu/pack`.
#   bench/pack-gpu.sh [CUDA_ARCH]   (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTOWERS_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DTOWERS_NATIVE=OFF >/dev/null
cmake --build build-gpu -j"$(nproc)" --target towers towers_tests gpu_bench remote_bench
pack=build-gpu/pack
rm -rf "$pack"
mkdir -p "$pack/tests" "$pack/bench" "$pack/devlibs"
cp build-gpu/towers "$pack/"
cp build-gpu/tests/towers_tests "$pack/tests/"
cp build-gpu/bench/gpu_bench build-gpu/bench/remote_bench "$pack/bench/"
git rev-parse --short HEAD > "$pack/COMMIT" 2>/dev/null || echo unknown > "$pack/COMMIT"
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  sed -i 's/$/+uncommitted changes/' "$pack/COMMIT"
fi
# Every shared library the binaries load, except the C/C++ runtime and the CUDA/NVIDIA
# libraries (driver, cudart, cuBLAS, cuDNN, NCCL), which a GPU machine brings itself.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libgcc_s\.|libstdc\+\+\.|libcuda|libcudart|libcublas|libcudnn|libnccl|libnvidia)'
for bin in "$pack/towers" "$pack/tests/towers_tests" "$pack/bench/gpu_bench" "$pack/bench/remote_bench"; do
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -f "$path" ] || { echo "missing: $name (needed by $bin)" >&2; continue; }
    cp -uL "$path" "$pack/devlibs/$name"
  done
done
du -sh "$pack" "$pack/devlibs"
# One compressed file to carry (OpenBLAS alone is tens of MB): on the GPU machine,
# `tar xJf build-gpu/pack.tar.xz -C build-gpu`.
tar cJf build-gpu/pack.tar.xz -C build-gpu pack
ls -la build-gpu/pack.tar.xz
