"""Training accuracy of bf16 without master weights: rounded to nearest, stochastically or with Kahan
compensation, against fp32 and bf16 with fp32 master weights.

An MLP (64-256-256-10) on scikit-learn's 8x8 digits (1,437 training images, 360 held out, a stratified
split), batch 32, momentum 0.9, weight decay 5e-4, lr 0.05 with cosine decay to 0 over 40 epochs: late in the
run the updates fall below half a bf16 ulp of many weights, where rounding to nearest drops them. The model
is small because bf16 matmuls are slow on CPUs without native bf16 (a bf16 ResNet would take hours here).

Usage: ``python bench/bf16_rounding.py [--seeds N] [--epochs N]``; writes
``bench/results/bf16_rounding.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from common import write_json
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from lightning_fusedsgd import FusedSGD

VARIANTS = {  # name: (param dtype, FusedSGD options)
    "fp32": (torch.float32, {}),
    "bf16 + fp32 master weights": (torch.bfloat16, {"master_weights": True}),
    "bf16, rounded to nearest": (torch.bfloat16, {}),
    "bf16, rounded stochastically": (torch.bfloat16, {"update_rounding": "stochastic"}),
    "bf16, Kahan compensation": (torch.bfloat16, {"update_rounding": "kahan"}),
}
BATCH, LR, MOMENTUM, WEIGHT_DECAY = 32, 0.05, 0.9, 5e-4


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=0
    )
    mean, std = x_train.mean(), x_train.std()
    as_tensor = lambda x: torch.tensor((x - mean) / std, dtype=torch.float32)  # noqa: E731
    return as_tensor(x_train), torch.tensor(y_train), as_tensor(x_val), torch.tensor(y_val)


def train(dtype: torch.dtype, options: dict, seed: int, epochs: int, data) -> dict[str, float]:
    x_train, y_train, x_val, y_val = data
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = model.to(dtype)
    optimizer = FusedSGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, **options)
    steps_per_epoch = len(x_train) // BATCH
    total = epochs * steps_per_epoch
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for b in range(steps_per_epoch):
            index = order[b * BATCH : (b + 1) * BATCH]
            for group in optimizer.param_groups:
                group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * step / total))
            loss = nn.functional.cross_entropy(model(x_train[index].to(dtype)).float(), y_train[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
    with torch.no_grad():
        val_acc = (model(x_val.to(dtype)).float().argmax(1) == y_val).float().mean().item()
        train_loss = nn.functional.cross_entropy(model(x_train.to(dtype)).float(), y_train).item()
    return {"val_acc": val_acc, "train_loss": train_loss, "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args()
    data = digits()
    runs: dict[str, list[dict[str, float]]] = {}
    for name, (dtype, options) in VARIANTS.items():
        runs[name] = [train(dtype, options, seed, args.epochs, data) for seed in range(args.seeds)]
        accs = [run["val_acc"] for run in runs[name]]
        losses = [run["train_loss"] for run in runs[name]]
        print(
            f"{name}: val acc {statistics.mean(accs):.4f} (min {min(accs):.4f}, max {max(accs):.4f}), "
            f"final train loss {statistics.mean(losses):.4f}",
            flush=True,
        )
    path = write_json(
        "bf16_rounding",
        {
            "model": "MLP 64-256-256-10 on the digits",
            "epochs": args.epochs,
            "batch_size": BATCH,
            "lr": LR,
            "momentum": MOMENTUM,
            "weight_decay": WEIGHT_DECAY,
            "schedule": "cosine to 0, per step",
            "seeds": args.seeds,
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
