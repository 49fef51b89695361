#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ (clang, AddressSanitizer and UndefinedBehaviorSanitizer)
# into build-fuzz/ and runs each, one after another, on its seed corpus tests/fuzz/corpus/<reader>/:
#   scripts/fuzz.sh ci               20000 executions per target; exits non-zero on any crash,
#                                    sanitizer report, leak, timeout or allocation over the bound
#   scripts/fuzz.sh campaign [RUNS]  RUNS executions per target (default 1000000); inputs that
#                                    reach new code go to $FUZZ_SCRATCH/<reader>/ (default
#                                    build-fuzz/campaign), never to tests/fuzz/corpus/; prints a table
#   scripts/fuzz.sh seeds            rewrites tests/fuzz/corpus/ with fuzz_make_seeds
# The memory bound, whatever sizes an input claims: no single allocation over 64 MiB
# (-malloc_limit_mb) and at most 256 MiB resident (-rss_limit_mb), sanitizer memory included;
# ASan's quarantine of freed memory is 16 MiB so that it does not crowd the readers out.
# A failing input is kept as build-fuzz/artifacts/<reader>-crash-<sha1> (or -oom-, -leak-,
# -timeout-); `build-fuzz/tests/fuzz/fuzz_<reader> <that file>` replays it.
# JOBS (default: all cores) sets the parallelism of the build.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-ci}
case "$mode" in
  ci) runs=20000 ;;
  campaign) runs=${2:-1000000} ;;
  seeds) runs=0 ;;
  *)
    echo "usage: scripts/fuzz.sh ci | campaign [RUNS] | seeds" >&2
    exit 2
    ;;
esac

readers=(idx cifar10 safetensors checkpoint json_source)
declare -A max_len=([idx]=4096 [cifar10]=9220 [safetensors]=4096 [checkpoint]=4096 [json_source]=4096)
declare -A dict=([safetensors]=tests/fuzz/safetensors.dict [checkpoint]=tests/fuzz/safetensors.dict)
malloc_limit_mb=64
rss_limit_mb=256

scripts/install-deps.sh
build=build-fuzz
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DTOWERS_BUILD_FUZZ=ON -DTOWERS_BUILD_TESTS=OFF \
  -DTOWERS_BUILD_BENCH=OFF -DTOWERS_CUDA=OFF -DTOWERS_NATIVE=OFF >/dev/null
if [ "$mode" = seeds ]; then
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target fuzz_make_seeds
  "$build/tests/fuzz/fuzz_make_seeds" tests/fuzz/corpus
  echo "fuzz.sh: wrote tests/fuzz/corpus/"
  exit 0
fi
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${readers[@]/#/fuzz_}"

export ASAN_OPTIONS=quarantine_size_mb=16:detect_leaks=1:${ASAN_OPTIONS:-}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}
artifacts=$build/artifacts
scratch=${FUZZ_SCRATCH:-$build/campaign}
if [ "$mode" = ci ]; then
  scratch=$build/ci-corpus
  rm -rf "$scratch"
fi
mkdir -p "$artifacts" "$build/logs"

stat_of() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

failed=0
rows=()
for r in "${readers[@]}"; do
  mkdir -p "$scratch/$r"
  log=$build/logs/$mode-$r.log
  args=(-runs="$runs" -max_len="${max_len[$r]}" -malloc_limit_mb=$malloc_limit_mb
        -rss_limit_mb=$rss_limit_mb -timeout=10 -print_final_stats=1
        -artifact_prefix="$artifacts/$r-")
  if [ -n "${dict[$r]:-}" ]; then args+=(-dict="${dict[$r]}"); fi
  echo "fuzz.sh: $build/tests/fuzz/fuzz_$r ${args[*]} $scratch/$r tests/fuzz/corpus/$r"
  start=$(date +%s.%N)
  # New inputs go to the first corpus directory only: the scratch one.
  "$build/tests/fuzz/fuzz_$r" "${args[@]}" "$scratch/$r" "tests/fuzz/corpus/$r" >"$log" 2>&1 &
  pid=$!
  rc=0
  wait $pid || rc=$?
  end=$(date +%s.%N)
  rm -f /dev/shm/towers-fuzz-$pid-* /tmp/towers-fuzz-$pid-*  # left behind by a crash
  crashes=$(grep -c -E "Test unit written to .*-(crash|oom|leak|timeout)-" "$log" || true)
  if [ $rc -ne 0 ] || [ "$crashes" -ne 0 ]; then
    failed=1
    if [ "$crashes" -eq 0 ]; then crashes=1; fi
    echo "fuzz.sh: fuzz_$r FAILED (exit $rc); the report ends $log:" >&2
    grep -E "ERROR|SUMMARY|runtime error|Test unit written" "$log" | head -20 >&2 || tail -20 "$log" >&2
  fi
  execs=$(stat_of number_of_executed_units "$log")
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  rate=$(awk -v n="${execs:-0}" -v s="$seconds" 'BEGIN { printf "%.0f", (s > 0) ? n / s : 0 }')
  # The last status line: "#N DONE cov: C ft: F corp: inputs/bytes ...".
  corpus=$(grep -o "corp: [0-9]*/[0-9]*[a-zA-Z]*" "$log" | tail -1 | cut -d' ' -f2)
  cov=$(grep -o "cov: [0-9]*" "$log" | tail -1 | cut -d' ' -f2)
  rows+=("$(printf '%-12s %12s %9s %8s %8s %8s %6s %12s' "$r" "${execs:-?}" "$seconds" "$rate" \
    "$crashes" "$(stat_of peak_rss_mb "$log")" "${cov:-?}" "${corpus:-?}")")
done

echo
echo "fuzz.sh $mode: $runs executions per target; bound: malloc ${malloc_limit_mb} MiB," \
  "RSS ${rss_limit_mb} MiB; logs in $build/logs/"
printf '%-12s %12s %9s %8s %8s %8s %6s %12s\n' target executions seconds exec/s crashes \
  "rss MB" cov corpus
printf '%s\n' "${rows[@]}"
exit $failed
