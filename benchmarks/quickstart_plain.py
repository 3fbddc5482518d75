"""The quickstart's job as a plain PyTorch script: the baseline of ``benchmarks/quickstart.py``.

The same work as ``pimm launch --train.config configs/digits.toml -- train.epochs=N``: the
bundled digits (read from scikit-learn's file as pimm reads it, /16, the same 80/20 split),
the same MLP (64-128-128-10, ReLU, dropout 0.1), AdamW (lr 0.002, weight decay 0.01), linear
warm-up of 20 steps then cosine to 2e-5, gradient clipping at 1.0, batch 32 per rank
(shuffled each epoch), one evaluation of the validation split per epoch (batch 256, loss and
accuracy summed over the ranks), and one ``torch.save`` of the model and optimizer at the end
(rank 0). Under torchrun (``--nproc-per-node 2``) the model is wrapped in DDP (gloo) and each
rank reads its ``DistributedSampler`` shard. Nothing else: no checkpoint of the loader, no
EMA, no run directory, no metrics file.

Prints one JSON line (rank 0) with the per-epoch seconds of training and evaluation, the
save's seconds and the final accuracy.

Usage: ``python benchmarks/quickstart_plain.py OUT_DIR [--epochs 5] [--threads 1]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("gloo")

    path = Path(importlib.util.find_spec("sklearn").origin).parent / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",")
    x = torch.from_numpy(data[:, :-1].astype(np.float32) / 16.0)
    y = torch.from_numpy(data[:, -1].astype(np.int64))
    perm = np.random.RandomState(0).permutation(len(x))
    n_val = int(round(len(x) * 0.2))
    val = torch.utils.data.TensorDataset(x[perm[:n_val]], y[perm[:n_val]])
    train = torch.utils.data.TensorDataset(x[perm[n_val:]], y[perm[n_val:]])
    train_sampler = torch.utils.data.DistributedSampler(train, world, rank, shuffle=True, seed=0)
    val_sampler = torch.utils.data.DistributedSampler(val, world, rank, shuffle=False)
    loader = torch.utils.data.DataLoader(train, batch_size=32, sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(val, batch_size=256, sampler=val_sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
    total, warmup, floor = args.epochs * len(loader), 20, 0.00002 / 0.002

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * (1 + math.cos(math.pi * p)) / 2

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    t_ready = time.perf_counter()
    epochs = []
    acc = float("nan")
    for epoch in range(args.epochs):
        e0 = time.perf_counter()
        train_sampler.set_epoch(epoch)
        net.train()
        for xb, yb in loader:
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        e1 = time.perf_counter()
        net.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for xb, yb in val_loader:
                logits = model(xb)
                sums += torch.tensor([F.cross_entropy(logits, yb, reduction="sum").item(),
                                      (logits.argmax(1) == yb).sum().item(), len(yb)], dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(sums)
        acc = (sums[1] / sums[2]).item()
        epochs.append({"epoch": epoch, "train_s": round(e1 - e0, 4), "eval_s": round(time.perf_counter() - e1, 4),
                       "val_acc": round(acc, 4)})
    s0 = time.perf_counter()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.out / "model.pth")
    save_s = time.perf_counter() - s0
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank == 0:
        print(json.dumps({"epochs": epochs, "save_s": round(save_s, 4), "val_acc": round(acc, 4),
                          "start_to_first_epoch_s": round(t_ready - t0, 4), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
