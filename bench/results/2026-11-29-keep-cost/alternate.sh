#!/bin/bash
# Alternates shard binaries under the 2-worker sync rounds of remote_bench, REPS times:
# for each name in VARIANTS, build/towers is replaced by $BINS/towers-NAME (remote_bench starts
# the towers binary beside its bench/ folder as the shard processes), and the 4 cases run
# once, into OUT/NAME-REP.json. The kept binary ($BINS/towers-keep) is put back at the end.
#   BINS=/tmp VARIANTS="keep nokeep" REPS=6 alternate.sh OUT
set -e
out=$1
for r in $(seq "$REPS"); do
  for v in $VARIANTS; do
    cp "$BINS/towers-$v" build/towers
    OPENBLAS_NUM_THREADS=1 build/bench/remote_bench \
      --benchmark_filter='BM_SyncRoundsToProcesses/4194304/[12]/2/' \
      --benchmark_out="$out/$v-$r.json" --benchmark_out_format=json > /dev/null 2>&1
  done
done
cp "$BINS/towers-keep" build/towers
