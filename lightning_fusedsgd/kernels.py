"""Builds and loads the compiled kernels: the ``torch.ops.lightning_fusedsgd`` operator library.

The ops are registered with ``TORCH_LIBRARY`` (schemas in ``csrc/fused_sgd.cpp``): ``sgd_step``,
``grad_sq_sum``, ``lars_sq_sums`` and ``schedule_lrs`` (the lr schedule on the device) with their CPU
kernels, their CUDA kernels (``csrc/fused_sgd_cuda.cu``, a second library that registers for the same
schemas) and fake kernels for tracing (``torch.compile``), ``hparam_names`` and ``decay_names``, and the
``CachedStep`` class (``torch.classes.lightning_fusedsgd.CachedStep``). No pybind module: the dispatcher
calls them, and dynamo can trace a call into ``sgd_step``.

Where the libraries come from, in order:

1. **The wheel** (``pip wheel --no-build-isolation .``, see setup.py): prebuilt, portable libraries under
   ``_lib/``. The CPU kernel is compiled three times, whole, once per instruction set of
   ``CPU_CAPABILITIES`` (baseline x86-64, AVX2 + FMA, AVX-512); at load the one this CPU runs is picked
   from torch's own CPU capability (which honours ``ATEN_CPU_CAPABILITY``), and
   ``LIGHTNING_FUSEDSGD_CPU_CAPABILITY`` can pick a lower one. Whole libraries rather than per-ISA
   namespaces in one library: inline functions of the headers (ours and torch's) compiled with AVX-512
   flags would otherwise be merged by the linker into code that the baseline path calls too. The CUDA
   library is there when the wheel was built with nvcc, for the architectures in ``_lib/build.json``.
   The libraries link against one torch's C++ API (the LibTorch stable ABI cannot express the
   ``CachedStep`` class or the dispatcher calls), so ``_lib/build.json`` records the torch version they
   were built for, and a library is only loaded under that torch.
2. **Compiled on first use** (JIT): editable installs (``make install``), and the fallback where the
   wheel's library cannot be used, with one message that says why. Built with ninja through
   ``torch.utils.cpp_extension`` and cached under ``$LIGHTNING_FUSEDSGD_CACHE`` (default
   ``~/.cache/lightning_fusedsgd``), keyed by a hash of the sources, the flags, the torch version and the
   machine: the CPU's instruction set for the CPU kernel (built with ``-march=native``: it only ever runs
   on the machine that compiled it, so it takes every instruction set that machine has), the CUDA
   version and the GPUs' compute capabilities for the CUDA kernel. ``python -m lightning_fusedsgd``
   loads (or prebuilds) them and says which.

Where neither works, ``backends.compiled_or_fallback`` decides what runs instead;
``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1`` (CI) makes that an error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REQUIRE_COMPILED_ENV = "LIGHTNING_FUSEDSGD_REQUIRE_COMPILED"
CPU_CAPABILITY_ENV = "LIGHTNING_FUSEDSGD_CPU_CAPABILITY"
_CSRC = Path(__file__).parent / "csrc"
_PREBUILT = Path(__file__).parent / "_lib"  # the wheel's libraries and build.json (absent in a source tree)
_HEADERS = ("sgd_math.h", "schedule.h", "bucket.h", "cached_step.h", "work_list.h")


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
"""The kernels by device type, as compiled on first use."""

CPU_CAPABILITIES = {
    "default": (),
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
}
"""The wheel's CPU libraries, lowest first, and their flags: the features torch checks before it reports
its AVX2 capability (AVX2, FMA) and its AVX512 one (AVX-512 F/BW/VL/DQ, FMA)."""

PREBUILT_CPU_CFLAGS = ("-O3", "-fopenmp")
"""The wheel's CPU flags before an instruction set's: the JIT flags less -march=native."""


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
            _OUTCOMES[device_type] = _load(device_type, verbose=False)
        except KernelBuildError as error:
            _OUTCOMES[device_type] = error
    return _OUTCOMES[device_type]


def cpu_capability() -> str:
    """The instruction set of the wheel's CPU library to load: torch's CPU capability (its own pick for
    ATen's kernels; ``ATEN_CPU_CAPABILITY`` lowers it), or a lower one named by
    ``LIGHTNING_FUSEDSGD_CPU_CAPABILITY``."""
    names = list(CPU_CAPABILITIES)
    supported = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default")
    requested = os.environ.get(CPU_CAPABILITY_ENV, supported)
    if requested not in names:
        raise KernelBuildError(f"{CPU_CAPABILITY_ENV}={requested!r}: use one of {', '.join(names)}")
    if names.index(requested) > names.index(supported):
        raise KernelBuildError(
            f"{CPU_CAPABILITY_ENV}={requested!r}, but this CPU runs at most {supported!r}: lower or unset it"
        )
    return requested


def _build_info() -> dict[str, Any] | None:
    """The wheel's build.json: the torch it was built for and its libraries; None in a source tree."""
    path = _PREBUILT / "build.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _cuda_arch_problem(arch_list: str, capabilities: list[tuple[int, int]]) -> str | None:
    """Why a CUDA library built for ``arch_list`` (TORCH_CUDA_ARCH_LIST syntax) cannot run on GPUs of these
    compute capabilities, or None: machine code runs on its major version at the same or a later minor,
    PTX on any later GPU (the driver compiles it)."""
    archs = []
    for arch in arch_list.replace(" ", ";").split(";"):
        major, minor = arch.removesuffix("+PTX").split(".")
        archs.append(((int(major), int(minor)), arch.endswith("+PTX")))
    for major, minor in capabilities:
        if not any(
            (ptx and arch <= (major, minor)) or (arch[0] == major and arch[1] <= minor) for arch, ptx in archs
        ):
            return f"it was built for CUDA architectures {arch_list}, this GPU is {major}.{minor}"
    return None


def _prebuilt_library(device_type: str) -> tuple[Path | None, str | None]:
    """The wheel's library for ``device_type`` on this machine, or why it cannot be used; (None, None) where
    there is no wheel (a source tree: compiled on first use, as designed)."""
    info = _build_info()
    if info is None:
        return None, None
    if info["torch"] != torch.__version__:
        return None, f"it was built for torch {info['torch']}, this is torch {torch.__version__}"
    if device_type == "cpu":
        name = f"cpu_{cpu_capability()}"
    else:
        name = device_type
        if name in info["libraries"]:
            capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
            problem = _cuda_arch_problem(info["cuda_arch_list"], capabilities)
            if problem is not None:
                return None, problem
    if name not in info["libraries"]:
        return None, f"the wheel was built without a {name} library"
    return _PREBUILT.parent / info["libraries"][name], None


@torch.compiler.disable  # loading is never traced (a graph break, before the first load only)
def _load(device_type: str, verbose: bool) -> Path:
    """Loads the wheel's library for ``device_type``, else the one compiled from source."""
    library, problem = _prebuilt_library(device_type)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
        except OSError as error:
            problem = f"it does not load: {error}"
        else:
            return _registered(device_type, library)
    return _build_and_load(device_type, verbose, problem)


def _complete_cpu_library() -> None:
    """Checks that the kernels read the hyperparameter table's columns as reference.HPARAM_COLUMNS lists
    them and number the decays as schedules.DECAYS does, and registers the ops' fake kernels (Python's part
    of the ops, for tracing)."""
    from lightning_fusedsgd.reference import HPARAM_COLUMNS
    from lightning_fusedsgd.schedules import DECAYS

    names = tuple(torch.ops.lightning_fusedsgd.hparam_names())
    if names != HPARAM_COLUMNS:
        raise KernelBuildError(
            f"the compiled kernel reads hyperparameters {names}, reference.HPARAM_COLUMNS lists "
            f"{HPARAM_COLUMNS}: keep LFSGD_HPARAMS in csrc/sgd_math.h and HPARAM_COLUMNS in the same order"
        )
    decays = tuple(torch.ops.lightning_fusedsgd.decay_names())
    if decays != DECAYS:
        raise KernelBuildError(
            f"the compiled kernel numbers the decays {decays}, schedules.DECAYS lists {DECAYS}: keep "
            "kDecayNames in csrc/schedule.h and DECAYS in the same order"
        )
    torch.library.register_fake("lightning_fusedsgd::sgd_step")(_sgd_step_fake)
    torch.library.register_fake("lightning_fusedsgd::schedule_lrs")(_sgd_step_fake)
    torch.library.register_fake("lightning_fusedsgd::grad_sq_sum")(_grad_sq_sum_fake)
    torch.library.register_fake("lightning_fusedsgd::lars_sq_sums")(_lars_sq_sums_fake)


def _sgd_step_fake(*args: Any) -> None:
    """sgd_step and schedule_lrs write their inputs in place and return nothing: tracing needs no output
    metadata."""
    del args


def _grad_sq_sum_fake(grads: list[torch.Tensor]) -> torch.Tensor:
    """grad_sq_sum returns a float64 scalar on the gradients' device."""
    return grads[0].new_empty((), dtype=torch.float64)


def _lars_sq_sums_fake(params: list[torch.Tensor], *args: Any) -> torch.Tensor:
    """lars_sq_sums returns a float64 [params, 3] table on the params' device."""
    del args
    return params[0].new_empty((len(params), 3), dtype=torch.float64)


def _build_and_load(device_type: str, verbose: bool, prebuilt_problem: str | None = None) -> Path:
    """Loads the library compiled from source, compiling it first where the cache has none.
    ``prebuilt_problem``: why the wheel's library is not used (None: there is no wheel)."""
    extension = EXTENSIONS[device_type]
    unused = ""  # the one message saying why the wheel's library is not used, where there is a wheel
    if prebuilt_problem:
        unused = f"the wheel's {device_type} kernel cannot be used ({prebuilt_problem}); "
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
            if unused:
                print(
                    f"lightning_fusedsgd: {unused}loading it as compiled from source: {library}",
                    file=sys.stderr,
                )
            return _registered(device_type, library)
    _quiet_cpp_extension()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"lightning_fusedsgd: {unused}compiling the {device_type} kernel into {build_dir} (first use only, "
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
        if prebuilt_problem:  # the wheel's reason first: the fallback warning keeps a message's start only
            raise KernelBuildError(
                f"the wheel's lightning_fusedsgd {device_type} kernel is unusable ({prebuilt_problem}), and "
                f"compiling it in {build_dir} failed: {error}. Install a wheel built for torch "
                f"{torch.__version__} (README: Installing from a wheel), or {toolchain}, or use "
                "FusedSGD(..., backend='torch')."
            ) from error
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
    """Loads the kernels, building them where the wheel has none for this machine:
    ``python -m lightning_fusedsgd [--verbose]`` (CUDA's where a GPU is seen)."""
    parser = argparse.ArgumentParser(description="Load, or build and cache, the lightning_fusedsgd kernels.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    device_types = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    status = 0
    for device_type in device_types:
        try:
            if device_type != "cpu":
                load_extension("cpu")  # defines the op the CUDA kernel registers for
            library = _load(device_type, verbose=args.verbose)
        except KernelBuildError as error:
            print(error, file=sys.stderr)
            # Without nvcc, CUDA steps fall back with a warning (as at run time); only the CPU kernel, or
            # CI's switch, makes a failed build fatal.
            if device_type == "cpu" or os.environ.get(REQUIRE_COMPILED_ENV) == "1":
                status = 1
            continue
        print(f"lightning_fusedsgd {device_type} kernel ready: {library}")
    return status
