"""Which implementation of the ops runs a bucket: the compiled kernels or the reference in plain PyTorch.

Backends:
    ``compiled``: our kernels, for CPU and CUDA tensors. ``reference``: the same math in plain PyTorch
    (``ops/reference.py``): the oracle in tests and the fallback. ``auto``: ``compiled`` on CPU and CUDA,
    ``reference`` on other devices, and ``reference`` with one warning where the kernel cannot be built.
    ``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1`` turns that fallback into an error (CI sets it, to prove the
    compiled kernel is what ran). ``cuda_emulated``: the CUDA kernels and their host code, built by the host
    compiler and run on CPU tensors under an emulation of CUDA's execution model (slow; for testing them where
    no GPU is).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

import torch

from lightning_fusedsgd import ops
from lightning_fusedsgd.ops import reference

BACKENDS = ("auto", "compiled", "reference", "cuda_emulated")
# Earlier names, accepted with a FutureWarning until 0.3.0.
_RENAMED = {"torch": "reference"}
_KERNEL_DEVICES = ("cpu", "cuda")


def checked(backend: Any) -> str:
    """The backend asked for, by its current name (an earlier name warns).

    Raises:
        ValueError: Naming the backends there are.
    """
    if backend in _RENAMED:
        warnings.warn(
            f"backend={backend!r} is now backend={_RENAMED[backend]!r} (the same math in plain PyTorch); "
            "the old name is accepted until lightning_fusedsgd 0.3.0.",
            FutureWarning,
            stacklevel=_first_frame_outside_the_package(),
        )
        return _RENAMED[backend]
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; choose one of {BACKENDS}.")
    return backend


def _first_frame_outside_the_package() -> int:
    """The stack level of the user's code that called into the package (a warning's place)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"lightning_fusedsgd: the compiled kernel is unavailable ({reason}); running the reference backend "
        "(plain PyTorch ops) instead, which is correct but slower. Run `python -m lightning_fusedsgd "
        "--verbose` to see why.",
        RuntimeWarning,
        stacklevel=5,
    )


def implementation(requested: str, device: torch.device) -> tuple[str, Any]:
    """The backend that runs a bucket on ``device`` when ``requested`` is asked for: its name and its ops
    (``sgd_step``, ``grad_sq_sum``, ``lars_sq_sums``, ``schedule_lrs``), with the signatures of the ops'
    schemas.

    Raises:
        KernelBuildError: ``compiled`` was asked for (or CI's switch is set) and the kernel cannot be built.
        RuntimeError: ``compiled`` was asked for on a device without kernels.
    """
    if requested == "reference" or (requested == "auto" and device.type not in _KERNEL_DEVICES):
        return "reference", reference
    if requested == "cuda_emulated":
        if device.type != "cpu":
            raise RuntimeError(
                "backend='cuda_emulated' runs the CUDA kernels on CPU tensors, under an emulation of CUDA's "
                f"execution model (to test them without a GPU); these are on {device}. Use backend='auto'."
            )
        return "cuda_emulated", ops.load("cuda_emulated")
    if device.type not in _KERNEL_DEVICES:
        raise RuntimeError(
            f"backend='compiled' runs on CPU and CUDA tensors; these are on {device}. Use backend='auto'."
        )
    try:
        return "compiled", ops.load(device.type)
    except ops.KernelBuildError as error:
        if requested == "compiled" or os.environ.get(ops.REQUIRE_COMPILED_ENV) == "1":
            raise
        _warn_fallback(str(error).splitlines()[0][:300])
        return "reference", reference


def is_compiled(requested: str, device: torch.device) -> bool:
    """Whether ``requested`` runs our kernel on ``device`` (loading it, or falling back, on first use)."""
    return implementation(requested, device)[0] == "compiled"
