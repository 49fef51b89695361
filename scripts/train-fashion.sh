#!/usr/bin/env bash
# The main job: install, build, then train the `fashion` net (the TF CIFAR-10 tutorial net on
# 28x28x1) on Fashion-MNIST from Debian's dataset-fashion-mnist package, printing progress and
# the final test accuracy. The run's record goes to runs/fashion/ (metrics.jsonl, checkpoints);
# run it again to train from scratch, or add --resume to continue an interrupted run.
#   scripts/train-fashion.sh [extra `towers train` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh build >/dev/null
out=runs/fashion
mkdir -p "$out"
resume=false
for a in "$@"; do [ "$a" = "--resume" ] && resume=true; done
if ! $resume; then rm -f "$out"/ckpt-*.safetensors "$out"/metrics.jsonl; fi
exec build/towers train --model fashion --dataset fashion-mnist \
  --epochs 5 --batch 128 --optimizer momentum --lr 0.01 --lr-schedule cosine \
  --metrics "$out/metrics.jsonl" --checkpoint-dir "$out" "$@"
