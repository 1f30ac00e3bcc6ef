"""Step time on a GPU: FusedSGD (our CUDA kernel) against torch.optim.SGD (fused, foreach), the average of
the weights after torch's step, schedulefree, timm's Lars and a data-movement floor; captured in CUDA graphs;
and a whole ResNet-50 training step.

Sections, each timed on its own and written to the results file as soon as it ends (a section that fails is
recorded with its error and the others run; a section that would start after ``--deadline`` seconds is
recorded as skipped):

- ``resnet50``: ResNet-50's 161 parameters (``param_groups``' two groups). Every step of the table below,
  and bf16 params (with fp32 masters; without: ``update_rounding`` nearest, stochastic, kahan) beside torch's
  fused bf16 step and copy floors of their traffic (10 bytes per parameter, 14 with a Kahan compensation).
- ``flat``: one tensor of ``--flat-numel`` fp32 parameters (200M), the bandwidth case.
- ``captured`` (CUDA only): ResNet-50, a CIFAR ResNet-18 (62 tensors) and 2,000 tensors of 4,096 elements,
  each step captured once in a CUDA graph and replayed, with the host time an eager and a replayed step cost.
- ``train`` (``--train``): a ResNet-50 training step on a fixed synthetic batch (256 images, channels_last,
  bf16 autocast), images/s with FusedSGD and with torch's fused SGD, and the optimizer's share of the step.

The steps compared on a set of parameters: the copy floor (torch's copy kernel moving the 20 bytes a momentum
step moves per fp32 parameter), FusedSGD, torch fused and foreach, FusedSGD with the average of the weights
(``ema_decay``) against torch fused followed by ``torch._foreach_lerp_`` of the averages, FusedSGDScheduleFree
against ``schedulefree.SGDScheduleFree`` (foreach), and FusedLARS against timm's ``Lars``. Each contender runs
``--steps`` back-to-back steps between two CUDA events (host launch cost counts where it is the bottleneck);
tables give the median per-step time over ``--repeats``, interleaved round-robin.

Usage: ``python bench/gpu.py [--train]`` on a machine with a GPU (``bench/gpu_check.sh`` runs it). ``--smoke``
runs every section on small sizes, on the CPU where there is no GPU (wall-clock timing there; the captured
section needs CUDA): the test suite runs it so, so that the script is whole when a GPU is lent.
Writes ``bench/results/gpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import schedulefree
import torch
import torchvision
from common import RESULTS_DIR, print_table, write_json
from timm.optim import Lars

from lightning_fusedsgd import FusedLARS, FusedSGD, FusedSGDScheduleFree, param_groups

HPARAMS = dict(lr=0.1, momentum=0.9, weight_decay=5e-5)
EMA_DECAY = 0.999
Groups = Callable[[], list[dict]]
Step = Callable[[], object]


def with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def model_groups(model: str, device: str, dtype: torch.dtype = torch.float32) -> Groups:
    """A torchvision model's params in ``param_groups``' groups, with gradients: fresh ones at each call."""

    def groups() -> list[dict]:
        torch.manual_seed(0)
        kwargs = {"num_classes": 10} if model == "resnet18" else {}
        net = getattr(torchvision.models, model)(weights=None, **kwargs).to(device=device, dtype=dtype)
        with_grads(list(net.parameters()))
        return param_groups(net, HPARAMS["weight_decay"])

    return groups


def tensors_groups(shapes: list[tuple[int, ...]], device: str) -> Groups:
    def groups() -> list[dict]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]
        return [{"params": with_grads(params)}]

    return groups


def numel_of(groups: list[dict]) -> int:
    """Parameters in ``groups`` (``param_groups`` lists them as (name, tensor) pairs)."""
    return sum((p[1] if isinstance(p, tuple) else p).numel() for group in groups for p in group["params"])


def copy_floor(numel: int, bytes_per_param: int, device: str) -> Step:
    """torch's copy moving ``bytes_per_param`` per parameter (a copy of float32 moves 8 bytes an element)."""
    source = torch.empty(numel * bytes_per_param // 8, device=device)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def averaged_after_torch_fused(groups: list[dict]) -> Step:
    """torch's fused step, then the average of the weights as a second pass (timm's ModelEmaV3 does this)."""
    optimizer = torch.optim.SGD(groups, fused=True, **HPARAMS)
    params = [p for group in optimizer.param_groups for p in group["params"]]  # tensors, names apart
    averages = [p.detach().clone() for p in params]

    def step() -> None:
        optimizer.step()
        torch._foreach_lerp_(averages, [p.detach() for p in params], 1 - EMA_DECAY)

    return step


def schedule_free_step(kind: type, groups: list[dict]) -> Step:
    hparams = dict(lr=HPARAMS["lr"], momentum=HPARAMS["momentum"], weight_decay=HPARAMS["weight_decay"])
    if kind is schedulefree.SGDScheduleFree:
        groups = [{k: v for k, v in group.items() if k in ("params", "weight_decay")} for group in groups]
        hparams["foreach"] = True
    optimizer = kind(groups, **hparams)
    optimizer.train()
    return optimizer.step


def contenders(groups: Groups, device: str) -> dict[str, Step]:
    """The steps compared on one set of parameters, the copy floor first."""
    numel = numel_of(groups())
    return {
        "copy floor": copy_floor(numel, 20, device),
        "FusedSGD": FusedSGD(groups(), backend="compiled", **HPARAMS).step,
        "torch fused": torch.optim.SGD(groups(), fused=True, **HPARAMS).step,
        "torch foreach": torch.optim.SGD(groups(), foreach=True, **HPARAMS).step,
        "FusedSGD + average": FusedSGD(groups(), backend="compiled", ema_decay=EMA_DECAY, **HPARAMS).step,
        "torch fused + _foreach_lerp_": averaged_after_torch_fused(groups()),
        "FusedSGDScheduleFree": schedule_free_step(FusedSGDScheduleFree, groups()),
        "schedulefree (foreach)": schedule_free_step(schedulefree.SGDScheduleFree, groups()),
        "FusedLARS": FusedLARS(groups(), backend="compiled", **HPARAMS).step,
        "timm Lars": Lars(groups(), **HPARAMS).step,
    }


# The ratios each table states, as (step, what it is compared with).
COMPARISONS = [
    ("FusedSGD", "copy floor"),
    ("torch fused", "FusedSGD"),
    ("torch foreach", "FusedSGD"),
    ("FusedSGD + average", "FusedSGD"),
    ("torch fused + _foreach_lerp_", "FusedSGD + average"),
    ("FusedSGDScheduleFree", "copy floor"),
    ("schedulefree (foreach)", "FusedSGDScheduleFree"),
    ("FusedLARS", "FusedSGD"),
    ("timm Lars", "FusedLARS"),
]


def ratios(times: dict[str, float], comparisons: list[tuple[str, str]]) -> dict[str, float]:
    return {f"{a} / {b}": times[a] / times[b] for a, b in comparisons if a in times and b in times}


class Clock:
    """Per-step times of callables on one device: CUDA events on a GPU, wall time on the CPU."""

    def __init__(self, device: str, repeats: int, steps: int) -> None:
        self.cuda = device == "cuda"
        self.repeats, self.steps = repeats, steps

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _elapsed(self, fn: Step, count: int) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(count):
                fn()
            return (time.perf_counter() - start) / count
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count

    def times(self, steps: dict[str, Step], per_repeat: int | None = None) -> dict[str, float]:
        """Median seconds per step of each callable, run round-robin after three warmup calls."""
        for fn in steps.values():
            for _ in range(3):
                fn()
        self.sync()
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(self.repeats):
            for name, fn in steps.items():
                samples[name].append(self._elapsed(fn, per_repeat or self.steps))
        return {name: statistics.median(values) for name, values in samples.items()}

    def host(self, fn: Step) -> float:
        """Median seconds of host work per step: the time to issue ``steps`` steps, not waiting for them."""
        samples = []
        for _ in range(5):
            self.sync()
            start = time.perf_counter()
            for _ in range(self.steps):
                fn()
            samples.append((time.perf_counter() - start) / self.steps)
            self.sync()
        return statistics.median(samples)


def captured(step: Step) -> Step:
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


def section_steps(args: argparse.Namespace, clock: Clock, groups: Groups, title: str) -> dict[str, object]:
    times = clock.times(contenders(groups, args.device))
    print_table(title, [("fp32", times)], "FusedSGD")
    return {"title": title, "times": times, "ratios": ratios(times, COMPARISONS)}


def resnet50(args: argparse.Namespace, clock: Clock) -> dict[str, object]:
    model = "mobilenet_v3_small" if args.smoke else "resnet50"
    result = section_steps(args, clock, model_groups(model, args.device), f"{model} params, fp32")
    numel = numel_of(model_groups(model, args.device)())
    bf16 = model_groups(model, args.device, torch.bfloat16)
    steps = {
        "FusedSGD bf16 + master": FusedSGD(bf16(), backend="compiled", master_weights=True, **HPARAMS).step,
        **{
            f"FusedSGD bf16 {rounding}": FusedSGD(
                bf16(), backend="compiled", update_rounding=rounding, **HPARAMS
            ).step
            for rounding in ("nearest", "stochastic", "kahan")
        },
        "torch fused bf16": torch.optim.SGD(bf16(), fused=True, **HPARAMS).step,
        "copy floor 10 B": copy_floor(numel, 10, args.device),
        "copy floor 14 B": copy_floor(numel, 14, args.device),
    }
    times = clock.times(steps)
    print_table(f"{model} params, bf16", [("bf16", times)], "FusedSGD bf16 nearest")
    result["bf16_times"] = times
    result["bf16_ratios"] = ratios(
        times,
        [
            ("FusedSGD bf16 nearest", "copy floor 10 B"),
            ("FusedSGD bf16 stochastic", "copy floor 10 B"),
            ("FusedSGD bf16 kahan", "copy floor 14 B"),
            ("torch fused bf16", "FusedSGD bf16 nearest"),
            ("FusedSGD bf16 + master", "FusedSGD bf16 stochastic"),
        ],
    )
    return result


def flat(args: argparse.Namespace, clock: Clock) -> dict[str, object]:
    numel = args.flat_numel
    groups = tensors_groups([(numel,)], args.device)
    return section_steps(args, clock, groups, f"one tensor of {numel:,} fp32")


def captured_steps(args: argparse.Namespace, clock: Clock) -> dict[str, object]:
    models = {
        "ResNet-50 (161 tensors)": model_groups("resnet50", "cuda"),
        "CIFAR ResNet-18 (62 tensors)": model_groups("resnet18", "cuda"),
        "2,000 x 4,096": tensors_groups([(4096,)] * 2000, "cuda"),
    }
    rows, hosts = {}, {}
    for name, groups in models.items():
        numel = numel_of(groups())
        eager = FusedSGD(groups(), backend="compiled", **HPARAMS).step
        replay = captured(FusedSGD(groups(), backend="compiled", capturable=True, **HPARAMS).step)
        steps = {
            "copy floor": copy_floor(numel, 20, "cuda"),
            "FusedSGD eager": eager,
            "FusedSGD captured": replay,
            "torch fused captured": captured(torch.optim.SGD(groups(), fused=True, **HPARAMS).step),
            "FusedSGD + average captured": captured(
                FusedSGD(groups(), backend="compiled", capturable=True, ema_decay=EMA_DECAY, **HPARAMS).step
            ),
            "FusedLARS captured": captured(
                FusedLARS(groups(), backend="compiled", capturable=True, **HPARAMS).step
            ),
        }
        rows[name] = clock.times(steps)
        hosts[name] = {"FusedSGD eager": clock.host(eager), "FusedSGD captured": clock.host(replay)}
    print_table("steps captured in a CUDA graph", list(rows.items()), "FusedSGD captured")
    return {"title": "steps captured in a CUDA graph", "times": rows, "host_seconds": hosts}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> Step:
    """One training step of ``model`` on a fixed synthetic batch (bf16 autocast on a GPU)."""
    size = (args.train_batch, 3, args.image_size, args.image_size)
    images = torch.randn(size, device=args.device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.train_batch,), device=args.device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


def train(args: argparse.Namespace, clock: Clock) -> dict[str, object]:
    """Images/s of a whole ResNet-50 training step with each optimizer, and the optimizer's share of it."""
    results: dict[str, float] = {}
    for name, make in (
        ("FusedSGD", lambda params: FusedSGD(params, backend="compiled", **HPARAMS)),
        ("torch fused", lambda params: torch.optim.SGD(params, fused=True, **HPARAMS)),
    ):
        torch.manual_seed(0)
        model = torchvision.models.resnet50().to(args.device, memory_format=torch.channels_last)
        optimizer = make(param_groups(model, HPARAMS["weight_decay"]))
        step_time = clock.times({"train": train_step(model, optimizer, args)}, args.train_steps)["train"]
        optimizer_time = clock.times({"step": optimizer.step})["step"]
        results[f"{name} images/s"] = args.train_batch / step_time
        results[f"{name} optimizer share"] = optimizer_time / step_time
    for key, value in results.items():
        print(f"{key}: {value:.3f}" if "share" in key else f"{key}: {value:.0f}")
    title = f"ResNet-50 training step, batch {args.train_batch}, {args.image_size}px"
    return {"title": title, "training": results}


SECTIONS = {"resnet50": resnet50, "flat": flat, "captured": captured_steps, "train": train}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="back-to-back steps per timed repeat")
    parser.add_argument("--train", action="store_true", help="also time a whole ResNet-50 training step")
    parser.add_argument("--train-steps", type=int, default=10, help="training steps per timed repeat")
    parser.add_argument("--train-batch", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--flat-numel", type=int, default=200_000_000)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no section after (s)")
    parser.add_argument("--smoke", action="store_true", help="every section on small sizes, on any device")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu.json")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.repeats, args.steps, args.train_steps = 1, 1, 1
        args.train_batch, args.image_size, args.flat_numel, args.train = 2, 64, 1 << 16, True
    elif args.device != "cuda":
        parser.error("no CUDA device: run on a GPU, or with --smoke")
    clock = Clock(args.device, args.repeats, args.steps)
    settings = {key: getattr(args, key) for key in ("repeats", "steps", "train_batch", "image_size", "smoke")}
    payload: dict[str, object] = {"settings": {**settings, "hparams": HPARAMS, "ema_decay": EMA_DECAY}}
    sections: dict[str, object] = {}
    payload["sections"] = sections
    start, failed = time.monotonic(), 0
    for name, section in SECTIONS.items():
        if name == "train" and not args.train:
            continue
        if name == "captured" and args.device != "cuda":
            sections[name] = {"skipped": "CUDA graphs need a CUDA device"}
        elif time.monotonic() - start > args.deadline:
            sections[name] = {"skipped": f"past the deadline of {args.deadline:.0f} s"}
        else:
            try:
                sections[name] = section(args, clock)
            except Exception as error:  # recorded, and the other sections still run
                traceback.print_exc()
                sections[name] = {"error": f"{type(error).__name__}: {error}"}
                failed += 1
        write_json("gpu", payload, args.out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    outcomes = {name: "ok" if "title" in result else next(iter(result)) for name, result in sections.items()}
    print(f"wrote {args.out}; sections: " + ", ".join(f"{name}: {what}" for name, what in outcomes.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
