#!/usr/bin/env bash
# The tower-scaling experiments behind the README's plots, on this machine's CPU cores:
#   1. time to 90% Fashion-MNIST test accuracy with 2 towers in sync, async and ssp modes
#   2. throughput at 1, 2 and 4 towers (one thread each) in every mode, fixed steps
#   bench/run-scale.sh [BUILD_DIR]     -> bench/results/<date>-scale/{accuracy,throughput}/
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=bench/results/$(date +%Y-%m-%d)-scale
mkdir -p "$out"
"$build/towers" scale --model fashion --dataset fashion-mnist --batch 128 --threads-per-tower 1 \
  --optimizer momentum --lr 0.01 --lr-schedule cosine --lr-scaling linear --epochs 6 \
  --eval-every 0.5 --target-accuracy 0.90 --towers 2 --modes sync,async,ssp --ssp-staleness 2 \
  --out "$out/accuracy" --log-every 200
"$build/towers" scale --model fashion --dataset fashion-mnist --batch 128 --threads-per-tower 1 \
  --optimizer momentum --lr 0.01 --steps 96 --eval-every 0 --towers 1,2,4 \
  --modes sync,async,ssp --ssp-staleness 2 --out "$out/throughput" --quiet
# 3. async and ssp again with less explicit momentum (stale gradients add implicit momentum) and
#    a longer cosine. Recorded: async ended at 89.57%, short of 90% (the ssp run was not made).
"$build/towers" scale --model fashion --dataset fashion-mnist --batch 128 --threads-per-tower 1 \
  --optimizer momentum --momentum 0.8 --lr 0.01 --lr-schedule cosine --epochs 8 \
  --eval-every 0.5 --target-accuracy 0.90 --towers 2 --modes async,ssp --ssp-staleness 2 \
  --out "$out/accuracy-async-recipe" --log-every 400
# 4. Time to 90% side by side, one recipe for all three modes: momentum 0.9, cosine over 8
#    epochs (sync with the linear lr rule for its 256-example updates); each run stops at 90%.
#    Recorded: sync 410 s, async 464 s, ssp 435 s of training to 90%.
"$build/towers" scale --model fashion --dataset fashion-mnist --batch 128 --threads-per-tower 1 \
  --optimizer momentum --lr 0.01 --lr-schedule cosine --lr-scaling linear --epochs 8 \
  --eval-every 0.5 --target-accuracy 0.90 --towers 2 --modes sync,async,ssp --ssp-staleness 2 \
  --out "$out/time-to-90" --log-every 400
