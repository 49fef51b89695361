#!/usr/bin/env python3
"""Plots training curves of towers runs and peers side by side: OUT.png.

Each input is a JSON-lines file, either a towers `--metrics` file (its `eval` records, its
`step` records, `summary`, and `rollback` records, after which the evaluations of the steps
taken again are dropped) or a peer's output (`{"event": "eval", ...}` lines and a
`summary`, as bench/peers/torch_model_file.py prints). Left: test accuracy against training
seconds (evaluation time left out, as both report it). Right: test accuracy against epochs.
The final accuracy is the summary's.

    python3 bench/plot_curves.py OUT.png towers=run/metrics.jsonl pytorch=run/torch.jsonl
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    evals, summary = [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("event") == "eval":
                evals.append((r["train_seconds"], r["epoch"], r["test_accuracy"], r.get("step")))
            elif r.get("event") == "rollback":
                # A remote sync run went back to step r["step"]: the evaluations after it are
                # of steps that are taken again.
                evals = [e for e in evals if e[3] is None or e[3] <= r["step"]]
            elif r.get("event") == "summary":
                summary = r
    if summary is None:
        raise SystemExit(f"{path}: no summary record (did the run finish?)")
    seconds = summary.get("train_seconds", summary.get("wall_seconds"))
    evals.append((seconds, summary["epochs"], summary["test_accuracy"], None))
    return [e[:3] for e in evals]


def main(out, runs):
    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, path in runs:
        pts = read(path)
        t, e, a = zip(*pts)
        acc = [100.0 * x for x in a]
        by_time.plot([s / 60.0 for s in t], acc, marker="o", label=f"{label} ({acc[-1]:.2f}%)")
        by_epoch.plot(e, acc, marker="o", label=label)
    for ax, xlabel in ((by_time, "training minutes"), (by_epoch, "epochs")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        raise SystemExit(__doc__)
    main(sys.argv[1], [tuple(a.split("=", 1)) for a in sys.argv[2:]])
