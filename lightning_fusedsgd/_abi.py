"""The kernel ABI: how a parameter group's hyperparameters reach the compiled kernels, and which values they
accept, in one place.

Every op that takes hyperparameters reads them as a CPU float64 table with one row per group; ``HPARAMS``
lists the columns in order (``LFSGD_HPARAMS`` in ``ops/csrc/sgd_math.h`` names the same fields in the same
order, checked when the library loads), each with the group key it encodes, how (None and option names become
numbers here, nowhere else), and which values the kernel accepts; a value one for the whole step
(``STEP_HPARAMS``) is an argument of the ops instead. The schedule op reads a schedule as a row too
(``SCHEDULE_HEADER`` then the milestones, decays numbered as ``DECAYS``); ``lars_sq_sums`` returns
``LARS_SUM_NAMES`` sums per tensor. The C++ side exports its order of each (``KERNEL_TABLES``), compared when
the library loads. The state keys are named here too.

A group's values are checked here too, before anything is written: each column's own check
(:func:`check_group`, whose refusals start with torch.optim.SGD's words where torch refuses the same value),
the rules that relate two keys, and the step values every group must share (:func:`check_groups`).

Adding a hyperparameter: its column here, its argument on ``FusedSGD``, its field and math in ``sgd_math.h``,
its math in ``ops/reference.py``, and a row of the test table.

Imports nothing of this package: every layer may use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DECAYS",
    "HPARAMS",
    "HPARAM_NAMES",
    "KAHAN_COMPENSATION",
    "KERNEL_TABLES",
    "LARS_DENOMINATORS",
    "LARS_SUMS",
    "LARS_SUM_NAMES",
    "MASTER_PARAM",
    "MOMENTUM_BUFFER",
    "ROUNDING_STEP",
    "LARS_ZERO_NORMS",
    "SCHEDULE_HEADER",
    "STEP_HPARAMS",
    "UPDATE_ROUNDINGS",
    "TORCH_SWITCHES",
    "Column",
    "FLAGS",
    "check_flag",
    "check_group",
    "check_groups",
    "encode_groups",
    "step_hparams",
    "table",
]


def _number(value: Any) -> float:
    return float(value)


def _flag(value: Any) -> float:
    return 1.0 if value else 0.0


def _type_problem(value: Any) -> str | None:
    """Why ``value`` is no number at all (a str, None, ...): the check names the type it expected."""
    if isinstance(value, numbers.Real) or (hasattr(value, "numel") and value.numel() == 1):
        return None  # a number, or a one-element tensor (lr, as torch.optim.SGD takes it)
    return f"It must be a number (a float, an int or a one-element tensor), got a {type(value).__name__}."


def _finite(value: Any) -> str | None:
    problem = _type_problem(value)
    if problem is None and not math.isfinite(value):
        problem = "It must be a finite number."
    return problem


def _non_negative(value: Any) -> str | None:
    return _type_problem(value) or (None if value >= 0 else "It must be >= 0.")


def _positive(value: Any) -> str | None:
    return _type_problem(value) or (None if value > 0 else "It must be > 0.")


def _threshold(value: Any) -> str | None:
    if value is None or (isinstance(value, numbers.Real) and value > 0):
        return None
    return "It must be a number > 0, or None for no clipping."


def _bool(value: Any) -> str | None:
    # A string is the usual mistake (a config's "false", which Python takes as true).
    return f"It must be True or False, got a {type(value).__name__}." if isinstance(value, str) else None


LARS_DENOMINATORS = ("grad_plus_decay", "decayed_grad")
"""LARS denominators: ``||g|| + lambda ||w||`` (You et al., MLPerf) or ``||g + lambda w||``."""

LARS_ZERO_NORMS = ("unit_ratio", "plain_grad")
"""What LARS does where a norm is 0: a ratio of 1 with the decay applied, or the plain gradient."""


UPDATE_ROUNDINGS = ("nearest", "stochastic", "kahan")
"""How a bf16 param without master weights takes its update: rounded to nearest, stochastically, or to nearest
with a Kahan compensation (the bucket's ``master_params``); numbered as ``kUpdateRoundingNames`` in
ops/csrc/sgd_math.h."""


def _seed(value: Any) -> str | None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < 2**53
    return None if ok else "It must be an int in [0, 2**53)."


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"Choose one of {choices}."


@dataclass(frozen=True)
class Column:
    """One column of the hyperparameter table.

    Attributes:
        name: The kernel's field (``GroupHParams`` in sgd_math.h).
        key: The parameter-group key it encodes.
        encode: The group value as the kernel reads it (a float64).
        check: Why a value is refused (a sentence naming the valid ones), or None where it is valid. Checks
            that relate two keys live with the optimizer's other checks.
        refused: How a refusal starts, where ``torch.optim.SGD`` words it (its ``{}`` is the value), so that
            code matching torch's messages keeps working; else ``Invalid <key>: <value>``.
    """

    name: str
    key: str
    encode: Callable[[Any], float] = _number
    check: Callable[[Any], str | None] | None = None
    refused: str | None = None


HPARAMS: tuple[Column, ...] = (
    # lr: NaN where the op reads the lrs from a tensor instead
    Column("lr", "lr", check=_non_negative, refused="Invalid learning rate: {}"),
    Column("momentum", "momentum", check=_non_negative, refused="Invalid momentum value: {}"),
    Column("dampening", "dampening", check=_finite),
    Column("weight_decay", "weight_decay", check=_non_negative, refused="Invalid weight_decay value: {}"),
    Column("nesterov", "nesterov", _flag, _bool),
    Column("maximize", "maximize", _flag, _bool),
    Column("wd_after_momentum", "wd_after_momentum", _flag, _bool),
    Column("lars", "lars", _flag, _bool),
    Column("trust_coefficient", "trust_coefficient", check=_positive),
    Column("lars_eps", "lars_eps", check=_non_negative),
    Column("trust_clip", "trust_clip", _flag, _bool),
    Column(
        "lars_decayed_grad",
        "lars_denominator",
        lambda v: _flag(v == "decayed_grad"),
        _one_of(LARS_DENOMINATORS),
    ),
    Column("max_grad_value", "max_grad_value", lambda v: math.inf if v is None else float(v), _threshold),
    Column("always_adapt", "always_adapt", _flag, _bool),
    Column(
        "lars_zero_plain_grad", "lars_zero_norm", lambda v: _flag(v == "plain_grad"), _one_of(LARS_ZERO_NORMS)
    ),
    Column("update_rounding", "update_rounding", UPDATE_ROUNDINGS.index, _one_of(UPDATE_ROUNDINGS)),
    Column("rounding_seed", "rounding_seed", check=_seed),
)
"""The table's columns, in the kernel's order."""

HPARAM_NAMES: tuple[str, ...] = tuple(column.name for column in HPARAMS)

STEP_HPARAMS: tuple[Column, ...] = (
    Column("max_grad_norm", "max_grad_norm", lambda v: v if v is None else float(v), _threshold),
)
"""Group keys whose value is one for the whole step (every group holds the same): the ops take each as an
argument of its name, encoded as here, not as a column."""


def encode_groups(groups: Sequence[dict[str, Any]], lr_on_device: bool) -> list[list[float]]:
    """The table's rows for these parameter groups. ``lr_on_device``: the op reads the lrs from a tensor, and
    the lr column holds NaN, so that any other use of it shows."""
    return [
        [
            math.nan if lr_on_device and column.key == "lr" else column.encode(group[column.key])
            for column in HPARAMS
        ]
        for group in groups
    ]


DECAYS: tuple[str, ...] = ("cosine", "multistep", "poly", "linear", "constant")
"""Decay shapes after warmup, numbered as ``kDecayNames`` in ops/csrc/schedule.h."""

SCHEDULE_HEADER: tuple[str, ...] = (
    "total_steps",
    "warmup_steps",
    "start_factor",
    "decay",
    "gamma",
    "power",
    "end_lr",
)
"""A schedule row's leading values, ``WarmupSchedule``'s fields of these names (the decay as its index in
``DECAYS``), in the order of ``LFSGD_SCHEDULE_HEADER`` in ops/csrc/schedule.h; the milestones follow."""

LARS_SUM_NAMES: tuple[str, ...] = ("w_sq", "term_sq", "w_term")
"""A ``lars_sq_sums`` row, per tensor: the sums of w^2, of the LARS norm term squared and of w times it, in
the order of ``kLarsSumNames`` in ops/csrc/sgd_math.h."""

LARS_SUMS = len(LARS_SUM_NAMES)

MOMENTUM_BUFFER = "momentum_buffer"
MASTER_PARAM = "master_param"
KAHAN_COMPENSATION = "kahan_compensation"
ROUNDING_STEP = "rounding_step"
"""The optimizer state keys of a param: its momentum buffer (as torch.optim.SGD names it), its fp32 master
weight, its bf16 Kahan compensation, and its count of stochastic steps."""

KERNEL_TABLES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("hparam_names", HPARAM_NAMES, "hyperparameter columns"),
    ("decay_names", DECAYS, "decays"),
    ("update_rounding_names", UPDATE_ROUNDINGS, "update roundings"),
    ("schedule_header_names", SCHEDULE_HEADER, "schedule row"),
    ("lars_sum_names", LARS_SUM_NAMES, "LARS sums"),
)
"""Every table the kernels read, as (the library op that exports the kernels' order, the order here, what it
is): loading the library compares each."""


FLAGS: tuple[str, ...] = ("master_weights",)
"""Boolean group keys that are no column (they decide what a step keeps, not the kernel's math), checked as
the flag columns are."""

TORCH_SWITCHES = ("foreach", "fused", "differentiable")
"""``torch.optim.SGD``'s implementation switches: accepted, so configs written for it work, and choosing
nothing (every step runs the fused kernel); ``differentiable=True`` is refused."""


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return str(value.item()) if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, str) else str(value)


def check_flag(key: str, value: Any) -> None:
    """Raises ValueError for a value of a boolean option that no step may take as True or False: a string
    (a config's ``"false"``, which Python takes as true). Every boolean option is checked by this, wherever it
    enters."""
    problem = _bool(value)
    if problem is not None:
        raise ValueError(f"Invalid {key}: {_shown(value)}. {problem}")


def check_group(group: dict[str, Any]) -> None:
    """Raises ValueError, naming the value and the fix, for a hyperparameter the step cannot use. Where
    ``torch.optim.SGD`` refuses the same value, the message starts with torch's words."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}: set a float or a 0-d tensor."
        )
    for column in (*HPARAMS, *STEP_HPARAMS):
        value = group[column.key]
        if column.check is None or (isinstance(value, Tensor) and torch.compiler.is_compiling()):
            continue  # a traced step cannot branch on a tensor's value; eager steps check it
        problem = column.check(value)
        if problem is not None:
            start = (column.refused or f"Invalid {column.key}: {{}}").format(_shown(value))
            raise ValueError(f"{start}. {problem}")
    for key in FLAGS:
        check_flag(key, group[key])
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
    for key in TORCH_SWITCHES:
        if group[key] not in (None, False, True):
            raise ValueError(f"Invalid {key}: {_shown(group[key])}. It must be None, True or False.")
    if group["differentiable"]:
        raise ValueError(
            "FusedSGD(differentiable=True): the fused step is not differentiable (it writes the params in "
            "place, outside autograd). Use torch.optim.SGD(differentiable=True) to differentiate through "
            "optimizer steps."
        )


def check_groups(groups: Sequence[dict[str, Any]], label: str = "param_groups") -> None:
    """Every group's check, naming the group, and the one global norm clipping takes."""
    for index, group in enumerate(groups):
        try:
            check_group(group)
        except ValueError as error:
            raise ValueError(f"{label}[{index}]: {error}") from None
    for column in STEP_HPARAMS:
        values = {group[column.key] for group in groups}
        if len(values) > 1:
            raise ValueError(
                f"{column.key} differs between parameter groups ({sorted(map(str, values))}), but it is one "
                "value for the whole step (max_grad_norm clips the one global norm of every group's "
                f"gradients): set it on the optimizer (FusedSGD(..., {column.key}=...)), not per group."
            )


def step_hparams(groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The values one for the whole step (``STEP_HPARAMS``, equal in every group: ``check_groups``), as
    the ops take them."""
    return {column.name: column.encode(groups[0][column.key]) for column in STEP_HPARAMS}


def table(groups: Sequence[dict[str, Any]], lr_on_device: bool) -> Tensor:
    """The hyperparameter table of these groups (``encode_groups``)."""
    return torch.tensor(encode_groups(groups, lr_on_device), dtype=torch.float64)
