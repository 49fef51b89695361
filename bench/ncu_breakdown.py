#!/usr/bin/env python3
"""Kernel-time breakdown of a training step from an `ncu --csv --metrics gpu__time_duration.sum`
log of `towers train --no-cuda-graphs` (bench/run-gpu.sh writes ncu_step.csv and
ncu_step_mirrored.csv): the run's training steps found in the kernel sequence, each step's
kernel time, and the mean of the steps after the first (which may differ: plans, first
touches) by kernel family.

    bench/ncu_breakdown.py ncu_step.csv [ncu_step_mirrored.csv ...]
"""
import csv
import sys
from collections import OrderedDict

# (family, substrings of the kernel name, any of which puts it there), first match wins.
FAMILIES = [
    ("cuDNN FFT (transforms, complex GEMMs)", ("fft2d", "cf32cf32", "flip_filter")),
    ("cuDNN Winograd (non-fused)", ("winograd",)),
    ("cuDNN implicit-GEMM forward", ("fprop_implicit_gemm", "implicit_convolve")),
    ("cuDNN backward (GEMM family)", ("dgrad", "wgrad", "convolve_sgemm", "cudnn::detail",
                                      "scalePackedTensor")),
    ("GEMM (cuBLAS, CUTLASS, split-K)", ("gemm", "sgemm", "cutlass", "xmma", "splitKreduce",
                                         "cublas")),
    ("im2col / col2im", ("im2col", "col2im")),
    ("BatchNorm (statistics, normalize, backward)", ("::Bn",)),
    ("BatchNorm running statistics", ("StateStep",)),
    ("gradient tree-sum", ("TreeSum",)),
    ("global average pool", ("GlobalAvgPool",)),
    ("ReLU forward", ("ReluForward",)),
    ("max-pool forward and backward", ("Maxpool",)),
    ("LRN forward and backward", ("Lrn",)),
    ("bias add (+ReLU)", ("BiasAdd",)),
    ("ReLU backward", ("ReluBackward",)),
    ("bias gradients", ("bias_grad",)),
    ("softmax + cross-entropy", ("SoftmaxXent",)),
    ("finiteness check", ("nonfinite",)),
    ("optimizer update", ("Momentum", "Sgd", "Adam", "optimizer", "apply", "Update")),
]


def family(name):
    for f, keys in FAMILIES:
        if any(k in name for k in keys):
            return f
    return "other: " + name.replace("void ", "").split("(")[0][:60]


def is_backward(name):
    return any(k in name for k in ("col2im", "Backward", "bias_grad", "dgrad", "wgrad"))


def breakdown(path):
    rows = [r for r in csv.DictReader(l for l in open(path) if l.startswith('"'))
            if r["Metric Name"] == "gpu__time_duration.sum"]
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration.sum rows")
    # A step starts with conv1's forward: the run's first kernel, again wherever that kernel
    # follows another (the evaluation's forwards start the same way, but hold no backward).
    first = rows[0]["Kernel Name"]
    starts = [i for i, r in enumerate(rows)
              if r["Kernel Name"] == first and (i == 0 or rows[i - 1]["Kernel Name"] != first)]
    starts.append(len(rows))
    steps = [rows[a:b] for a, b in zip(starts, starts[1:])
             if any(is_backward(r["Kernel Name"]) for r in rows[a:b])]
    if not steps:
        sys.exit(f"{path}: no complete training step found")
    us = lambda r: float(r["Metric Value"].replace(",", "")) / 1000.0
    print(f"== {path}: {len(rows)} kernels profiled, {len(steps)} training steps found")
    for i, s in enumerate(steps):
        print(f"  step {i + 1}: {len(s)} kernels, {sum(us(r) for r in s):.1f} us of kernel time")
    mean = steps[1:] or steps
    groups = OrderedDict()
    for s in mean:
        for r in s:
            g = groups.setdefault(family(r["Kernel Name"]), [0.0, 0])
            g[0] += us(r) / len(mean)
            g[1] += 1
    total = sum(v[0] for v in groups.values())
    kernels = sum(len(s) for s in mean) / len(mean)
    print(f"  steps {2 if len(steps) > 1 else 1}-{len(steps)}, per step: {total:.0f} us of "
          f"kernel time, {kernels:.0f} kernels")
    for f, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"    {t:8.1f} us {100 * t / total:5.1f}% {c / len(mean):4.0f} kernels  {f}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        breakdown(p)
