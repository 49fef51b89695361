#!/usr/bin/env bash
# Soak: one long async run of 4 CPU towers with stragglers, evaluations and checkpoints, sampled
# once a second from /proc/<pid>/status and /proc/<pid>/fd. At DURATION seconds it is stopped
# with SIGINT (the Ctrl-C path: the step finishes, a checkpoint is written, exit 130). It fails,
# naming the check, unless
#   - memory is flat: the median RSS of the second half of the run (after WARMUP) exceeds the
#     median of the first half by at most RSS_BOUND_KB + 16 bytes per update of the second half
#     (the engine keeps each tower step's time, 8 bytes, for the percentiles of the summary;
#     a std::vector doubles, so its capacity is at most twice its contents);
#   - open file descriptors and threads do not grow: their maxima in the second half are at most
#     those of the first half (descriptors open on the checkpoint folder, a save in progress,
#     are counted apart: at most 2 at a time, its temporary and the folder);
#   - no update is lost or counted twice: the metrics' step records hold every version from
#     start_step + 1 to the final one exactly once, and the final version = the number of step
#     records = the summary's steps = the sum of the towers' "applied" (one tower per update);
#   - evaluations and checkpoints kept coming (in both halves), the checkpoint folder holds at
#     most --keep-checkpoints files and no temporary, and the last checkpoint loads
#     (`towers eval`) at the summary's step.
#
#   scripts/soak.sh                       # 5 minutes
#   DURATION=3600 scripts/soak.sh         # an hour
# Settings (environment): DURATION and WARMUP (seconds), SIZE (--synthetic-size), BATCH,
# EVAL_EVERY and CKPT_EVERY (epochs), KEEP, RSS_BOUND_KB (default 4096), TOWERS_BIN,
# OUT (folder for samples.csv, summary.txt, metrics.jsonl, the run's log and checkpoints;
# default a new folder under /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."

TOWERS_BIN=${TOWERS_BIN:-build/towers}
DURATION=${DURATION:-300}
WARMUP=${WARMUP:-30}
SIZE=${SIZE:-10000}
BATCH=${BATCH:-64}
EVAL_EVERY=${EVAL_EVERY:-10}
CKPT_EVERY=${CKPT_EVERY:-10}
KEEP=${KEEP:-3}
RSS_BOUND_KB=${RSS_BOUND_KB:-4096}

[[ -x $TOWERS_BIN ]] || { echo "soak: no towers binary at $TOWERS_BIN (build it first)" >&2; exit 2; }
((DURATION >= WARMUP + 20)) || { echo "soak: DURATION must be at least WARMUP + 20 s" >&2; exit 2; }
TOWERS_BIN=$(realpath "$TOWERS_BIN")
OUT=${OUT:-$(mktemp -d /tmp/soak.XXXXXX)}
mkdir -p "$OUT"
rm -rf "$OUT/ckpt" "$OUT/metrics.jsonl"

cmd=("$TOWERS_BIN" train --model mlp --dataset synthetic --synthetic-size "$SIZE" --batch "$BATCH"
     --mode async --towers 4 --threads-per-tower 1 --slow-tower 1:5 --slow-tower 3:20
     --lr 0.01 --epochs 1000000 --eval-every "$EVAL_EVERY" --checkpoint-dir "$OUT/ckpt"
     --checkpoint-every "$CKPT_EVERY" --keep-checkpoints "$KEEP" --metrics "$OUT/metrics.jsonl"
     --log-every 1000000 --quiet)
echo "soak: ${cmd[*]}" | tee "$OUT/command.txt"

pid=""
cleanup() { if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

"${cmd[@]}" >"$OUT/run.log" 2>&1 &
pid=$!
t0=$(date +%s.%N)
ckpt_dir=$(realpath "$OUT")/ckpt
echo "t_s,rss_kb,fds,fds_saving,threads,step" >"$OUT/samples.csv"
# One sample a second, on whole seconds after the start, for DURATION seconds.
for ((i = 1; i <= DURATION; i++)); do
  now=$(date +%s.%N)
  pause=$(awk -v t0="$t0" -v i="$i" -v now="$now" 'BEGIN { d = t0 + i - now; if (d < 0) d = 0; printf "%.3f", d }')
  sleep "$pause"
  if ! kill -0 "$pid" 2>/dev/null; then
    rc=0
    wait "$pid" || rc=$?
    pid=""
    echo "FAIL [ran-to-the-end]: the run ended by itself after $i s with exit $rc: $(tail -2 "$OUT/run.log" | tr '\n' ' ')" >&2
    exit 1
  fi
  rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || rss=""
  threads=$(awk '/^Threads:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || threads=""
  # fds_saving: those open on the checkpoint folder (a save in progress: its temporary, the folder)
  targets=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 -printf '%l\n' 2>/dev/null) || targets=""
  fds=$(grep -c . <<<"$targets") || true
  saving=$(grep -c -F "$ckpt_dir" <<<"$targets") || true
  step=$(tail -c 4096 "$OUT/metrics.jsonl" 2>/dev/null | grep '"event":"step"' | tail -1 |
    grep -o '"step":[0-9]*' | cut -d: -f2) || step=""
  if [[ -n $rss && -n $threads ]]; then echo "$i,$rss,$fds,$saving,$threads,${step:-}" >>"$OUT/samples.csv"; fi
done

kill -INT "$pid" 2>/dev/null || true
rc=0
wait "$pid" || rc=$?
pid=""
echo "soak: stopped with SIGINT after $DURATION s; exit $rc"
((rc == 130)) || { echo "FAIL [interrupt]: exit $rc after SIGINT, expected 130: $(tail -2 "$OUT/run.log" | tr '\n' ' ')" >&2; exit 1; }

python3 - "$OUT" "$TOWERS_BIN" "$WARMUP" "$RSS_BOUND_KB" "$KEEP" "$DURATION" <<'PY'
import csv, json, os, re, subprocess, sys, tempfile

out, towers, warmup, bound_kb, keep, duration = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
failures, lines = [], []

def check(name, ok, detail):
    lines.append(f"{'ok  ' if ok else 'FAIL'} [{name}] {detail}")
    if not ok:
        failures.append(name)

# Samples: after WARMUP, the first and the second half of what is left.
rows = [{k: (int(v) if v else None) for k, v in r.items()} for r in csv.DictReader(open(f"{out}/samples.csv"))]
rows = [r for r in rows if r["t_s"] > warmup]
half = len(rows) // 2
first, second = rows[:half], rows[half:]

# Metrics: every version once; the summary agrees.
steps, evals, ckpts, summary = [], [], [], None
with open(f"{out}/metrics.jsonl") as f:
    for line in f:
        r = json.loads(line)
        e = r.get("event")
        if e == "step":
            steps.append(r["step"])
        elif e == "eval":
            evals.append(r)
        elif e == "checkpoint":
            ckpts.append(r)
        elif e == "summary":
            summary = r
if summary is None:
    print("FAIL [summary]: the metrics have no summary record", file=sys.stderr)
    sys.exit(1)
start, final = summary["start_step"], summary["steps"]
counts = {}
for v in steps:
    counts[v] = counts.get(v, 0) + 1
dup = sorted(v for v, n in counts.items() if n > 1)
missing = [v for v in range(start + 1, final + 1) if v not in counts]
outside = sorted(v for v in counts if v <= start or v > final)
applied = [t["applied"] for t in summary["towers"]]
tower_steps = [t["steps"] for t in summary["towers"]]
check("no-lost-update", not missing and not outside,
      f"versions {start + 1}..{final}: {len(missing)} missing{' (first ' + str(missing[:5]) + ')' if missing else ''}, {len(outside)} outside")
check("no-double-count", not dup, f"{len(dup)} versions recorded more than once{' (first ' + str(dup[:5]) + ')' if dup else ''}")
check("counts-agree", final - start == len(steps) == sum(applied) and summary["interrupted"],
      f"final version {final} (from {start}), {len(steps)} step records, summary steps {final}, "
      f"sum of applied {sum(applied)} ({' + '.join(map(str, applied))}), interrupted {summary['interrupted']}")

# Memory, descriptors, threads.
steps_at = lambda r: r["step"] or 0
second_updates = max(0, steps_at(second[-1]) - steps_at(second[0])) if second else 0
med = lambda xs: sorted(xs)[len(xs) // 2]
rss1, rss2 = med([r["rss_kb"] for r in first]), med([r["rss_kb"] for r in second])
peak1, peak2 = max(r["rss_kb"] for r in first), max(r["rss_kb"] for r in second)
allow = bound_kb + 16 * second_updates / 1024
check("rss-flat", rss2 - rss1 <= allow,
      f"median RSS {rss1 / 1024:.1f} MiB in the first half, {rss2 / 1024:.1f} MiB in the second: "
      f"{(rss2 - rss1) / 1024:+.2f} MiB, bound {allow / 1024:.2f} MiB ({bound_kb} KiB + 16 B x {second_updates} updates); "
      f"peaks {peak1 / 1024:.1f} / {peak2 / 1024:.1f} MiB")
# Information, not a check: the least-squares slope of RSS over the measured samples.
n = len(rows)
mt, mr = sum(r["t_s"] for r in rows) / n, sum(r["rss_kb"] for r in rows) / n
var = sum((r["t_s"] - mt) ** 2 for r in rows)
slope = sum((r["t_s"] - mt) * (r["rss_kb"] - mr) for r in rows) / var if var else 0.0
lines.append(f"     [rss-trend] {slope * 60:+.1f} KiB/min over the {n} samples after the warm-up "
             f"(min {min(r['rss_kb'] for r in rows) / 1024:.1f}, max {max(r['rss_kb'] for r in rows) / 1024:.1f} MiB)")
for r in rows:
    r["fds_other"] = r["fds"] - r["fds_saving"]
for key, what in (("fds_other", "open files (besides a save in progress)"), ("threads", "threads")):
    m1, m2 = max(r[key] for r in first), max(r[key] for r in second)
    check(f"{key.split('_')[0]}-flat", m2 <= m1, f"{what}: max {m1} in the first half, {m2} in the second (min {min(r[key] for r in rows)})")
saving = max(r["fds_saving"] for r in rows)
check("save-fds", saving <= 2,
      f"at most {saving} files open on the checkpoint folder at a sample (a save: its temporary and the folder); "
      f"{sum(1 for r in rows if r['fds_saving'])} samples caught a save")

# Evaluations and checkpoints kept coming; the folder is clean; the last checkpoint loads.
t_mid = second[0]["t_s"] if second else duration
v_mid = steps_at(second[0]) if second else final
e1 = sum(1 for e in evals if e["step"] <= v_mid)
c1 = sum(1 for c in ckpts if c["step"] <= v_mid)
check("side-work", e1 > 0 and len(evals) - e1 > 0 and c1 > 0 and len(ckpts) - c1 > 0,
      f"{len(evals)} evaluations ({e1} up to version {v_mid}, at {t_mid} s), {len(ckpts)} checkpoints ({c1} up to it)")
names = sorted(os.listdir(f"{out}/ckpt"))
good = [n for n in names if re.fullmatch(r"ckpt-\d{9}\.safetensors", n)]
check("checkpoint-folder", len(good) == len(names) and 1 <= len(good) <= keep,
      f"{len(names)} files, {len(good)} checkpoints (keep {keep}): {' '.join(names)}")
last = f"{out}/ckpt/ckpt-{final:09d}.safetensors"
with tempfile.NamedTemporaryFile(suffix=".json") as ev:
    r = subprocess.run([towers, "eval", "--checkpoint", last, "--threads", "1", "--metrics", ev.name],
                       capture_output=True, text=True)
    got = json.loads(open(ev.name).read().splitlines()[-1]) if r.returncode == 0 else {}
check("last-checkpoint-loads", r.returncode == 0 and got.get("step") == final,
      f"{os.path.basename(last)}: towers eval exit {r.returncode}, step {got.get('step')}, test accuracy {got.get('test_accuracy')}")

head = [
    f"soak: {duration} s (warm-up {warmup} s excluded; halves of {len(first)} and {len(second)} samples)",
    f"run: async x 4 towers, {final - start} updates, {summary['epochs']:.1f} epochs, "
    f"{summary['train_images_per_sec']:.0f} images/s, max staleness {summary['max_staleness']}, "
    f"per-tower steps {tower_steps}, {len(evals)} evaluations, {len(ckpts)} checkpoints, "
    f"last evaluation {evals[-1]['test_accuracy'] if evals else None}",
]
text = "\n".join(head + lines + [f"soak: {'FAIL (' + ', '.join(failures) + ')' if failures else 'PASS'}"])
print(text)
open(f"{out}/summary.txt", "w").write(text + "\n")
sys.exit(1 if failures else 0)
PY
echo "soak: samples, summary and metrics in $OUT"
