"""Backend policy: which implementation runs a bucket (our op, the reference, torch's fused SGD), the
fallback where our kernel cannot be built, and the adapter that gives torch's fused SGD the op's signature.

Backends:
    ``compiled``: our kernel, for CPU and CUDA tensors.
    ``torch``: the same math in plain PyTorch (``reference.py``): the oracle in tests and the fallback.
    ``torch_fused``: ``torch._fused_sgd_`` (CUDA, where its semantics are identical to ours). Like
        torch's own fused SGD it unscales ``p.grad`` in place under a GradScaler; the other backends
        leave gradients untouched.
    ``auto``: ``compiled`` on CPU and CUDA, ``torch`` on other devices.

Where a kernel cannot be built, ``auto`` warns once and runs PyTorch ops instead (``torch``; on CUDA
``torch_fused`` where eligible). Setting ``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1`` turns that fallback
into an error (CI sets it, to prove the compiled kernel is what ran).
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fusedsgd import kernels, reference
from lightning_fusedsgd.reference import HPARAM_COLUMNS

if TYPE_CHECKING:
    from lightning_fusedsgd.plan import Bucket

BACKENDS = ("auto", "compiled", "torch", "torch_fused")


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"lightning_fusedsgd: the compiled kernel is unavailable ({reason}); running PyTorch ops instead "
        "(the reference backend; on CUDA torch's fused SGD where its semantics match), which are correct "
        "but slower. Run `python -m lightning_fusedsgd --verbose` to see why.",
        RuntimeWarning,
        stacklevel=4,
    )


def compiled_or_fallback(requested: str, device_type: str = "cpu") -> str:
    """Resolves the backend for ``device_type``: ``compiled`` when it loads, else ``torch`` with one
    warning.

    An explicit ``backend="compiled"``, or ``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1``, makes a build
    failure an error instead. Devices with no kernel of ours (``mps``, ``xpu``, ...) run ``torch``.
    """
    if requested == "auto" and device_type not in kernels.EXTENSIONS:
        return "torch"
    try:
        kernels.load_extension(device_type)
        return "compiled"
    except kernels.KernelBuildError as error:
        if requested == "compiled" or os.environ.get(kernels.REQUIRE_COMPILED_ENV) == "1":
            raise
        _warn_fallback(str(error).splitlines()[0][:300])
        return "torch"


def step_function(
    requested: str, device: torch.device, bucket: Bucket, groups: list[dict[str, Any]]
) -> tuple[str, Any]:
    """The backend that runs ``bucket`` (of ``groups``) when ``requested`` is asked for (see ``kernels``):
    its name and its ops, ``sgd_step``, ``grad_sq_sum`` and ``lars_sq_sums`` with the op library's
    signatures."""
    backend = requested
    if backend == "auto":
        backend = compiled_or_fallback("auto", device.type)
        if backend == "torch" and device.type == "cuda" and _torch_fused_eligible(groups, bucket):
            backend = "torch_fused"
    if backend == "compiled":
        if device.type not in kernels.EXTENSIONS:
            raise RuntimeError(
                f"backend='compiled' runs on CPU and CUDA tensors; these are on {device}. Use backend='auto'."
            )
        compiled_or_fallback("compiled", device.type)
        return backend, kernels.load_extension(device.type)
    if backend == "torch_fused":
        if not _torch_fused_eligible(groups, bucket):
            raise ValueError(
                "backend='torch_fused' cannot run master weights, wd_after_momentum, LARS or gradient "
                "clipping: use backend='auto'."
            )
        return backend, _TORCH_FUSED
    return "torch", reference


def schedule_function(requested: str, device: torch.device) -> Any:
    """The ``schedule_lrs`` op that a capturable optimizer's WarmupLR runs on ``device``: our kernel, or the
    reference (which reads the position on the host) where the optimizer's backend is ``torch`` or nothing
    compiles."""
    if requested in ("auto", "compiled") and compiled_or_fallback(requested, device.type) == "compiled":
        return kernels.load_extension(device.type).schedule_lrs
    return reference.schedule_lrs


def _torch_fused_eligible(groups: list[dict[str, Any]], bucket: Bucket) -> bool:
    """torch's fused SGD has our semantics when no master weights, wd_after_momentum, LARS or clipping are
    used."""
    return not bucket.master_params and not any(
        g["wd_after_momentum"] or g["lars"] or g["max_grad_norm"] or g["max_grad_value"] for g in groups
    )


def _torch_fused_step(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    master_params: list[Tensor],
    group_hparams: Tensor,
    tensor_group: list[int],
    first_step: list[bool],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    grad_sq_sum: Tensor | None,
    lars_sq_sums: Tensor | None = None,
    lrs: Tensor | None = None,
) -> None:
    """Runs a bucket through ``torch._fused_sgd_``, one call per (group, first step) subset."""
    # Never present: see _torch_fused_eligible.
    del master_params, grad_sq_sum, lars_sq_sums
    rows = group_hparams.tolist()
    h = {name: i for i, name in enumerate(HPARAM_COLUMNS)}
    if lrs is not None:  # tensor lrs (FusedSGD refuses capturable with torch_fused): read on the host
        for row, lr in zip(rows, lrs.tolist(), strict=True):
            row[h["lr"]] = lr
    buffers = iter(momentum_buffers)
    per_param = [next(buffers) if rows[group][h["momentum"]] != 0 else None for group in tensor_group]
    subsets: dict[tuple[int, bool], list[int]] = {}
    for i, (group, first) in enumerate(zip(tensor_group, first_step)):
        subsets.setdefault((group, first), []).append(i)
    for (group, first), indices in subsets.items():
        row = rows[group]
        torch._fused_sgd_(
            [params[i] for i in indices],
            [grads[i] for i in indices],
            [per_param[i] for i in indices] if row[h["momentum"]] != 0 else [],
            weight_decay=row[h["weight_decay"]],
            momentum=row[h["momentum"]],
            lr=row[h["lr"]],
            dampening=row[h["dampening"]],
            nesterov=bool(row[h["nesterov"]]),
            maximize=bool(row[h["maximize"]]),
            is_first_step=first,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )


_TORCH_FUSED = types.SimpleNamespace(sgd_step=_torch_fused_step)
"""The ``torch_fused`` backend's ops (no clipping: see ``_torch_fused_eligible``)."""
