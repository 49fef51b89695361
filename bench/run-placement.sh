#!/usr/bin/env bash
# Model parallelism on this machine's CPU cores (README, "Model parallelism"): the cifar10 net,
# one tower placed over 2 CPU parts of 1 thread each, with M = 1, 2, 4, 8 micro-batches, next
# to data parallelism on the same cores (2 sync towers of 1 thread) and one whole tower of 2
# threads. Every run takes the same 512 examples per update (M = 8: micro-batches of 64, the
# dense layers' gradient block), synthetic data, momentum SGD. Two placements:
#   issue      conv1..pool2 | local3..softmax_linear  (the convolutional half, the dense half)
#   balanced   conv1..norm1 | conv2..softmax_linear   (the most even 2-way cut: conv2 alone is
#                                                      about 70% of a step)
# Prints, and writes to OUT/summary.txt, images/s and each part's busy and idle time per step
# (idle = the step's wall time minus the part's jobs: the pipeline bubble).
#   bench/run-placement.sh [BUILD_DIR] [OUT_DIR]      STEPS=N (default 20) updates per run
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bench/results/$(date +%Y-%m-%d)-placement}
steps=${STEPS:-20}
mkdir -p "$out"
common=(train --model cifar10 --dataset synthetic --synthetic-size 4096 --optimizer momentum
        --lr 0.01 --steps "$steps" --eval-every 0 --quiet --seed 1)
declare -A placements=(
  [issue]='conv1,pool1,norm1,conv2,norm2,pool2@cpu:0x1;local3,local4,softmax_linear@cpu:1x1'
  [balanced]='conv1..norm1@cpu:0x1;conv2..softmax_linear@cpu:1x1'
)
runs=()
for name in issue balanced; do
  for m in 1 2 4 8; do
    "$build/towers" "${common[@]}" --batch 512 --placement "${placements[$name]}" \
      --micro-batches "$m" --metrics "$out/placed-$name-m$m.jsonl"
    runs+=("placed-$name-m$m")
  done
done
"$build/towers" "${common[@]}" --towers 2 --batch 256 --mode sync --threads-per-tower 1 \
  --metrics "$out/sync-2x1.jsonl"
runs+=(sync-2x1)
"$build/towers" "${common[@]}" --towers 1 --batch 512 --threads-per-tower 2 \
  --metrics "$out/whole-1x2.jsonl"
runs+=(whole-1x2)
{
  nproc | sed 's/^/cores: /'
  grep -m1 'model name' /proc/cpuinfo || true
  python3 - "$out" "${runs[@]}" <<'EOF'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
print(f"{'run':<22}{'images/s':>10}  parts: busy / idle ms per step (idle %)")
for run in runs:
    s = [json.loads(l) for l in open(f"{out}/{run}.jsonl") if '"summary"' in l][-1]
    line = f"{run:<22}{s['train_images_per_sec']:>10.0f}"
    for t in s.get("pipeline", {}).get("towers", []):
        n = max(t["steps"], 1)
        for p in t["parts"]:
            line += (f"  [{p['device']} {p['layers']}: {1e3 * p['busy_seconds'] / n:.0f} / "
                     f"{1e3 * p['idle_seconds'] / n:.0f} ({100 * p['idle_fraction']:.0f}%)]")
    print(line)
EOF
} | tee "$out/summary.txt"
