"""Shared helpers for the step benchmarks: parameter sets, optimizers under test, interleaved timing."""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"
FLOOR_SOURCE = Path(__file__).parent / "csrc" / "floor.cpp"


@functools.cache
def floor_ops():
    """``torch.ops.lightning_fusedsgd_bench`` (``floor_step``: the data-movement floor, csrc/floor.cpp), built
    on first use beside the product kernels with the CPU kernel's flags and work list."""
    from lightning_fusedsgd import ops
    from lightning_fusedsgd.ops import _build, _loader

    cpp_extension = _loader._cpp_extension()
    build_dir = _build.cache_dir() / "bench"
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="lightning_fusedsgd_bench",
        sources=[str(FLOOR_SOURCE)],
        extra_cflags=_build.cpu_flags(ops.cpu_capability()),
        extra_ldflags=list(_build.EXTENSIONS["cpu"].ldflags),
        extra_include_paths=[str(_build.CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
    )
    return torch.ops.lightning_fusedsgd_bench


def resnet50_shapes() -> list[torch.Size]:
    """The 161 parameter shapes of torchvision's ResNet-50."""
    import torchvision

    return [p.shape for p in torchvision.models.resnet50(weights=None).parameters()]


def make_params(
    shapes: list[torch.Size], dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.Tensor]:
    """Parameters with gradients attached, as after a backward pass."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=generator).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=generator) * 1e-3).to(dtype)
        params.append(p)
    return params


def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median wall time (seconds) of each callable, run round-robin so drift hits all of them alike."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next(
                (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), ""
            )
    except OSError:
        return platform.processor()


def _commit() -> str:
    """The commit measured, with "-dirty" where the tree has uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    run = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True)
    head = run(["git", "rev-parse", "--short=12", "HEAD"]).stdout.strip()
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    return f"{head}-dirty" if head and dirty else head or "unknown"


def machine_info() -> dict[str, object]:
    """What a result was measured on and with: the machine, its CPU and GPU, the versions, the commit, the
    date."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def write_json(name: str, payload: dict[str, object], path: Path | None = None) -> Path:
    """The result ``name`` with the machine it ran on, in ``bench/results/NAME.json`` or ``path``."""
    path = path or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def print_table(title: str, rows: list[tuple[str, dict[str, float]]], baseline: str) -> None:
    """Prints a markdown table: median ms per contender and its ratio to `baseline`."""
    names = list(rows[0][1])
    print(f"\n### {title}\n")
    print(
        "| case | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} / {baseline}" for n in names if n != baseline)
        + " |"
    )
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for case, times in rows:
        cells = [f"{times[n] * 1e3:.2f}" for n in names]
        ratios = [f"{times[n] / times[baseline]:.2f}" for n in names if n != baseline]
        print(f"| {case} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
