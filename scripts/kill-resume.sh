#!/usr/bin/env bash
# Crash and resume: kills CPU training runs (sync, async, ssp) with kill -9 at seeded random
# moments and resumes each with --resume, checking after every kill that
#   - every ckpt-*.safetensors in the folder loads (`towers eval --checkpoint FILE`, which also
#     checks the CRC of the data) and holds the step its name says;
#   - nothing half-written is visible under a checkpoint name: the only other files allowed are
#     the temporaries of save_checkpoint (ckpt-<step>.safetensors.tmp-<pid>), and only of a
#     process that was killed while writing one; at most --keep-checkpoints files, or one more
#     than there were before for a process killed between a rename and the removal of the oldest;
#   - the latest checkpoint's step never goes backwards, and each resumed process starts at the
#     latest checkpoint present before it (the start_step of its metrics' config record);
#   - a process's step records are unique versions after its start (contiguous in sync);
#   - sync: every checkpoint on disk is bitwise (data section and metadata) the checkpoint of the
#     same step of one uninterrupted run with the same flags, and so is the final one.
# A round ends when its run completes (exit 0) with the requested steps, checked against the
# metrics' summary; a new round then starts in a fresh folder until the mode's kills are done.
# A kill before the first checkpoint leaves an empty folder; --resume then starts afresh (the
# latest checkpoint of an empty folder is none), which is counted as a fresh start, not a resume.
#
#   scripts/kill-resume.sh                # 102 kills, 34 per mode, 2-3 minutes on 2 cores
#   KILLS=12 scripts/kill-resume.sh       # quick (CI): about 15 s
#   SEED=7 MODES=sync scripts/kill-resume.sh
# Settings (environment): KILLS, SEED (the delays before each kill), MODES, STEPS, BATCH,
# SIZE (--synthetic-size), EVERY (--checkpoint-every, epochs), KEEP (--keep-checkpoints),
# DELAY_MAX_MS (delays are uniform in 0..DELAY_MAX_MS ms after the launch), TOWERS_BIN,
# WORK (folder; default a new one under /tmp, removed after a pass, kept after a failure).
# The delays are replayable with the same SEED; where a kill lands within a run also depends
# on the machine's timing.
set -euo pipefail
cd "$(dirname "$0")/.."

TOWERS_BIN=${TOWERS_BIN:-build/towers}
KILLS=${KILLS:-102}
SEED=${SEED:-20261123}
MODES=${MODES:-"sync async ssp"}
STEPS=${STEPS:-400}
BATCH=${BATCH:-16}
SIZE=${SIZE:-2000}
EVERY=${EVERY:-0.02}
KEEP=${KEEP:-3}
DELAY_MAX_MS=${DELAY_MAX_MS:-500}
KEEP_WORK=${KEEP_WORK:-0}

read -r -a modes <<<"$MODES"
for mode in "${modes[@]}"; do
  [[ $mode == sync || $mode == async || $mode == ssp ]] ||
    { echo "kill-resume: unknown mode '$mode' in MODES (sync, async, ssp)" >&2; exit 2; }
done
[[ -x $TOWERS_BIN ]] || { echo "kill-resume: no towers binary at $TOWERS_BIN (build it first)" >&2; exit 2; }
TOWERS_BIN=$(realpath "$TOWERS_BIN")
WORK=${WORK:-$(mktemp -d /tmp/kill-resume.XXXXXX)}
mkdir -p "$WORK"
RANDOM=$SEED
t_start=$(date +%s.%N)

common=(--model mlp --dataset synthetic --synthetic-size "$SIZE" --batch "$BATCH"
        --steps "$STEPS" --towers 2 --threads-per-tower 1 --lr 0.01 --eval-every 0.5
        --checkpoint-every "$EVERY" --quiet)
mode_flags() {
  case $1 in
    sync) echo "--mode sync" ;;
    async) echo "--mode async" ;;
    ssp) echo "--mode ssp --staleness 2" ;;
    *) echo "kill-resume: unknown mode '$1'" >&2; exit 2 ;;
  esac
}

child=""
cleanup() {
  if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then kill -9 "$child" 2>/dev/null || true; fi
}
trap cleanup EXIT
fail() {  # fail CHECK DETAIL
  echo "FAIL [$1]: $2" >&2
  echo "kill-resume: FAIL after $(elapsed) s; work folder kept: $WORK" >&2
  echo "replay: SEED=$SEED KILLS=$KILLS MODES=\"$MODES\" STEPS=$STEPS BATCH=$BATCH SIZE=$SIZE EVERY=$EVERY KEEP=$KEEP DELAY_MAX_MS=$DELAY_MAX_MS scripts/kill-resume.sh" >&2
  exit 1
}
elapsed() { awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# The checks of one attempt, in Python (standard library only).
cat >"$WORK/check.py" <<'PY'
import json, os, re, struct, subprocess, sys, tempfile

CKPT = re.compile(r"^ckpt-(\d{9})\.safetensors$")
TEMP = re.compile(r"^ckpt-(\d{9})\.safetensors\.tmp-(\d+)$")

def fail(check, detail):
    print(f"FAIL [{check}]: {detail}", file=sys.stderr)
    sys.exit(1)

def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    return header.pop("__metadata__", {}), header, raw[8 + n:]

def compare(path, ref_path):
    """'' when the two checkpoints hold bitwise the same tensors and run state, else why not."""
    meta, tensors, data = read_safetensors(path)
    rmeta, rtensors, rdata = read_safetensors(ref_path)
    if tensors != rtensors:
        return "the tensor names, shapes or offsets differ"
    if data != rdata:
        for name, t in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = t["data_offsets"]
            if data[a:b] != rdata[a:b]:
                return f"tensor '{name}' differs"
        return "the data sections differ"
    for key in ("model", "step", "examples_seen", "epoch", "optimizer_state", "checksum", "config"):
        if meta.get(key) != rmeta.get(key):
            return f"metadata '{key}' is {meta.get(key)!r}, the uninterrupted run's {rmeta.get(key)!r}"
    return ""

def records(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # a kill may cut the last line; nothing after it
                break
            fail("metrics", f"{path}: line {i + 1} is not JSON")
    return out

def main():
    if sys.argv[1] == "compare":  # compare A B: exit 0 when bitwise the same
        why = compare(sys.argv[2], sys.argv[3])
        print(why or "same")
        sys.exit(1 if why else 0)
    a = dict(arg.split("=", 1) for arg in sys.argv[1:])
    mode, ckdir, state_path = a["mode"], a["dir"], a["state"]
    rc, pid, steps, keep = int(a["rc"]), int(a["pid"]), int(a["steps"]), int(a["keep"])
    killed, complete = rc == 137, rc == 0
    state = json.load(open(state_path)) if os.path.exists(state_path) else {
        "latest": -1, "stale_temps": [], "loads": 0, "seen": [], "compared": 0}
    prev = state["latest"]

    # 1. The folder: checkpoints that load, and nothing else but a killed writer's temporary.
    names = sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []
    ckpts, temps = {}, []
    for name in names:
        m, t = CKPT.match(name), TEMP.match(name)
        if m:
            ckpts[int(m.group(1))] = os.path.join(ckdir, name)
        elif t:
            temps.append(name)
        else:
            fail("no-stray-files", f"{ckdir}/{name} is neither a checkpoint nor a checkpoint temporary")
    for name in temps:
        if name in state["stale_temps"]:
            continue  # left by an earlier kill
        if int(TEMP.match(name).group(2)) != pid or not killed:
            fail("no-visible-temporary", f"{ckdir}/{name} is a temporary left by a process that was not killed")
        state["stale_temps"].append(name)
    # A process that finishes a save leaves at most --keep-checkpoints files; one killed between
    # the rename and the removal of the oldest adds one more to what it found.
    limit = max(state.get("files", 0), keep) + 1 if killed else keep
    if len(ckpts) > limit:
        fail("rotation", f"{len(ckpts)} checkpoints in {ckdir} after a {'kill' if killed else 'finished run'}; at most {limit} expected")
    state["files"] = len(ckpts)
    for step, path in sorted(ckpts.items()):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            r = subprocess.run([a["towers"], "eval", "--checkpoint", path, "--threads", "1",
                                "--metrics", out.name], capture_output=True, text=True)
            if r.returncode != 0:
                fail("loads", f"towers eval --checkpoint {path} exited {r.returncode}: {r.stderr.strip()}")
            ev = json.loads(open(out.name).read().splitlines()[-1])
        if ev.get("step") != step:
            fail("loads", f"{path} holds step {ev.get('step')}, its name says {step}")
        state["loads"] += 1
        st = os.stat(path)
        key = f"{os.path.basename(path)} {st.st_ino} {st.st_mtime_ns}"
        if key not in state["seen"]:
            state["seen"].append(key)
        if mode == "sync":
            ref = os.path.join(a["ref"], os.path.basename(path))
            if not os.path.exists(ref):
                fail("sync-bitwise", f"{path}: the uninterrupted run has no checkpoint of step {step}")
            why = compare(path, ref)
            if why:
                fail("sync-bitwise", f"{path} is not the uninterrupted run's {ref}: {why}")
            state["compared"] += 1

    # 2. Steps: the latest checkpoint never goes backwards and stays within the run.
    latest = max(ckpts) if ckpts else -1
    if latest < prev:
        fail("monotonic-step", f"latest checkpoint step {latest} after this attempt, {prev} before it")
    if latest > steps:
        fail("monotonic-step", f"checkpoint step {latest} beyond --steps {steps}")

    # 3. The attempt's own metrics: where it started, what it applied, what it saved.
    recs = records(a["metrics"])
    start = max(prev, 0)
    config = [r for r in recs if r.get("event") == "config"]
    if config and config[0].get("start_step") != start:
        fail("resume-from-latest", f"the process started at step {config[0].get('start_step')}; the latest checkpoint before it was step {prev}")
    versions = [r["step"] for r in recs if r.get("event") == "step"]
    if len(set(versions)) != len(versions):
        fail("step-records", f"{a['metrics']}: a version is recorded twice")
    if versions and (min(versions) <= start or max(versions) > steps):
        fail("step-records", f"{a['metrics']}: versions {min(versions)}..{max(versions)} outside ({start}, {steps}]")
    if mode == "sync" and versions != list(range(start + 1, start + 1 + len(versions))):
        fail("step-records", f"{a['metrics']}: sync versions are not {start + 1}, {start + 2}, ... in order")
    saved = [r["step"] for r in recs if r.get("event") == "checkpoint"]
    if saved and max(saved) > latest:
        fail("durable", f"the process reported checkpoint step {max(saved)} written, the folder's latest is {latest}")
    if complete:
        summary = [r for r in recs if r.get("event") == "summary"]
        if not summary:
            fail("finished", f"{a['metrics']} has no summary record after exit 0")
        s = summary[-1]
        if s.get("steps") != steps or s.get("interrupted") or latest != steps:
            fail("finished", f"summary steps {s.get('steps')} (interrupted {s.get('interrupted')}), latest checkpoint {latest}; --steps {steps}")
        if sorted(versions) != list(range(start + 1, steps + 1)):
            fail("finished", f"{a['metrics']}: the step records are not exactly versions {start + 1}..{steps}")
        applied = [t["applied"] for t in s["towers"]]
        want = [steps - start] * len(applied) if mode == "sync" else None
        if (want is not None and applied != want) or (want is None and sum(applied) != steps - start):
            fail("finished", f"towers applied {applied} for {steps - start} updates in mode {mode}")
        if mode == "sync":
            why = compare(ckpts[steps], os.path.join(a["ref"], os.path.basename(ckpts[steps])))
            if why:
                fail("sync-bitwise", f"final checkpoint: {why}")

    state["latest"] = latest
    json.dump(state, open(state_path, "w"))
    print(f"latest={latest} files={len(ckpts)} stale_temps={len(state['stale_temps'])} "
          f"loads={state['loads']} distinct={len(state['seen'])} compared={state['compared']}")

main()
PY

check_py=(python3 "$WORK/check.py")
check_name() { sed -n 's/^FAIL \[\([^]]*\)\].*/\1/p' <<<"$1" | grep . || echo check-script; }

# The uninterrupted sync run, keeping every checkpoint, for the bitwise comparisons.
ref_dir="$WORK/sync-reference"
if [[ " ${modes[*]} " == *" sync "* ]]; then
  echo "kill-resume: uninterrupted sync run (the reference), every checkpoint kept"
  # shellcheck disable=SC2046
  "$TOWERS_BIN" train "${common[@]}" $(mode_flags sync) --keep-checkpoints 1000000 \
    --checkpoint-dir "$ref_dir" --metrics "$WORK/sync-reference.jsonl" >"$WORK/sync-reference.log" 2>&1 ||
    fail "reference" "the uninterrupted sync run failed: $(tail -1 "$WORK/sync-reference.log")"
  last=$(printf '%s/ckpt-%09d.safetensors' "$ref_dir" "$STEPS")
  ref_files=("$ref_dir"/ckpt-*.safetensors)
  prev=${ref_files[${#ref_files[@]} - 2]}
  [[ -f $last ]] || fail "reference" "no final checkpoint $last"
  # The comparison must see a difference where there is one: two consecutive checkpoints.
  if "${check_py[@]}" compare "$last" "$prev" >/dev/null 2>&1; then
    fail "comparator" "the comparison finds no difference between $last and $prev"
  fi
fi

total_kills=0 total_resumes=0 total_fresh=0 total_rounds=0 total_loads=0 total_compared=0 total_stale=0
total_distinct=0
declare -A mkills mresumes mfresh mrounds mmost mloads mdistinct mcompared mstale
n_modes=${#modes[@]}
for i in "${!modes[@]}"; do
  mode=${modes[$i]}
  want=$(( KILLS / n_modes + (i < KILLS % n_modes ? 1 : 0) ))
  # shellcheck disable=SC2207
  flags=($(mode_flags "$mode"))
  kills=0 resumes=0 fresh=0 rounds=0 loads=0 distinct=0 compared=0 stale=0 most=0
  round=0 attempt=0 dir="" state=""
  new_round() {
    round=$((round + 1)) attempt=0 round_kills=0
    dir="$WORK/$mode/round-$round"
    state="$dir/state.json"
    mkdir -p "$dir"
  }
  round_done() {  # adds the finished round's counts (the checks' last line) to the mode's
    local kv
    rounds=$((rounds + 1))
    if ((round_kills > most)); then most=$round_kills; fi
    for kv in $line; do
      case $kv in
        loads=*) loads=$((loads + ${kv#*=})) ;;
        distinct=*) distinct=$((distinct + ${kv#*=})) ;;
        compared=*) compared=$((compared + ${kv#*=})) ;;
        stale_temps=*) stale=$((stale + ${kv#*=})) ;;
      esac
    done
  }
  # run_attempt KILL_AFTER_MS (-1: let it finish); sets rc and the checks' line
  run_attempt() {
    local delay=$1 had_ckpt
    attempt=$((attempt + 1))
    had_ckpt=$(compgen -G "$dir/ckpt/ckpt-*.safetensors" >/dev/null && echo 1 || echo 0)
    "$TOWERS_BIN" train "${common[@]}" "${flags[@]}" --keep-checkpoints "$KEEP" \
      --checkpoint-dir "$dir/ckpt" --metrics "$dir/attempt-$attempt.jsonl" --resume \
      >"$dir/attempt-$attempt.log" 2>&1 &
    child=$!
    if ((delay >= 0)); then
      sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
      kill -9 "$child" 2>/dev/null || true
    fi
    rc=0
    { wait "$child"; } 2>/dev/null || rc=$?
    local pid=$child
    child=""
    case $rc in
      137) ;;
      0) ;;
      *) fail "exit-code" "$mode round $round attempt $attempt exited $rc (expected 0, or 137 when killed): $(tail -2 "$dir/attempt-$attempt.log" | tr '\n' ' ')" ;;
    esac
    if ((attempt > 1)); then  # the first attempt of a round starts a fresh folder
      if ((had_ckpt)); then resumes=$((resumes + 1)); else fresh=$((fresh + 1)); fi
    fi
    line=$("${check_py[@]}" mode="$mode" dir="$dir/ckpt" state="$state" rc="$rc" pid="$pid" \
      steps="$STEPS" keep="$KEEP" metrics="$dir/attempt-$attempt.jsonl" ref="$ref_dir" \
      towers="$TOWERS_BIN" 2>&1) ||
      fail "$(check_name "$line")" "$mode round $round attempt $attempt (exit $rc, kill delay ${delay} ms): ${line#FAIL \[*\]: }"
  }
  new_round
  while ((kills < want)); do
    delay=$((RANDOM % (DELAY_MAX_MS + 1)))
    run_attempt "$delay"
    if ((rc == 137)); then
      kills=$((kills + 1)) round_kills=$((round_kills + 1))
      echo "$mode round $round attempt $attempt: kill -9 at ${delay} ms -> $line"
    else
      echo "$mode round $round attempt $attempt: finished before the kill at ${delay} ms -> $line"
    fi
    if ((rc == 0)); then
      round_done
      if ((kills < want)); then new_round; fi
    fi
  done
  if ((rc != 0)); then  # the last round was left killed: finish it
    run_attempt -1
    echo "$mode round $round attempt $attempt: resumed to the end -> $line"
    round_done
  fi
  mkills[$mode]=$kills mresumes[$mode]=$resumes mfresh[$mode]=$fresh mrounds[$mode]=$rounds mmost[$mode]=$most
  mloads[$mode]=$loads mdistinct[$mode]=$distinct mcompared[$mode]=$compared mstale[$mode]=$stale
  total_kills=$((total_kills + kills)) total_resumes=$((total_resumes + resumes))
  total_fresh=$((total_fresh + fresh)) total_rounds=$((total_rounds + rounds))
  total_loads=$((total_loads + loads)) total_distinct=$((total_distinct + distinct))
  total_compared=$((total_compared + compared))
  total_stale=$((total_stale + stale))
done

echo
echo "kill-resume: SEED=$SEED, $STEPS steps per run, batch $BATCH, 2 towers, checkpoint every $EVERY epochs, keep $KEEP, kill delays 0..$DELAY_MAX_MS ms"
row() { printf '%-6s %6s %8s %6s %5s %9s %6s %9s %8s %6s\n' "$@"; }
row mode kills resumes fresh runs max-kills loads distinct bitwise stale
for mode in "${modes[@]}"; do
  cmp=${mcompared[$mode]}
  [[ $mode == sync ]] || cmp="-"
  row "$mode" "${mkills[$mode]}" "${mresumes[$mode]}" "${mfresh[$mode]}" "${mrounds[$mode]}" \
    "${mmost[$mode]}" "${mloads[$mode]}" "${mdistinct[$mode]}" "$cmp" "${mstale[$mode]}"
done
row total "$total_kills" "$total_resumes" "$total_fresh" "$total_rounds" "" "$total_loads" \
  "$total_distinct" "$total_compared" "$total_stale"
cat <<'EOF'
resumes: starts with a checkpoint present; fresh: --resume of a folder still empty (the kill
before came before the first checkpoint); runs: runs resumed to the end (--steps reached);
max-kills: the most kills one run survived; loads: successful `towers eval` of a checkpoint
after an attempt (every file present, every time); distinct: different checkpoint files among
them; bitwise: sync checkpoints compared equal with the uninterrupted run's of the same step;
stale: save_checkpoint temporaries (ckpt-*.safetensors.tmp-PID) that killed processes left
behind (--resume never reads them; nothing removes them).
EOF
echo "kill-resume: PASS in $(elapsed) s"
if ((KEEP_WORK)); then echo "work folder: $WORK"; else rm -rf "$WORK"; fi
