#!/usr/bin/env bash
# Everything GPU in one go, for a machine with an NVIDIA GPU: the GPU test suite,
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on the kernel and tower tests, the GPU benchmarks
# and the PyTorch peer on the same GPU, all logged with the GPU's name, driver and date.
#   bench/run-gpu.sh [BUILD_DIR] [OUT_DIR]
# BUILD_DIR (default build-gpu) holds towers, towers_tests and bench/gpu_bench, built with
# -DCMAKE_CUDA_ARCHITECTURES matching the GPU (90 for H100/H200); where the machine lacks the
# Debian libraries, carry them in BUILD_DIR/devlibs (see bench/pack-gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=${2:-bench/results/$(date +%Y-%m-%d)-gpu}
mkdir -p "$out"
if [ -d "$build/devlibs" ]; then export LD_LIBRARY_PATH="$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}"; fi
# cuBLAS and NCCL from the Python wheels where the toolkit's lib64 lacks them.
py_nvidia=$(python3 -c "import nvidia, os; print(nvidia.__path__[0])" 2>/dev/null || true)
if [ -n "$py_nvidia" ]; then
  for d in "$py_nvidia"/*/lib; do LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"; done
fi
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"
{
  echo "date: $(date -Iseconds)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || cat "$build/COMMIT" 2>/dev/null || echo unknown)"
  python3 -c "import torch; print('torch:', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null ||
    echo "torch: not installed"
} > "$out/machine.txt"
cat "$out/machine.txt"
"$build/towers" devices | tee "$out/devices.txt"

# 1. The GPU suite (and the rest: it must pass on a GPU machine too). The end-to-end tests run
# the towers binary of this build tree, wherever it was carried.
export TOWERS_BINARY="$PWD/$build/towers"
# Fashion-MNIST for the 90% GPU run, where Debian's dataset package is absent: carry the four
# .gz files of /usr/share/datasets/fashion-mnist to data/fashion-mnist.
if [ ! -d /usr/share/datasets/fashion-mnist ] && [ -d data/fashion-mnist ]; then
  export TOWERS_FASHION_MNIST="$PWD/data/fashion-mnist"
fi
"$build/tests/towers_tests" --gtest_brief=1 2>&1 | tee "$out/tests.txt"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$out/tests.txt"

# 2. compute-sanitizer on the kernel and tower tests.
gpu_filter='*Gpu*:*GPU*'
for tool in memcheck racecheck synccheck initcheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 99 "$build/tests/towers_tests" \
    --gtest_filter="$gpu_filter:-*Fashion*:EngineGpu.*" 2>&1 | tail -40 | tee "$out/sanitizer-$tool.txt"
  echo "$tool exit: ${PIPESTATUS[0]}" | tee -a "$out/sanitizer-$tool.txt"
done

# 3. Benchmarks: towers, then the PyTorch peer on the same GPU.
"$build/bench/gpu_bench" --benchmark_out="$out/gpu_bench.json" --benchmark_out_format=json \
  2>&1 | tee "$out/gpu_bench.txt"
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  python3 bench/peers/torch_cifar10.py --device cuda --seconds 20 | tee "$out/pytorch_eager.jsonl"
  python3 bench/peers/torch_cifar10.py --device cuda --seconds 20 --compile |
    tee "$out/pytorch_compile.jsonl" || echo "torch.compile failed" | tee "$out/pytorch_compile.jsonl"
  # torch.compile with CUDA graphs: the peer of towers' graph replay.
  python3 bench/peers/torch_cifar10.py --device cuda --seconds 20 --compile \
    --compile-mode reduce-overhead | tee "$out/pytorch_compile_graphs.jsonl" ||
    echo "torch.compile reduce-overhead failed" | tee "$out/pytorch_compile_graphs.jsonl"
fi
