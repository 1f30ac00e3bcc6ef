"""The step with the average of the weights (``ema_decay``) against our plain step, the data-movement floor,
and torch's fused SGD step followed by timm's ``ModelEmaV3`` update (its ``_foreach_lerp_``), on ResNet-50's
shapes: in fp32, and bf16 with fp32 master weights.

The bytes a step moves per parameter: 20 for the plain fp32 momentum step (read w, g, b; write w, b), 28 with
the average (read and write it too: 1.4x; ``floor + average`` moves them), 32 for torch's step and timm's pass
(the pass reads w and the average and writes the average). With bf16 params and fp32 masters: 22 (read w, g,
master, buffer; write w, master, buffer), 30 with the average.

Usage: ``python bench/ema.py [--repeats N]``. Prints a markdown table and writes ``bench/results/ema.json``.
"""

from __future__ import annotations

import argparse

import torch
from common import floor_ops, make_params, print_table, resnet50_shapes, time_interleaved, write_json
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from lightning_fusedsgd import FusedSGD

HPARAMS = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
DECAY = 0.9998


def clone_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    clones = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        clones.append(q)
    return clones


def contenders(params: list[torch.Tensor], master_weights: bool) -> dict[str, object]:
    """One step function per contender, each on its own copy of the params (state created beforehand)."""
    plain = FusedSGD(clone_params(params), master_weights=master_weights, backend="compiled", **HPARAMS)
    averaged = FusedSGD(
        clone_params(params), master_weights=master_weights, backend="compiled", ema_decay=DECAY, **HPARAMS
    )
    torch_params = clone_params(params)
    fused_torch = torch.optim.SGD(torch_params, fused=True, **HPARAMS)
    holder = nn.Module()
    holder.params = nn.ParameterList(torch_params)
    timm_ema = ModelEmaV3(holder, decay=DECAY)  # foreach: torch._foreach_lerp_ over the weights

    def torch_and_timm() -> None:
        fused_torch.step()
        timm_ema.update(holder)

    for step in (plain.step, averaged.step, torch_and_timm):
        step()  # buffers, masters and averages created outside the timed steps
    steps = {
        "FusedSGD": plain.step,
        "FusedSGD + average": averaged.step,
        "torch fused + timm ModelEmaV3": torch_and_timm,
        "timm ModelEmaV3 alone": lambda: timm_ema.update(holder),
    }
    if not master_weights:
        floor = floor_ops()
        floor_params = clone_params(params)
        buffers = [plain.state[p]["momentum_buffer"].clone() for g in plain.param_groups for p in g["params"]]
        averages = [p.detach().clone() for p in floor_params]
        grads = [p.grad for p in floor_params]
        steps["floor"] = lambda: floor.floor_step(floor_params, grads, buffers, [], [])
        steps["floor + average"] = lambda: floor.floor_step(floor_params, grads, buffers, averages, [])
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rn50 = resnet50_shapes()
    rows = []
    for name, dtype, masters in (
        ("ResNet-50, fp32", torch.float32, False),
        ("ResNet-50, bf16 + fp32 master weights", torch.bfloat16, True),
    ):
        times = time_interleaved(contenders(make_params(rn50, dtype), masters), repeats=args.repeats)
        rows.append((name, times))
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()), flush=True)
    title = (
        f"Step with the average (decay {DECAY}), median of {args.repeats} ({torch.get_num_threads()} threads)"
    )
    print_table(title, rows[:1], "floor")
    ratios = {
        name: {
            "average / plain step": t["FusedSGD + average"] / t["FusedSGD"],
            "average / torch fused + timm": t["FusedSGD + average"] / t["torch fused + timm ModelEmaV3"],
            **(
                {"average / its floor": t["FusedSGD + average"] / t["floor + average"]}
                if "floor + average" in t
                else {}
            ),
        }
        for name, t in rows
    }
    for name, ratio in ratios.items():
        print(f"{name}: " + ", ".join(f"{key} {value:.2f}" for key, value in ratio.items()))
    path = write_json(
        "ema",
        {"repeats": args.repeats, "hparams": HPARAMS, "decay": DECAY, "cases": dict(rows), "ratios": ratios},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
