#!/usr/bin/env python3
"""PyTorch peer: the TF CIFAR-10 tutorial net, trained the way a towers tower trains it, so
images/s can be compared side by side on the same machine in the same run.

Same net as towers' `cifar10` model (NCHW, 24x24x3): conv1 5x5 3->64 SAME + ReLU, max-pool 3x3/2
SAME (TF puts the extra padding after: F.pad right/bottom with -inf), LRN(depth_radius 4, bias 1,
alpha 0.001/9, beta 0.75; PyTorch divides alpha by the window size 9, so alpha=0.001 here),
conv2 5x5 64->64 + ReLU, LRN, max-pool, local3 2304->384 ReLU, local4 384->192 ReLU,
logits 192->10; momentum SGD with weight decay 0.004 on local3/local4. A step is forward,
cross-entropy, backward and the optimizer update, on a fixed random batch (no data loading).
`--model models/airbench.json` (any towers model file) times that net instead, built by
torch_model_file.py, with momentum SGD and the file's weight decay.

Prints one JSON line: {"peer": "pytorch", "mode": ..., "images_per_sec": ..., ...}.
"""
import argparse
import json
import platform
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class TutorialNet(nn.Module):
    def __init__(self, in_ch=3, hw=24):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.norm = nn.LocalResponseNorm(size=9, alpha=0.001, beta=0.75, k=1.0)
        flat = 64 * ((hw + 3) // 4) ** 2
        self.local3 = nn.Linear(flat, 384)
        self.local4 = nn.Linear(384, 192)
        self.softmax_linear = nn.Linear(192, 10)

    @staticmethod
    def pool(x):
        # TF SAME 3x3/2 on an even size pads one row/column after, with -inf.
        x = F.pad(x, (0, 1, 0, 1), value=float("-inf"))
        return F.max_pool2d(x, 3, 2)

    def forward(self, x):
        x = self.norm(self.pool(F.relu(self.conv1(x))))
        x = self.pool(self.norm(F.relu(self.conv2(x))))
        x = torch.flatten(x, 1)
        x = F.relu(self.local3(x))
        x = F.relu(self.local4(x))
        return self.softmax_linear(x)


def set_precision(precision):
    """fp32: true FP32 everywhere (cuDNN convolutions use TF32 by default in PyTorch);
    tf32: TF32 tensor cores for convolutions and matmuls, as towers' --tf32 does for its GEMMs."""
    tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def tutorial_init(net):
    """The TF tutorial's initializers, as towers' models use them: truncated normal weights
    (stddev 5e-2 for the convolutions, 0.04 for local3/local4, 1/192 for the logits), biases 0
    (conv1, logits) or 0.1 (conv2, local3, local4)."""
    with torch.no_grad():
        for name, std, bias in (("conv1", 5e-2, 0.0), ("conv2", 5e-2, 0.1), ("local3", 0.04, 0.1),
                                ("local4", 0.04, 0.1), ("softmax_linear", 1.0 / 192.0, 0.0)):
            layer = getattr(net, name)
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
            layer.bias.fill_(bias)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--seconds", type=float, default=20.0, help="time to measure")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="",
                    help="a towers model file (models/*.json) to time instead of the tutorial net")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step")
    ap.add_argument("--precision", choices=["fp32", "tf32"], default="fp32",
                    help="fp32 (no tensor cores) or tf32 (TF32 convolutions and matmuls)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the whole eager step (forward, backward, optimizer) in one CUDA "
                         "graph with torch.cuda.graph and replay it: PyTorch's own whole-step graph")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    set_precision(args.precision)
    dev = torch.device(args.device)
    if args.model:
        from torch_model_file import build_model_file, optimizer_groups
        net, decay, spec = build_model_file(args.model)
        net = net.to(dev)
        opt = torch.optim.SGD(optimizer_groups(net, decay), lr=0.01, momentum=0.9)
        shape, classes, model = tuple(spec["input"]), spec["classes"], spec["name"]
    else:
        net = TutorialNet().to(dev)
        decay = [p for n, p in net.named_parameters() if n.startswith(("local3.weight", "local4.weight"))]
        other = [p for n, p in net.named_parameters() if not n.startswith(("local3.weight", "local4.weight"))]
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.004}, {"params": other}], lr=0.01, momentum=0.9)
        shape, classes, model = (3, 24, 24), 10, "cifar10"
    x = torch.randn(args.batch, *shape, device=dev)
    y = torch.randint(0, classes, (args.batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    fn = torch.compile(step, mode=args.compile_mode) if args.compile else step
    if args.compile and args.compile_mode == "reduce-overhead":
        # Compiling the whole step (optimizer included) with CUDA-graph trees fails in
        # PyTorch 2.11 ("accessing tensor output of CUDAGraphs that has been overwritten", in
        # SGD.step; seen on an H100, 2026-11-23). So the forward and loss are compiled (their
        # backward is graphed with them) and the optimizer step runs eagerly, as PyTorch's
        # documentation of CUDA-graph trees does it.
        loss_fn = torch.compile(lambda: F.cross_entropy(net(x), y), mode=args.compile_mode)

        def fn():
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            opt.step()
            return loss.detach().clone()
    if args.cuda_graph:
        # PyTorch's whole-network capture: warm up on a side stream (the momentum buffers are
        # made there), then capture one step, gradients kept as static tensors (zero_grad
        # without set_to_none inside the graph), and replay it.
        assert dev.type == "cuda" and not args.compile, "--cuda-graph needs --device cuda, no --compile"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=False)
                F.cross_entropy(net(x), y).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            opt.zero_grad(set_to_none=False)
            static_loss = F.cross_entropy(net(x), y)
            static_loss.backward()
            opt.step()

        def fn():
            graph.replay()
            return static_loss
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        loss = fn()
    sync()
    assert torch.isfinite(loss).item(), "loss is not finite"
    # Five windows; the median is the figure, the best is reported too (towers' benchmark
    # reports the median of its repetitions).
    rates, steps_total, t_all = [], 0, time.perf_counter()
    for _ in range(5):
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds / 5:
            fn()
            steps += 1
        sync()
        rates.append(steps * args.batch / (time.perf_counter() - t0))
        steps_total += steps
    rates.sort()
    print(json.dumps({
        "peer": "pytorch", "model": model, "version": torch.__version__, "mode": f"compile:{args.compile_mode}" if args.compile else ("eager+cuda-graph" if args.cuda_graph else "eager"),
        "device": args.device, "precision": args.precision, "threads": torch.get_num_threads(), "batch": args.batch,
        "steps": steps_total, "seconds": time.perf_counter() - t_all,
        "images_per_sec": rates[2], "images_per_sec_best": rates[-1], "images_per_sec_windows": rates,
        "mkldnn": torch.backends.mkldnn.is_available(), "machine": platform.processor() or platform.machine(),
    }))


if __name__ == "__main__":
    main()
