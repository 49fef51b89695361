#!/usr/bin/env bash
# Shard faults at random moments: runs `towers launch --ps 2 --workers 2` clusters (sync; sync
# with one backup worker, --replicas-to-aggregate 1; async; ssp) and, at seeded random moments
# from the run's start (the shards' first checkpoints), kills a shard with kill -9 and starts it
# again with its own command line (processes.json), as an operator or a supervisor would, or
# kills both shards at once and starts both again; a second fault in the same run may follow at
# once (during the rollback of the first). A fault may instead kill the non-chief worker, for
# good: plain sync must then stop with an error naming it and the checkpoint of the last
# complete round, and is continued with --resume as after a chief's kill; the other modes go on
# without it. A fault may also kill the chief: the launch must then end (every process of the
# cluster), and the same launch with --resume continues the run from the chief's last
# checkpoint. Or a fault stops a process with SIGSTOP and continues it: a shard for up to 6 s
# (twice the heartbeat timeout), a worker for up to 1.5 s (half of it); neither may lose a
# worker. Each run must then:
#   - finish: the launcher exits 0, and every restarted shard exits 0 once the workers are done;
#   - sync: end bitwise where one process with the same 4 towers ends (the chief's last
#     checkpoint: every tensor, the optimizer's slots and state, the step and examples seen);
#   - sync and backup: every live worker's summary at --steps, and a rollback recorded by every
#     live worker whenever a restarted shard said it would ask for one;
#   - async, ssp and backup: reach --steps (the summary), with a killed worker named in the
#     chief's summary (lost_workers) when the run went on for more than twice the heartbeat
#     timeout after the kill, and no worker named where none was killed; the chief's last
#     checkpoint loads (`towers eval`);
#   - backup: a rollback that finds no round every shard has a checkpoint of (rounds go on
#     while the chief checkpoints) ends the run with an error saying so; the run is then
#     continued with --resume, as after a chief's kill, and counted apart;
#   - leave in ps-checkpoints only ps-I-VERSION.ckpt files (at most 3 a shard, one more for a
#     shard killed between a rename and the removal of its oldest) and the temporaries of killed
#     shards; in sync and backup, no version beyond --steps.
#
#   scripts/kill-shards.sh                  # 24 runs, 6 per mode, about 4 minutes on 2 cores
#   RUNS=3 MODES=sync scripts/kill-shards.sh
#   SEED=7 scripts/kill-shards.sh
# Settings (environment): RUNS, SEED (the faults' kinds, targets and delays), MODES, STEPS,
# DELAY_MAX_MS (a fault comes uniformly 0..DELAY_MAX_MS ms after the shards' first checkpoints,
# of the run's start), PIECE_KIB (the pieces of a push and a pull, default 16; 1 makes a push
# long enough that a killed worker often dies in the middle of one), TOWERS_BIN, WORK (folder; default a new one under /tmp, removed after a
# pass, kept after a failure). Where a fault lands in a run also depends on the machine's
# timing; the seed replays the choices.
set -euo pipefail
cd "$(dirname "$0")/.."

TOWERS_BIN=${TOWERS_BIN:-build/towers}
RUNS=${RUNS:-24}
SEED=${SEED:-20261129}
MODES=${MODES:-"sync backup async ssp"}
STEPS=${STEPS:-240}
DELAY_MAX_MS=${DELAY_MAX_MS:-3000}
PIECE_KIB=${PIECE_KIB:-16}

read -r -a modes <<<"$MODES"
for mode in "${modes[@]}"; do
  [[ $mode == sync || $mode == backup || $mode == async || $mode == ssp ]] ||
    { echo "kill-shards: unknown mode '$mode' in MODES (sync, backup, async, ssp)" >&2; exit 2; }
done
[[ -x $TOWERS_BIN ]] || { echo "kill-shards: no towers binary at $TOWERS_BIN (build it first)" >&2; exit 2; }
[[ $RUNS =~ ^[0-9]+$ && $STEPS =~ ^[0-9]+$ && $DELAY_MAX_MS =~ ^[0-9]+$ && $PIECE_KIB =~ ^[1-9][0-9]*$ ]] ||
  { echo "kill-shards: RUNS, STEPS and DELAY_MAX_MS must be whole numbers, PIECE_KIB a positive one" >&2; exit 2; }
TOWERS_BIN=$(realpath "$TOWERS_BIN")
WORK=$(realpath -m "${WORK:-$(mktemp -d /tmp/kill-shards.XXXXXX)}")
mkdir -p "$WORK"
RANDOM=$SEED
t_start=$(date +%s.%N)
elapsed() { awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# The run: the mlp on synthetic data, 2 shards, 2 workers of 2 towers, 10 ms a tower step (so
# that a fault lands mid-run), checkpoints twice an epoch, pieces of PIECE_KIB (a push and a pull
# travel in stripes, and the killed shard's connections break under them).
common=(--model mlp --dataset synthetic --synthetic-size 1000 --batch 16 --seed 5 --eval-every 0 --log-every 1 --checkpoint-every 0.5 --threads-per-tower 1)
# An async or ssp update is one tower's gradient, a sync step is the 4 towers': 4 x STEPS
# updates take about as long as STEPS steps (and 2 x STEPS rounds with a backup worker).
steps_of() {
  case $1 in
    sync) echo "$STEPS" ;;
    backup) echo $((2 * STEPS)) ;;  # a round applies one worker's 2 towers
    *) echo $((4 * STEPS)) ;;
  esac
}
mode_flags() {
  case $1 in
    sync) echo "--mode sync --optimizer adam --lr 0.001 --steps $STEPS" ;;
    # backup workers: each round applies the first worker's gradient, drops the other's
    backup) echo "--mode sync --replicas-to-aggregate 1 --optimizer adam --lr 0.001 --steps $((2 * STEPS))" ;;
    # lr 0.01: interleaved Hogwild workers with momentum at 0.1 diverge on this data
    async) echo "--mode async --lr 0.01 --steps $((4 * STEPS))" ;;
    ssp) echo "--mode ssp --staleness 2 --lr 0.01 --steps $((4 * STEPS))" ;;
  esac
}
cluster_flags=(--rpc-timeout 60 --heartbeat-timeout 3 --rpc-piece-kib "$PIECE_KIB"
               --slow-tower 0:10 --slow-tower 1:10)

children=()
cleanup() {
  local p
  for p in "${children[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() {  # fail CHECK DETAIL
  echo "FAIL [$1]: $2" >&2
  echo "kill-shards: FAIL after $(elapsed) s; work folder kept: $WORK" >&2
  echo "replay: SEED=$SEED RUNS=$RUNS MODES=\"$MODES\" STEPS=$STEPS DELAY_MAX_MS=$DELAY_MAX_MS PIECE_KIB=$PIECE_KIB scripts/kill-shards.sh" >&2
  exit 1
}
sleep_ms() { sleep "$(printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)))"; }
# wait_pid PID SECONDS: the exit status of a child of this shell, or 124 when it outlives SECONDS
# (it is then killed).
wait_pid() {
  local pid=$1 t=0 rc=0
  while kill -0 "$pid" 2>/dev/null && ((t < $2 * 10)); do sleep 0.1; t=$((t + 1)); done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; return 124; fi
  { wait "$pid"; } 2>/dev/null || rc=$?
  return $rc
}

# The checks, in Python (standard library only).
cat >"$WORK/check.py" <<'PY'
import json, os, re, struct, subprocess, sys

def fail(check, detail):
    print(f"FAIL [{check}]: {detail}")
    sys.exit(1)

def safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    return header.pop("__metadata__", {}), header, raw[8 + n:]

def differs(path, ref):
    """'' when the two checkpoints hold bitwise the same tensors and training state."""
    meta, tensors, data = safetensors(path)
    rmeta, rtensors, rdata = safetensors(ref)
    if tensors != rtensors:
        return "the tensor names, shapes or offsets differ"
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = t["data_offsets"]
        if data[a:b] != rdata[a:b]:
            return f"tensor '{name}' differs"
    for key in ("model", "step", "examples_seen", "epoch", "optimizer_state"):
        if meta.get(key) != rmeta.get(key):
            return f"metadata '{key}' is {meta.get(key)!r}, one process's {rmeta.get(key)!r}"
    return ""

def records(path, event):
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == event:
                out.append(r)
    return out

def latest(folder):
    names = sorted(n for n in os.listdir(folder) if re.fullmatch(r"ckpt-\d{9}\.safetensors", n))
    return os.path.join(folder, names[-1]) if names else None

def main():
    a = dict(arg.split("=", 1) for arg in sys.argv[1:])
    if a.get("what") == "differs":  # what=differs a=A b=B: exit 0 when bitwise the same
        why = differs(a["a"], a["b"])
        print(why or "same")
        sys.exit(1 if why else 0)
    mode, out, steps = a["mode"], a["out"], int(a["steps"])
    killed_shards = {int(i) for i in a["killed_shards"].split(",") if i}
    worker_killed = a["worker_killed"] == "1"
    rollback_asked = a["rollback_asked"] == "1"

    # 1. The workers' summaries.
    workers = [0] if worker_killed else [0, 1]
    rollbacks = {}
    for w in workers:
        metrics = f"{out}/worker-{w}.jsonl"
        summary = records(metrics, "summary")  # (a run continued with --resume appends)
        if not summary:
            fail("finished", f"{metrics} holds no summary")
        s = summary[-1]
        if s.get("interrupted") or s["steps"] < steps or (mode in ("sync", "backup") and s["steps"] != steps):
            fail("finished", f"worker {w}: summary steps {s['steps']} (interrupted {s.get('interrupted')}), --steps {steps}")
        rollbacks[w] = len(records(metrics, "rollback"))
    chief = records(f"{out}/worker-0.jsonl", "summary")[-1]
    # The shards count a worker lost after --heartbeat-timeout (3 s) without a call from it; a
    # run that ends well after that must say so. (One that ends sooner may not know yet.)
    alone = float(a["ended_at"]) - float(a["worker_killed_at"])
    if not worker_killed and chief.get("lost_workers"):
        fail("no-false-loss", f"no worker was killed, the chief's summary says lost_workers {chief['lost_workers']}")
    if worker_killed and alone > 7 and 1 not in (chief.get("lost_workers") or []):
        fail("lost-worker", f"worker 1 was killed {alone:.1f} s before the run's end, the chief's summary says lost_workers {chief.get('lost_workers')}")
    if mode in ("sync", "backup") and rollback_asked and min(rollbacks.values()) < 1:
        fail("rollback", f"a restarted shard asked for a rollback; rollbacks recorded per worker: {rollbacks}")

    # 2. The chief's last checkpoint.
    last = latest(f"{out}/ck")
    if last is None:
        fail("checkpoint", f"no checkpoint in {out}/ck")
    if mode == "sync":
        why = differs(last, latest(a["ref"]))
        if why:
            fail("sync-bitwise", f"{last} is not one process's last checkpoint: {why}")
    else:
        r = subprocess.run([a["towers"], "eval", "--checkpoint", last, "--threads", "1"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail("loads", f"towers eval --checkpoint {last} exited {r.returncode}: {r.stderr.strip()}")

    # 3. The shards' checkpoint folder.
    per_shard = {}
    for name in os.listdir(f"{out}/ps-checkpoints"):
        m = re.fullmatch(r"ps-(\d+)-(\d{10})\.ckpt(\.tmp-\d+)?", name)
        if not m:
            fail("no-stray-files", f"{out}/ps-checkpoints/{name} is no shard checkpoint")
        shard, version, temp = int(m.group(1)), int(m.group(2)), m.group(3)
        if temp:
            if shard not in killed_shards:
                fail("no-visible-temporary", f"{name}: a temporary of shard {shard}, which was not killed")
            continue
        # (async and ssp: a restarted shard lost its updates since its checkpoint, and the
        # other shard's version runs ahead of the run's count by as many)
        if mode in ("sync", "backup") and version > steps:
            fail("no-stray-files", f"{name}: version {version}, beyond the run's {steps} steps")
        per_shard.setdefault(shard, []).append(version)
    # (A launch continued after its chief was killed starts its shards afresh; one that resumed
    # at the last step has nothing to save.)
    for shard in (0, 1):
        n = len(per_shard.get(shard, []))
        if (n < 1 and a["chief_killed"] != "1") or n > 3 + (shard in killed_shards):
            fail("rotation", f"shard {shard} keeps {n} checkpoints (killed: {shard in killed_shards})")
    print(f"steps={chief['steps']} rollbacks={','.join(str(rollbacks[w]) for w in workers)} "
          f"lost={chief.get('lost_workers') or []} dropped={chief.get('dropped_by_shards', 0)}")

main()
PY
check=(python3 "$WORK/check.py")

# One process with the same 4 towers: where every sync run must end, bitwise.
ref="$WORK/sync-reference"
if [[ " ${modes[*]} " == *" sync "* ]]; then
  echo "kill-shards: one process with 4 towers (the sync reference)"
  # shellcheck disable=SC2046
  "$TOWERS_BIN" train "${common[@]}" $(mode_flags sync) --towers 4 --quiet \
    --checkpoint-dir "$ref" >"$WORK/sync-reference.log" 2>&1 ||
    fail "reference" "the one-process run failed: $(tail -1 "$WORK/sync-reference.log")"
  # A comparison that sees a difference where there is one: two checkpoints of that run.
  files=("$ref"/ckpt-*.safetensors)
  ((${#files[@]} >= 2)) || fail "reference" "fewer than 2 checkpoints in $ref"
  if "${check[@]}" what=differs a="${files[0]}" b="${files[-1]}" >/dev/null; then
    fail "comparator" "no difference found between ${files[0]} and ${files[-1]}"
  fi
fi

# shard_pid OUT I: the process id of shard I as processes.json has it.
shard_pid() {
  python3 -c 'import json,sys; print(next(p["pid"] for p in json.load(open(sys.argv[1])) if p["task"] == sys.argv[2]))' \
    "$1/processes.json" "$2"
}
# restart_shard OUT I N: starts shard I again with its command line; its pid in $restarted.
restart_shard() {
  local -a argv
  mapfile -t argv < <(python3 -c 'import json,sys; print("\n".join(next(p["argv"] for p in json.load(open(sys.argv[1])) if p["task"] == sys.argv[2])))' \
    "$1/processes.json" "ps:$2")
  "${argv[@]}" >"$1/ps-$2-again-$3.log" 2>&1 &
  restarted=$!
  children+=("$restarted")
}
saved() { compgen -G "$1/ps-checkpoints/ps-$2-*.ckpt" >/dev/null; }

total_no_common=0 total_sync_stops=0 total_faults=0 total_shard_kills=0 total_worker_kills=0 total_chief_kills=0 total_stops=0 total_rollbacks=0 total_taken_back=0 missed=0
n_modes=${#modes[@]}
for ((run = 0; run < RUNS; run++)); do
  mode=${modes[$((run % n_modes))]}
  out="$WORK/$mode-$run"
  # shellcheck disable=SC2207
  flags=($(mode_flags "$mode"))
  "$TOWERS_BIN" launch --ps 2 --workers 2 --towers-per-worker 2 --out "$out" -- train \
    "${common[@]}" "${flags[@]}" "${cluster_flags[@]}" --checkpoint-dir "$out/ck" \
    >"$WORK/$mode-$run.log" 2>&1 &
  launcher=$!
  children=("$launcher")
  # Up to two faults: the second (half the runs) right after the first's restart.
  faults=$((1 + RANDOM % 2))
  declare -A pid_of=()
  killed_shards="" worker_killed=0 worker_killed_at=0 chief_killed=0 sync_stopped=0 notes=() restarted_pids=()
  for ((f = 0; f < faults; f++)); do
    pick=$((RANDOM % 8))
    if ((f == 0 && pick == 0)); then
      target=chief
    elif ((worker_killed == 0 && (pick == 1 || pick == 2))); then
      target=worker  # (with a backup worker, W - K = 1 may die; plain sync stops)
    elif ((pick == 3)); then
      target=stop-ps
    elif ((pick == 4 && worker_killed == 0)); then
      target=stop-worker
    elif ((pick == 5)); then
      target=both  # both shards at once: each restores its own last checkpoint
    else
      target=$((RANDOM % 2))
    fi
    delay=$((f == 0 ? RANDOM % (DELAY_MAX_MS + 1) : RANDOM % 400))
    # The first fault waits for both shards' first checkpoints, of the run's start (a shard
    # restarted without one cannot rejoin a run, and says so).
    t=0
    while kill -0 "$launcher" 2>/dev/null && ! { saved "$out" 0 && saved "$out" 1; } && ((t < 600)); do
      sleep 0.1; t=$((t + 1))
    done
    # A worker's fault waits for its first step too: a worker that never called the shards has
    # their start-up grace (60 s) before it counts as lost, longer than the run.
    if [[ $target == worker || $target == stop-worker ]]; then
      while kill -0 "$launcher" 2>/dev/null && ! grep -qs '"event":"step"' "$out/worker-1.jsonl" &&
        ((t < 600)); do
        sleep 0.1; t=$((t + 1))
      done
    fi
    sleep_ms "$delay"
    if ! kill -0 "$launcher" 2>/dev/null; then
      notes+=("run over before fault $((f + 1)) at ${delay} ms")
      missed=$((missed + 1))
      break
    fi
    if [[ $target == chief ]]; then
      if ! kill -9 "$(shard_pid "$out" worker:0)" 2>/dev/null; then
        notes+=("run over before fault $((f + 1)) at ${delay} ms")
        missed=$((missed + 1))
        break
      fi
      chief_killed=1
      total_chief_kills=$((total_chief_kills + 1))
      notes+=("the chief killed at +${delay} ms")
      total_faults=$((total_faults + 1))
      break  # the run ends; it is then continued with --resume
    elif [[ $target == stop-ps || $target == stop-worker ]]; then
      # Stopped (SIGSTOP) and continued: a shard for up to twice the heartbeat timeout (3 s),
      # which must lose no worker (the time it did not run does not count against them), or
      # a worker for up to half of it, which must not be lost either.
      i=$((RANDOM % 2))
      if [[ $target == stop-ps ]]; then
        task=ps:$i pid=${pid_of[$i]:-$(shard_pid "$out" "ps:$i")} pause=$((500 + RANDOM % 5501))
      else
        task=worker:$i pid=$(shard_pid "$out" "worker:$i") pause=$((200 + RANDOM % 1301))
      fi
      kill -STOP "$pid" 2>/dev/null || true
      sleep_ms "$pause"
      kill -CONT "$pid" 2>/dev/null || true
      total_stops=$((total_stops + 1))
      notes+=("$task stopped at +${delay} ms for $pause ms")
    elif [[ $target == worker ]]; then
      if ! kill -9 "$(shard_pid "$out" worker:1)" 2>/dev/null; then
        notes+=("worker:1 over before fault $((f + 1)) at ${delay} ms")
        missed=$((missed + 1))
        break
      fi
      worker_killed=1
      worker_killed_at=$(date +%s.%N)
      total_worker_kills=$((total_worker_kills + 1))
      notes+=("worker:1 killed at +${delay} ms")
      if [[ $mode == sync ]]; then
        # Plain sync stops (below), after the checkpoint of the last complete round.
        sync_stopped=1
        total_faults=$((total_faults + 1))
        break
      fi
    else
      if [[ $target == both ]]; then shards=(0 1); else shards=("$target"); fi
      pids=()
      for s in "${shards[@]}"; do
        if [[ -n ${pid_of[$s]:-} ]]; then  # a shard restarted here: killed again
          pid=${pid_of[$s]}
          kill -9 "$pid" 2>/dev/null || true
          { wait "$pid"; } 2>/dev/null || true
          for i in "${!restarted_pids[@]}"; do
            [[ ${restarted_pids[$i]} != "$pid" ]] || unset 'restarted_pids[i]'
          done
        else
          pid=$(shard_pid "$out" "ps:$s")
          kill -9 "$pid" 2>/dev/null || true
        fi
        pids+=("$pid")
      done
      for pid in "${pids[@]}"; do
        for ((t = 0; t < 40; t++)); do [[ -d /proc/$pid && $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null) != Z ]] || break; sleep 0.05; done
      done
      pause=$((RANDOM % 500))
      sleep_ms "$pause"
      for s in "${shards[@]}"; do
        restart_shard "$out" "$s" "$f"
        pid_of[$s]=$restarted
        restarted_pids+=("$restarted")
        killed_shards+="$s,"
        total_shard_kills=$((total_shard_kills + 1))
      done
      notes+=("$(printf 'ps:%s ' "${shards[@]}")killed at +${delay} ms, restarted $pause ms later")
    fi
    total_faults=$((total_faults + 1))
  done
  rc=0
  wait_pid "$launcher" 240 || rc=$?
  # With a backup worker, rounds complete while the chief checkpoints, so the shards'
  # checkpoints need not be of one round, and a rollback may find none that the restarted
  # shard and the others share: the run then stops saying so, and goes on with --resume
  # (README, decision 77). Counted apart.
  no_common=0
  if ((rc != 0 && chief_killed == 0)) && [[ $mode == backup ]] &&
    grep -q "cannot roll back to round .*continue the run from the chief's checkpoint with --resume" "$WORK/$mode-$run.log"; then
    no_common=1
    total_no_common=$((total_no_common + 1))
    notes+=("the rollback found no round of every shard's checkpoints")
  fi
  # Plain sync with a worker killed: the run stops with an error naming the lost worker and the
  # checkpoint of the last complete round, and is continued with --resume. (A worker killed
  # after its last round leaves a run that ended well.)
  if ((sync_stopped)); then
    if ((rc == 0)); then
      sync_stopped=0
      notes+=("the run had completed its rounds")
    else
      grep -q "worker(s) 1 lost .*\(the last complete round, step [0-9]*, is saved in\|no round completed since the run's start\)" "$WORK/$mode-$run.log" ||
        fail "sync-stops" "$mode run $run (${notes[*]}): the launcher exited $rc without naming the lost worker and the saved round: $(grep -v '^step\|^  ' "$WORK/$mode-$run.log" | tail -4 | tr '\n' ' ')"
      total_sync_stops=$((total_sync_stops + 1))
      # The worker died in the middle of its push: a shard took the round's pieces back
      # (decision 79), and the run must still end bitwise.
      if grep -qs "taken back" "$out"/ps-*.log; then
        total_taken_back=$((total_taken_back + 1))
        notes+=("a shard took back the round the worker left in part")
      fi
    fi
  fi
  if ((chief_killed || no_common || sync_stopped)); then
    # The launcher exits with the chief's status; the other workers and the shards (those it
    # started, and those started here, which count the workers lost) all end.
    ((rc != 0 && rc != 124)) ||
      fail "run-ended" "$mode run $run (${notes[*]}): the launcher exited $rc"
    for p in "${restarted_pids[@]}"; do
      prc=0
      wait_pid "$p" 60 || prc=$?
      ((prc != 124)) || fail "run-ended" "$mode run $run (${notes[*]}): a restarted shard still ran 60 s after the launcher's end"
    done
    restarted_pids=()
    # (the pattern's [.] keeps grep from finding its own command line)
    left=$(grep -l -e "$out/cluster[.]json" /proc/[0-9]*/cmdline 2>/dev/null | tr '\n' ' ' || true)
    [[ -z $left ]] ||
      fail "run-ended" "$mode run $run (${notes[*]}): processes of the cluster still run after the launcher's end: $left"
    # The same launch again, continuing the run from the chief's last checkpoint.
    rc=0
    "$TOWERS_BIN" launch --ps 2 --workers 2 --towers-per-worker 2 --out "$out" -- train \
      "${common[@]}" "${flags[@]}" "${cluster_flags[@]}" --checkpoint-dir "$out/ck" --resume \
      >>"$WORK/$mode-$run.log" 2>&1 &
    launcher=$!
    children=("$launcher")
    wait_pid "$launcher" 240 || rc=$?
    notes+=("continued with --resume")
  fi
  ended_at=$(date +%s.%N)
  ((rc == 0)) || fail "exit-code" "$mode run $run (${notes[*]}): the launcher exited $rc: $(grep -v '^step\|^  ' "$WORK/$mode-$run.log" | tail -4 | tr '\n' ' ')"
  rollback_asked=0
  for p in "${restarted_pids[@]}"; do
    prc=0
    wait_pid "$p" 60 || prc=$?
    ((prc == 0)) || fail "restarted-shard" "$mode run $run (${notes[*]}): a restarted shard exited $prc: $(tail -q -n 2 "$out"/ps-*-again-*.log | tr '\n' ' ')"
  done
  # (A shard restarted after the run's end says it would ask, but no worker calls it.)
  # (Nor does one that restored the run's last round: the workers only say they are done.)
  for log in "$out"/ps-*-again-*.log; do
    if [[ -f $log ]] && grep -q "workers will be asked to roll back" "$log" &&
      ! grep -q "no worker has called since this shard restarted" "$log"; then
      restored=$(sed -n 's/.* from version \([0-9]*\) (initialised by .*/\1/p' "$log" | head -1)
      ((${restored:-0} >= $(steps_of "$mode"))) || rollback_asked=1
    fi
  done
  # (The rollback was refused, or a worker was killed before it took it: the run was continued.)
  ((no_common == 0 && sync_stopped == 0)) || rollback_asked=0
  total_rollbacks=$((total_rollbacks + rollback_asked))
  line=$("${check[@]}" mode="$mode" out="$out" steps="$(steps_of "$mode")" ref="$ref" towers="$TOWERS_BIN" \
    killed_shards="$killed_shards" worker_killed="$((worker_killed && !sync_stopped))" \
    worker_killed_at="$worker_killed_at" chief_killed="$((chief_killed || no_common || sync_stopped))" ended_at="$ended_at" rollback_asked="$rollback_asked") ||
    fail "$(sed -n 's/^FAIL \[\([^]]*\)\].*/\1/p' <<<"$line" | grep . || echo check-script)" \
      "$mode run $run (${notes[*]}): ${line#FAIL \[*\]: }"
  echo "$mode run $run: ${notes[*]} -> $line"
  unset pid_of
done

echo "kill-shards: PASS: $RUNS runs ($MODES), $total_faults faults: $total_shard_kills shards killed and restarted ($total_rollbacks runs rolled back), $total_worker_kills workers ($total_sync_stops sync runs stopped and continued with --resume, $total_taken_back of them after a shard took back a round left in part) and $total_chief_kills chiefs killed, $total_stops processes stopped and continued; $total_no_common backup runs continued with --resume for want of a common round; $missed faults came after the run's end; $(elapsed) s"
rm -rf "$WORK"
