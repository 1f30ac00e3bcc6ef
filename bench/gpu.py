"""Step time on a CUDA GPU: FusedSGD (our CUDA kernel) against torch.optim.SGD (foreach, fused), timm's
Lars and a data-movement floor, on ResNet-50's parameter shapes.

Usage: ``python bench/gpu.py [--repeats N]`` on a machine with a GPU. Each contender runs ``--steps``
back-to-back steps between two CUDA events (so host launch cost counts when it is the bottleneck);
the table gives the median per-step time over the repeats, interleaved round-robin. The floor is
torch's copy kernel moving the bytes a momentum step moves (20 per fp32 parameter). Writes
``bench/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torchvision
from common import print_table, write_json

from lightning_fusedsgd import FusedSGD, param_groups

HPARAMS = dict(lr=0.1, momentum=0.9, weight_decay=5e-5)


def model_groups(dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """ResNet-50's params in ``param_groups``' two groups, on the GPU, with gradients."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None).to(device="cuda", dtype=dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return param_groups(model, HPARAMS["weight_decay"])


def time_cuda(steps: dict[str, Callable[[], None]], repeats: int, per_repeat: int) -> dict[str, float]:
    for fn in steps.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_repeat):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / per_repeat)
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="back-to-back steps per timed repeat")
    args = parser.parse_args()
    numel = sum(p.numel() for p in torchvision.models.resnet50(weights=None).parameters())
    copy_src = torch.empty(numel * 5 // 2, device="cuda")  # a copy moves 8 bytes per element: 20 per param
    copy_dst = torch.empty_like(copy_src)
    steps: dict[str, Callable[[], None]] = {
        "FusedSGD": FusedSGD(model_groups(torch.float32), backend="compiled", **HPARAMS).step,
        "torch fused": torch.optim.SGD(model_groups(torch.float32), fused=True, **HPARAMS).step,
        "torch foreach": torch.optim.SGD(model_groups(torch.float32), foreach=True, **HPARAMS).step,
        "FusedSGD+LARS": FusedSGD(model_groups(torch.float32), lars=True, backend="compiled", **HPARAMS).step,
        "LARS, reference backend": FusedSGD(
            model_groups(torch.float32), lars=True, backend="torch", **HPARAMS
        ).step,
        "FusedSGD bf16+master": FusedSGD(
            model_groups(torch.bfloat16), backend="compiled", master_weights=True, **HPARAMS
        ).step,
        "floor (copy)": lambda: copy_dst.copy_(copy_src),
    }
    try:
        from timm.optim import Lars

        steps["timm Lars"] = Lars(model_groups(torch.float32), **HPARAMS).step
    except ImportError:
        print("timm is not installed (pip install -e .[bench]): skipping timm's Lars")
    times = time_cuda(steps, args.repeats, args.steps)
    print_table(
        f"ResNet-50 step on {torch.cuda.get_device_name()}, median of {args.repeats} x {args.steps} steps",
        [("(a) ResNet-50, fp32 (bf16 row: bf16 params)", times)],
        "FusedSGD",
    )
    floor = times["floor (copy)"]
    print(f"\nFusedSGD / floor: {times['FusedSGD'] / floor:.2f}")
    print(f"FusedSGD+LARS / FusedSGD: {times['FusedSGD+LARS'] / times['FusedSGD']:.2f}")
    if "timm Lars" in times:
        print(f"timm Lars / FusedSGD+LARS: {times['timm Lars'] / times['FusedSGD+LARS']:.1f}x")
    payload = {"device": torch.cuda.get_device_name(), "repeats": args.repeats, "steps": args.steps}
    print(f"wrote {write_json('gpu', {**payload, 'hparams': HPARAMS, 'times': times})}")


if __name__ == "__main__":
    main()
