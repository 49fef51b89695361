#!/usr/bin/env bash
# Remote tower groups on this machine (README, "Remote tower groups"):
#   1. remote_bench: push and pull to 1, 2, 4 shards over message sizes of 64 KiB .. 64 MiB,
#      next to raw TCP loopback (several write/read sizes), gRPC's floors (a unary call, a push
#      stream and a pull stream of 1 MiB pieces, none of them read or copied) and memcpy
#      measured in the same run, and push, pull and gRPC's stream floors at 4 and 64 MiB
#      against servers that are processes of their own (`towers ps`, `remote_bench
#      --ack-server`); then the 4 MiB cases again, REPS (default 5) repetitions
#      randomly interleaved, whose medians give the push and pull rates as shares of raw TCP
#      (the best of its variants);
#   2. the same training job (fashion net, Fashion-MNIST, sync, batch 128 per tower, one
#      thread per tower) as 1 process x 2 towers and as 2 worker processes x 1 tower with 1
#      shard, alternated ROUNDS times: images/s, and each worker's time per step split into
#      compute (its tower's step), push (send, and wait at the barrier for the round) and pull.
# Prints, and writes to OUT/summary.txt.
#   bench/run-remote.sh [BUILD_DIR] [OUT_DIR]     STEPS=N (default 60), ROUNDS=R (default 3)
# SWEEP=0 leaves out step 1's pass over the sizes (the 4 MiB cases, which the shares come
# from, still run). CASES (a --benchmark_filter; default every 4 MiB case) narrows the 4 MiB
# pass, and ROUNDS=0 leaves out step 2 (a short lease on a GPU machine's cores:
# bench/gpu-lease.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bench/results/$(date +%Y-%m-%d)-remote}
steps=${STEPS:-60}
rounds=${ROUNDS:-3}
reps=${REPS:-5}
mkdir -p "$out"
# towers calls OpenBLAS single-threaded; told so before it loads, OpenBLAS starts no helper
# thread that would spin on one of the cores while the first cases run (remote_bench.cpp).
export OPENBLAS_NUM_THREADS=1
if [ "${SWEEP:-1}" != 0 ]; then
  "$build/bench/remote_bench" --benchmark_out="$out/remote_bench.json" \
    --benchmark_out_format=json > "$out/remote_bench.txt" 2>&1
fi
"$build/bench/remote_bench" --benchmark_filter="${CASES:-/4194304(/|\$)}" --benchmark_repetitions="$reps" \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
  --benchmark_out="$out/remote_bench_4mib.json" --benchmark_out_format=json \
  > "$out/remote_bench_4mib.txt" 2>&1
flags=(--model fashion --dataset fashion-mnist --mode sync --batch 128 --steps "$steps"
       --threads-per-tower 1 --eval-every 0 --seed 1 --quiet)
for r in $(seq 1 "$rounds"); do
  "$build/towers" train "${flags[@]}" --towers 2 --metrics "$out/one-process-$r.jsonl"
  rm -rf "$out/launch-$r"
  "$build/towers" launch --ps 1 --workers 2 --out "$out/launch-$r" -- train "${flags[@]}" \
    > "$out/launch-$r.log" 2>&1
  rm -f "$out/launch-$r/token" "$out/launch-$r/read-token"  # the cluster's secrets, not results
done
python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
medians = [b for b in json.load(open(f"{out}/remote_bench_4mib.json"))["benchmarks"]
           if b.get("aggregate_name") == "median"]
med = {b["run_name"].split("/min_time")[0]: b["bytes_per_second"] / 1e9 for b in medians}
# The shard-process cases' CPU counters (remote_bench.cpp, ThreadTimes): cores busy on average
# and the busiest thread's share of the time, on the worker's side and the shards'.
cpu = {b["run_name"].split("/min_time")[0]: b for b in medians
       if "client_cores" in b and "shard_cores" in b}
# Raw TCP is the best of the socket's variants (write and read sizes; remote_bench.cpp).
variants = {n: v for n, v in med.items() if n.startswith("BM_TcpLoopback/")}
best = max(variants, key=variants.get)
tcp = variants[best]
print(f"4 MiB messages, medians of interleaved repetitions (GB/s, share of raw TCP {tcp:.2f}, "
      f"the best variant: {best}):")
for name in sorted(med):
    c = cpu.get(name)
    busy = (f"   worker {c['client_cores']:.2f} cores (top thread {c['client_top']:.0%}), "
            f"shards {c['shard_cores']:.2f} (top {c['shard_top']:.0%})" if c else "")
    print(f"  {name:40s} {med[name]:6.2f}  {med[name] / tcp:6.1%}{busy}")
def summary(path):
    for line in open(path):
        j = json.loads(line)
        if j["event"] == "summary":
            return j
if rounds == 0:
    sys.exit(0)
one = [summary(f"{out}/one-process-{r}.jsonl") for r in range(1, rounds + 1)]
two = [[summary(f"{out}/launch-{r}/worker-{w}.jsonl") for w in (0, 1)] for r in range(1, rounds + 1)]
print("images/s, sync, fashion net, batch 128 per tower, 1 thread per tower")
print("  1 process x 2 towers:   " + ", ".join(f"{s['train_images_per_sec']:.0f}" for s in one) +
      f"   median {statistics.median(s['train_images_per_sec'] for s in one):.0f}")
print("  2 processes x 1 tower:  " + ", ".join(f"{w[0]['train_images_per_sec']:.0f}" for w in two) +
      f"   median {statistics.median(w[0]['train_images_per_sec'] for w in two):.0f}")
print("per step of each worker (ms; the last round): tower step (pull + compute, p50), of it the "
      "pull (mean), then the push (mean), of it the wait at the barrier for the other worker "
      "(the shards' count) and the rest (sending, and the shard taking the gradient)")
for w, s in enumerate(two[-1]):
    t = s["remote"]
    step = s["towers"][0]["step_ms_p50"]
    pull = 1e3 * t["pull_seconds"] / max(t["pulls"], 1)
    push = 1e3 * t["push_seconds"] / max(t["pushes"], 1)
    wait = 1e3 * t["push_wait_seconds"] / max(t["pushes"], 1)
    print(f"  worker {w}: step {step:.1f} = pull {pull:.1f} + compute {step - pull:.1f}; "
          f"push {push:.1f} = wait {wait:.1f} + send {push - wait:.1f}")
PY
