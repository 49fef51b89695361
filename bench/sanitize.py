#!/usr/bin/env python3
"""compute-sanitizer over the GPU tests, as jobs from one queue, within a time limit.

    bench/sanitize.py --tests BUILD/tests/towers_tests --out DIR --seconds S --slots N \
        [--costs FILE] [--only FILE] RUN...

RUN is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS (run-gpu.sh's list). Each run's tests are listed
with --gtest_list_tests and cut into jobs of a few tests each; every job is one
compute-sanitizer process. The jobs of all runs share N slots, the costliest first, so that
no slot idles while another still holds a long queue (fixed gtest shards, 3 per tool, left 5
of 18 unfinished after 200 s on an H200 on 2026-11-27).

A test's cost is its time in --costs (lines "TEST SECONDS" or "RUN|TEST SECONDS"; run-gpu.sh
passes bench/sanitize-costs.txt, the emulator's times), or 1 s where unknown, times a factor
per tool (racecheck is the slowest). A test whose cost is above a job's target runs alone.

A test counts as checked when its job's tool printed its error summary and the job exited as
a sanitizer run does (0; 1 with a failed test; 99 with errors). A job cut at the time limit,
or one that crashed before the summary, leaves its tests unchecked, even those that printed
OK: an error report of theirs may be missing. A job that crashed after its summary (at the
program's exit, say) has its tests checked, and fails the run.

What DIR holds:
  sanitizer-NAME.txt        every job's output of the run, one after the other
  sanitizer-jobs.txt        one line a job: run, tests, estimated and measured seconds, how it
                            ended, errors (to correct the costs after a run)
  sanitizer-times.txt       "RUN|TEST SECONDS" for every test that ran to its end, and for the
                            test a cut job was running, the time it had run (a lower bound):
                            a --costs file for the next run
  sanitizer-unfinished.txt  "RUN|TEST" for every test not checked: --only this file checks
                            just those
It prints one line per run ("sanitizer NAME: E errors; tests passed P, failed F, skipped S,
unfinished U of T") and names the failed and unfinished tests. The exit code is 0 only when
every run had tests, every test was checked and passed, every job exited as a sanitizer run
does, and the tools found 0 errors. SIGTERM or SIGINT ends the running jobs and writes the
report as at the time limit.
"""

import argparse
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# How much slower a tool is than the others, roughly (racecheck instruments every shared
# memory access): only the queue's order and the jobs' sizes depend on it.
TOOL_FACTOR = {"racecheck": 4.0}

RESULT = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+)(?:, where .*)? \((\d+) ms\)$")
ERRORS = (re.compile(r"^========= ERROR SUMMARY: (\d+) error"),
          re.compile(r"^========= RACECHECK SUMMARY: .*\((\d+) error"))
# The jobs run with gtest's defaults whatever the caller's environment says (a sharded suite
# sets GTEST_TOTAL_SHARDS, which would leave each job's tests to other shards).
GTEST_FLAGS = ["--gtest_print_time=1", "--gtest_brief=0", "--gtest_color=no"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GTEST_")}


def list_tests(binary, gtest_filter):
    """The full names of the tests that gtest_filter selects, in gtest's order."""
    out = subprocess.run([binary, "--gtest_list_tests", "--gtest_filter=" + gtest_filter],
                         check=True, capture_output=True, env=ENV).stdout
    tests, suite = [], None
    for line in out.decode(errors="replace").splitlines():
        if not line.strip() or line.startswith("Running main()"):
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        else:
            tests.append(suite + line.split("#")[0].strip())
    return tests


def read_costs(path):
    costs = {}
    if not path:
        return costs
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, seconds = line.rsplit(None, 1)
                costs[name] = float(seconds)
    return costs


def make_jobs(runs, costs, slots):
    """Jobs (run, tests, estimated cost) for all runs: a run's tests, costliest first, packed
    into jobs of about the target cost each (total / (2 * slots)), first fit."""
    weighted = []
    for run in runs:
        factor = TOOL_FACTOR.get(run["tool"], 1.0)
        for t in run["tests"]:
            c = costs.get(run["name"] + "|" + t, costs.get(t, 1.0))
            weighted.append((run, t, factor * max(c, 0.05)))
    total = sum(c for _, _, c in weighted)
    target = max(total / (2 * slots), 1e-9)
    jobs = []
    for run in runs:
        mine = sorted(((t, c) for r, t, c in weighted if r is run), key=lambda x: -x[1])
        bins = []  # [tests, cost]
        for t, c in mine:
            for b in bins:
                if b[1] + c <= target:
                    b[0].append(t)
                    b[1] += c
                    break
            else:
                bins.append([[t], c])
        jobs += [{"run": run, "tests": b[0], "cost": b[1]} for b in bins]
    jobs.sort(key=lambda j: -j["cost"])
    return jobs


def become_subreaper():
    """Makes the orphans of the jobs' trees (a program whose tool died first) children of this
    process rather than of init: stop() still finds them, and their pids stay theirs while
    they wait here to be reaped."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def tree():
    """(pid, pidfd or None) of every process below this one, from /proc's children lists. Each
    is opened (a pidfd, where the kernel has them) and then checked to be still the child of
    the process it was listed under, so that a process that took a listed pid afterwards is
    never signalled."""
    found, todo, seen = [], [os.getpid()], set()
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{parent}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k in seen:
                    continue
                fd = None
                if hasattr(os, "pidfd_open"):
                    try:
                        fd = os.pidfd_open(k)
                    except OSError:
                        continue  # gone
                if parent_of(k) != parent:  # gone before it was opened
                    if fd is not None:
                        os.close(fd)
                    continue
                seen.add(k)
                found.append((k, fd))
                todo.append(k)
    return found


def close_tree(handles):
    for _, fd in handles:
        if fd is not None:
            os.close(fd)


def signal_tree(handles, sig):
    for pid, fd in handles:
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except OSError:
            pass


def stop(jobs, grace=5.0):
    """Ends the jobs still running, and everything below this process (their tools, the
    programs the tools run, and those programs' orphans, in whatever group or session): TERM,
    then KILL after `grace` seconds. A tool that is still not reaped 5 s after that is given up
    ("would not end")."""
    live = [j for j in jobs if j["proc"].poll() is None]
    for j in live:
        j["cut"] = True
    handles = tree()
    try:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for j in live:
                try:
                    os.killpg(j["proc"].pid, sig)
                except OSError:
                    pass
            signal_tree(handles, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(j["proc"].poll() is None for j in live):
                time.sleep(0.1)
    finally:
        close_tree(handles)
    for j in live:
        if j["proc"].poll() is None:
            j["stuck"] = True


def parse(log):
    """Per test: (status, ms); the error count, or None when the tool printed no summary."""
    results, errors = {}, None
    for line in log.splitlines():
        m = RESULT.match(line)
        if m:
            results[m.group(2)] = (m.group(1), int(m.group(3)))
            continue
        for e in ERRORS:
            m = e.match(line)
            if m:
                errors = int(m.group(1))
    return results, errors


def run_queue(a, jobs, deadline):
    """Runs the jobs, a.slots at once, until they are done or the deadline (or a signal)."""
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    queue, running = list(jobs), []
    try:
        while queue or running:
            now = time.monotonic()
            late = now >= deadline or bool(interrupted)
            while queue and len(running) < a.slots and not late:
                job = queue.pop(0)
                run = job["run"]
                cmd = [a.sanitizer, "--tool", run["tool"], *run["extra"], "--error-exitcode",
                       "99", a.tests, "--gtest_filter=" + ":".join(job["tests"]), *GTEST_FLAGS]
                job["file"] = open(job["log"], "wb")
                job["started"] = now
                # A process group of its own (the tool and the program it runs end together),
                # in the caller's session, so that whoever ends the caller's session ends it.
                job["proc"] = subprocess.Popen(cmd, stdout=job["file"], stderr=subprocess.STDOUT,
                                               env=ENV, preexec_fn=lambda: os.setpgid(0, 0))
                running.append(job)
            if late and running:
                # Stopped from outside: whoever sent it will not wait long.
                stop(running, 2.0 if interrupted else 5.0)
            for job in list(running):
                if job["proc"].poll() is None and not job.get("stuck"):
                    continue
                job["rc"] = job["proc"].returncode
                job["seconds"] = time.monotonic() - job["started"]
                job["file"].close()
                running.remove(job)
            if late:
                break
            time.sleep(0.2)
    finally:
        left = [j for j in running if j["proc"].poll() is None]
        if left:
            stop(left)
        # Whatever a finished job left behind (a program its tool did not wait for).
        behind = tree()
        signal_tree(behind, signal.SIGKILL)
        close_tree(behind)
    return bool(interrupted)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", required=True, help="the towers_tests binary")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, required=True, help="the time limit of it all")
    ap.add_argument("--slots", type=int, required=True, help="jobs at once")
    ap.add_argument("--costs", help="TEST SECONDS lines")
    ap.add_argument("--only", help="RUN|TEST lines: check just these")
    ap.add_argument("--sanitizer", default="compute-sanitizer")
    ap.add_argument("runs", nargs="+", help="NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS")
    a = ap.parse_args()
    start = time.monotonic()
    deadline = start + a.seconds
    if a.slots < 1 or a.seconds <= 0:
        ap.error("--slots must be at least 1 and --seconds positive")
    for spec in a.runs:
        parts = spec.split("|")
        if len(parts) != 4 or not all(parts[:3]):
            ap.error(f"a run is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS, not '{spec}'")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out: '{a.out}' exists and is not a folder")
    if not os.access(a.tests, os.X_OK):
        ap.error(f"--tests: '{a.tests}' is not an executable file")
    if shutil.which(a.sanitizer) is None:
        ap.error(f"--sanitizer: '{a.sanitizer}' is not a program on the PATH")
    os.makedirs(a.out, exist_ok=True)

    only = None
    if a.only:
        with open(a.only) as f:
            only = {line.strip() for line in f if line.strip()}
    runs, listed = [], set()
    for spec in a.runs:
        name, tool, gtest_filter, extra = spec.split("|")
        tests = list_tests(a.tests, gtest_filter)
        listed |= {f"{name}|{t}" for t in tests}
        run = {"name": name, "tool": tool, "extra": extra.split(), "tests": tests,
               "listed": len(tests)}
        if only is not None:
            run["tests"] = [t for t in tests if f"{name}|{t}" in only]
        runs.append(run)
    jobs = make_jobs([r for r in runs if r["tests"]], read_costs(a.costs), a.slots)

    logs_dir = os.path.join(a.out, "sanitizer-jobs")
    os.makedirs(logs_dir, exist_ok=True)
    for k, job in enumerate(jobs):
        job["log"] = os.path.join(logs_dir, f"{job['run']['name']}-{k}.txt")
    become_subreaper()
    interrupted = run_queue(a, jobs, deadline)

    ok = not interrupted
    unfinished_all, times, job_lines = [], [], []
    for run in runs:
        mine = [j for j in jobs if j["run"] is run]
        passed = failed = skipped = errors = 0
        unfinished, failed_names, no_summary, abnormal = [], [], 0, []
        with open(os.path.join(a.out, f"sanitizer-{run['name']}.txt"), "w") as log:
            for j in mine:
                text = ""
                if "proc" in j:
                    with open(j["log"], errors="replace") as f:
                        text = f.read()
                    os.remove(j["log"])
                results, errs = parse(text)
                rc = j.get("rc")
                if "proc" not in j:
                    state = "not started"
                elif j.get("stuck"):
                    state = "would not end"
                elif j.get("cut"):
                    state = "cut at the time limit"
                else:
                    state = f"exit {rc}"
                log.write(f"##### job: {len(j['tests'])} tests, {state}\n{text}")
                checked = "proc" in j and not j.get("cut") and errs is not None
                if "proc" in j and errs is None:
                    no_summary += 1
                # How a sanitizer run ends: 0; 1 (a test failed, no errors found); 99 (errors).
                any_failed = any(results.get(t, ("",))[0] == "FAILED" for t in j["tests"])
                if checked and not (rc == 0 or (rc == 1 and any_failed) or (rc == 99 and errs > 0)):
                    abnormal.append(f"{state} ({len(j['tests'])} tests from {j['tests'][0]})")
                errors += errs or 0
                job_lines.append(f"{run['name']} tests={len(j['tests'])} estimated={j['cost']:.1f}s "
                                 f"took={j.get('seconds', 0):.1f}s {state} errors="
                                 f"{'none printed' if errs is None else errs} first={j['tests'][0]}")
                ran_for = sum(ms for _, ms in results.values()) / 1000
                running_test = j.get("cut")  # the first test without a result was running
                for t in j["tests"]:
                    status, ms = results.get(t, (None, 0))
                    if status is not None:
                        times.append(f"{run['name']}|{t} {ms / 1000:.2f}")
                    elif running_test:
                        times.append(f"{run['name']}|{t} {max(j['seconds'] - ran_for, 0):.2f}")
                        running_test = False
                    if status is None or not checked:
                        unfinished.append(t)
                        continue
                    if status == "OK":
                        passed += 1
                    elif status == "SKIPPED":
                        skipped += 1
                    else:
                        failed += 1
                        failed_names.append(t)
        if only is not None and not run["tests"]:
            continue  # none of this run's tests to check again
        line = (f"sanitizer {run['name']}: {errors} errors; tests passed {passed}, failed "
                f"{failed}, skipped {skipped}, unfinished {len(unfinished)} of {len(run['tests'])}")
        if no_summary:
            line += f" ({no_summary} jobs printed no error summary: cut or crashed)"
        if run["listed"] == 0:
            line += " (its filter selects no test)"
        print(line)
        for t in failed_names:
            print(f"  failed: {t}")
        for t in unfinished:
            print(f"  unfinished: {t}")
        for what in abnormal:
            print(f"  a job ended abnormally after its error summary: {what}")
        unfinished_all += [f"{run['name']}|{t}" for t in unfinished]
        ok = (ok and errors == 0 and failed == 0 and not unfinished and no_summary == 0
              and not abnormal and run["listed"] > 0)
    if only is not None:
        stale = sorted(only - listed)
        for entry in stale:
            print(f"  --only: '{entry}' names no test of the runs")
        ok = ok and not stale
    for name, lines in (("sanitizer-unfinished.txt", unfinished_all),
                        ("sanitizer-times.txt", times), ("sanitizer-jobs.txt", job_lines)):
        with open(os.path.join(a.out, name), "w") as f:
            f.writelines(line + "\n" for line in lines)
    try:
        os.rmdir(logs_dir)  # (emptied: each job's log is in its run's file)
    except OSError:
        pass
    end = " (ended by a signal)" if interrupted else ""
    print(f"sanitizers: {len(jobs)} jobs in {a.slots} slots, {time.monotonic() - start:.0f} s{end}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
