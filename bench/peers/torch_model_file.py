#!/usr/bin/env python3
"""PyTorch peer of a towers model file: builds the net of a models/*.json file (conv2d,
batchnorm, relu, gelu, dropout, residual, maxpool, global_avg_pool, dense) and trains it on
Fashion-MNIST or CIFAR-10 with the recipe of a towers run, so that accuracy and time can be
compared with towers on the same machine in the same run.

Precision: FP32 by default (--precision), as towers runs by default; PyTorch's own default would
let cuDNN's convolutions use TF32 on the GPU.

The recipe, as towers runs it (`towers train --optimizer momentum --nesterov --lr-schedule cosine
--warmup-epochs W --label-smoothing E --augment flip|airbench`):
  - batches of B from a stream that concatenates per-epoch permutations;
  - Nesterov momentum 0.9 (a = mu a + g'; w -= lr (g' + mu a)), g' = g + wd w with each
    variable's weight decay from the file (conv and dense weights; never biases or BatchNorm);
  - lr(epoch) = lr * (1 + cos(pi * epoch / epochs)) / 2, times epoch / W during the warm-up,
    at the epoch of the examples seen before the step;
  - cross-entropy against (1 - E) onehot + E / classes (PyTorch's label_smoothing);
  - random flips (and, for airbench, a random translation by up to 2 pixels with zero fill),
    then TF's per_image_standardization;
  - BatchNorm with the file's momentum (PyTorch's momentum is 1 - TF's) and epsilon, batch
    statistics in training and the running ones in evaluation;
  - the file's initialisers: truncated normal weights (redrawn beyond 2 stddev), constant
    biases, BatchNorm gamma 1 and beta 0.

Prints one JSON line per evaluation ({"event": "eval", ...}) and a summary line.
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_cifar10 import set_precision
from torch_fashion import batch_indices, load, random_flip, standardize




def load_fashion(folder):
    xtr, ytr = load(folder, "train")
    xte, yte = load(folder, "t10k")
    return xtr[:, None, :, :], ytr, xte[:, None, :, :], yte


def load_cifar10(folder):
    def batches(names):
        xs, ys = [], []
        for n in names:
            raw = np.fromfile(os.path.join(folder, n), dtype=np.uint8).reshape(-1, 3073)
            ys.append(raw[:, 0])
            xs.append(raw[:, 1:].reshape(-1, 3, 32, 32))
        return np.concatenate(xs), np.concatenate(ys)
    xtr, ytr = batches([f"data_batch_{i}.bin" for i in range(1, 6)])
    xte, yte = batches(["test_batch.bin"])
    return xtr, ytr, xte, yte




def truncated_normal_(t, stddev):
    # TF's truncated_normal: normal values beyond 2 stddev are redrawn.
    nn.init.trunc_normal_(t, mean=0.0, std=stddev, a=-2.0 * stddev, b=2.0 * stddev)


def same_padding(size, kernel, stride):
    # TF "same": out = ceil(size / stride); the extra pixel of an odd total goes after.
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class Pad2d(nn.Module):
    def __init__(self, pads, value):
        super().__init__()
        self.pads, self.value = pads, value

    def forward(self, x):
        return F.pad(x, self.pads, value=self.value)


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class Flatten(nn.Module):
    def forward(self, x):
        return x.flatten(1)


def add_affine(mod, L, decay, mods):
    """A conv2d or dense layer of the file: its initialisers, its weight decay and its ReLU."""
    truncated_normal_(mod.weight, L["weight_init"]["stddev"])
    nn.init.constant_(mod.bias, L.get("bias_init", 0.0))
    decay.append((mod.weight, L.get("weight_decay", 0.0)))
    mods.append(mod)
    if L.get("relu", True):
        mods.append(nn.ReLU())


def build(layers, shape, decay):
    """The layers of a model file as modules; shape is (C, H, W) or (N,); decay collects
    (parameter, weight decay) pairs."""
    mods = []
    for L in layers:
        kind = L["type"]
        if kind in ("conv2d", "maxpool"):
            c, h, w = shape
            k, s = L["kernel"], L.get("stride", 1)
            pad = L.get("padding", "same")
            if pad == "same":
                ph, pw = same_padding(h, k, s), same_padding(w, k, s)
                if ph != (0, 0) or pw != (0, 0):
                    mods.append(Pad2d((pw[0], pw[1], ph[0], ph[1]),
                                      0.0 if kind == "conv2d" else -math.inf))
                h, w = h + sum(ph), w + sum(pw)
            oh, ow = (h - k) // s + 1, (w - k) // s + 1
            if kind == "maxpool":
                mods.append(nn.MaxPool2d(k, s))
                shape = (c, oh, ow)
                continue
            add_affine(nn.Conv2d(c, L["filters"], k, s), L, decay, mods)
            shape = (L["filters"], oh, ow)
        elif kind == "batchnorm":
            bn_cls = nn.BatchNorm2d if len(shape) == 3 else nn.BatchNorm1d
            bn = bn_cls(shape[0], eps=L.get("epsilon", 1e-5), momentum=1.0 - L.get("momentum", 0.9))
            decay.append((bn.weight, L.get("weight_decay", 0.0)))  # towers decays gamma and beta
            decay.append((bn.bias, L.get("weight_decay", 0.0)))
            mods.append(bn)
        elif kind == "relu":
            mods.append(nn.ReLU())
        elif kind == "gelu":
            mods.append(nn.GELU(approximate="tanh"))
        elif kind == "dropout":  # inverted dropout, as towers; masks from torch's generator
            mods.append(nn.Dropout(L.get("rate", 0.5)))
        elif kind == "residual":
            body, out = build(L["layers"], shape, decay)
            assert out == shape, (L["name"], out, shape)
            mods.append(Residual(body))
        elif kind == "global_avg_pool":
            mods.append(nn.AdaptiveAvgPool2d(1))
            shape = (shape[0], 1, 1)
        elif kind == "dense":
            if len(shape) == 3:
                mods.append(Flatten())
                shape = (shape[0] * shape[1] * shape[2],)
            add_affine(nn.Linear(shape[0], L["units"]), L, decay, mods)
            shape = (L["units"],)
        else:
            raise SystemExit(f"layer {L['name']}: type {kind} is not in this peer")
    return nn.Sequential(*mods), shape


def build_model_file(path):
    """The net of a towers model file, its (parameter, weight decay) pairs and the file."""
    spec = json.load(open(path))
    decay = []
    net, out = build(spec["layers"], tuple(spec["input"]), decay)
    assert out == (spec["classes"],), out
    return net, decay, spec


def optimizer_groups(net, decay):
    """SGD parameter groups: each decayed weight with its decay, the rest without."""
    decayed = {id(p) for p, wd in decay if wd > 0}
    groups = [{"params": [p], "weight_decay": wd} for p, wd in decay if wd > 0]
    groups.append({"params": [p for p in net.parameters() if id(p) not in decayed], "weight_decay": 0.0})
    return groups


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/resnet-small.json")
    ap.add_argument("--dataset", choices=["fashion-mnist", "cifar10"], default="fashion-mnist")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=float, default=9.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--warmup-epochs", type=float, default=0.5)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--augment", choices=["flip", "airbench"], default="flip")
    ap.add_argument("--eval-every", type=float, default=1.0, help="epochs between evaluations")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (timing)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "tf32"], default="fp32",
                    help="fp32 (no tensor cores, as towers by default) or tf32 (TF32 convolutions "
                         "and matmuls, as towers' --tf32); PyTorch's own default lets cuDNN's "
                         "convolutions take TF32")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target-accuracy", type=float, default=0.0,
                    help="stop at the first evaluation with at least this test accuracy (as towers' "
                         "--target-accuracy); the summary gives the wall time to it")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    set_precision(args.precision)
    dev = torch.device(args.device)
    net, decay, spec = build_model_file(args.model)
    net = net.to(dev)

    xtr, ytr, xte, yte = (load_fashion if args.dataset == "fashion-mnist" else load_cifar10)(args.data)
    xtr = torch.tensor(xtr, dtype=torch.float32, device=dev)
    ytr = torch.tensor(ytr, dtype=torch.int64, device=dev)
    xte = standardize(torch.tensor(xte, dtype=torch.float32, device=dev))
    yte = torch.tensor(yte, dtype=torch.int64, device=dev)

    opt = torch.optim.SGD(optimizer_groups(net, decay), lr=args.lr, momentum=args.momentum, nesterov=True)
    train_size = xtr.shape[0]
    steps = math.ceil(args.epochs * train_size / args.batch)  # towers rounds up, too
    if args.steps:
        steps = min(steps, args.steps)

    def evaluate():
        net.eval()
        correct, loss = 0, 0.0
        with torch.no_grad():
            for i in range(0, xte.shape[0], 500):
                z = net(xte[i:i + 500])
                correct += (z.argmax(1) == yte[i:i + 500]).sum().item()
                loss += F.cross_entropy(z, yte[i:i + 500], reduction="sum").item()
        net.train()
        return correct / xte.shape[0], loss / xte.shape[0]

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    side = 0.0  # evaluation time, left out of train_seconds as towers does
    batches = batch_indices(train_size, args.batch, args.seed, dev)
    net.train()
    reached = None  # (step, wall seconds, accuracy, test loss) of the evaluation that met the target
    for step in range(steps):
        idx = next(batches)
        x = random_flip(xtr[idx])
        if args.augment == "airbench":
            # A translation by (dy, dx) in -2..2 each, zeros coming in: crop the padded image.
            h, w = x.shape[2], x.shape[3]
            padded = F.pad(x, (2, 2, 2, 2))
            dy = torch.randint(0, 5, (args.batch,), device=dev)
            dx = torch.randint(0, 5, (args.batch,), device=dev)
            rows = (dy.view(-1, 1) + torch.arange(h, device=dev)).view(-1, 1, h, 1).expand(-1, x.shape[1], h, w + 4)
            x = padded.gather(2, rows)
            cols = (dx.view(-1, 1) + torch.arange(w, device=dev)).view(-1, 1, 1, w).expand(-1, x.shape[1], h, w)
            x = x.gather(3, cols)
        x = standardize(x)
        epoch = step * args.batch / train_size
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * min(epoch / args.epochs, 1.0)))
        if args.warmup_epochs > 0 and epoch < args.warmup_epochs:
            lr *= epoch / args.warmup_epochs
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), ytr[idx], label_smoothing=args.label_smoothing)
        loss.backward()
        opt.step()
        done = (step + 1) * args.batch / train_size
        if args.eval_every > 0 and step + 1 < steps and \
                math.floor(done / args.eval_every) > math.floor(epoch / args.eval_every):
            sync()
            t_side = time.perf_counter()
            acc, test_loss = evaluate()
            side += time.perf_counter() - t_side
            print(json.dumps({"event": "eval", "step": step + 1, "epoch": done, "test_accuracy": acc,
                              "test_loss": test_loss, "train_seconds": time.perf_counter() - t0 - side,
                              "wall_seconds": time.perf_counter() - t0}), flush=True)
            if args.target_accuracy > 0 and acc >= args.target_accuracy:
                reached = (step + 1, time.perf_counter() - t0, acc, test_loss)
                break
    sync()
    train_seconds = time.perf_counter() - t0 - side
    if reached is None:
        acc, test_loss = evaluate()
        if args.target_accuracy > 0 and acc >= args.target_accuracy:
            reached = (steps, time.perf_counter() - t0, acc, test_loss)
    else:
        steps, _, acc, test_loss = reached
    print(json.dumps({
        "event": "summary", "peer": "pytorch", "version": torch.__version__, "model": spec["name"],
        "device": args.device, "precision": args.precision, "threads": torch.get_num_threads(),
        "epochs": args.epochs,
        "batch": args.batch, "steps": steps, "final_loss": loss.item(), "test_accuracy": acc,
        "test_loss": test_loss, "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - t0,
        "train_images_per_sec": steps * args.batch / train_seconds,
        "target_accuracy": args.target_accuracy or None,
        "target_reached_wall_seconds": reached[1] if reached else None,
    }), flush=True)


if __name__ == "__main__":
    main()
