#!/usr/bin/env bash
# Remote tower groups over a real network path (README, "Remote tower groups"): one shard and
# two workers, each in a network namespace of its own (ip netns), joined by veth pairs to a
# bridge, so that every call crosses a network stack between hosts with addresses of their own
# (10.77.0.0/24), not loopback. Worker 1's link is shaped with tbf to RATE in both directions:
# a straggler. The same fashion job runs
#   fair:     sync, no shaping;
#   straggler sync:   every round waits for worker 1;
#   straggler backup: sync with --replicas-to-aggregate 1, so a round applies the first
#                     gradient and worker 1's late ones are dropped (TF's ConditionalAccumulator);
#   straggler async:  every push applied at once.
# Prints, and writes to OUT/summary.txt, each worker's images/s, the run's updates, its pushes,
# the gradients the shard dropped as late, the largest staleness, and push and pull times per
# call.
# Needs root (CAP_NET_ADMIN) and the kernel's veth, bridge and tbf; without a bridge it says so
# and exits 2, having changed nothing, and it removes what it made however it ends. A host whose
# firewall filters bridged traffic (br_netfilter with a FORWARD policy of DROP) stops the calls:
# each worker then fails after --rpc-timeout, and each run after 600 s at most.
#   bench/run-netns.sh [BUILD_DIR] [OUT_DIR]     STEPS=N (default 40), RATE (default 200mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(realpath "${1:-build}")
out=${2:-bench/results/$(date +%Y-%m-%d)-netns}
steps=${STEPS:-40}
rate=${RATE:-200mbit}
towers="$build/towers"
[ -x "$towers" ] || { echo "run-netns: no $towers (build first)" >&2; exit 2; }

ns_ps=twr-ps0 ns_w0=twr-w0 ns_w1=twr-w1 br=twr-br
declare -A addr=([$ns_ps]=10.77.0.10 [$ns_w0]=10.77.0.20 [$ns_w1]=10.77.0.21)
cleanup() {
  for sig in TERM KILL; do
    for ns in $ns_ps $ns_w0 $ns_w1; do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -s "$sig" 2>/dev/null || true
    done
    sleep 0.5
  done
  for ns in $ns_ps $ns_w0 $ns_w1; do
    ip link del "${ns}-h" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$br" 2>/dev/null || true
  [ -z "${token:-}" ] || rm -f "$token"
}
# Everything it makes is named twr-*; a previous run's leftovers go first.
cleanup
trap cleanup EXIT
if ! ip link add "$br" type bridge 2>/dev/null; then
  echo "run-netns: cannot make a bridge (needs root and the bridge driver)" >&2; exit 2
fi
ip link set "$br" up
for ns in $ns_ps $ns_w0 $ns_w1; do
  ip netns add "$ns"
  ip link add "${ns}-h" type veth peer name eth0 netns "$ns"
  ip link set "${ns}-h" master "$br" up
  ip netns exec "$ns" ip link set lo up
  ip netns exec "$ns" ip addr add "${addr[$ns]}/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
done
tc_w1() {  # tc qdisc ARGS... on both ends of worker 1's link
  ip netns exec "$ns_w1" tc qdisc "$1" dev eth0 root "${@:2}" &&
    tc qdisc "$1" dev "${ns_w1}-h" root "${@:2}"
}
shape() {  # on|off: worker 1's link shaped to $rate in both directions, or not
  ip netns exec "$ns_w1" tc qdisc del dev eth0 root 2>/dev/null || true
  tc qdisc del dev "${ns_w1}-h" root 2>/dev/null || true
  if [ "$1" = on ] && ! tc_w1 add tbf rate "$rate" burst 256kb latency 200ms; then
    echo "run-netns: tc tbf failed (the kernel lacks sch_tbf?)" >&2
    exit 2
  fi
}
mkdir -p "$out"
out=$(realpath "$out")
token=$(mktemp)  # the run's secret stays out of OUT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$token"
port=7070
flags=(--model fashion --dataset synthetic --synthetic-size 8192 --batch 128 --steps "$steps"
       --threads-per-tower 1 --eval-every 0 --seed 1 --quiet --token-file "$token")

run() {  # name, shaping, train flags...
  local name=$1 shaping=$2; shift 2
  port=$((port + 1))
  cat > "$out/$name.cluster.json" <<JSON
{"cluster": {"worker": ["${addr[$ns_w0]}:1", "${addr[$ns_w1]}:1"], "ps": ["${addr[$ns_ps]}:$port"]}}
JSON
  shape "$shaping"
  ip netns exec $ns_ps "$towers" ps --cluster "$out/$name.cluster.json" --task ps:0 \
    --token-file "$token" --bind "${addr[$ns_ps]}" > "$out/$name.ps.log" 2>&1 &
  local ps=$!
  local pids=()
  for w in 0 1; do
    local ns=$ns_w0
    [ "$w" = 1 ] && ns=$ns_w1
    timeout 600 ip netns exec "$ns" "$towers" train --cluster "$out/$name.cluster.json" --task "worker:$w" \
      "${flags[@]}" "$@" --metrics "$out/$name.worker-$w.jsonl" > "$out/$name.worker-$w.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  kill "$ps" 2>/dev/null || true
  wait "$ps" 2>/dev/null || true
  echo "$name: workers exit $rc" >> "$out/exits.txt"
}

rm -f "$out/exits.txt"
run fair off --mode sync
run straggler-sync on --mode sync
run straggler-backup on --mode sync --replicas-to-aggregate 1
run straggler-async on --mode async
shape off

python3 - "$out" "$rate" "$steps" <<'PY' | tee "$out/summary.txt"
import json, subprocess, sys
out, rate, steps = sys.argv[1], sys.argv[2], sys.argv[3]
def summary(path):
    try:
        for line in open(path):
            j = json.loads(line)
            if j["event"] == "summary":
                return j
    except OSError:
        pass
    return None
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"commit {commit}; 1 shard and 2 workers in network namespaces on a bridge (10.77.0.0/24);")
print(f"fashion net, synthetic data, batch 128 per worker, {steps} steps; worker 1's link shaped to {rate} (tbf) where marked")
print(f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores; load average at the end: {open('/proc/loadavg').read().split()[:3]}")
print(open(f"{out}/exits.txt").read().rstrip())
print("updates: the run's (global) step count when the worker ended; pushes: the worker's own;")
print("dropped: late gradients the shard dropped in the run (all workers); staleness: the largest")
print("push ms: a push's mean time, of it wait ms at the barrier (the shards' count; sync only)")
print(f"{'run':18s} {'worker':>6s} {'images/s':>9s} {'updates':>8s} {'pushes':>7s} {'dropped':>8s} {'staleness':>9s} {'push ms':>8s} {'wait ms':>8s} {'pull ms':>8s}")
for name in ("fair", "straggler-sync", "straggler-backup", "straggler-async"):
    for w in (0, 1):
        s = summary(f"{out}/{name}.worker-{w}.jsonl")
        if s is None:
            print(f"{name:18s} {w:6d}  no summary (see {name}.worker-{w}.log)")
            continue
        r = s.get("remote", {})
        push = 1e3 * r.get("push_seconds", 0) / max(r.get("pushes", 0), 1)
        wait = 1e3 * r.get("push_wait_seconds", 0) / max(r.get("pushes", 0), 1)
        pull = 1e3 * r.get("pull_seconds", 0) / max(r.get("pulls", 0), 1)
        print(f"{name:18s} {w:6d} {s['train_images_per_sec']:9.0f} {s['steps']:8d} "
              f"{r.get('pushes', 0):7d} {s.get('dropped_by_shards', 0):8d} "
              f"{s.get('max_staleness', 0):9d} {push:8.1f} {wait:8.1f} {pull:8.1f}")
PY
