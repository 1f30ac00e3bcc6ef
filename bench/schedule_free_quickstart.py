"""The quickstart recipe (ResNet-18 on the digits) with schedule-free SGD against its step-decay and cosine
schedules: validation accuracy (at x, as ScheduleFreeModes evaluates), final training loss and the run's wall
time over seeds, each variant run the same way.

Each run is ``python train.py OVERRIDES seed=S``; its ``metrics.json`` gives the numbers. The wall time is the
whole run's (data, forward, backward, validation): the optimizer step is a small part of it.

Usage: ``python bench/schedule_free_quickstart.py [--seeds N] [--variants NAME ...] [-- OVERRIDE ...]``;
writes ``bench/results/schedule_free_quickstart.json``.
"""

from __future__ import annotations

import argparse
import statistics

from bf16_quickstart import run
from common import write_json

VARIANTS = {  # name: train.py overrides
    "SGD, step decay (the quickstart)": [],
    "SGD, cosine": ["schedule=cosine", "schedule.warmup=1"],
    "schedule-free SGD, lr 0.5": ["optim=schedule_free", "optim.lr=0.5"],
    "schedule-free SGD, lr 1.0": ["optim=schedule_free", "optim.lr=1.0"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run, after --")
    args = parser.parse_args()
    runs = {}
    for seed in range(args.seeds):  # seed by seed: a drift of the machine falls on every variant alike
        for name in args.variants:
            runs.setdefault(name, []).append(run([*VARIANTS[name], *args.overrides], seed))
    for name, results in runs.items():
        accuracies = [r["val_acc"] for r in results]
        print(
            f"{name}: val acc {statistics.mean(accuracies):.4f} (min {min(accuracies):.4f}, max "
            f"{max(accuracies):.4f}), wall {statistics.mean(r['wall_s'] for r in results):.1f} s",
            flush=True,
        )
    path = write_json(
        "schedule_free_quickstart",
        {
            "model": "quickstart: ResNet-18 on the digits (recipes/quickstart.yaml), 10 epochs",
            "overrides": args.overrides,
            "seeds": args.seeds,
            "variants": {name: VARIANTS[name] for name in args.variants},
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
