"""LARS step time on ResNet-50: FusedSGD with LARS vs FusedSGD plain vs timm's Lars vs torch fused SGD.

Usage: ``python bench/lars.py [--repeats N]`` (timm is an optional bench dependency:
``pip install -e .[bench]``). Groups come from ``param_groups`` (54 decayed + LARS tensors, 107
excluded), as in the MLPerf recipe. Two data-movement floors run on copies of the LARS optimizer's
tensors: the plain floor (a momentum step's reads and writes) and the LARS floor (the same waves, plus the
norm pass's re-read of w and g for LARS tensors). Prints a markdown table and writes
``bench/results/lars.json``.
"""

from __future__ import annotations

import argparse

import torch
import torchvision
from common import floor_ops, print_table, time_interleaved, write_json
from step import clone_params

from lightning_fusedsgd import FusedSGD, param_groups

HPARAMS = dict(lr=10.5, momentum=0.9, weight_decay=5e-5)


def model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def groups(model: torch.nn.Module) -> list[dict]:
    return param_groups(model, HPARAMS["weight_decay"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    floor = floor_ops()
    fused_lars = FusedSGD(groups(model_with_grads()), lars=True, backend="compiled", **HPARAMS)
    fused_lars.step()  # creates the buffers, so the floors can copy them
    # The kernel's bucket order (groups in order, then their params), so the floors get the step's waves.
    ours = [p for g in fused_lars.param_groups for p in g["params"]]
    lars_flags = [g["lars"] for g in fused_lars.param_groups for _ in g["params"]]
    floor_params = clone_params(ours)  # the floors scribble over their tensors: never the timed optimizer's
    floor_grads = [p.grad for p in floor_params]
    floor_bufs = [fused_lars.state[p]["momentum_buffer"].clone() for p in ours]
    steps = {
        "FusedSGD+LARS": fused_lars.step,
        "FusedSGD plain": FusedSGD(groups(model_with_grads()), backend="compiled", **HPARAMS).step,
        "torch fused": torch.optim.SGD(groups(model_with_grads()), fused=True, **HPARAMS).step,
        "plain floor": lambda: floor.floor_step(floor_params, floor_grads, floor_bufs, [], []),
        "LARS floor": lambda: floor.floor_step(floor_params, floor_grads, floor_bufs, [], lars_flags),
    }
    try:
        from timm.optim import Lars

        steps["timm Lars"] = Lars(groups(model_with_grads()), **HPARAMS).step
    except ImportError:
        print("timm is not installed (pip install -e .[bench]): skipping timm's Lars")
    times = time_interleaved(steps, repeats=args.repeats)
    print_table(
        f"ResNet-50 LARS step, median of {args.repeats} ({torch.get_num_threads()} threads)",
        [("(a) ResNet-50, fp32", times)],
        "FusedSGD plain",
    )
    ratios = {
        "LARS / plain": times["FusedSGD+LARS"] / times["FusedSGD plain"],
        "LARS / LARS floor": times["FusedSGD+LARS"] / times["LARS floor"],
        "LARS floor / plain floor": times["LARS floor"] / times["plain floor"],
    }
    if "timm Lars" in times:
        ratios["timm Lars / FusedSGD+LARS"] = times["timm Lars"] / times["FusedSGD+LARS"]
    print()
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    payload = {"repeats": args.repeats, "hparams": HPARAMS, "times": times, "ratios": ratios}
    print(f"wrote {write_json('lars', payload)}")


if __name__ == "__main__":
    main()
