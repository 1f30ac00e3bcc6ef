"""The checks of what users hand the optimizer, before anything is written: a group's values against the
kernels' declarations in ``lightning_fusedsgd._abi`` (each option's own check, whose refusals start with
torch.optim.SGD's words where torch refuses the same value), the rules that relate two keys or a key to a
param's dtype, and the values one for the whole step. Every refusal names the value and the fix.

Imports only ``_abi``: every layer above may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi

__all__ = ["GroupChecks", "check_average", "check_flag", "check_group", "check_groups", "check_param"]


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return str(value.item()) if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, str) else str(value)


def check_flag(key: str, value: Any) -> None:
    """Raises ValueError for a value of a boolean option that no step may take as True or False: a string
    (a config's ``"false"``, which Python takes as true). Every boolean option is checked by this, wherever it
    enters."""
    problem = _abi.flag_problem(value)
    if problem is not None:
        raise ValueError(f"Invalid {key}: {_shown(value)}. {problem}")


def check_group(group: Mapping[str, Any]) -> None:
    """Raises ValueError, naming the value and the fix, for a hyperparameter the step cannot use. Where
    ``torch.optim.SGD`` refuses the same value, the message starts with torch's words."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}: set a float or a 0-d tensor."
        )
    if group.get("schedule_free"):
        _check_schedule_free(group)
    for option in _abi.options():
        value = group.get(option.key)
        if option.check is None or option.key not in group:
            continue  # a key the group lacks is no value to check (the table refuses a missing column)
        if isinstance(value, Tensor) and torch.compiler.is_compiling():
            continue  # a traced step cannot branch on a tensor's value; eager steps check it
        problem = option.check(value)
        if problem is not None:
            start = (option.refused or f"Invalid {option.key}: {{}}").format(_shown(value))
            raise ValueError(f"{start}. {problem}")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            "Nesterov momentum requires a momentum and zero dampening "
            f"(got momentum={group['momentum']}, dampening={group['dampening']}): "
            "set nesterov=False or choose a momentum > 0 with dampening = 0."
        )
    if group["max_grad_norm"] is not None and group["max_grad_value"] is not None:
        raise ValueError(
            "max_grad_norm and max_grad_value are alternatives (as Lightning's gradient_clip_algorithm "
            "'norm' and 'value'): set one of them, and None for the other."
        )
    if group["differentiable"]:
        raise ValueError(
            "FusedSGD(differentiable=True): the fused step is not differentiable (it writes the params in "
            "place, outside autograd). Use torch.optim.SGD(differentiable=True) to differentiate through "
            "optimizer steps."
        )


def check_average(decay: float, param: Tensor, label: Callable[[], str]) -> None:
    """Raises ValueError where an average of the weights (``ema_decay``) is asked of a param the kernel cannot
    average: it keeps averages of dense real params."""
    if param.is_complex() or param.layout != torch.strided:
        kind = param.dtype if param.is_complex() else param.layout
        raise ValueError(
            f"ema_decay={decay}: an average of the weights is kept of dense real params, and {label()} "
            f"(shape {tuple(param.shape)}) is {kind}: put it in a group with ema_decay=None."
        )


def check_param(group: Mapping[str, Any], param: Tensor, label: Callable[[], str]) -> None:
    """Raises ValueError, naming the param (``label()``, built only for a refusal) and the fix, where its
    group's options cannot step a param of its dtype."""
    rounding = group["update_rounding"]
    if rounding != "nearest" and param.dtype == torch.float16 and not group["master_weights"]:
        raise ValueError(
            f"update_rounding={rounding!r} rounds updates to bfloat16, and {label()} is float16 without "
            "master weights: set master_weights=True for it, make it bfloat16, or put it in a group with "
            "update_rounding='nearest'."
        )
    if group["ema_decay"] is not None:
        check_average(group["ema_decay"], param, label)
    if param.is_complex() and group["max_grad_value"] is not None:
        raise ValueError(
            f"max_grad_value clips each gradient element, and {label()} is complex ({param.dtype}), which "
            "torch.nn.utils.clip_grad_value_ refuses too (clamp is not defined for complex numbers): use "
            "max_grad_norm for this group, or leave it unclipped."
        )


def _check_schedule_free(group: Mapping[str, Any]) -> None:
    """A schedule-free group's rules (schedulefree.SGDScheduleFree's words where it refuses the same): its
    momentum interpolates, so it lies in (0, 1), and the options of SGD's momentum and of LARS are off."""
    momentum = group["momentum"]
    if _abi.number_problem(momentum) is None and not 0 < momentum < 1:
        raise ValueError(
            f"Momentum must be between 0 and 1 exclusive: {_shown(momentum)}. Schedule-free SGD's momentum "
            "interpolates between the average x and the SGD sequence z: choose one in (0, 1), e.g. 0.9."
        )
    sgd_only = [key for key in ("nesterov", "wd_after_momentum", "lars") if group.get(key) is True]
    sgd_only += ["dampening"] if group.get("dampening", 0) != 0 else []
    sgd_only += ["ema_decay"] if group.get("ema_decay") is not None else []
    if sgd_only:
        raise ValueError(
            f"A schedule-free group steps without {', '.join(sgd_only)} (options of SGD's momentum buffer, "
            "of LARS and of an average of the weights, which schedule-free SGD has not: its x is an "
            "average already): leave them out of the group, or step it with FusedSGD."
        )


def check_groups(groups: Sequence[Mapping[str, Any]], label: str = "param_groups") -> None:
    """Every group's check, naming the group, and the values one for the whole step."""
    for index, group in enumerate(groups):
        try:
            check_group(group)
        except ValueError as error:
            raise ValueError(f"{label}[{index}]: {error}") from None
    for option in _abi.options():
        values = {group.get(option.key) for group in groups} if option.step_wide else ()
        if len(values) > 1:
            raise ValueError(
                f"{option.key} differs between parameter groups ({sorted(map(str, values))}), but it is one "
                "value for the whole step (max_grad_norm clips the one global norm of every group's "
                f"gradients): set it on the optimizer (FusedSGD(..., {option.key}=...)), not per group."
            )
    if len({bool(group.get("schedule_free")) for group in groups}) > 1:
        raise ValueError(
            "schedule_free differs between parameter groups: it is the optimizer's, not a group's "
            "(FusedSGDScheduleFree steps every group schedule-free, FusedSGD none): leave it out of the "
            "groups."
        )


class GroupChecks:
    """:func:`check_groups`, run again only where the groups' values changed since they last passed: a group
    dict can be edited at any time, and a bad value must fail before anything is written."""

    def __init__(self) -> None:
        self._passed: list[tuple[Any, ...]] | None = None

    def __call__(self, groups: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> None:
        values = [tuple(map(group.get, keys)) for group in groups]
        if not self._same(values):
            check_groups(groups)
            self._passed = values

    def _same(self, values: list[tuple[Any, ...]]) -> bool:
        """Tensors (an lr) compare by identity, as their elements may be many (a refused lr), the others by
        value."""
        return (
            self._passed is not None
            and len(values) == len(self._passed)
            and all(
                len(a) == len(b)
                and all(x is y or (not isinstance(x, Tensor) and x == y) for x, y in zip(a, b))
                for a, b in zip(values, self._passed)
            )
        )
