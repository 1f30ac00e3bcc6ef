"""The operator library ``torch.ops.lightning_fusedsgd``: each op's schema, arguments and fake kernel, in one
place.

The compiled libraries (``csrc/``, loaded by :func:`load`) register the CPU and CUDA kernels of these ops;
:mod:`lightning_fusedsgd.ops.reference` implements the same contract in plain PyTorch (the oracle in tests and
the fallback where nothing compiles). The fake kernels give ``torch.compile`` the ops' output metadata, so a
traced step calls the op inside its graph. The schemas say what each op writes (``a!``, ``b!``, ``c!``).

The hyperparameter table ``group_hparams`` is a contiguous CPU float64 ``[groups, len(_abi.HPARAMS)]`` tensor,
one row per parameter group, columns and encodings as ``lightning_fusedsgd._abi.HPARAMS`` lists them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fusedsgd._abi import LARS_SUMS
from lightning_fusedsgd.ops import _build
from lightning_fusedsgd.ops._loader import (
    CPU_CAPABILITY_ENV,
    REQUIRE_COMPILED_ENV,
    KernelBuildError,
    cpu_capability,
    is_loaded,
    load,
)

__all__ = [
    "CPU_CAPABILITY_ENV",
    "REQUIRE_COMPILED_ENV",
    "KernelBuildError",
    "cpu_capability",
    "is_loaded",
    "load",
]

SCHEMAS: dict[str, str] = {}
"""Each op's schema, by name; the docstring after each is its contract."""

SCHEMAS["sgd_step"] = (
    "sgd_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state, int[] state_slots, "
    "Tensor group_hparams, int[] tensor_group, Tensor?[] step, Tensor(c!)? unscaled_grad_sq_sum=None) -> ()"
)
"""One SGD/LARS step of one bucket (one device, one param dtype, one kind of weight), in place.

Arguments:
    params: [n] dense tensors of one device and dtype (fp32, fp64, bf16, fp16); updated.
    grads: [n] laid out as their params, of their dtype.
    state: every param's state, param by param, each param's slots in ``_abi.SLOTS``' order; updated. Tensor
        slots are laid out as their params, in their slot's dtype; a count is a one-element int64 tensor on
        the params' device. The weight of a param with a ``master_param`` is that fp32 master (the param
        holding its rounding); with a ``kahan_compensation``, param + compensation in fp32 (the param takes
        the update rounded to nearest, the compensation what that rounding dropped). Every param of a bucket
        has the same weight slot, or none. A ``rounding_step`` is read as the step of its param's random
        bits, then advanced by one (not by a skipped step).
    state_slots: [n] which slots each param holds (bit s: ``_abi.SLOTS[s]``, as its group and dtype say,
        ``Slot.held``) and which of them the kernel seeds this step (bit ``len(SLOTS) + s``: the momentum
        buffer, with the gradient, on the param's first step): ``_abi.state_slots``.
    group_hparams: the hyperparameter table (module docstring).
    tensor_group: [n] each param's row of the table.
    step: [len(_abi.STEP_ROW)] the step row, in ``_abi.STEP_ROW``'s order, each on the params' device or None:
        each value of the dtype and shape its ``StepValue`` declares, read as its ``doc`` says (a value
        ``paired_with`` another comes with it, or neither).
    unscaled_grad_sq_sum: a one-element float64 tensor on the params' device, or None. Where given, the step
        adds to it the sum of squares of every gradient of the bucket as its norm pass takes it (its LARS
        tensors' ``grad_sq`` sums, ``_abi.LARS_SUM_NAMES``, and every other tensor's in the same pass):
        unscaled, sign-corrected, clipped by value, before the norm clip; nothing where the step is skipped
        (``found_inf``). Not with the step row's ``lars_sq_sums``, which replace that pass (their ``grad_sq``
        column holds the sums).

A schedule-free bucket (every group ``schedule_free``: ``FusedSGDScheduleFree``) holds each param's y, and its
``z`` slot where SGD's momentum buffer is; its step is schedulefree.SGDScheduleFree's
(``schedule_free_element`` in csrc/sgd_math.h).
"""

SCHEMAS["grad_sq_sum"] = "grad_sq_sum(Tensor[] grads) -> Tensor"
"""The sum of squares of every gradient, a float64 scalar on their device, summed in a fixed order (the result
does not depend on the thread count)."""

SCHEMAS["lars_sq_sums"] = (
    "lars_sq_sums(Tensor[] params, Tensor[] grads, Tensor[] state, int[] state_slots, Tensor group_hparams, "
    "int[] tensor_group, Tensor?[] step) -> Tensor"
)
"""Each LARS tensor's sums of w^2, of its norm term squared, of w times that term and of its gradient squared
(``_abi.LARS_SUM_NAMES``), before norm clipping
(which needs the global norm: ``sgd_step`` applies it to the reduced sums), as a float64 [n, LARS_SUMS] tensor
on the params' device (zeros for tensors without LARS); arguments as ``sgd_step``'s (of the step row, only
``grad_scale`` is read). A sharded step all-reduces them and hands them to ``sgd_step``."""

SCHEMAS["schedule_lrs"] = (
    "schedule_lrs(Tensor(a!) lrs, Tensor(b!) position, Tensor schedule, Tensor peaks, Tensor? applied, "
    "bool advance) -> ()"
)
"""One step of the lr schedule on the lrs' device (capturable steps).

Arguments:
    lrs: float64 [groups], written: f(applied steps) of each group's peak.
    position: int64 [applied steps, skipped steps], advanced.
    schedule: the schedule as a float64 row (``WarmupSchedule.as_row``: ``_abi.SCHEDULE_HEADER``, the
        milestones, the decay's factors).
    peaks: float64 [groups], each group's peak lr.
    applied: a one-element bool, whether the optimizer's last step was applied (None: it was).
    advance: False only sets the lrs from the position (a new or resumed scheduler).
"""

SCHEMAS["schedule_free_scalars"] = (
    "schedule_free_scalars(Tensor(a!) scalars, Tensor group_hparams, Tensor?[] step) -> ()"
)
"""One applied step of a schedule-free optimizer's per-group scalars, on their device (before the step's
``sgd_step`` calls, which read its ``scheduled_lr`` and ``ckp1`` rows as their row's ``lrs`` and ``ckp1``).

Arguments:
    scalars: float64 [len(_abi.SCHEDULE_FREE_SCALARS), groups], advanced in place as
        schedulefree.SGDScheduleFree advances its groups' ``k``, ``lr_max``, ``weight_sum`` and
        ``scheduled_lr`` (its warmup and average weights), ``ckp1`` set to this step's weight of z.
    group_hparams: the hyperparameter table (each group's lr, ``warmup_steps``, ``r``, ``weight_lr_power``).
    step: the step row, on the scalars' device; of it only ``found_inf`` (a skipped step changes nothing) and
        ``lrs`` (each group's lr before warmup, read there instead of the table's lr column) are read.
"""

SCHEMAS["schedule_free_switch"] = (
    "schedule_free_switch(Tensor(a!)[] params, Tensor(b!)[] state, int[] state_slots, Tensor group_hparams, "
    "int[] tensor_group, bool train) -> ()"
)
"""A schedule-free bucket's params switched between y (``train``: ``optimizer.train()``) and their average x
(``optimizer.eval()``), one pass over each weight and its z: ``lerp(w, z, 1 - beta)`` to y,
``lerp(w, z, 1 - 1 / beta)`` to x, each rounded to nearest into the param (and its master or compensation);
arguments as ``sgd_step``'s without the gradients and the step row."""


# The op libraries, each defining every op: the compiled libraries register their kernels there, the CPU and
# CUDA ones under "lightning_fusedsgd", the CUDA kernels run on CPU tensors under emulation (the tests) under
# their own.
_LIBRARIES = [
    torch.library.Library(namespace, "DEF")
    for namespace in dict.fromkeys(extension.namespace for extension in _build.EXTENSIONS.values())
]
for _library in _LIBRARIES:
    for _schema in SCHEMAS.values():
        _library.define(_schema)


@torch.library.register_fake("lightning_fusedsgd::sgd_step")
def _sgd_step_fake(*args: object) -> None:
    """Writes its inputs in place and returns nothing: tracing needs no output metadata."""


@torch.library.register_fake("lightning_fusedsgd::grad_sq_sum")
def _grad_sq_sum_fake(grads: list[Tensor]) -> Tensor:
    return grads[0].new_empty((), dtype=torch.float64)


@torch.library.register_fake("lightning_fusedsgd::lars_sq_sums")
def _lars_sq_sums_fake(params: list[Tensor], *args: object) -> Tensor:
    return params[0].new_empty((len(params), LARS_SUMS), dtype=torch.float64)


@torch.library.register_fake("lightning_fusedsgd::schedule_lrs")
def _schedule_lrs_fake(*args: object) -> None:
    """Writes the lrs and the position in place."""


@torch.library.register_fake("lightning_fusedsgd::schedule_free_scalars")
def _schedule_free_scalars_fake(*args: object) -> None:
    """Writes the scalars in place."""


@torch.library.register_fake("lightning_fusedsgd::schedule_free_switch")
def _schedule_free_switch_fake(*args: object) -> None:
    """Writes the params and their weights' state in place."""
