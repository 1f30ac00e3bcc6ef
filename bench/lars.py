"""LARS step time on ResNet-50: FusedSGD with LARS vs FusedSGD plain vs timm's Lars vs torch fused SGD.

Usage: ``python bench/lars.py [--repeats N]`` (timm is an optional bench dependency:
``pip install -e .[bench]``). Groups come from ``param_groups`` (54 decayed + LARS tensors, 107
excluded), as in the MLPerf recipe. Prints a markdown table and writes ``bench/results/lars.json``.
"""

from __future__ import annotations

import argparse

import torch
import torchvision
from common import print_table, time_interleaved, write_json

from lightning_fusedsgd import FusedSGD, param_groups

HPARAMS = dict(lr=10.5, momentum=0.9, weight_decay=5e-5)


def model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def groups(model: torch.nn.Module, lars: bool) -> list[dict]:
    built = param_groups(model, HPARAMS["weight_decay"])
    for group in built:
        group["lars"] = group["lars"] and lars
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    steps = {
        "FusedSGD+LARS": FusedSGD(groups(model_with_grads(), lars=True), backend="compiled", **HPARAMS).step,
        "FusedSGD plain": FusedSGD(
            groups(model_with_grads(), lars=False), backend="compiled", **HPARAMS
        ).step,
        "torch fused": torch.optim.SGD(groups(model_with_grads(), lars=False), fused=True, **HPARAMS).step,
    }
    try:
        from timm.optim import Lars

        steps["timm Lars"] = Lars(groups(model_with_grads(), lars=True), **HPARAMS).step
    except ImportError:
        print("timm is not installed (pip install -e .[bench]): skipping timm's Lars")
    times = time_interleaved(steps, repeats=args.repeats)
    print_table(
        f"ResNet-50 LARS step, median of {args.repeats} ({torch.get_num_threads()} threads)",
        [("(a) ResNet-50, fp32", times)],
        "FusedSGD plain",
    )
    print(f"\nLARS / plain: {times['FusedSGD+LARS'] / times['FusedSGD plain']:.2f}")
    if "timm Lars" in times:
        print(f"timm Lars / FusedSGD+LARS: {times['timm Lars'] / times['FusedSGD+LARS']:.2f}x")
    print(f"wrote {write_json('lars', {'repeats': args.repeats, 'hparams': HPARAMS, 'times': times})}")


if __name__ == "__main__":
    main()
