#!/usr/bin/env bash
# One GPU lease in one command. The device machines are lent for about 15 minutes of device
# time in all (their start included) and at most 10 minutes a command, so this runs what the
# GPU issues need in at most 560 s of main phases, then spare phases while 570 s from its
# start allow (LEASE_BUDGET; give a second command's budget to match its time limit), from
# the repository root on the GPU machine:
#   bench/gpu-lease.sh OUT [PACK]
# OUT: where the results go (a few files, below); PACK: the build bench/pack-gpu.sh made
# (default build-gpu/pack, unpacked from build-gpu/pack.tar.xz when it is not there yet).
# Carry build-gpu/pack.tar.xz and data/fashion-mnist.
#   1. correctness, side by side (at most 265 s): the whole suite with TOWERS_REQUIRE_GPU=1 in
#      8 shards, run-gpu.sh's six compute-sanitizer runs (the four tools) as jobs of a few
#      tests, 16 at once from one queue (bench/sanitize.py), and the PyTorch peers'
#      torch.compile cache warmed on the idle cores;
#   2. speed (at most 205 s): gpu_bench's rows of the bars (a cifar10 step at batch 128, FP32
#      and TF32, host and mirrored parameters, cuDNN ranked, timed (deterministic or not) and
#      kept to the GEMM family, and the compute alone; at batch 512 the ranked mirrored step),
#      then the PyTorch peers of the bars (eager, whole-step CUDA graph, torch.compile,
#      reduce-overhead);
#   3. training (at most 90 s): Fashion-MNIST to 90% with the main job's recipe, host and
#      mirrored parameters, time to 91%, towers and PyTorch.
# On 2026-11-27 (H200) the suite took 133 s; 5 of the 18 sanitizer shards (3 per run, fixed
# gtest shards then) had not finished in 200 s; the speed phase needed more than its 190 s (the
# last PyTorch peer was cut; plain torch.compile was not in it), the training 75 s. The next
# run there (commit 2a18dd1): the suite 154 s, the 33 sanitizer jobs 176 s, gpu_bench 73 s (20
# rows, cudnn:1-6) and the six peers 132 s, so the peer at batch 512 after them was cut at 205 s;
# training 83 s, leaving the remote phase 71 s (its short set). The speed phase now times
# cudnn:1, 3, 4 and 5 only (2 and 6 came out within 2% of 1 and 5) and no peer at batch 512.
# What OUT holds: lease.txt (the phases' times), summary.txt (every phase's summary), the
# first four of the phases' top-level logs (tests.log, san.log, san-again.log, bench.log,
# fashion.log, remote.log, profile.log: at most 8 files come back from the machine) and
# lease.tgz with everything (logs, JSON, profiles), packed again after each phase and when the
# script is stopped, so that a run cut short still leaves what it did in a few files. If
# lease.tgz would pass 15 MiB it is packed without the largest files (listed in
# OUT/left-out.txt). The phases write into LEASE_WORK (default: a fresh temporary folder).
# LEASE_PHASES="correctness speed training" (default) picks phases; "profile" (ncu, then the
# dense layers' GEMMs one at a time; about a minute) and "remote" (the transport's 4 MiB shares
# on this machine's cores, against shard processes only, 3 interleaved repetitions, at most
# two minutes, the bar's cases alone when less than 115 s is left: every 4 MiB case with 5
# repetitions did not finish in 150 s on the 16-core H200 machine on 2026-11-27) run after them
# as spare phases when the command's time allows (LEASE_SPARE, LEASE_BUDGET below), or as a
# second command on the same warm machine, as the session's device time allows (15 minutes in
# all, the start of the machine included: after a main command of up to 570 s, a minute or two):
#   LEASE_PHASES="remote profile" LEASE_BUDGET=150 bench/gpu-lease.sh OUT
# and "sanitize" checks again, alone, the tests that the correctness phase's sanitizers did not
# finish (san/sanitizer-unfinished.txt in its lease.tgz, carried back to the machine):
#   LEASE_PHASES=sanitize SANITIZE_ONLY_TESTS=FILE SANITIZE_S=200 bench/gpu-lease.sh OUT
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/gpu-lease.sh OUT [PACK]}
pack=${2:-build-gpu/pack}
phases=${LEASE_PHASES:-correctness speed training}
mkdir -p "$out"
work=${LEASE_WORK:-$(mktemp -d)} || exit 2
mkdir -p "$work" || exit 2
if [ ! -x "$pack/towers" ] && [ -f build-gpu/pack.tar.xz ] && [ "$pack" = build-gpu/pack ]; then
  tar xJf build-gpu/pack.tar.xz -C build-gpu
fi
[ -x "$pack/towers" ] || { echo "gpu-lease: no towers binary in $pack" >&2; exit 2; }
start=$SECONDS
stamp() { echo "gpu-lease: $* at $((SECONDS - start)) s" | tee -a "$out/lease.txt"; }
# Runs a command as a session of its own and ends the whole session after S seconds: the
# inner `timeout`s of run-gpu.sh make process groups of their own, which a plain `timeout`
# around the script would leave running (a PyTorch peer on the GPU while the next phase
# times). Returns the command's exit code (143 when it was cut).
# (Without pkill, the session's first process group is signalled: the inner groups survive.)
end_session() {  # signal, session id
  if command -v pkill >/dev/null; then pkill "-$1" -s "$2" 2>/dev/null; else kill "-$1" -- "-$2" 2>/dev/null; fi
}
within() {
  local s=$1
  shift
  setsid "$@" &
  local sid=$!
  echo "$sid" >> "$work/.sessions"
  (
    sleep "$s"
    end_session TERM "$sid" && echo "gpu-lease: cut after $s s: $*" >> "$out/lease.txt"
    sleep 5
    end_session KILL "$sid"
  ) &
  local watch=$!
  wait "$sid"
  local rc=$?
  end_session KILL "$sid"  # what the session left behind
  kill "$watch" 2>/dev/null  # (its sleep ends by itself)
  wait "$watch" 2>/dev/null
  return "$rc"
}
# Every phase's summary into OUT/summary.txt, and everything into OUT/lease.tgz.
pack_results() {
  for f in "$work"/*/summary.txt; do
    [ -f "$f" ] || continue
    echo "##### ${f#"$work"/}"
    cat "$f"
  done > "$out/summary.txt"
  cp "$out/lease.txt" "$work/" 2>/dev/null
  # At most 8 files come back from the machine: lease.txt, summary.txt, lease.tgz and
  # left-out.txt, and the first four of the phases' logs (all of them are in lease.tgz).
  local log copied=0
  for log in tests san san-again bench fashion remote profile; do
    [ -f "$work/$log.log" ] && [ "$copied" -lt 4 ] || continue
    cp "$work/$log.log" "$out/" && copied=$((copied + 1))
  done
  local limit=$((15 * 1024 * 1024))
  rm -f "$out/left-out.txt"
  local part="$out/lease.tgz.part"
  tar czf "$part" -C "$work" . || rm -f "$part"
  if [ -f "$part" ] && [ "$(stat -c %s "$part")" -gt "$limit" ]; then
    # Too large to come back: leave out the largest files (over 1 MiB) and say which.
    (cd "$work" && find . -type f -size +1M) > "$out/left-out.txt"
    tar czf "$part" -C "$work" --exclude-from="$out/left-out.txt" . || rm -f "$part"
  fi
  if [ -f "$part" ]; then mv "$part" "$out/lease.tgz"; fi
}
# Stopped from outside (the machine's time limit): end the phases' sessions, which would
# otherwise run on, and pack what they left.
stopped() {
  stamp "stopped"
  local sid
  while read -r sid; do end_session KILL "$sid"; done < "$work/.sessions" 2>/dev/null
  rm -f "$work/.sessions"
  pack_results
  [ -n "${LEASE_WORK:-}" ] || rm -rf "$work"
  exit 143
}
trap stopped TERM INT
stamp "start ($(cat "$pack/COMMIT" 2>/dev/null || echo unknown commit))"

if [[ " $phases " == *" correctness "* ]]; then
  PHASES=tests SHARDS=8 TESTS_S=200 within 210 bench/run-gpu.sh "$pack" "$work/tests" \
    > "$work/tests.log" 2>&1 &
  PHASES=sanitize SAN_SLOTS=16 SANITIZE_S=240 within 265 bench/run-gpu.sh "$pack" "$work/san" \
    > "$work/san.log" 2>&1 &
  PEERS='^(compile_fp32|compile_graphs_fp32|compile_graphs_tf32)$' \
    PHASES=warm within 200 bench/run-gpu.sh "$pack" "$work/warm" > "$work/warm.log" 2>&1 &
  wait
  stamp "correctness done"
  pack_results
fi

if [[ " $phases " == *" sanitize "* ]]; then
  # (into san-again: beside a correctness phase of the same command, whose unfinished tests
  # it then checks unless SANITIZE_ONLY_TESTS names others)
  rest=${SANITIZE_ONLY_TESTS:-}
  [ -z "$rest" ] && [ -f "$work/san/sanitizer-unfinished.txt" ] && rest=$work/san/sanitizer-unfinished.txt
  SANITIZE_ONLY_TESTS=$rest PHASES=sanitize SAN_SLOTS=16 SANITIZE_S=${SANITIZE_S:-200} \
    within $((${SANITIZE_S:-200} + 25)) bench/run-gpu.sh "$pack" "$work/san-again" \
    > "$work/san-again.log" 2>&1
  stamp "sanitize done (exit $?)"
  pack_results
fi

if [[ " $phases " == *" speed "* ]]; then
  BENCH_FILTER='BM_GpuMirroredStep/batch:128/tf32:./cudnn:[1345]/input:0/branches:0|BM_GpuMirroredStep/batch:512/tf32:./cudnn:1/input:0/branches:0|BM_GpuTowerStep|BM_GpuComputeOnly' \
  PEERS='^(eager_fp32|eager_tf32|graph_fp32|compile_fp32|compile_graphs_fp32|compile_graphs_tf32)$' \
  BENCH_EXTRAS=0 TOWERS_BENCH_MIN_TIME=0.5 PEER_S=3 BENCH_S=100 PHASES=bench \
    within 205 bench/run-gpu.sh "$pack" "$work/bench" > "$work/bench.log" 2>&1
  stamp "speed done (exit $?)"
  pack_results
fi

if [[ " $phases " == *" training "* ]]; then
  PHASES=fashion FASHION_S=60 within 90 bench/run-gpu.sh "$pack" "$work/fashion" \
    > "$work/fashion.log" 2>&1
  stamp "training done (exit $?)"
  pack_results
fi

run_profile() {  # at most $1 s
  PHASES=profile within "$1" bench/run-gpu.sh "$pack" "$work/profile" > "$work/profile.log" 2>&1
  stamp "profile done (exit $?)"
  pack_results
}
run_remote() {  # at most $1 s
  # What the transport's bar reads (issue 11). With at least 115 s: push and pull to 1, 2 and 4
  # shard processes in 1, 2 and 4 stripes (and to 1 in 256 KiB pieces) on sessions, and in 1
  # and 4 stripes also on a call each, gRPC's floors against a process (one stream, in stripes,
  # and on sessions: streams opened once), raw TCP's two best variants (94 s on 2 cores). With
  # less: the bar's cases alone, push and pull to 1, 2 and 4 shard processes in the default
  # stripes (4) on sessions and on a call each, to 1 also in 256 KiB pieces, the push floor in
  # 4 stripes and on 4 sessions, and raw TCP's two best variants (39 s on 2 cores).
  # No training job. The shard-process cases also say how busy each side's threads
  # were (remote_bench.cpp, timed_loop).
  local cases='BM_(PushToProcesses|PullFromProcesses)/4194304/|BM_Grpc(StreamToProcess|StripesToProcess|SessionsToProcess|PullStreamFromProcess)/4194304|BM_TcpLoopback/4194304/(262144|1048576)/'
  [ "$1" -ge 115 ] || cases='BM_(PushToProcesses|PullFromProcesses)/4194304/[124]/4/|BM_Grpc(StripesToProcess|SessionsToProcess)/4194304/4|BM_TcpLoopback/4194304/(262144|1048576)/'
  CASES=$cases SWEEP=0 ROUNDS=0 REPS=3 REMOTE_S=$(($1 - 10)) PHASES=remote \
    within "$1" bench/run-gpu.sh "$pack" "$work/remote" > "$work/remote.log" 2>&1
  stamp "remote done"
  pack_results
}
# The transport's shares and the profile: those LEASE_PHASES asks for, then the spare ones
# (LEASE_SPARE; after the main command's phases, "remote profile": issue 11's bar, then issue
# 12's kernels), each while the command's time allows: it runs if at least its minimum is left
# of LEASE_BUDGET seconds from the script's start (default 570, inside the lease's 10 minutes
# a command, with room for the packing after it), cut to what is left less `within`'s grace.
# remote's result is all or nothing (its repetitions interleave, and its summary reads the
# JSON written at its end): 3 repetitions of all its cases took 94 s on 2 cores here
# (2026-11-28, with the stripes', the pieces' and the sessions' cases, and the 4 MiB pushes and
# pulls in 1 and 4 stripes both on sessions and on a call each), of the bar's cases alone 39 s;
# so it runs the bar's cases from 55 s left, and all of them from 115 s (run_remote).
budget=${LEASE_BUDGET:-570}
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu-lease: LEASE_BUDGET '$budget' is not a number of seconds; using 570" >&2; budget=570; }
spare_default="remote profile"
[ -n "${LEASE_PHASES:-}" ] && spare_default=""
asked=""
for extra in remote profile; do [[ " $phases " == *" $extra "* ]] && asked="$asked $extra"; done
for extra in $asked ${LEASE_SPARE-$spare_default}; do
  case $extra in
    remote) min=55 cap=120 ;;
    profile) min=30 cap=130 ;;
    *) echo "gpu-lease: LEASE_SPARE: no phase '$extra' (remote, profile)" >&2; continue ;;
  esac
  [[ " ${done_extras:-} " == *" $extra "* ]] && continue
  done_extras="${done_extras:-} $extra"
  left=$((budget - SECONDS - 8))
  if [ "$left" -ge "$min" ]; then
    stamp "$extra, with $left s left"
    "run_$extra" $((left < cap ? left : cap))
  else
    stamp "no time for $extra ($left s left, $min needed)"
  fi
done

rm -f "$work/.sessions"
pack_results
cat "$out/summary.txt"
[ -n "${LEASE_WORK:-}" ] || rm -rf "$work"
