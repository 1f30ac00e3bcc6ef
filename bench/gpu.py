"""Step time on a CUDA GPU: FusedSGD (our CUDA kernel) against torch.optim.SGD (foreach, fused), timm's
Lars and a data-movement floor, on ResNet-50's parameter shapes.

Usage: ``python bench/gpu.py [--repeats N]`` on a machine with a GPU. Each contender runs ``--steps``
back-to-back steps between two CUDA events (so host launch cost counts when it is the bottleneck);
the table gives the median per-step time over the repeats, interleaved round-robin. The floor is
torch's copy kernel moving the bytes a momentum step moves (20 per fp32 parameter).

bf16 params without master weights (``update_rounding`` nearest, stochastic, kahan) run beside torch's fused
bf16 step and copy floors of their traffic: 10 bytes per parameter, 14 with a Kahan compensation.

Then, for three models (ResNet-50's 161 tensors, a CIFAR ResNet-18's 62, and 2,000 tensors of 4,096
elements), the step eager and captured in a CUDA graph (``FusedSGD(capturable=True)``, one step captured,
replayed), against torch fused and foreach and the copy floor, with the host time a step costs (the Python
and launch work before the GPU runs it). ``--train``: a whole ResNet-50 training step on synthetic data
(batch 256, channels_last, bf16 autocast), images/s with FusedSGD and with torch fused SGD, and the
optimizer's share.
Writes ``bench/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from common import print_table, write_json

from lightning_fusedsgd import FusedSGD, param_groups

HPARAMS = dict(lr=0.1, momentum=0.9, weight_decay=5e-5)
# Copy floors, by name: the bytes per parameter each moves.
FLOORS = {"floor (copy)": 20, "floor bf16 (copy, 10 B)": 10, "floor bf16 Kahan (copy, 14 B)": 14}


def model_groups(dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """ResNet-50's params in ``param_groups``' two groups, on the GPU, with gradients."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(weights=None).to(device="cuda", dtype=dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return param_groups(model, HPARAMS["weight_decay"])


def small_groups(seed: int = 0) -> list[dict]:
    """Three models' params with gradients, as ``param_groups`` groups them (the last one group)."""
    torch.manual_seed(seed)
    cifar = torchvision.models.resnet18(num_classes=10).cuda()
    for p in cifar.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    many = [torch.nn.Parameter(torch.randn(4096, device="cuda")) for _ in range(2000)]
    for p in many:
        p.grad = torch.randn_like(p) * 1e-3
    return {
        "CIFAR ResNet-18 (62 tensors)": lambda: param_groups(cifar, HPARAMS["weight_decay"]),
        "2,000 x 4,096": lambda: [{"params": many}],
    }


def captured(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured once in a CUDA graph (after three warmup steps on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def host_time(step: Callable[[], None], repeats: int) -> float:
    """Median seconds of host work per step: the time to issue ``repeats`` steps, before waiting for them."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        samples.append((time.perf_counter() - start) / repeats)
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_floor(numel: int) -> Callable[[], None]:
    source = torch.empty(numel * 5 // 2, device="cuda")  # a copy moves 8 bytes per element: 20 per param
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def eager_and_captured(name: str, make_groups: Callable[[], list[dict]], args: argparse.Namespace) -> tuple:
    """One model's row of the captured-step table, and the host times of our eager and captured steps."""
    numel = sum(p.numel() for group in make_groups() for p in group["params"])
    eager = FusedSGD(make_groups(), backend="compiled", **HPARAMS).step
    replay = captured(FusedSGD(make_groups(), backend="compiled", capturable=True, **HPARAMS).step)
    steps = {
        "FusedSGD eager": eager,
        "FusedSGD captured": replay,
        "torch fused": torch.optim.SGD(make_groups(), fused=True, **HPARAMS).step,
        "torch foreach": torch.optim.SGD(make_groups(), foreach=True, **HPARAMS).step,
        "floor (copy)": copy_floor(numel),
    }
    times = time_cuda(steps, args.repeats, args.steps)
    hosts = {
        "FusedSGD eager": host_time(eager, args.steps),
        "FusedSGD captured": host_time(replay, args.steps),
    }
    return (name, times), hosts


def training_throughput(args: argparse.Namespace) -> dict[str, float]:
    """Images/s of a whole ResNet-50 training step (synthetic data, batch 256, channels_last, bf16 autocast)
    with each optimizer, and the optimizer step's share of it."""
    results: dict[str, float] = {}
    for name, make in (
        ("FusedSGD", lambda params: FusedSGD(params, backend="compiled", **HPARAMS)),
        ("torch fused", lambda params: torch.optim.SGD(params, fused=True, **HPARAMS)),
    ):
        torch.manual_seed(0)
        model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        optimizer = make(param_groups(model, HPARAMS["weight_decay"]))
        step_time = time_cuda({"train": train_step(model, optimizer)}, 5, args.train_steps)["train"]
        optimizer_time = time_cuda({"step": optimizer.step}, 5, args.steps)["step"]
        results[f"{name} images/s"] = 256 / step_time
        results[f"{name} optimizer share"] = optimizer_time / step_time
    return results


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """One training step of ``model`` on a fixed synthetic batch of 256 ImageNet-sized images."""
    images = torch.randn(256, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (256,), device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


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
    parser.add_argument("--train", action="store_true", help="also time a whole ResNet-50 training step")
    parser.add_argument("--train-steps", type=int, default=10, help="training steps per timed repeat")
    args = parser.parse_args()
    numel = sum(p.numel() for p in torchvision.models.resnet50(weights=None).parameters())
    # A copy of float32 elements moves 8 bytes per element: 20 bytes per param, 10 and 14 for bf16 steps.
    copies = {
        name: torch.empty(numel * bytes_moved // 8, device="cuda") for name, bytes_moved in FLOORS.items()
    }
    copy_dst = {name: torch.empty_like(src) for name, src in copies.items()}
    steps: dict[str, Callable[[], None]] = {
        "FusedSGD": FusedSGD(model_groups(torch.float32), backend="compiled", **HPARAMS).step,
        "torch fused": torch.optim.SGD(model_groups(torch.float32), fused=True, **HPARAMS).step,
        "torch foreach": torch.optim.SGD(model_groups(torch.float32), foreach=True, **HPARAMS).step,
        "FusedSGD+LARS": FusedSGD(model_groups(torch.float32), lars=True, backend="compiled", **HPARAMS).step,
        "LARS, reference backend": FusedSGD(
            model_groups(torch.float32), lars=True, backend="reference", **HPARAMS
        ).step,
        "FusedSGD bf16+master": FusedSGD(
            model_groups(torch.bfloat16), backend="compiled", master_weights=True, **HPARAMS
        ).step,
        **{
            f"FusedSGD bf16 {rounding}": FusedSGD(
                model_groups(torch.bfloat16), backend="compiled", update_rounding=rounding, **HPARAMS
            ).step
            for rounding in ("nearest", "stochastic", "kahan")
        },
        "torch fused bf16": torch.optim.SGD(model_groups(torch.bfloat16), fused=True, **HPARAMS).step,
        **{name: (lambda name=name: copy_dst[name].copy_(copies[name])) for name in FLOORS},
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
    bf16_floor, kahan_floor = times["floor bf16 (copy, 10 B)"], times["floor bf16 Kahan (copy, 14 B)"]
    for rounding in ("nearest", "stochastic"):
        print(
            f"FusedSGD bf16 {rounding} / 10-byte floor: {times[f'FusedSGD bf16 {rounding}'] / bf16_floor:.2f}"
        )
    print(f"FusedSGD bf16 kahan / 14-byte floor: {times['FusedSGD bf16 kahan'] / kahan_floor:.2f}")
    for rounding in ("stochastic", "kahan"):
        ratio = times["FusedSGD bf16+master"] / times[f"FusedSGD bf16 {rounding}"]
        print(f"FusedSGD bf16+master / {rounding}: {ratio:.2f}")
    if "timm Lars" in times:
        print(f"timm Lars / FusedSGD+LARS: {times['timm Lars'] / times['FusedSGD+LARS']:.1f}x")
    rows, hosts = [], {}
    for name, make_groups in {"ResNet-50": lambda: model_groups(torch.float32), **small_groups()}.items():
        row, host = eager_and_captured(name, make_groups, args)
        rows.append(row)
        hosts[name] = host
    print_table(
        f"(b) eager and captured steps, median of {args.repeats} x {args.steps} steps",
        rows,
        "FusedSGD captured",
    )
    print("\n| case | host ms per step, eager | host ms per step, captured | captured / floor |")
    print("|---|---|---|---|")
    for name, times in rows:
        host = hosts[name]
        print(
            f"| {name} | {host['FusedSGD eager'] * 1e3:.3f} | {host['FusedSGD captured'] * 1e3:.3f} | "
            f"{times['FusedSGD captured'] / times['floor (copy)']:.2f} |"
        )
    training = training_throughput(args) if args.train else {}
    for key, value in training.items():
        print(f"{key}: {value:.3f}" if "share" in key else f"{key}: {value:.0f}")
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "repeats": args.repeats,
        "steps": args.steps,
        "hparams": HPARAMS,
        "times": times,
        "captured": {
            name: {**row_times, **hosts_of} for (name, row_times), hosts_of in zip(rows, hosts.values())
        },
        "training": training,
    }
    print(f"wrote {write_json('gpu', payload)}")


if __name__ == "__main__":
    main()
