#!/usr/bin/env bash
# The whole test suite (the CPU tests and the GPU suite on the CUDA emulator) built with
# AddressSanitizer and UndefinedBehaviorSanitizer into BUILD_DIR (default build-asan), then
# run by ctest: a memory error, a leak or undefined behaviour fails the test that hit it. CI
# runs it after scripts/test.sh.
#   scripts/asan.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build-asan}
scripts/install-deps.sh
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -g1: line tables (a report's frames keep their files, lines and inlined calls) without the
# full debug information, which made the build about a fifth slower.
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTOWERS_NATIVE=OFF \
  -DTOWERS_BUILD_BENCH=OFF -DTOWERS_CUDA="${TOWERS_CUDA:-AUTO}" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCMAKE_CXX_FLAGS="$sanitize" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build "$build_dir" -j "$(nproc)"
# protect_shadow_gap=0: the CUDA runtime, linked in CUDA builds (and idle without a GPU),
# maps memory where ASan would otherwise protect its shadow gap. exitcode=86: a sanitizer
# report in a `towers` process that the CLI tests start must not pass for the exit code 1 of
# an expected error.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:exitcode=86
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:exitcode=86
# A leak inside OpenSSL that gRPC's TLS threads leave at exit (scripts/lsan.supp says which).
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp
cd "$build_dir"
# Left out: Engine.TwoSyncTowersOfHalfTheBatchEqualOneTower, two 50-step runs of the fashion net
# (the bar of one tower against two, bitwise). Under the sanitizers it took 756 s of a 2-core
# machine (66 s without them), most of it in the Winograd transforms' inner loops; the same
# code runs here in the shorter tests of the engine, the models and the Winograd kernels, and
# the test itself runs in scripts/test.sh.
ctest --output-on-failure -j "$(nproc)" --timeout 1800 \
  -E '^Engine\.TwoSyncTowersOfHalfTheBatchEqualOneTower$'
