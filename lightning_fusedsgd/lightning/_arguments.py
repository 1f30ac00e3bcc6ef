"""``configure_fused_sgd``'s checks of its arguments, before anything is built: an option the optimizer does
not take (named with the nearest one it does), a LARS option changed where no group steps with LARS (the step
would not read it), and a learning rate that is no number. Each refusal is a :class:`ConfigError` naming the
argument and the fix; the optimizer checks the values of the options it takes itself."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_fusedsgd import _abi
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.optim import FusedSGD, FusedSGDScheduleFree

__all__ = ["LARS_OPTIONS", "check_arguments"]

LARS_OPTIONS = (
    "trust_coefficient",
    "lars_eps",
    "trust_clip",
    "lars_denominator",
    "always_adapt",
    "lars_zero_norm",
)
"""FusedSGD's options that only a group with ``lars`` reads."""


def _defaults(function: Any) -> dict[str, Any]:
    """A function's arguments with their defaults (the first, self, and ``*args``/``**kwargs`` left out)."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {p.name: p.default for p in parameters if p.kind not in variadic}


def check_arguments(
    factory: Any,
    lr: Any,
    lars: bool,
    schedule_free: bool,
    no_lars: Mapping[str, bool],
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Refuses what ``configure_fused_sgd`` (``factory``) would otherwise pass on to fail later or not use.

    Raises:
        ConfigError: For an option the optimizer does not take, one the factory sets itself (``params``;
            schedule-free SGD's ``warmup_steps``, the schedule's warmup), a LARS option or ``no_lars_*``
            changed with ``lars=False``, or an ``lr`` that is no number >= 0.
    """
    if lr is not None:
        problem = _abi.option("lr").check(lr)
        if problem is not None:
            raise ConfigError(f"Invalid learning rate: {_abi.shown(lr)}. {problem}")
    optimizer = FusedSGDScheduleFree if schedule_free else FusedSGD
    takes = _defaults(optimizer.__init__)
    for key in optimizer_kwargs:
        if key == "params":
            raise ConfigError("configure_fused_sgd makes the params (param_groups): leave them out")
        if key == "warmup_steps" and schedule_free:
            raise ConfigError(
                "schedule-free SGD's warmup_steps is the schedule's warmup: pass "
                "schedule=Schedule(warmup=...) (in epochs, or steps with unit='step')"
            )
        if key not in takes:
            raise ConfigError(_not_taken(optimizer, key, [*takes, *_defaults(factory)]))
    if not lars:
        changed = {key: optimizer_kwargs[key] for key in LARS_OPTIONS if key in optimizer_kwargs}
        defaults = {key: value for key, value in _defaults(FusedSGD.__init__).items() if key in changed}
        defaults |= _defaults(factory)
        changed |= dict(no_lars)
        for key, value in changed.items():
            if value != defaults[key]:
                raise ConfigError(
                    f"{key}={value!r} is an option of LARS, and lars=False steps every group without LARS, "
                    f"so it would not be used: set lars=True (the runner's optim=fused_lars), or leave {key} "
                    f"at {defaults[key]!r}"
                )


def _not_taken(optimizer: type, key: str, names: Iterable[str]) -> str:
    message = f"{optimizer.__name__} takes no option {key!r}"
    if optimizer is FusedSGDScheduleFree and key in _defaults(FusedSGD.__init__):
        return f"{message}: it is FusedSGD's, and schedule-free SGD steps without it"
    nearest = difflib.get_close_matches(key, [name for name in names if name != "module"], n=1)
    return message + (f"; did you mean {nearest[0]!r}?" if nearest else "")
