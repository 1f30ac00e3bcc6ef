"""The checks of what users hand the optimizer, before anything is written: a group's values against the
kernels' declarations in ``lightning_fusedsgd._abi`` (each option's own check, whose refusals start with
torch.optim.SGD's words where torch refuses the same value, and its rules, declared beside it, that relate its
value to the group's other keys or to a param), and the values one for the whole step. Every refusal names the
value and the fix.

Imports only ``_abi``: every layer above may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi

__all__ = ["GroupChecks", "check_average", "check_flag", "check_group", "check_groups", "check_param"]


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


def check_flag(key: str, value: Any) -> None:
    """Raises ValueError for a value of a boolean option that no step may take as True or False: a string
    (a config's ``"false"``, which Python takes as true). Every boolean option is checked by this, wherever it
    enters."""
    problem = _abi.flag_problem(value)
    if problem is not None:
        raise ValueError(f"Invalid {key}: {_abi.shown(value)}. {problem}")


def check_group(group: Mapping[str, Any]) -> None:
    """Raises ValueError, naming the value and the fix, for a hyperparameter the step cannot use: the options'
    rules declared ``rule_first``, each option's check (where ``torch.optim.SGD`` refuses the same value, the
    message starts with torch's words), then the other rules."""
    ruled = [option for option in _abi.options() if option.rule is not None]
    for option in ruled:
        if option.rule_first:
            _refuse(option.rule(group))
    for option in _abi.options():
        value = group.get(option.key)
        if option.check is None or option.key not in group:
            continue  # a key the group lacks is no value to check (the table refuses a missing column)
        if isinstance(value, Tensor) and torch.compiler.is_compiling():
            continue  # a traced step cannot branch on a tensor's value; eager steps check it
        problem = option.check(value)
        if problem is not None:
            start = (option.refused or f"Invalid {option.key}: {{}}").format(_abi.shown(value))
            raise ValueError(f"{start}. {problem}")
    for option in ruled:
        if not option.rule_first:
            _refuse(option.rule(group))


def check_average(decay: float, param: Tensor, label: Callable[[], str]) -> None:
    """Raises ValueError where an average of the weights (``ema_decay``) is asked of a param the kernel cannot
    average (the ``ema_decay`` option's param rule)."""
    _refuse(_abi.option("ema_decay").param_rule({"ema_decay": decay}, param, label))


def check_param(group: Mapping[str, Any], param: Tensor, label: Callable[[], str]) -> None:
    """Raises ValueError, naming the param (``label()``, built only for a refusal) and the fix, where its
    group's options cannot step a param of its dtype or layout (their param rules)."""
    for option in _abi.options():
        if option.param_rule is not None:
            _refuse(option.param_rule(group, param, label))


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
