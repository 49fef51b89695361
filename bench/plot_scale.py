#!/usr/bin/env python3
"""Plots a `towers scale` folder: DIR/scale.png.

Left: training images/s against the number of towers, one line per mode, with the ideal
(linear from one tower) dashed. Middle: scaling efficiency = images/s(N) / (N x images/s(1)).
Right: test accuracy against training time for every run, from the runs' eval records, with
the target accuracy (if any) as a horizontal line.

    python3 bench/plot_scale.py runs/scale
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"sync": "tab:blue", "async": "tab:orange", "ssp": "tab:green"}


def main(folder: Path) -> None:
    doc = json.loads((folder / "scale.json").read_text())
    runs = doc["runs"]
    cfg = doc["config"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    counts = sorted({r["towers"] for r in runs})
    if len(counts) > 1:
        fig, (ax_ips, ax_eff, ax_acc) = plt.subplots(1, 3, figsize=(16, 4.8))
    else:  # one tower count: throughput against towers says nothing
        fig, ax_acc = plt.subplots(1, 1, figsize=(7, 4.8))
        ax_ips = ax_eff = None

    for m in modes:
        rs = sorted((r for r in runs if r["mode"] == m), key=lambda r: r["towers"])
        n = [r["towers"] for r in rs]
        ips = [r["images_per_sec"] for r in rs]
        c = COLORS.get(m)
        if ax_ips is not None:
            ax_ips.plot(n, ips, "o-", color=c, label=m)
            ax_eff.plot(n, [r["efficiency"] for r in rs], "o-", color=c, label=m)
            per_tower = ips[0] / n[0]
            ax_ips.plot(n, [per_tower * k for k in n], "--", color=c, alpha=0.4)
        for r in rs:
            events = [json.loads(line) for line in open(folder / Path(r["metrics"]).name)]
            ev = [e for e in events if e["event"] == "eval"]
            summary = [e for e in events if e["event"] == "summary"][-1]
            t = [e["train_seconds"] for e in ev] + [summary["train_seconds"]]
            acc = [100 * e["test_accuracy"] for e in ev] + [100 * summary["test_accuracy"]]
            style = {1: "-", 2: "--", 4: ":"}.get(r["towers"], "-.")
            ax_acc.plot(t, acc, style, color=c, marker=".", label=f"{m} x{r['towers']}")

    if ax_ips is not None:
        ax_ips.set(xlabel="towers", ylabel="training images/s", title="throughput (dashed: linear)")
        ax_eff.set(xlabel="towers", ylabel=f"images/s(N) / (N/{counts[0]} x images/s({counts[0]}))",
                   title="scaling efficiency", ylim=(0, 1.15))
        ax_eff.axhline(1.0, color="gray", lw=0.8)
        for ax in (ax_ips, ax_eff):
            ax.set_xticks(counts)
    ax_acc.set(xlabel="training seconds", ylabel="test accuracy (%)", title="accuracy vs time")
    target = doc.get("target_accuracy") or 0
    if target:
        ax_acc.axhline(100 * target, color="gray", lw=0.8, ls="--")
    for ax in (ax_ips, ax_eff, ax_acc):
        if ax is None:
            continue
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"towers scale: model {cfg['model']} on {cfg['dataset']}, batch {cfg['batch']} per tower,\n"
                 f"{cfg['optimizer']} lr {cfg['lr']:g}, {cfg.get('threads_per_tower') or 'auto'} thread(s) per tower")
    fig.tight_layout()
    out = folder / "scale.png"
    fig.savefig(out, dpi=110)
    print(f"plot_scale: wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
