"""Builds and loads the compiled kernel, and chooses the backend that runs a bucket.

The C++ extension in ``csrc/`` is compiled on first use with ninja through
``torch.utils.cpp_extension`` and cached under ``$LIGHTNING_FUSEDSGD_CACHE`` (default
``~/.cache/lightning_fusedsgd``), keyed by a hash of the sources, the flags, the torch version and the
CPU's instruction set (the build uses ``-march=native``). ``python -m lightning_fusedsgd``
prebuilds it.

Backends:
    ``compiled``: our kernel (CPU tensors).
    ``torch``: the same math in plain PyTorch (``reference.py``): the oracle in tests and the fallback.
    ``torch_fused``: ``torch._fused_sgd_`` (CUDA, where its semantics are identical to ours). Like
        torch's own fused SGD it unscales ``p.grad`` in place under a GradScaler; the other backends
        leave gradients untouched.
    ``auto``: ``compiled`` on CPU, ``torch_fused`` on CUDA where eligible, else ``torch``.

Where the compiler is missing, ``auto`` warns once and runs ``torch``. Setting
``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1`` turns that fallback into an error (CI sets it, to prove the
compiled kernel is what ran).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

BACKENDS = ("auto", "compiled", "torch", "torch_fused")
REQUIRE_COMPILED_ENV = "LIGHTNING_FUSEDSGD_REQUIRE_COMPILED"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("fused_sgd.cpp",)
_HEADERS = ("sgd_math.h",)
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


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


def _build_key() -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    # The .so links against this torch installation's libraries: another venv gets its own build.
    for part in (*_CFLAGS, *_LDFLAGS, torch.__version__, torch.__file__, sys.version, _cpu_signature()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where built kernels are cached."""
    root = os.environ.get("LIGHTNING_FUSEDSGD_CACHE", Path.home() / ".cache" / "lightning_fusedsgd")
    return Path(root)


def load_extension() -> ModuleType:
    """The compiled kernel, built on first use; the outcome (module or failure) is cached per process.

    Raises:
        KernelBuildError: no working C++ toolchain, or the build failed.
    """
    outcome = _load_once()
    if isinstance(outcome, KernelBuildError):
        raise outcome
    return outcome


@functools.cache
def _load_once() -> ModuleType | KernelBuildError:
    try:
        return _build_and_import(verbose=False)
    except KernelBuildError as error:
        return error


def _build_and_import(verbose: bool) -> ModuleType:
    key = _build_key()
    name = f"lightning_fusedsgd_C_{key}"
    build_dir = cache_dir() / key
    ready = build_dir / "ready"  # written after a complete build: a half-linked .so is never imported
    if ready.exists():
        try:  # import directly: skips the toolchain check that load() runs in every process
            spec = importlib.util.spec_from_file_location(name, build_dir / f"{name}.so")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except (ImportError, OSError):
            pass  # a damaged cache: go through cpp_extension's locked build below
    # cpp_extension logs a CUDA_HOME notice at import on machines without CUDA; it is irrelevant here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"lightning_fusedsgd: compiling the kernel into {build_dir} (first use only, about 30 s)",
        file=sys.stderr,
    )
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(_CSRC / source) for source in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            extra_include_paths=[str(_CSRC)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    # The toolchain raises many types: compiler or ninja missing, compile and link errors.
    except Exception as error:
        raise KernelBuildError(
            f"could not build the lightning_fusedsgd kernel in {build_dir}: {error}. "
            "Install a C++ compiler (g++) and ninja, or use FusedSGD(..., backend='torch')."
        ) from error
    ready.touch()
    return module


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"lightning_fusedsgd: the compiled kernel is unavailable ({reason}); running the plain-PyTorch "
        "reference backend, which is correct but slower. "
        "Run `python -m lightning_fusedsgd --verbose` to see why.",
        RuntimeWarning,
        stacklevel=4,
    )


def compiled_or_fallback(requested: str) -> str:
    """Resolves the CPU backend: ``compiled`` when it loads, else ``torch`` with one warning.

    An explicit ``backend="compiled"``, or ``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1``, makes a build
    failure an error instead.
    """
    try:
        load_extension()
        return "compiled"
    except KernelBuildError as error:
        if requested == "compiled" or os.environ.get(REQUIRE_COMPILED_ENV) == "1":
            raise
        _warn_fallback(str(error).splitlines()[0][:300])
        return "torch"


def main(argv: list[str] | None = None) -> int:
    """Prebuilds the kernel: ``python -m lightning_fusedsgd [--verbose]``."""
    parser = argparse.ArgumentParser(description="Build and cache the lightning_fusedsgd kernel.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    try:
        module = _build_and_import(verbose=args.verbose)
    except KernelBuildError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"lightning_fusedsgd kernel ready: {module.__file__}")
    return 0
