#!/usr/bin/env bash
# Everything GPU in one go, for a machine with an NVIDIA GPU, logged with the GPU's name,
# driver, date and commit:
#   tests     the whole suite with TOWERS_REQUIRE_GPU=1 (a GPU test that cannot run fails),
#             in gtest shards run side by side; the summary counts passed, failed and skipped
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck on the GPU tests
#   bench     gpu_bench (all but BM_DenseGemm), then the PyTorch peer on the same GPU (eager,
#             compile, compile with CUDA graphs; FP32 and TF32), then --sync-bn on GPU towers;
#             BENCH_FILTER (a gpu_bench --benchmark_filter) and PEERS (an extended regular expression on the
#             peers' names below) narrow it, BENCH_EXTRAS=0 leaves out --sync-bn
#   profile   kernel-time profiles of a host-parameter and a mirrored step (ncu), and the dense
#             layers' GEMMs one at a time (gpu_bench's BM_DenseGemm: cublasSgemm and cuBLASLt)
#   fashion   Fashion-MNIST to 90% with the main job's recipe on one GPU tower, then the
#             PyTorch run of the same net and recipe
#   remote    bench/run-remote.sh on this machine's cores (the remote transport next to raw
#             TCP loopback, and a 2-worker training job), into OUT_DIR/remote
#   warm      (not by default) compiles the PyTorch peers' torch.compile steps once, briefly,
#             so that the bench phase finds them in PyTorch's compile cache: run it beside the
#             tests and sanitizers, which leave most of the CPU cores idle
#   bench/run-gpu.sh [BUILD_DIR] [OUT_DIR]
#   PHASES="tests sanitize bench profile fashion remote" (the default)
# PEER_S (default 10) is each PyTorch speed peer's measured time; TOWERS_BENCH_MIN_TIME (default
# 2) each gpu_bench repetition's.
# bench/gpu-lease.sh runs the phases the bars need in one command that fits a lease. By hand,
# within a lease of about 10 minutes (on an H100, 2026-11-26: the correctness phases took 200 s
# side by side and the training runs 110 s; the bench phase, cut there at 200 s, needs about
# 250 s):
#   PHASES=tests SHARDS=8 TESTS_S=200 bench/run-gpu.sh P OUT/tests &
#   PHASES=sanitize SAN_SLOTS=16 SANITIZE_S=200 bench/run-gpu.sh P OUT/san &
#   PHASES=warm bench/run-gpu.sh P OUT/warm & wait
#   TOWERS_BENCH_MIN_TIME=0.5 PEER_S=3 PHASES=bench bench/run-gpu.sh P OUT/bench
#   PHASES=fashion FASHION_S=60 bench/run-gpu.sh P OUT/fashion
# The FP32 mirrored step's cuDNN choices alone (the default ranking, --cudnn-nondeterministic,
# --cudnn-benchmark, both; their plans go to stderr), about a minute:
#   TOWERS_BENCH_MIN_TIME=0.5 P/bench/gpu_bench --benchmark_filter='BM_GpuMirroredStep/batch:128/tf32:0/cudnn:[1-4]/input:0/branches:0'
# BUILD_DIR (default build-gpu) holds towers, tests/towers_tests and bench/gpu_bench, built with
# -DCMAKE_CUDA_ARCHITECTURES matching the GPU (90 for H100/H200); where the machine lacks the
# Debian libraries, carry them in BUILD_DIR/devlibs (bench/pack-gpu.sh makes such a folder).
# The long steps have time limits (TESTS_S, SANITIZE_S, BENCH_S, FASHION_S, REMOTE_S seconds;
# each PyTorch peer and warm-up 150 s, each ncu profile 90 s), so the script ends inside a
# lease and says which step ran out.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=${2:-bench/results/$(date +%Y-%m-%d)-gpu}
phases=${PHASES:-tests sanitize bench profile fashion remote}
mkdir -p "$out"
build=$(cd "$build" && pwd)
if [ -d "$build/devlibs" ]; then export LD_LIBRARY_PATH="$build/devlibs:${LD_LIBRARY_PATH:-}"; fi
# cuBLAS, cuDNN and NCCL from the Python wheels where the toolkit's lib64 lacks them.
py_nvidia=$(python3 -c "import nvidia, os; print(nvidia.__path__[0])" 2>/dev/null || true)
if [ -n "$py_nvidia" ]; then
  for d in "$py_nvidia"/*/lib; do LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"; done
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
export TOWERS_BINARY="$build/towers" TOWERS_REQUIRE_GPU=1
# Fashion-MNIST, where Debian's dataset package is absent: carry the four .gz files of
# /usr/share/datasets/fashion-mnist to data/fashion-mnist.
# Tests that exercise the CLI's default --data path read /usr/share/datasets/fashion-mnist itself:
# link it there where the machine lets us (the GPU machines run as root).
fashion=/usr/share/datasets/fashion-mnist
if [ ! -d "$fashion" ] && [ -d data/fashion-mnist ]; then
  if mkdir -p /usr/share/datasets 2>/dev/null && ln -sfn "$PWD/data/fashion-mnist" "$fashion" 2>/dev/null &&
    [ -d "$fashion" ]; then
    echo "linked $fashion to $PWD/data/fashion-mnist"
  else
    fashion="$PWD/data/fashion-mnist"
  fi
fi
export TOWERS_FASHION_MNIST="$fashion"
summary="$out/summary.txt"
: > "$summary"
failed_phases=()  # the exit code: 1 when the suite or the sanitizers found something
note() { echo "$*" | tee -a "$summary"; }

{
  echo "date: $(date -Iseconds)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "commit: $(cat "$build/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  python3 -c "import torch; print('torch:', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" 2>/dev/null ||
    echo "torch: not installed"
  echo "fashion-mnist: $fashion"
} > "$out/machine.txt"
cat "$out/machine.txt"
"$build/towers" devices | tee "$out/devices.txt"

# Counts gtest's summary lines of one or more logs: passed, failed, skipped.
count_gtest() {
  local p f s
  p=$(grep -h '^\[  PASSED  \] [0-9]* test' "$@" | awk '{n += $4} END {print n + 0}')
  # --gtest_brief prints each failed test's line but no count of them: count the names, and
  # each shard that ended abnormally (the lines written above) as one more.
  f=$(grep -h '^\[  FAILED  \] [A-Za-z]' "$@" | sed -e 's/ (.*//' -e 's/, where .*//' |
    sort -u | wc -l)
  s=$(grep -h '^\[  SKIPPED \] [0-9]* test' "$@" | awk '{n += $4} END {print n + 0}')
  echo "passed $p, failed $f, skipped $s"
}

# 1. The whole suite, GPU tests included, in shards side by side.
if [[ " $phases " == *" tests "* ]]; then
  shards=${SHARDS:-8}
  start=$SECONDS
  pids=()
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${TESTS_S:-300}" \
      "$build/tests/towers_tests" --gtest_brief=1 > "$out/tests-shard$i.txt" 2>&1 &
    pids+=($!)
  done
  # A shard that crashes or runs out of time prints no "[  PASSED  ]" line (gtest prints it,
  # with 0 when nothing passed, whenever the shard ran to its end): report its exit code.
  for ((i = 0; i < shards; ++i)); do
    wait "${pids[$i]}"
    rc=$?
    # A shard that failed a test exits with 1 after its summary; any other non-zero exit (a
    # crash after the summary, at teardown, say) is reported too.
    if [ "$rc" -ne 0 ] && ! grep -q '^\[  PASSED  \] [0-9]* test' "$out/tests-shard$i.txt"; then
      note "tests: shard $i exited with $rc before its summary (124: out of time)"
      echo "[  FAILED  ] shard $i exited with $rc" >> "$out/tests-shard$i.txt"
    elif [ "$rc" -ne 0 ] && ! grep -q '^\[  FAILED  \] [A-Za-z]' "$out/tests-shard$i.txt"; then
      note "tests: shard $i exited with $rc after its summary, with no failed test"
      echo "[  FAILED  ] shard $i exited with $rc" >> "$out/tests-shard$i.txt"
    fi
  done
  cat "$out"/tests-shard*.txt > "$out/tests.txt" && rm -f "$out"/tests-shard*.txt
  grep -h '^\[  FAILED  \] [A-Za-z]' "$out/tests.txt" | sort -u > "$out/tests-failed.txt"
  grep -h -A1 ': Skipped$' "$out/tests.txt" | grep -v '^--' > "$out/tests-skipped.txt"
  note "tests: $(count_gtest "$out/tests.txt") ($((SECONDS - start)) s, $shards shards); of the skips, $(grep -c '^needs more GPUs:' "$out/tests-skipped.txt") need more GPUs than this machine has"
  [ -s "$out/tests-failed.txt" ] && sed 's/^/  /' "$out/tests-failed.txt" | tee -a "$summary" &&
    failed_phases+=(tests)
  [ -s "$out/tests-skipped.txt" ] && sed 's/^/  skipped: /' "$out/tests-skipped.txt" | tee -a "$summary"
fi

# 2. compute-sanitizer, the four tools side by side, on every GPU test (the end-to-end engine
# tests start the towers binary, which the tool does not follow; their kernels are the ones
# the tower tests run).
#  - racecheck checks shared-memory accesses and is by far the slowest: it runs the kernel
#    tests, which launch every kernel the towers launch at the tower's shapes, and, apart, the
#    GPU-against-CPU tower test of the three models at batch 32. Not the placement tests
#    (Cuts/PlacedGpu: the same kernels, split between devices), which took 108 s of a 200 s
#    shard under racecheck on 2026-11-26 (H100).
#  - NCCL's set-up probes its kernels with cudaFuncGetAttributes and ignores the "no kernel
#    image" errors of the architectures it was not built for (NVIDIA/nccl, enqueue.cc); memcheck
#    reports every failed API call, so the NCCL test runs under memcheck on its own, with API
#    error reports off and memory checking on.
if [[ " $phases " == *" sanitize "* ]]; then
  gpu_filter=${SANITIZE_FILTER:-'*Gpu*:*GPU*:NcclReducer.*:-*EngineGpu*'}
  runs=(
    "memcheck|memcheck|*Gpu*:*GPU*:-*EngineGpu*:NcclReducer.*|"
    "memcheck-nccl|memcheck|NcclReducer.*|--report-api-errors no"
    "racecheck|racecheck|*Gpu*:-*EngineGpu*:*TowerGpu*:Cuts/PlacedGpu.*|${SAN_RACECHECK_FLAGS:-}"
    "racecheck-towers|racecheck|Models/TowerGpu.MatchesTheCpuTower/*|${SAN_RACECHECK_FLAGS:-}"
    "synccheck|synccheck|$gpu_filter|"
    "initcheck|initcheck|$gpu_filter|"
  )
  # SANITIZE_ONLY="initcheck racecheck-towers" runs those of the runs above alone.
  # SAN_RACECHECK_FLAGS adds flags to the racecheck runs, e.g. a kernel-name filter that keeps
  # racecheck to towers' own kernels where the library kernels (cuDNN, cuBLAS: shared memory in
  # every tile) make it too slow to finish; read the machine's `compute-sanitizer --help` for
  # the option's spelling first, and say so with the results (none by default).
  if [ -n "${SANITIZE_ONLY:-}" ]; then
    kept=()
    for r in "${runs[@]}"; do [[ " $SANITIZE_ONLY " == *" ${r%%|*} "* ]] && kept+=("$r"); done
    runs=("${kept[@]}")
  fi
  # The runs' tests as jobs of a few tests each, one compute-sanitizer process a job, SAN_SLOTS
  # (default 4) at once from one queue, the costliest first (bench/sanitize.py): the tool's
  # per-process cost is mostly on the host, and the machine has the cores. The logs keep every
  # test's line and time (no --gtest_brief); a test counts as checked only once its job's tool
  # has printed its error summary, and sanitizer-unfinished.txt names the others
  # (SANITIZE_ONLY_TESTS=that file checks just those, in a later command).
  only=()
  [ -n "${SANITIZE_ONLY_TESTS:-}" ] && only=(--only "$SANITIZE_ONLY_TESTS")
  python3 bench/sanitize.py --tests "$build/tests/towers_tests" --out "$out" \
    --seconds "${SANITIZE_S:-300}" --slots "${SAN_SLOTS:-4}" --costs bench/sanitize-costs.txt \
    "${only[@]}" "${runs[@]}" | tee -a "$summary"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    note "sanitizers: exit $rc (an error, a failed or unfinished test, or a job that ended abnormally)"
    failed_phases+=(sanitize)
  fi
fi

# The PyTorch speed peers: name, then torch_cifar10.py's flags. The tutorial net at batch 128
# (the issue's bar) and 512: eager; eager with the whole step in one CUDA graph
# (torch.cuda.graph, PyTorch's own answer to launch overhead); torch.compile; torch.compile
# with CUDA graphs (reduce-overhead); FP32 and TF32. Then the nets of the fast CIFAR-10 recipe at
# batch 512, next to BM_GpuModelStep and BM_GpuMirroredModelStep.
peers=(
  "eager_fp32|--precision fp32"
  "eager_tf32|--precision tf32"
  "graph_fp32|--precision fp32 --cuda-graph"
  "graph_tf32|--precision tf32 --cuda-graph"
  "compile_fp32|--precision fp32 --compile"
  "compile_graphs_fp32|--precision fp32 --compile --compile-mode reduce-overhead"
  "compile_graphs_tf32|--precision tf32 --compile --compile-mode reduce-overhead"
  "eager_fp32_b512|--precision fp32 --batch 512"
  "graph_fp32_b512|--precision fp32 --batch 512 --cuda-graph"
  "compile_graphs_fp32_b512|--precision fp32 --batch 512 --compile --compile-mode reduce-overhead"
)
for net in airbench resnet-small-cifar; do
  peers+=("${net}_eager_tf32|--model models/$net.json --batch 512 --precision tf32"
          "${net}_compile_tf32|--model models/$net.json --batch 512 --precision tf32 --compile")
done
has_torch_gpu() { python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; }

# 0. The compile cache, filled beside the tests (no timing is taken from it).
if [[ " $phases " == *" warm "* ]] && has_torch_gpu; then
  start=$SECONDS
  for p in "${peers[@]}"; do
    [[ "${p#*|}" == *--compile* ]] || continue
    [[ "${p%%|*}" =~ ${PEERS:-.} ]] || continue
    # shellcheck disable=SC2086
    timeout 150 python3 bench/peers/torch_cifar10.py --device cuda --seconds 0.2 --warmup 3 ${p#*|} \
      > "$out/warm_${p%%|*}.txt" 2>&1
    note "warm ${p%%|*}: exit $?"
  done
  note "warm: $((SECONDS - start)) s"
fi

# 3. Speed: towers, then the PyTorch peer on the same GPU, then --sync-bn on GPU towers.
if [[ " $phases " == *" bench "* ]]; then
  timeout "${BENCH_S:-400}" "$build/bench/gpu_bench" --benchmark_filter="${BENCH_FILTER:--BM_DenseGemm}" \
    --benchmark_out="$out/gpu_bench.json" --benchmark_out_format=json > "$out/gpu_bench.txt" 2>&1
  note "gpu_bench exit $?"
  grep -E '_median|BM_(Param|Grad)' "$out/gpu_bench.txt" | sed 's/^/  /' | tee -a "$summary"
  if has_torch_gpu; then
    for p in "${peers[@]}"; do
      name=${p%%|*}
      [[ "$name" =~ ${PEERS:-.} ]] || continue
      # shellcheck disable=SC2086
      timeout 150 python3 bench/peers/torch_cifar10.py --device cuda --seconds "${PEER_S:-10}" ${p#*|} \
        > "$out/pytorch_$name.jsonl" 2> "$out/pytorch_$name.err"
      note "pytorch $name: $(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(round(r['images_per_sec']), 'images/s')" "$out/pytorch_$name.jsonl" 2>/dev/null || echo failed)"
    done
  fi
  # --sync-bn on GPU towers: airbench, 2 mirrored towers of 256 sharing the GPU, with each
  # tower's own statistics (CUDA graphs) and with the global batch's (eager steps, five host
  # exchanges per BatchNorm layer and step).
  for bn in own sync; do
    [ "${BENCH_EXTRAS:-1}" = 0 ] && break
    m="$out/sync_bn_gpu_$bn.jsonl"
    rm -f "$m"
    extra=()
    [ "$bn" = sync ] && extra=(--sync-bn)
    timeout 120 "$build/towers" train --device cuda --gpus 1 --params mirrored --model models/airbench.json \
      --dataset synthetic --synthetic-size 8192 --towers 2 --batch 256 --steps 40 \
      --optimizer momentum --nesterov --lr 0.01 "${extra[@]}" --eval-every 0 --quiet --metrics "$m" \
      > "$out/sync_bn_gpu_$bn.txt" 2>&1
    note "airbench 2 GPU towers x 256, BatchNorm statistics $bn: $(grep '"summary"' "$m" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(round(r['train_images_per_sec']), 'images/s')" 2>/dev/null || echo failed)"
  done
fi

# 3b. Kernel times of plain-launch steps (ncu serializes kernels; copies and the host apply are
# not in it: gpu_bench's step minus its compute-only figure is their share).
if [[ " $phases " == *" profile "* ]]; then
  if command -v ncu >/dev/null; then
    for params in host mirrored; do
      suffix=$([ "$params" = host ] && echo "" || echo "_$params")
      timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        "$build/towers" train --device cuda --params "$params" --model cifar10 --dataset synthetic \
        --batch 128 --steps 4 --no-cuda-graphs --quiet --eval-every 0 \
        > "$out/ncu_step$suffix.csv" 2> "$out/ncu_step$suffix.err"
      note "ncu $params exit $?"
    done
    # resnet-small (BatchNorm, residual blocks: the time-to-91% net), mirrored parameters.
    timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      "$build/towers" train --device cuda --params mirrored --model resnet-small \
      --dataset synthetic --batch 128 --steps 4 --no-cuda-graphs --quiet --eval-every 0 \
      > "$out/ncu_step_resnet_small.csv" 2> "$out/ncu_step_resnet_small.err"
    note "ncu resnet-small exit $?"
    python3 - "$out/ncu_step_resnet_small.csv" <<'PY' | tee -a "$summary"
import csv, re, sys
from collections import defaultdict
try:
    rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
            if r["Metric Name"] == "gpu__time_duration.sum"]
except (OSError, KeyError) as e:
    print(f"  resnet-small kernels: no ncu rows ({e})")
    sys.exit(0)
# 4 steps and the final evaluation: each kernel family's time over the run, per step.
fam = defaultdict(lambda: [0.0, 0])
for r in rows:
    full = r["Kernel Name"].replace("void ", "")
    m = re.search(r"for_each_index_kernel<\w+, (.+)>\(", full)  # the functor's name
    n = re.sub(r".*::", "", m.group(1).split("<")[0]) if m else full.split("(")[0]
    for key in ("cudnn", "cutlass", "gemm", "xmma", "fft", "winograd"):
        if not m and key in n.lower():
            n = key
            break
    fam[n][0] += float(r["Metric Value"].replace(",", "")) / 1000.0 / 4
    fam[n][1] += 1
total = sum(v[0] for v in fam.values())
print(f"  resnet-small kernels per step (4 steps + evaluation, / 4): {total:.0f} us")
for n, (t, c) in sorted(fam.items(), key=lambda kv: -kv[1][0])[:14]:
    print(f"    {n[:60]:60} {t:8.1f} us  {c} launches")
PY
  else
    note "profile: no ncu on this machine"
  fi
  # The dense layers' GEMMs alone: the tower's cublasSgemm call and cuBLASLt's candidates.
  timeout "${GEMM_S:-40}" "$build/bench/gpu_bench" --benchmark_filter='BM_DenseGemm' \
    --benchmark_out="$out/dense_gemm.json" --benchmark_out_format=json > "$out/dense_gemm.txt" 2>&1
  note "dense GEMMs exit $?"
  python3 - "$out/dense_gemm.json" <<'PY' | tee -a "$summary"
import json, sys
try:
    benchmarks = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError, KeyError) as e:
    print(f"  dense GEMMs: no complete JSON ({e}); dense_gemm.txt has the rows that finished")
    sys.exit(0)
rows = {}
for b in benchmarks:
    if b.get("error_occurred"):
        continue
    product, algo = (int(p.split(":")[1]) for p in b["name"].split("/")[1:3])
    us = b["real_time"] * {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
    rows.setdefault(product, []).append((us, algo, b.get("label", "")))
for product in sorted(rows):
    r = rows[product]
    sgemm = [t for t, a, _ in r if a == -1]
    best = min(r)
    print(f"  dense GEMM {product} ({best[2].split(',')[0]}): cublasSgemm "
          f"{sgemm[0] if sgemm else float('nan'):.1f} us, best {best[0]:.1f} us ({best[2]})")
PY
fi

# 4. Fashion-MNIST to 90% on one GPU tower, the main job's recipe, then PyTorch's run.
if [[ " $phases " == *" fashion "* ]]; then
  m="$out/fashion_towers.jsonl"
  rm -f "$m"
  timeout "${FASHION_S:-200}" "$build/towers" train --device cuda \
    --model fashion --dataset fashion-mnist --data "$fashion" --epochs 5 --batch 128 \
    --optimizer momentum --lr 0.01 --lr-schedule cosine --eval-every 1 --quiet --metrics "$m" \
    > "$out/fashion_towers.txt" 2>&1
  note "towers fashion: $(grep '"summary"' "$m" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('test accuracy', r['test_accuracy'], 'wall', round(r['wall_seconds'],1), 's,', round(r['train_images_per_sec']), 'images/s')" 2>/dev/null || echo failed)"
  timeout "${FASHION_S:-200}" python3 bench/peers/torch_fashion.py --data "$fashion" \
    --device cuda --precision fp32 > "$out/fashion_pytorch.jsonl" 2> "$out/fashion_pytorch.err"
  note "pytorch fashion: $(tail -1 "$out/fashion_pytorch.jsonl" 2>/dev/null || echo failed)"
  # Time to 91%: the tutorial net tops out near 90-91% on Fashion-MNIST, so the README's
  # resnet-small recipe (Nesterov, cosine with warm-up, label smoothing, flips), evaluated every
  # half epoch and stopped at the first evaluation at or above 91%: towers with mirrored
  # parameters and the input made on the GPU, then PyTorch with the same net and recipe and the
  # dataset on the GPU. Both count their evaluations in the wall time, and both run FP32 (towers'
  # default; PyTorch's own default would let cuDNN's convolutions take TF32).
  m="$out/t91_towers.jsonl"
  rm -f "$m"
  timeout "${FASHION_S:-200}" "$build/towers" train --device cuda --params mirrored --input device \
    --model resnet-small --dataset fashion-mnist --data "$fashion" --epochs 8 --batch 128 \
    --optimizer momentum --nesterov --lr 0.1 --lr-schedule cosine --warmup-epochs 0.5 \
    --label-smoothing 0.1 --eval-every 0.5 --target-accuracy 0.91 --seed 1 --quiet --metrics "$m" \
    > "$out/t91_towers.txt" 2>&1
  note "towers resnet-small to 91%: $(grep '"summary"' "$m" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('test accuracy', r['test_accuracy'], 'wall', round(r['wall_seconds'],2), 's,', round(r['train_images_per_sec']), 'images/s')" 2>/dev/null || echo failed)"
  timeout "${FASHION_S:-200}" python3 bench/peers/torch_model_file.py --model models/resnet-small.json \
    --precision fp32 --data "$fashion" --device cuda --epochs 8 --batch 128 --lr 0.1 --warmup-epochs 0.5 \
    --label-smoothing 0.1 --eval-every 0.5 --target-accuracy 0.91 --seed 1 \
    > "$out/t91_pytorch.jsonl" 2> "$out/t91_pytorch.err"
  note "pytorch resnet-small to 91%: $(grep '"summary"' "$out/t91_pytorch.jsonl" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('test accuracy', r['test_accuracy'], 'to target', r['target_reached_wall_seconds'], 's, wall', round(r['wall_seconds'],2), 's,', round(r['train_images_per_sec']), 'images/s')" 2>/dev/null || echo failed)"
  # The same recipe with the parameters and optimizer on the GPU (--params mirrored), then
  # with the batches made on the GPU as well (--input device), then two async towers sharing
  # the GPU, each folding its steps into the host copy every 8 (local SGD).
  for variant in mirrored mirrored_device_input mirrored_async2; do
    m="$out/fashion_towers_$variant.jsonl"
    rm -f "$m"
    extra=(--params mirrored)
    [ "$variant" = mirrored_device_input ] && extra+=(--input device)
    [ "$variant" = mirrored_async2 ] && extra+=(--input device --mode async --towers 2 --sync-every 8)
    timeout "${FASHION_S:-200}" "$build/towers" train --device cuda "${extra[@]}" \
      --model fashion --dataset fashion-mnist --data "$fashion" --epochs 5 --batch 128 \
      --optimizer momentum --lr 0.01 --lr-schedule cosine --eval-every 1 --quiet --metrics "$m" \
      > "$out/fashion_towers_$variant.txt" 2>&1
    note "towers fashion $variant: $(grep '"summary"' "$m" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('test accuracy', r['test_accuracy'], 'wall', round(r['wall_seconds'],1), 's,', round(r['train_images_per_sec']), 'images/s')" 2>/dev/null || echo failed)"
  done
  # Model parallelism with a GPU part: the convolutions on the GPU, the dense layers on the
  # CPU, one micro-batch and four (images/s and each part's busy time per step).
  for mb in 1 4; do
    m="$out/placed_gpu_m$mb.jsonl"
    rm -f "$m"
    timeout 120 "$build/towers" train --model cifar10 --dataset synthetic --batch 512 --steps 30 \
      --placement 'conv1..pool2@cuda:0;local3..softmax_linear@cpu:0' --micro-batches "$mb" \
      --eval-every 0 --quiet --metrics "$m" > "$out/placed_gpu_m$mb.txt" 2>&1
    note "placed cifar10 conv@cuda:0|dense@cpu M=$mb: $(grep '"summary"' "$m" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(round(r['train_images_per_sec']), 'images/s', [(p['device'], round(p['busy_seconds'],2), round(p['idle_fraction'],2)) for p in r['pipeline']['towers'][0]['parts']])" 2>/dev/null || echo failed)"
  done
fi

# 5. The remote transport on this machine's cores (the 2-core build machines share two cores
# between client, gRPC's threads and the shard).
if [[ " $phases " == *" remote "* ]]; then
  if [ -x "$build/bench/remote_bench" ]; then
    STEPS=${STEPS:-30} ROUNDS=${ROUNDS:-2} REPS=${REPS:-7} timeout "${REMOTE_S:-240}" \
      bench/run-remote.sh "$build" "$out/remote" > "$out/remote.txt" 2>&1
    note "remote exit $?"
    sed 's/^/  /' "$out/remote/summary.txt" 2>/dev/null | tee -a "$summary"
  else
    note "remote: no remote_bench in $build"
  fi
fi
if [ "${#failed_phases[@]}" -gt 0 ]; then
  note "failed: ${failed_phases[*]}"
  exit 1
fi
