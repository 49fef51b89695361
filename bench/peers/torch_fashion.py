#!/usr/bin/env python3
"""PyTorch peer of the main job: the `fashion` net (the TF tutorial net on 28x28x1) trained on
Fashion-MNIST with towers' recipe (scripts/train-fashion.sh), on one device, so that time to
accuracy and images/s can be compared with a towers run on the same machine in the same run.

The recipe, as towers runs it: 5 epochs of batch 128 (the example stream is the concatenation
of per-epoch permutations, so every batch is full and the last may straddle epochs), momentum
SGD 0.9 at lr 0.01 with a cosine schedule over the examples seen, weight decay 0.004 on
local3/local4 weights (g + wd * w), random horizontal flips, per-image standardization
(TF's per_image_standardization), the tutorial's initializers. The whole dataset lives on the
device, so no input pipeline is measured. The test accuracy is taken at the end, or every
--eval-every epochs (each evaluation counted in the wall time, as towers counts its own); with
--target-accuracy the run stops at the first evaluation that reaches it, as towers'
--target-accuracy does, and reports the wall time to that point.

Prints one JSON line: {"peer": "pytorch", "test_accuracy": ..., "wall_seconds": ..., ...}.
"""
import argparse
import gzip
import json
import math
import os
import struct
import time

import numpy as np
import torch
import torch.nn.functional as F

from torch_cifar10 import TutorialNet, set_precision, tutorial_init


def read_idx(path):
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(folder, split):
    def find(stem):
        for name in (stem + ".gz", stem):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
        raise SystemExit(f"{folder}: no {stem}[.gz]")
    images = read_idx(find(f"{split}-images-idx3-ubyte"))
    labels = read_idx(find(f"{split}-labels-idx1-ubyte"))
    return images, labels


def standardize(x):
    # TF per_image_standardization: (x - mean) / max(stddev, 1 / sqrt(N)).
    n = x[0].numel()
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
    return (x - mean) / torch.clamp(std, min=1.0 / math.sqrt(n))


def batch_indices(train_size, batch, seed, dev):
    """Batches of example indices from a stream of per-epoch permutations (epoch e seeded by
    seed * 1000 + e), so a batch may span two epochs, as in towers."""
    stream = torch.empty(0, dtype=torch.int64, device=dev)
    epoch_index = 0
    while True:
        while stream.numel() < batch:
            g = torch.Generator(device="cpu").manual_seed(seed * 1000 + epoch_index)
            stream = torch.cat([stream, torch.randperm(train_size, generator=g).to(dev)])
            epoch_index += 1
        idx, stream = stream[:batch], stream[batch:]
        yield idx


def random_flip(x):
    """Each image of an NCHW batch mirrored left-right with probability 1/2."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", choices=["fp32", "tf32"], default="fp32")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-every", type=float, default=0.0,
                    help="epochs between test evaluations (0: at the end only)")
    ap.add_argument("--target-accuracy", type=float, default=0.0,
                    help="stop at the first evaluation with at least this test accuracy")
    args = ap.parse_args()

    set_precision(args.precision)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    xtr, ytr = load(args.data, "train")
    xte, yte = load(args.data, "t10k")
    xtr = torch.tensor(xtr, dtype=torch.float32, device=dev).unsqueeze(1)
    ytr = torch.tensor(ytr, dtype=torch.int64, device=dev)
    xte = standardize(torch.tensor(xte, dtype=torch.float32, device=dev).unsqueeze(1))
    yte = torch.tensor(yte, dtype=torch.int64, device=dev)

    net = TutorialNet(in_ch=1, hw=28).to(dev)
    tutorial_init(net)
    decay = [p for n, p in net.named_parameters() if n in ("local3.weight", "local4.weight")]
    other = [p for n, p in net.named_parameters() if n not in ("local3.weight", "local4.weight")]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.004}, {"params": other}],
                          lr=args.lr, momentum=0.9)
    train_size = xtr.shape[0]
    steps = math.ceil(args.epochs * train_size / args.batch)  # towers rounds up, too

    def evaluate():
        net.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, xte.shape[0], 1000):
                correct += (net(xte[i:i + 1000]).argmax(1) == yte[i:i + 1000]).sum().item()
        net.train()
        return correct / xte.shape[0]

    eval_steps = math.ceil(args.eval_every * train_size / args.batch) if args.eval_every > 0 else 0
    curve, reached = [], None
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eval_seconds = 0.0
    batches = batch_indices(train_size, args.batch, args.seed, dev)
    net.train()
    step = 0
    while step < steps:
        idx = next(batches)
        x = standardize(random_flip(xtr[idx]))
        epoch = step * args.batch / train_size
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * min(epoch / args.epochs, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), ytr[idx])
        loss.backward()
        opt.step()
        step += 1
        if eval_steps and step % eval_steps == 0 and step < steps:
            te = time.perf_counter()
            accuracy = evaluate()
            eval_seconds += time.perf_counter() - te
            curve.append({"step": step, "epoch": step * args.batch / train_size,
                          "test_accuracy": accuracy, "wall_seconds": time.perf_counter() - t0})
            if args.target_accuracy > 0 and accuracy >= args.target_accuracy:
                reached = curve[-1]
                break
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t0 - eval_seconds
    if reached is None:
        accuracy = evaluate()
        curve.append({"step": step, "epoch": step * args.batch / train_size,
                      "test_accuracy": accuracy, "wall_seconds": time.perf_counter() - t0})
        if args.target_accuracy > 0 and accuracy >= args.target_accuracy:
            reached = curve[-1]
    wall = time.perf_counter() - t0
    print(json.dumps({
        "peer": "pytorch", "version": torch.__version__, "model": "fashion", "device": args.device,
        "precision": args.precision, "epochs": args.epochs, "batch": args.batch, "steps": step,
        "final_loss": loss.item(), "test_accuracy": curve[-1]["test_accuracy"], "curve": curve,
        "target_accuracy": args.target_accuracy or None,
        "target_reached_wall_seconds": reached["wall_seconds"] if reached else None,
        "train_seconds": train_seconds, "wall_seconds": wall,
        "train_images_per_sec": step * args.batch / train_seconds,
    }))


if __name__ == "__main__":
    main()
