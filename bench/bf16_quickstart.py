"""The quickstart recipe (ResNet-18 on the digits) under ``precision=bf16-true`` with each way of updating
bf16 weights, against fp32 and fp32 master weights: validation accuracy and final training loss over seeds.

Each run is ``python train.py trainer.precision=... optim.master_weights=... optim.update_rounding=...
seed=S``; its ``metrics.json`` gives the numbers. bf16 convolutions run tens of times slower than fp32 on CPUs
without native bf16 (docs/guide/precision.md: hours per run on the 2-core benchmark machine), so this is a
benchmark for a GPU machine, or a CPU with AVX512-BF16 or AMX; ``bench/bf16_rounding.py`` measures the same
options on an MLP where bf16 is slow.

Usage: ``python bench/bf16_quickstart.py [--seeds N] [--variants NAME ...] [-- OVERRIDE ...]`` (overrides go
to every run, e.g. ``-- debug=tiny`` for a smoke run); writes ``bench/results/bf16_quickstart.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_json

ROOT = Path(__file__).resolve().parent.parent
BF16 = ["trainer.precision=bf16-true"]
VARIANTS = {  # name: train.py overrides
    "fp32": ["trainer.precision=32-true"],
    "bf16 + fp32 master weights": [*BF16, "optim.master_weights=true"],
    "bf16, rounded to nearest": [*BF16, "optim.master_weights=false"],
    "bf16, rounded stochastically": [*BF16, "optim.master_weights=false", "optim.update_rounding=stochastic"],
    "bf16, Kahan compensation": [*BF16, "optim.master_weights=false", "optim.update_rounding=kahan"],
}


def run(overrides: list[str], seed: int) -> dict[str, float]:
    """One training run; its validation accuracy, final logged training loss and wall time."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "train.py", *overrides, f"seed={seed}", f"hydra.run.dir={directory}"]
        subprocess.run(command, cwd=ROOT, check=True)
        summary = json.loads((Path(directory) / "metrics.json").read_text())
    return {
        "val_acc": summary["val/acc"],
        "train_loss": summary["metrics"].get("train/loss"),
        "wall_s": summary["wall_time_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run, after --")
    args = parser.parse_args()
    runs = {}
    for name in args.variants:
        runs[name] = [run([*VARIANTS[name], *args.overrides], seed) for seed in range(args.seeds)]
        accuracies = [r["val_acc"] for r in runs[name]]
        losses = [r["train_loss"] for r in runs[name] if r["train_loss"] is not None]
        loss = f"{statistics.mean(losses):.4f}" if losses else "not logged"
        print(
            f"{name}: val acc {statistics.mean(accuracies):.4f} (min {min(accuracies):.4f}, max "
            f"{max(accuracies):.4f}), final train loss {loss}",
            flush=True,
        )
    path = write_json(
        "bf16_quickstart",
        {
            "model": "quickstart: ResNet-18 on the digits (recipes/quickstart.yaml)",
            "overrides": args.overrides,
            "seeds": args.seeds,
            "variants": {name: VARIANTS[name] for name in args.variants},
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
