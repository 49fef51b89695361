#!/usr/bin/env bash
# One-tower CPU throughput of the cifar10 net (batch 128): towers (and towers with --conv im2col,
# without Winograd) and its peers in the same run
# on the same machine, alternating, ROUNDS rounds (default 3), then the medians next to the
# sgemm-rate bound (OpenBLAS's sgemm rate over the net's FLOPs per image), plus 2 sync towers
# of one thread each (a `towers train` on synthetic data) against MirroredStrategy. Writes
# bench/results/<date>-cpu/.
#   [OUT_DIR=bench/results/NAME] bench/run-cpu.sh [BUILD_DIR]
# Peers, each where installed:
#   TensorFlow (`pip install tensorflow-cpu`): bench/peers/tf_cifar10.py, one tf.function step,
#     and the same under MirroredStrategy over 2 logical CPU devices of one thread each;
#   PyTorch (`pip install torch`): bench/peers/torch_cifar10.py, eager.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${ROUNDS:-3}
seconds=${SECONDS_PER_PEER:-20}
out=${OUT_DIR:-bench/results/$(date +%Y-%m-%d)-cpu}
mkdir -p "$out"
have() { python3 -c "import $1" 2>/dev/null; }
{
  echo "date: $(date -Iseconds)"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "flags: $(grep -o -w 'avx512f\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "openblas: $(dpkg-query -W -f='${Version}' libopenblas0-pthread 2>/dev/null || echo ?)"
  python3 -c "import tensorflow as t; print('tensorflow:', t.__version__)" 2>/dev/null || echo "tensorflow: not installed"
  python3 -c "import torch; print('torch:', torch.__version__)" 2>/dev/null || echo "torch: not installed"
} > "$out/machine.txt"
cat "$out/machine.txt"

"$build/bench/towers_bench" --benchmark_filter='Sgemm' --benchmark_format=json \
  > "$out/sgemm.json"
for r in $(seq 1 "$rounds"); do
  echo "round $r of $rounds"
  "$build/bench/towers_bench" --benchmark_filter='TowerStep/cifar10/batch:128/threads:2' \
    --benchmark_min_time=$((seconds / 2)) --benchmark_format=json > "$out/round$r-towers.json"
  # The same step with every convolution as im2col + GEMM (no Winograd): what Winograd gains.
  "$build/bench/towers_bench" --benchmark_filter='TowerStep/cifar10_im2col/batch:128/threads:2' \
    --benchmark_min_time=$((seconds / 2)) --benchmark_format=json > "$out/round$r-towers-im2col.json"
  # 2 sync towers of one thread each, batch 128 per tower (global 256), as MirroredStrategy
  # below: a whole `towers train` on synthetic data (its input pipeline included).
  "$build/towers" train --model cifar10 --dataset synthetic --synthetic-size 5120 --augment none \
    --towers 2 --mode sync --threads-per-tower 1 --batch 128 --steps $((seconds * 3)) \
    --eval-every 0 --quiet --metrics "$out/round$r-towers-sync2.jsonl" > /dev/null
  if have tensorflow; then
    python3 bench/peers/tf_cifar10.py --seconds "$seconds" > "$out/round$r-tensorflow.jsonl"
    python3 bench/peers/tf_cifar10.py --seconds "$seconds" --towers 2 --threads 1 \
      > "$out/round$r-tensorflow-mirrored.jsonl"
  fi
  if have torch; then
    python3 bench/peers/torch_cifar10.py --seconds "$seconds" > "$out/round$r-pytorch.jsonl"
  fi
done

python3 - "$out" "$rounds" <<'EOF' | tee "$out/summary.md"
import glob, json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def towers(r):
    b = json.load(open(f"{out}/round{r}-towers.json"))["benchmarks"][0]
    return b["images_per_sec"], b["GFLOP_per_sec"] * 1e9 / b["images_per_sec"]
rates = {"towers (1 tower, 2 threads)": [towers(r)[0] for r in range(1, rounds + 1)]}
rates["towers --conv im2col (no Winograd)"] = [
    json.load(open(f"{out}/round{r}-towers-im2col.json"))["benchmarks"][0]["images_per_sec"]
    for r in range(1, rounds + 1)]
sync2 = "towers, 2 sync towers x 1 thread (towers train, synthetic data)"
rates[sync2] = [json.loads(open(f"{out}/round{r}-towers-sync2.jsonl").read().strip().splitlines()[-1])
                ["train_images_per_sec"] for r in range(1, rounds + 1)]
flop_per_image = towers(1)[1]
for name, pat in (("TensorFlow tf.function (2 threads)", "tensorflow"),
                  ("TensorFlow MirroredStrategy, 2 logical CPUs x 1 thread", "tensorflow-mirrored"),
                  ("PyTorch eager", "pytorch")):
    files = sorted(glob.glob(f"{out}/round*-{pat}.jsonl"))
    if files:
        rates[name] = [json.loads(open(f).read().strip().splitlines()[-1])["images_per_sec"] for f in files]
sgemm = max(b["GFLOP_per_sec"] for b in json.load(open(f"{out}/sgemm.json"))["benchmarks"]
            if "threads:2" in b["name"]) * 1e9
bound = sgemm / flop_per_image
# The FLOP-rate bound: the cores' peak, assuming 2 FMA units per core (Zen, Skylake and later),
# each 8 floats wide with AVX2 or 16 with AVX-512, at the clock /proc/cpuinfo reports now.
cpuinfo = open("/proc/cpuinfo").read()
mhz = statistics.mean(float(l.split(":")[1]) for l in cpuinfo.splitlines() if l.startswith("cpu MHz"))
lanes = 16 if " avx512f" in cpuinfo else 8 if " avx2" in cpuinfo else 4
cores = len(os.sched_getaffinity(0))
peak = cores * mhz * 1e6 * lanes * 2 * 2
base = statistics.median(rates["towers (1 tower, 2 threads)"])
print(f"cifar10, batch 128, {rounds} alternating rounds; {flop_per_image / 1e6:.0f} MFLOP per image (forward + backward)\n")
print("| run | images/s, median | rounds | towers / it |")
print("| --- | --- | --- | --- |")
for name, xs in rates.items():
    m = statistics.median(xs)
    print(f"| {name} | {m:,.0f} | {', '.join(f'{x:,.0f}' for x in xs)} | {base / m:.2f} |")
print(f"| sgemm-rate bound of the direct FLOPs (OpenBLAS sgemm {sgemm / 1e9:.1f} GFLOP/s, 2 threads; Winograd does fewer) | {bound:,.0f} | | {base / bound:.2f} |")
print(f"| FLOP-rate bound of the direct FLOPs ({cores} cores x {mhz / 1e3:.2f} GHz x {lanes} lanes x 2 FMA units x 2 = {peak / 1e9:.0f} GFLOP/s) | {peak / flop_per_image:,.0f} | | {base * flop_per_image / peak:.2f} |")
mirrored = "TensorFlow MirroredStrategy, 2 logical CPUs x 1 thread"
if mirrored in rates:
    r = statistics.median(rates[sync2]) / statistics.median(rates[mirrored])
    print(f"\n2 sync towers / MirroredStrategy: {r:.2f}")
EOF
