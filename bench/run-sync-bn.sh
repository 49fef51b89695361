#!/usr/bin/env bash
# The cost of --sync-bn (README, "Model files"): resnet-small (9 BatchNorm layers, so 27
# exchanges per step: two in each forward, one in each backward) on synthetic 28x28x1 data, 2
# sync towers of one thread each and 64 examples, with and without --sync-bn, in ROUNDS
# alternating rounds; next to them, 1 tower of 2 threads and 128 examples, whose statistics
# --sync-bn reproduces. Prints, and writes to
# OUT/summary.txt, each run's training images/s and the medians.
#   bench/run-sync-bn.sh [BUILD_DIR] [OUT_DIR]     STEPS=N (default 30), ROUNDS=N (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bench/results/$(date +%Y-%m-%d)-sync-bn}
steps=${STEPS:-30}
rounds=${ROUNDS:-3}
mkdir -p "$out"
common=(train --model resnet-small --dataset synthetic --synthetic-size 4096 --optimizer momentum
        --lr 0.05 --steps "$steps" --eval-every 0 --quiet --seed 1)
declare -A flags=(
  [own]='--towers 2 --batch 64 --threads-per-tower 1'
  [sync-bn]='--towers 2 --batch 64 --threads-per-tower 1 --sync-bn'
  [one-tower]='--towers 1 --batch 128 --threads-per-tower 2'
)
rate() { python3 -c 'import json,sys; print(round([json.loads(l) for l in open(sys.argv[1])][-1]["train_images_per_sec"], 1))' "$1"; }
for r in $(seq 1 "$rounds"); do
  for name in own sync-bn one-tower; do
    # shellcheck disable=SC2086
    "$build/towers" "${common[@]}" ${flags[$name]} --metrics "$out/$name-$r.jsonl"
  done
done
{
  nproc | sed 's/^/cores: /'
  grep -m1 'model name' /proc/cpuinfo
  echo "commit: $(git rev-parse --short HEAD)  date: $(date -u +%FT%TZ)"
  echo "command: ${common[*]} + each run's flags; $rounds alternating rounds"
  for name in own sync-bn one-tower; do
    vals=()
    for r in $(seq 1 "$rounds"); do vals+=("$(rate "$out/$name-$r.jsonl")"); done
    med=$(printf '%s\n' "${vals[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    echo "$name (${flags[$name]}): images/s ${vals[*]}; median $med"
  done
} | tee "$out/summary.txt"
