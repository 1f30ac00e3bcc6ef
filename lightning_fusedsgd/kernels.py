"""Builds and loads the compiled kernels: the ``torch.ops.lightning_fusedsgd`` operator library.

The ops are registered with ``TORCH_LIBRARY`` (schemas in ``csrc/fused_sgd.cpp``): ``sgd_step``,
``grad_sq_sum`` and ``lars_sq_sums`` with their CPU kernels, their CUDA kernels (``csrc/fused_sgd_cuda.cu``,
a second library that registers for the same schemas) and fake kernels for tracing (``torch.compile``),
``hparam_names``, and the ``CachedStep`` class (``torch.classes.lightning_fusedsgd.CachedStep``). No pybind
module: the dispatcher calls them, and dynamo can trace a call into ``sgd_step``.

The libraries in ``csrc/`` are compiled on first use with ninja through ``torch.utils.cpp_extension``
and cached under ``$LIGHTNING_FUSEDSGD_CACHE`` (default ``~/.cache/lightning_fusedsgd``), keyed by a
hash of the sources, the flags, the torch version and the machine: the CPU's instruction set for the
CPU kernel (built with ``-march=native``), the CUDA version and the GPUs' compute capabilities for the
CUDA kernel. ``python -m lightning_fusedsgd`` prebuilds them.

Where a kernel cannot be built, ``backends.compiled_or_fallback`` decides what runs instead;
``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1`` (CI) makes a failed build an error.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REQUIRE_COMPILED_ENV = "LIGHTNING_FUSEDSGD_REQUIRE_COMPILED"
_CSRC = Path(__file__).parent / "csrc"
_HEADERS = ("sgd_math.h", "bucket.h", "cached_step.h", "work_list.h")


@dataclass(frozen=True)
class _Extension:
    """One compiled module: what it is built from and how."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()


EXTENSIONS = {
    "cpu": _Extension(
        "lightning_fusedsgd_C", ("fused_sgd.cpp",), ("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)
    ),
    "cuda": _Extension("lightning_fusedsgd_cuda", ("fused_sgd_cuda.cu",), ("-O3",), (), ("-O3",)),
}
"""The kernels by device type."""


class KernelBuildError(RuntimeError):
    """The compiled kernel could not be built or loaded."""


def _cpu_signature() -> str:
    """The CPU's feature flags: a build with -march=native is only valid on a CPU that has them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _quiet_cpp_extension() -> None:
    # cpp_extension logs a CUDA_HOME notice at import on machines without CUDA; it is irrelevant here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _cuda_signature() -> str:
    """The CUDA toolkit that compiles the kernel (nvcc's path and timestamp), the one torch was built with,
    and the architectures the kernel is compiled for."""
    _quiet_cpp_extension()
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
    toolkit = f"{nvcc.resolve()} {nvcc.stat().st_mtime_ns}" if nvcc.exists() else "no nvcc"
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return f"{toolkit} cuda {torch.version.cuda} {os.environ.get('TORCH_CUDA_ARCH_LIST', '')} {capabilities}"


def _build_key(device_type: str) -> str:
    extension = EXTENSIONS[device_type]
    digest = hashlib.sha256()
    for name in extension.sources + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    machine = _cpu_signature() if device_type == "cpu" else _cuda_signature()
    # The .so links against this torch installation's libraries: another venv gets its own build.
    for part in (
        *extension.cflags,
        *extension.ldflags,
        *extension.cuda_cflags,
        torch.__version__,
        torch.__file__,
        sys.version,
        machine,
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where built kernels are cached."""
    root = os.environ.get("LIGHTNING_FUSEDSGD_CACHE", Path.home() / ".cache" / "lightning_fusedsgd")
    return Path(root)


def load_extension(device_type: str = "cpu") -> Any:
    """The ``torch.ops.lightning_fusedsgd`` namespace with the kernel for ``device_type`` ("cpu" or
    "cuda") registered, built on first use; the outcome (loaded or failure) is cached per process. The CUDA
    kernel registers for the op the CPU library defines, so it loads that first.

    Raises:
        KernelBuildError: no working toolchain (C++ compiler, ninja; nvcc for CUDA), or the build failed.
    """
    if device_type not in EXTENSIONS:
        raise KernelBuildError(f"lightning_fusedsgd has no compiled kernel for {device_type} tensors")
    for needed in ("cpu", device_type) if device_type != "cpu" else ("cpu",):
        outcome = _load_once(needed)
        if isinstance(outcome, KernelBuildError):
            raise outcome
    return torch.ops.lightning_fusedsgd


# The outcome of loading each device type's library (its path, or why it failed), once per process. A plain
# dict, so that a step traced by torch.compile reads it without a graph break once the library is loaded.
_OUTCOMES: dict[str, Path | KernelBuildError] = {}


def _load_once(device_type: str) -> Path | KernelBuildError:
    if device_type not in _OUTCOMES:
        try:
            _OUTCOMES[device_type] = _build_and_load(device_type, verbose=False)
        except KernelBuildError as error:
            _OUTCOMES[device_type] = error
    return _OUTCOMES[device_type]


def _complete_cpu_library() -> None:
    """Checks that the kernels read the hyperparameter table's columns as reference.HPARAM_COLUMNS lists
    them, and registers sgd_step's fake kernel (Python's part of the op, for tracing)."""
    from lightning_fusedsgd.reference import HPARAM_COLUMNS

    names = tuple(torch.ops.lightning_fusedsgd.hparam_names())
    if names != HPARAM_COLUMNS:
        raise KernelBuildError(
            f"the compiled kernel reads hyperparameters {names}, reference.HPARAM_COLUMNS lists "
            f"{HPARAM_COLUMNS}: keep LFSGD_HPARAMS in csrc/sgd_math.h and HPARAM_COLUMNS in the same order"
        )
    torch.library.register_fake("lightning_fusedsgd::sgd_step")(_sgd_step_fake)
    torch.library.register_fake("lightning_fusedsgd::grad_sq_sum")(_grad_sq_sum_fake)
    torch.library.register_fake("lightning_fusedsgd::lars_sq_sums")(_lars_sq_sums_fake)


def _sgd_step_fake(*args: Any) -> None:
    """sgd_step writes its inputs in place and returns nothing: tracing needs no output metadata."""
    del args


def _grad_sq_sum_fake(grads: list[torch.Tensor]) -> torch.Tensor:
    """grad_sq_sum returns a float64 scalar on the gradients' device."""
    return grads[0].new_empty((), dtype=torch.float64)


def _lars_sq_sums_fake(params: list[torch.Tensor], *args: Any) -> torch.Tensor:
    """lars_sq_sums returns a float64 [params, 3] table on the params' device."""
    del args
    return params[0].new_empty((len(params), 3), dtype=torch.float64)


@torch.compiler.disable  # building and loading is never traced (a graph break, before the first load only)
def _build_and_load(device_type: str, verbose: bool) -> Path:
    extension = EXTENSIONS[device_type]
    key = _build_key(device_type)
    name = f"{extension.name}_{key}"
    build_dir = cache_dir() / key
    library = build_dir / f"{name}.so"
    ready = build_dir / "ready"  # written after a complete build: a half-linked .so is never loaded
    if ready.exists():
        try:  # load directly: skips the toolchain check that load() runs in every process
            torch.ops.load_library(str(library))
        except OSError:
            pass  # a damaged cache: go through cpp_extension's locked build below
        else:
            return _registered(device_type, library)
    _quiet_cpp_extension()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"lightning_fusedsgd: compiling the {device_type} kernel into {build_dir} (first use only, "
        f"{'about 30 s' if device_type == 'cpu' else 'a minute or two'})",
        file=sys.stderr,
    )
    try:
        cpp_extension.load(
            name=name,
            sources=[str(_CSRC / source) for source in extension.sources],
            extra_cflags=list(extension.cflags),
            extra_cuda_cflags=list(extension.cuda_cflags),
            extra_ldflags=list(extension.ldflags),
            extra_include_paths=[str(_CSRC)],
            build_directory=str(build_dir),
            verbose=verbose,
            is_python_module=False,
        )
    # The toolchain raises many types: compiler or ninja missing, compile and link errors.
    except Exception as error:
        toolchain = "a C++ compiler (g++) and ninja" + (
            " and the CUDA toolkit (nvcc)" if device_type == "cuda" else ""
        )
        raise KernelBuildError(
            f"could not build the lightning_fusedsgd {device_type} kernel in {build_dir}: {error}. "
            f"Install {toolchain}, or use FusedSGD(..., backend='torch')."
        ) from error
    ready.touch()
    return _registered(device_type, library)


def _registered(device_type: str, library: Path) -> Path:
    if device_type == "cpu":
        _complete_cpu_library()
    return library


def main(argv: list[str] | None = None) -> int:
    """Prebuilds the kernels: ``python -m lightning_fusedsgd [--verbose]`` (CUDA's where a GPU is seen)."""
    parser = argparse.ArgumentParser(description="Build and cache the lightning_fusedsgd kernels.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    device_types = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    status = 0
    for device_type in device_types:
        try:
            if device_type != "cpu":
                load_extension("cpu")  # defines the op the CUDA kernel registers for
            library = _build_and_load(device_type, verbose=args.verbose)
        except KernelBuildError as error:
            print(error, file=sys.stderr)
            # Without nvcc, CUDA steps fall back with a warning (as at run time); only the CPU kernel, or
            # CI's switch, makes a failed build fatal.
            if device_type == "cpu" or os.environ.get(REQUIRE_COMPILED_ENV) == "1":
                status = 1
            continue
        print(f"lightning_fusedsgd {device_type} kernel ready: {library}")
    return status
