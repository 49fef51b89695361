#!/usr/bin/env python3
"""Kernel-time breakdown of one training step from an `ncu --csv --metrics gpu__time_duration.sum`
log of `towers train --no-cuda-graphs` (bench/run-gpu.sh writes ncu_step.csv): the kernels of the
last complete step, grouped into GEMMs (cuBLAS/CUTLASS) and towers' own kernels by family.

    bench/ncu_breakdown.py ncu_step.csv
"""
import csv
import sys
from collections import OrderedDict


def family(name):
    n = name.replace("void ", "")
    if any(k in n for k in ("gemm", "sgemm", "cutlass", "xmma", "splitKreduce", "cublas")):
        return "GEMM (cuBLAS)"
    return n.split("(")[0].split("<")[0].replace("towers::", "").replace("_kernel", "")


def main():
    rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
            if r["Metric Name"] == "gpu__time_duration.sum"]
    # A step starts with conv1's forward im2col: the first kernel, or an im2col right after a
    # GEMM (the previous step ends with conv1's weight-gradient GEMM; the backward's own
    # im2cols follow bias-gradient kernels). The evaluation after the last step starts the same
    # way, so the last complete step lies between the last two starts that enclose a backward.
    starts = [i for i, r in enumerate(rows) if "im2col" in r["Kernel Name"]
              and (i == 0 or family(rows[i - 1]["Kernel Name"]) == "GEMM (cuBLAS)")]
    starts.append(len(rows))
    steps = [rows[a:b] for a, b in zip(starts, starts[1:])
             if any("col2im" in r["Kernel Name"] for r in rows[a:b])]
    if not steps:
        sys.exit(f"{sys.argv[1]}: no complete training step found")
    step = steps[-1]
    groups = OrderedDict()
    for r in step:
        t = float(r["Metric Value"].replace(",", "")) / 1000.0
        f = family(r["Kernel Name"])
        groups.setdefault(f, [0.0, 0])
        groups[f][0] += t
        groups[f][1] += 1
    total = sum(v[0] for v in groups.values())
    print(f"{'kernel family':28} {'launches':>8} {'us':>9} {'share':>7}")
    for f, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{f:28} {c:8d} {t:9.1f} {100 * t / total:6.1f}%")
    print(f"{'total (one step, serialized)':28} {len(step):8d} {total:9.1f}")


if __name__ == "__main__":
    main()
