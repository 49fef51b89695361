#!/usr/bin/env bash
# One-tower CPU throughput of the cifar10 net (batch 128), towers and the PyTorch peer in the
# same run on the same machine, plus the sgemm limit. Writes bench/results/<date>-cpu/.
#   bench/run-cpu.sh [BUILD_DIR]
# The PyTorch peer needs `pip install torch` (the PyPI wheel; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=bench/results/$(date +%Y-%m-%d)-cpu
mkdir -p "$out"
{
  echo "date: $(date -Iseconds)"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "openblas: $(dpkg-query -W -f='${Version}' libopenblas0-pthread 2>/dev/null || echo ?)"
  python3 -c "import torch; print('torch:', torch.__version__)" 2>/dev/null || echo "torch: not installed"
} > "$out/machine.txt"
cat "$out/machine.txt"
"$build/bench/towers_bench" --benchmark_filter='TowerStep|Sgemm' --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_out="$out/towers_bench.json" \
  --benchmark_out_format=json | tee "$out/towers_bench.txt"
if python3 -c "import torch" 2>/dev/null; then
  python3 bench/peers/torch_cifar10.py --seconds 20 | tee "$out/pytorch_eager.jsonl"
  python3 bench/peers/torch_cifar10.py --seconds 20 --compile | tee "$out/pytorch_compile.jsonl" ||
    echo "torch.compile failed on this machine" | tee "$out/pytorch_compile.jsonl"
fi
