#!/usr/bin/env python3
"""compute-sanitizer over the GPU tests, as jobs from one queue, within a time limit.

    bench/sanitize.py --tests BUILD/tests/towers_tests --out DIR --seconds S --slots N \
        [--costs FILE] [--only FILE] RUN...

RUN is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS (run-gpu.sh's list). Each run's tests are listed
with --gtest_list_tests and cut into jobs of a few tests each; every job is one
compute-sanitizer process. The jobs of all runs share N slots, the costliest first, so that
no slot idles while another still holds a long queue: fixed gtest shards finished unevenly
(on an H200 on 2026-11-27, 5 of 18 shards had not finished after 200 s while others had
ended long before).

A test's cost is its time in --costs (lines "TEST SECONDS" or "RUN|TEST SECONDS"; run-gpu.sh
passes bench/sanitize-costs.txt, the emulator's times), or 1 s where unknown, times a factor
per tool (racecheck is the slowest). A test whose cost is above a job's target runs alone.

What DIR holds:
  sanitizer-NAME.txt        every job's output of the run, one after the other
  sanitizer-jobs.txt        one line a job: run, tests, estimated and measured seconds, exit
                            code, errors (to correct the costs after a run)
  sanitizer-times.txt       "RUN|TEST SECONDS" for every test that ran to its end (a --costs
                            file for the next run)
  sanitizer-unfinished.txt  "RUN|TEST" for every test not checked to its end: not reached, or
                            in a job that the time limit cut or that crashed (a test counts
                            only once its job's tool printed its error summary); --only this
                            file checks just those
It prints one line per run ("sanitizer NAME: E errors; tests passed P, failed F, skipped S,
unfinished U of T") and names the failed and unfinished tests. The exit code is 0 only when
every test of every run finished and passed with 0 errors.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

# How much slower a tool is than the others, roughly (racecheck instruments every shared
# memory access): only the order of the queue depends on it.
TOOL_FACTOR = {"racecheck": 4.0}

RESULT = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+)(?:, where .*)? \((\d+) ms\)$")
ERRORS = (re.compile(r"^========= ERROR SUMMARY: (\d+) error"),
          re.compile(r"^========= RACECHECK SUMMARY: .*\((\d+) error"))


def list_tests(binary, gtest_filter):
    """The full names of the tests that gtest_filter selects, in gtest's order."""
    out = subprocess.run([binary, "--gtest_list_tests", "--gtest_filter=" + gtest_filter],
                         check=True, capture_output=True, text=True).stdout
    tests, suite = [], None
    for line in out.splitlines():
        if not line.strip():
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


def stop(procs):
    """Ends the jobs' whole process groups: TERM, then KILL those left after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 5
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)


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
    if a.slots < 1 or a.seconds <= 0:
        ap.error("--slots must be at least 1 and --seconds positive")
    start = time.monotonic()
    deadline = start + a.seconds
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out: '{a.out}' exists and is not a folder")
    if not os.access(a.tests, os.X_OK):
        ap.error(f"--tests: '{a.tests}' is not an executable file")
    os.makedirs(a.out, exist_ok=True)

    only = None
    if a.only:
        with open(a.only) as f:
            only = {line.strip() for line in f if line.strip()}
    runs = []
    for spec in a.runs:
        parts = spec.split("|")
        if len(parts) != 4 or not all(parts[:3]):
            ap.error(f"a run is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS, not '{spec}'")
        name, tool, gtest_filter, extra = parts
        tests = list_tests(a.tests, gtest_filter)
        if only is not None:
            tests = [t for t in tests if f"{name}|{t}" in only]
        runs.append({"name": name, "tool": tool, "extra": extra.split(), "tests": tests})
    jobs = make_jobs([r for r in runs if r["tests"]], read_costs(a.costs), a.slots)

    logs_dir = os.path.join(a.out, "sanitizer-jobs")
    os.makedirs(logs_dir, exist_ok=True)
    queue, running = list(jobs), []
    for k, job in enumerate(jobs):
        job["log"] = os.path.join(logs_dir, f"{job['run']['name']}-{k}.txt")
    while queue or running:
        now = time.monotonic()
        while queue and len(running) < a.slots and now < deadline:
            job = queue.pop(0)
            run = job["run"]
            cmd = [a.sanitizer, "--tool", run["tool"], *run["extra"], "--error-exitcode", "99",
                   a.tests, "--gtest_filter=" + ":".join(job["tests"])]
            job["file"] = open(job["log"], "w")
            job["started"] = now
            job["proc"] = subprocess.Popen(cmd, stdout=job["file"], stderr=subprocess.STDOUT,
                                           start_new_session=True)
            running.append(job)
        if now >= deadline and running:
            stop([job["proc"] for job in running])
            for job in running:
                job["cut"] = True
        for job in list(running):
            rc = job["proc"].poll()
            if rc is None:
                continue
            job["rc"] = rc
            job["seconds"] = time.monotonic() - job["started"]
            job["file"].close()
            running.remove(job)
        if not queue and not running:
            break
        if now >= deadline and not running:
            break
        time.sleep(0.2)

    ok = True
    unfinished_all, times, job_lines = [], [], []
    for run in runs:
        mine = [j for j in jobs if j["run"] is run]
        passed = failed = skipped = errors = 0
        unfinished, failed_names, no_summary = [], [], 0
        with open(os.path.join(a.out, f"sanitizer-{run['name']}.txt"), "w") as log:
            for j in mine:
                text = ""
                if "proc" in j:
                    with open(j["log"]) as f:
                        text = f.read()
                state = ("not started" if "proc" not in j else
                         "cut at the time limit" if j.get("cut") else f"exit {j['rc']}")
                log.write(f"##### job: {len(j['tests'])} tests, {state}\n{text}")
                results, errs = parse(text)
                if "proc" in j and errs is None:
                    no_summary += 1
                errors += errs or 0
                job_lines.append(f"{run['name']} tests={len(j['tests'])} estimated={j['cost']:.1f}s "
                                 f"took={j.get('seconds', 0):.1f}s {state} errors="
                                 f"{'none printed' if errs is None else errs} first={j['tests'][0]}")
                for t in j["tests"]:
                    status, ms = results.get(t, (None, 0))
                    if status is not None:
                        times.append(f"{run['name']}|{t} {ms / 1000:.2f}")
                    # Checked only where the tool printed its summary: without it, an error
                    # report of the test may be missing.
                    if status is None or errs is None:
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
        print(line)
        for t in failed_names:
            print(f"  failed: {t}")
        for t in unfinished:
            print(f"  unfinished: {t}")
        unfinished_all += [f"{run['name']}|{t}" for t in unfinished]
        ok = ok and errors == 0 and failed == 0 and not unfinished and no_summary == 0
    for name, lines in (("sanitizer-unfinished.txt", unfinished_all),
                        ("sanitizer-times.txt", times), ("sanitizer-jobs.txt", job_lines)):
        with open(os.path.join(a.out, name), "w") as f:
            f.writelines(line + "\n" for line in lines)
    print(f"sanitizers: {len(jobs)} jobs in {a.slots} slots, {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
