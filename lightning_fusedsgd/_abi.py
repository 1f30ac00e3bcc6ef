"""The kernel ABI: everything a step hands the compiled kernels, declared once, and the checks of the values
they accept.

* **Options** (:class:`Option`): every parameter-group key of the optimizer, with its check and whether it
  decides a step's plan (what a kept plan is compared on). The keys the kernels read are **columns**
  (:class:`Column`, ``HPARAMS``) of a CPU float64 table with one row per group, named and ordered as the
  kernels' ``LFSGD_HPARAMS`` (ops/csrc/sgd_math.h); options and names become numbers in ``encode``, nowhere
  else.
* **Slots** (:class:`Slot`, ``SLOTS``): every kind of per-parameter optimizer state: its state key (also its
  kernel name, ``LFSGD_SLOTS``), which params hold it, its dtype, how a new one is seeded and whether it goes
  stale while its param steps without it. The plan, the kept plan, the state dicts and the checkpoint package
  derive their state handling from these.
* **The step row** (:class:`StepValue`, ``STEP_ROW``): the values that belong to a step rather than a group
  (GradScaler's scale and found-inf, the clip threshold and the gradients' sum of squares, the LARS sums
  reduced across shards, the lrs on the device, schedule-free's average weights), handed to the ops as one
  list (``LFSGD_STEP_ROW``).

The schedule op reads a schedule as a row (``SCHEDULE_HEADER``, the milestones and the decay's factors,
decays numbered as ``DECAYS``); ``lars_sq_sums`` returns ``LARS_SUM_NAMES`` sums per tensor; a schedule-free
optimizer keeps its per-group scalars as ``SCHEDULE_FREE_SCALARS`` rows on the device. The C++ side exports
its order of every table (``kernel_tables``), compared when the library loads.

Each option declares the values the kernels accept (its ``check``) and the rules that relate its value to
the group's other keys or to a param (its ``rule`` and ``param_rule``); ``lightning_fusedsgd._checks``
applies them before anything is written.

Adding a hyperparameter: its column here (with its check and rules), its argument on ``FusedSGD``, its field
and math in ``sgd_math.h``, its math in ``ops/reference.py``, and a row of the test table.

Adding a kind of state that the update reads and writes takes six library files at most (docs/design.md walks
through a second moment):

1. here: its :class:`Slot`, and the option that makes a param hold it (a :class:`Column` with ``examples``);
2. ``optim/sgd.py``: that option's argument, where the option is new;
3. ``ops/csrc/slots.h``: its row of ``LFSGD_SLOTS``, with the Slot's held rule, dtype rule and seed (loading
   the library compares them);
4. ``ops/csrc/sgd_math.h``: its operand (``Operands``, ``zip_operands``), its math, and the option's field;
5. ``ops/csrc/elements.h``: its stream (``Streams``, ``streams_of``, ``Streams::each``), its load
   (``load_operands``) and its store (``update_at``), which the CPU and CUDA loops both call;
6. ``ops/reference.py``: the same math, load and store in PyTorch.

The op's checks (``bucket.h``), the kernels' loops, the plan, the kept plan, the state dicts and the
checkpoints follow from these declarations. A state the update does not read (a count) takes 1-3 and its use.

Imports nothing of this package: every layer may use it. It is longer than 400 lines because each of its
tables is the Python half of one C++ table (``LFSGD_HPARAMS``, ``LFSGD_SLOTS``, ``LFSGD_STEP_ROW``, the
schedule, LARS and schedule-free rows), compared with it when the library loads, and each option's rules stand
beside it, so that a change to the ABI is read and reviewed as one file; ``lightning_fusedsgd._checks``
applies the checks and rules to what users hand the optimizer.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DECAYS",
    "GROUP_OPTIONS",
    "HPARAMS",
    "LARS_DENOMINATORS",
    "LARS_SUMS",
    "LARS_SUM_NAMES",
    "LARS_ZERO_NORMS",
    "LOW_PRECISION",
    "PARAM_DTYPES",
    "GROUP_STATE",
    "SCHEDULE_FREE_SCALARS",
    "SCHEDULE_HEADER",
    "SLOTS",
    "STEP_ROW",
    "UPDATE_ROUNDINGS",
    "Column",
    "Option",
    "Slot",
    "StepRow",
    "StepValue",
    "clip_thresholds",
    "defaults",
    "flag_problem",
    "hparam_names",
    "keeps_momentum_buffer",
    "kernel_tables",
    "masters_by_default",
    "number_problem",
    "option",
    "options",
    "options_on",
    "plan_key",
    "seeded",
    "shown",
    "slot",
    "slot_keys",
    "slot_rule_cases",
    "slots_in",
    "state_slots",
    "step_row",
    "step_row_names",
    "stored_weight",
    "table",
]


def _number(value: Any) -> float:
    return float(value)


def _flag(value: Any) -> float:
    return 1.0 if value else 0.0


def number_problem(value: Any) -> str | None:
    """Why ``value`` is no number at all (a str, None, ...): the check names the type it expected."""
    if isinstance(value, numbers.Real) or (hasattr(value, "numel") and value.numel() == 1):
        return None  # a number, or a one-element tensor (lr, as torch.optim.SGD takes it)
    return f"It must be a number (a float, an int or a one-element tensor), got a {type(value).__name__}."


def _finite(value: Any) -> str | None:
    problem = number_problem(value)
    if problem is None and not math.isfinite(value):
        problem = "It must be a finite number."
    return problem


def _non_negative(value: Any) -> str | None:
    return number_problem(value) or (None if value >= 0 else "It must be >= 0.")


def _positive(value: Any) -> str | None:
    return number_problem(value) or (None if value > 0 else "It must be > 0.")


def _threshold(value: Any) -> str | None:
    if value is None or (isinstance(value, numbers.Real) and value > 0):
        return None
    return "It must be a number > 0, or None for no clipping."


def flag_problem(value: Any) -> str | None:
    # A string is the usual mistake (a config's "false", which Python takes as true).
    return f"It must be True or False, got a {type(value).__name__}." if isinstance(value, str) else None


def _switch(value: Any) -> str | None:
    return None if value in (None, False, True) else "It must be None, True or False."


def _decay(value: Any) -> str | None:
    ok = value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= value < 1)
    return None if ok else "It must be a number in [0, 1), or None for no average."


def _count(least: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least
        return None if ok else f"It must be an int >= {least}."

    return check


def _warmup_gamma(value: Any) -> str | None:
    ok = value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0)
    return None if ok else "It must be a number > 0, or None for no warmup of the decay."


def _seed(value: Any) -> str | None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < 2**53
    return None if ok else "It must be an int in [0, 2**53)."


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"Choose one of {choices}."


def _is_set(value: Any) -> bool:
    return value is not None


def shown(value: Any) -> str:
    """A value as a refusal names it: a one-element tensor's number, a str quoted."""
    if isinstance(value, Tensor):
        return str(value.item()) if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, str) else str(value)


# The options' rules (Option.rule, Option.param_rule): each returns why a group, or a param of it, is refused.


def _one_element_lr(group: Mapping[str, Any]) -> str | None:
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        return f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}: set a float or a 0-d tensor."
    return None


def _nesterov_needs_momentum(group: Mapping[str, Any]) -> str | None:
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        return (
            "Nesterov momentum requires a momentum and zero dampening "
            f"(got momentum={group['momentum']}, dampening={group['dampening']}): "
            "set nesterov=False or choose a momentum > 0 with dampening = 0."
        )
    return None


def _one_clip(group: Mapping[str, Any]) -> str | None:
    if group["max_grad_norm"] is not None and group["max_grad_value"] is not None:
        return (
            "max_grad_norm and max_grad_value are alternatives (as Lightning's gradient_clip_algorithm "
            "'norm' and 'value'): set one of them, and None for the other."
        )
    return None


def _not_differentiable(group: Mapping[str, Any]) -> str | None:
    if group["differentiable"]:
        return (
            "FusedSGD(differentiable=True): the fused step is not differentiable (it writes the params in "
            "place, outside autograd). Use torch.optim.SGD(differentiable=True) to differentiate through "
            "optimizer steps."
        )
    return None


def _schedule_free_rules(group: Mapping[str, Any]) -> str | None:
    """A schedule-free group's rules (schedulefree.SGDScheduleFree's words where it refuses the same): its
    momentum interpolates, so it lies in (0, 1), and the options of SGD's momentum and of LARS are off."""
    if not group.get("schedule_free"):
        return None
    momentum = group["momentum"]
    if number_problem(momentum) is None and not 0 < momentum < 1:
        return (
            f"Momentum must be between 0 and 1 exclusive: {shown(momentum)}. Schedule-free SGD's momentum "
            "interpolates between the average x and the SGD sequence z: choose one in (0, 1), e.g. 0.9."
        )
    sgd_only = [key for key in ("nesterov", "wd_after_momentum", "lars") if group.get(key) is True]
    sgd_only += ["dampening"] if group.get("dampening", 0) != 0 else []
    sgd_only += ["ema_decay"] if group.get("ema_decay") is not None else []
    if sgd_only:
        return (
            f"A schedule-free group steps without {', '.join(sgd_only)} (options of SGD's momentum buffer, "
            "of LARS and of an average of the weights, which schedule-free SGD has not: its x is an "
            "average already): leave them out of the group, or step it with FusedSGD."
        )
    return None


def _value_clip_of_real(group: Mapping[str, Any], param: Tensor, label: Callable[[], str]) -> str | None:
    if param.is_complex() and group["max_grad_value"] is not None:
        return (
            f"max_grad_value clips each gradient element, and {label()} is complex ({param.dtype}), which "
            "torch.nn.utils.clip_grad_value_ refuses too (clamp is not defined for complex numbers): use "
            "max_grad_norm for this group, or leave it unclipped."
        )
    return None


def _rounded_to_bf16(group: Mapping[str, Any], param: Tensor, label: Callable[[], str]) -> str | None:
    rounding = group["update_rounding"]
    if rounding != "nearest" and param.dtype == torch.float16 and not group["master_weights"]:
        return (
            f"update_rounding={rounding!r} rounds updates to bfloat16, and {label()} is float16 without "
            "master weights: set master_weights=True for it, make it bfloat16, or put it in a group with "
            "update_rounding='nearest'."
        )
    return None


def _average_of_dense_real(group: Mapping[str, Any], param: Tensor, label: Callable[[], str]) -> str | None:
    """The kernel keeps averages of dense real params."""
    decay = group["ema_decay"]
    if decay is not None and (param.is_complex() or param.layout != torch.strided):
        kind = param.dtype if param.is_complex() else param.layout
        return (
            f"ema_decay={decay}: an average of the weights is kept of dense real params, and {label()} "
            f"(shape {tuple(param.shape)}) is {kind}: put it in a group with ema_decay=None."
        )
    return None


ARGUMENT: Any = type("Argument", (), {"__repr__": lambda self: "ARGUMENT"})()
"""An :class:`Option`'s default where every optimizer takes it as an argument (it has no other default)."""


LARS_DENOMINATORS = ("grad_plus_decay", "decayed_grad")
"""LARS denominators: ``||g|| + lambda ||w||`` (You et al., MLPerf) or ``||g + lambda w||``; numbered as
``kLarsDenominatorNames`` in ops/csrc/sgd_math.h."""

LARS_ZERO_NORMS = ("unit_ratio", "plain_grad")
"""What LARS does where a norm is 0: a ratio of 1 with the decay applied, or the plain gradient; numbered as
``kLarsZeroNormNames`` in ops/csrc/sgd_math.h."""

UPDATE_ROUNDINGS = ("nearest", "stochastic", "kahan")
"""How a bf16 param without master weights takes its update: rounded to nearest, stochastically, or to nearest
with a Kahan compensation; numbered as ``kUpdateRoundingNames`` in ops/csrc/sgd_math.h."""


@dataclass(frozen=True, kw_only=True)
class Option:
    """One parameter-group key of the optimizer.

    Attributes:
        key: The group key.
        check: Why a value is refused (a sentence naming the valid ones), or None where it is valid.
        refused: How a refusal starts, where ``torch.optim.SGD`` words it (its ``{}`` is the value), so that
            code matching torch's messages keeps working; else ``Invalid <key>: <value>``.
        rule: Why the group's value cannot go with its other keys (a sentence naming the values and the fix),
            or None where it can. ``_checks.check_group`` runs the rules after every option's ``check``, so
            that a rule reads valid values, and those declared ``rule_first`` before them.
        rule_first: The rule's refusal comes before the options' checks (schedule-free SGD's, in
            schedulefree's words).
        param_rule: Why the group's value cannot step this param (its dtype, its layout; ``label()`` names it,
            built only for a refusal), or None where it can: ``_checks.check_param``, for every param planned.
        plan: What of the value decides a step's plan (which state its params hold, what it refuses), or None
            where the value only enters the math: a kept plan is made anew when this changes.
        step_wide: One value for the whole step (every group must hold the same): a value of the step row of
            the same name, not a column.
        needs_norms: Where it is on, a step takes each tensor's or the global gradient norm (which sharded
            and flat-partition steps must reduce across ranks).
        fused_only: Only the fused kernel does it (torch's own SGD steps sparse gradients without it).
        clips: The ``gradient_clip_algorithm`` of Lightning's whose threshold it is (``"norm"``, ``"value"``),
            or None: :func:`clip_thresholds`.
        default: Its value in the groups of an optimizer that takes no argument of its name (FusedSGD's groups
            hold ``schedule_free=False``); ``ARGUMENT`` where every optimizer takes it (:func:`defaults`).
        examples: A plan option's values, one for each of its plan decisions: loading the library compares the
            kernels' slot rules with ``SLOTS``' over every combination of them (:func:`slot_rule_cases`).
    """

    key: str
    check: Callable[[Any], str | None] | None = None
    refused: str | None = None
    rule: Callable[[Mapping[str, Any]], str | None] | None = None
    rule_first: bool = False
    param_rule: Callable[[Mapping[str, Any], Tensor, Callable[[], str]], str | None] | None = None
    plan: Callable[[Any], Hashable] | None = None
    step_wide: bool = False
    needs_norms: bool = False
    fused_only: bool = False
    clips: str | None = None
    default: Any = ARGUMENT
    examples: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Column(Option):
    """An option the kernels read: a column of the hyperparameter table (``GroupHParams`` in sgd_math.h has a
    field of its key's name), ``encode`` giving the value as the kernel reads it (a float64)."""

    encode: Callable[[Any], float] = _number


HPARAMS: tuple[Column, ...] = (
    # lr: NaN where the op reads the lrs from the step row instead
    Column(
        key="lr",
        check=_non_negative,
        refused="Invalid learning rate: {}",
        rule=_one_element_lr,
        rule_first=True,
    ),
    Column(
        key="momentum",
        check=_non_negative,
        refused="Invalid momentum value: {}",
        plan=lambda v: v != 0,
        examples=(0.0, 0.9),
    ),
    Column(key="dampening", check=_finite),
    Column(key="weight_decay", check=_non_negative, refused="Invalid weight_decay value: {}"),
    Column(key="nesterov", encode=_flag, check=flag_problem, rule=_nesterov_needs_momentum),
    Column(key="maximize", encode=_flag, check=flag_problem),
    Column(key="wd_after_momentum", encode=_flag, check=flag_problem, fused_only=True),
    Column(
        key="lars",
        encode=_flag,
        check=flag_problem,
        plan=bool,
        needs_norms=True,
        fused_only=True,
        examples=(False, True),
    ),
    Column(key="trust_coefficient", check=_positive),
    Column(key="lars_eps", check=_non_negative),
    Column(key="trust_clip", encode=_flag, check=flag_problem),
    Column(key="lars_denominator", encode=LARS_DENOMINATORS.index, check=_one_of(LARS_DENOMINATORS)),
    Column(
        key="max_grad_value",
        encode=lambda v: math.inf if v is None else float(v),
        check=_threshold,
        param_rule=_value_clip_of_real,
        plan=_is_set,
        fused_only=True,
        clips="value",
        examples=(None, 1.0),
    ),
    Column(key="always_adapt", encode=_flag, check=flag_problem),
    Column(key="lars_zero_norm", encode=LARS_ZERO_NORMS.index, check=_one_of(LARS_ZERO_NORMS)),
    Column(
        key="update_rounding",
        encode=UPDATE_ROUNDINGS.index,
        check=_one_of(UPDATE_ROUNDINGS),
        param_rule=_rounded_to_bf16,
        plan=lambda v: v,
        examples=UPDATE_ROUNDINGS,
    ),
    Column(key="rounding_seed", check=_seed),
    # The average of the weights (ema_decay None: none), updated in the step: see Slot "ema".
    Column(
        key="ema_decay",
        encode=lambda v: math.nan if v is None else float(v),
        check=_decay,
        param_rule=_average_of_dense_real,
        plan=_is_set,
        fused_only=True,
        examples=(None, 0.999),
    ),
    Column(key="ema_every", check=_count(1)),
    Column(key="ema_start", check=_count(0)),
    Column(key="ema_warmup_gamma", encode=lambda v: 0.0 if v is None else float(v), check=_warmup_gamma),
    Column(key="ema_warmup_power", check=_positive),
    # Schedule-free SGD (FusedSGDScheduleFree, as schedulefree.SGDScheduleFree): its groups hold z and no
    # momentum buffer (momentum is its interpolation, in (0, 1)); the scalars' warmup and average weights.
    Column(
        key="schedule_free",
        encode=_flag,
        check=flag_problem,
        rule=_schedule_free_rules,
        rule_first=True,
        plan=bool,
        fused_only=True,
        default=False,
        examples=(False, True),
    ),
    Column(key="warmup_steps", check=_non_negative, default=0),
    Column(key="r", check=_finite, default=0.0),
    Column(key="weight_lr_power", check=_non_negative, default=2.0),
)
"""The table's columns, in the kernel's order."""


def hparam_names() -> tuple[str, ...]:
    """The table's column names, in order."""
    return tuple(column.key for column in HPARAMS)


GROUP_OPTIONS: tuple[Option, ...] = (
    Option(key="master_weights", check=flag_problem, plan=bool, examples=(False, True)),
    # Clips the one global norm of every group's gradients: one value for the step.
    Option(
        key="max_grad_norm",
        check=_threshold,
        rule=_one_clip,
        plan=_is_set,
        step_wide=True,
        needs_norms=True,
        fused_only=True,
        clips="norm",
        examples=(None, 1.0),
    ),
    # torch.optim.SGD's implementation switches: accepted, so configs written for it work, and choosing
    # nothing (every step runs the fused kernel); differentiable=True is refused (its rule).
    Option(key="foreach", check=_switch),
    Option(key="fused", check=_switch),
    Option(key="differentiable", check=_switch, rule=_not_differentiable),
)
"""The group keys the kernels do not read as columns."""


def option(key: str) -> Option:
    """The option of a group key."""
    return next(o for o in options() if o.key == key)


def options() -> tuple[Option, ...]:
    """Every group option: the columns, then the others."""
    return (*HPARAMS, *GROUP_OPTIONS)


def masters_by_default(chosen: Mapping[str, Any], dtypes: Iterable[torch.dtype]) -> bool:
    """``master_weights`` where a caller decides it from the params' dtypes and the options ``chosen``: on
    for 16-bit params, unless ``update_rounding`` chooses another way to take their updates (it needs them
    off)."""
    return chosen.get("update_rounding", "nearest") == "nearest" and any(d in LOW_PRECISION for d in dtypes)


def clip_thresholds() -> dict[str, str]:
    """The clip thresholds' keys by the ``gradient_clip_algorithm`` each is (``Option.clips``): a group clips
    by at most one of them."""
    return {o.clips: o.key for o in options() if o.clips is not None}


def defaults(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's defaults: each option's argument of its name in ``arguments``, or the option's declared
    ``default`` where the optimizer takes no such argument."""
    return {
        o.key: arguments[o.key] if o.key in arguments else o.default
        for o in options()
        if o.key in arguments or o.default is not ARGUMENT
    }


def options_on(group: Mapping[str, Any], kind: str) -> list[str]:
    """The keys of the options of a kind (an attribute of :class:`Option`: ``"needs_norms"``,
    ``"fused_only"``) that a group turns on (its plan decision is true, or its value where it decides no
    plan)."""
    return [
        o.key
        for o in options()
        if getattr(o, kind) and (o.plan(group[o.key]) if o.plan is not None else bool(group[o.key]))
    ]


def plan_key(group: Mapping[str, Any]) -> tuple[Hashable, ...]:
    """What of a group decides a step's plan: its number of params and each deciding option's decision."""
    return (len(group["params"]), *(o.plan(group[o.key]) for o in options() if o.plan is not None))


def table(groups: Sequence[Mapping[str, Any]], lr_on_device: bool) -> Tensor:
    """The hyperparameter table of these groups: a row per group, ``HPARAMS``'s encodings. ``lr_on_device``:
    the op reads the lrs from the step row, and the lr column holds NaN, so that any other use of it shows."""
    rows = [
        [
            math.nan if lr_on_device and column.key == "lr" else column.encode(group[column.key])
            for column in HPARAMS
        ]
        for group in groups
    ]
    return torch.tensor(rows, dtype=torch.float64)


LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION)
"""The dtypes of the params the kernels step (complex params step as their real views)."""


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One kind of per-parameter optimizer state.

    Attributes:
        key: The state key (``state[p][key]``), and its name in the kernels' ``LFSGD_SLOTS``.
        held: Whether a param of this dtype in this group holds it. It may read plan options only.
        dtype: Its dtype for a param of this dtype in this group (plan options only, too).
        seed: How a new one starts: ``"gradient"`` (the kernel seeds it from the first step's gradient: the
            op's ``first_step``), ``"weight"`` (the param's weight, as :func:`stored_weight` gives it),
            ``"residual"`` (what rounding the weight to the param dropped) or ``"zeros"``.
        option: The group option that makes a param hold it (what a refusal names).
        weight: What it is of the weight: ``"whole"`` (the param holds its rounding) or ``"residual"`` (the
            weight is param + it), or None where it is no part of the weight.
        torch_sgd: ``torch.optim.SGD`` keeps it too (its own path steps sparse gradients with it).
        missing_said: A loaded state without it (a checkpoint from before it was kept, or edited) says so, as
            it starts anew rather than with the history a checkpoint would carry (every slot but the momentum
            buffer, which starts from the next gradient without a word, as ``torch.optim.SGD``'s does).
        count: A one-element int64 count on the param's device (0-d), not a tensor laid out as the param.
        stale_unheld: It goes stale while its param steps without it: dropped then, and seeded anew when its
            group holds it again.
    """

    key: str
    held: Callable[[Mapping[str, Any], torch.dtype], bool]
    dtype: Callable[[Mapping[str, Any], torch.dtype], torch.dtype]
    seed: str
    option: str
    weight: str | None = None
    torch_sgd: bool = False
    missing_said: bool = False
    count: bool = False
    stale_unheld: bool = False


def _masters(group: Mapping[str, Any], dtype: torch.dtype) -> bool:
    return bool(group["master_weights"]) and dtype in LOW_PRECISION


def _averages(group: Mapping[str, Any], dtype: torch.dtype) -> bool:
    return group["ema_decay"] is not None


def _rounds(rounding: str) -> Callable[[Mapping[str, Any], torch.dtype], bool]:
    """Whether a bf16 param without master weights rounds its update this way."""
    return lambda group, dtype: (
        dtype == torch.bfloat16 and not _masters(group, dtype) and group["update_rounding"] == rounding
    )


def keeps_momentum_buffer(group: Mapping[str, Any]) -> bool:
    """Whether a group's update keeps a momentum buffer: SGD's momentum is on. A schedule-free group's
    ``momentum`` is its interpolation, and it keeps z instead. Decided here alone: the ``momentum_buffer``
    slot's held rule and the reference's coefficients read it (``keeps_momentum_buffer`` in sgd_math.h)."""
    return group["momentum"] != 0 and not group["schedule_free"]


def _stream_dtype(group: Mapping[str, Any], dtype: torch.dtype) -> torch.dtype:
    """The dtype of a stream the update reads and writes beside the weight (SGD's momentum buffer,
    schedule-free SGD's z): fp32 beside fp32 masters."""
    return torch.float32 if _masters(group, dtype) else dtype


def _average_family() -> tuple[Slot, ...]:
    """The average of the weights (ema_decay) and its two counts, held, dropped and declared together: the
    average in the opmath type (fp32 beside 16-bit params), updated in the step from its new weight and seeded
    from the weight, as a copy of the model is where an average begins; the param's applied steps since its
    average began (the schedule's step: ema_start, ema_every); the updates the average has had (the first
    copies the weight; the decay's warmup counts them)."""
    family = dict(held=_averages, option="ema_decay", stale_unheld=True, missing_said=True)
    count = dict(dtype=lambda group, dtype: torch.int64, seed="zeros", count=True, **family)
    return (
        Slot(
            key="ema",
            dtype=lambda group, dtype: torch.float64 if dtype == torch.float64 else torch.float32,
            seed="weight",
            **family,
        ),
        Slot(key="ema_step", **count),
        Slot(key="ema_updates", **count),
    )


SLOTS: tuple[Slot, ...] = (
    # As torch.optim.SGD keeps it (none when momentum is 0, or schedule-free, whose momentum interpolates).
    Slot(
        key="momentum_buffer",
        held=lambda group, dtype: keeps_momentum_buffer(group),
        dtype=_stream_dtype,
        seed="gradient",
        option="momentum",
        torch_sgd=True,
    ),
    # fp32 master weights of bf16/fp16 params; each param holds its master's rounding.
    Slot(
        key="master_param",
        held=_masters,
        dtype=lambda group, dtype: torch.float32,
        seed="weight",
        option="master_weights",
        weight="whole",
        missing_said=True,
        stale_unheld=True,
    ),
    # update_rounding="kahan": the weight is param + compensation, the param its rounding to nearest.
    Slot(
        key="kahan_compensation",
        held=_rounds("kahan"),
        dtype=lambda group, dtype: torch.bfloat16,
        seed="residual",
        option="update_rounding",
        weight="residual",
        missing_said=True,
        stale_unheld=True,
    ),
    # update_rounding="stochastic": the param's count of stochastic steps, the step of its random bits.
    Slot(
        key="rounding_step",
        held=_rounds("stochastic"),
        dtype=lambda group, dtype: torch.int64,
        seed="zeros",
        option="update_rounding",
        missing_said=True,
        count=True,
    ),
    *_average_family(),
    # Schedule-free SGD's z (schedulefree's state key), the sequence of plain SGD steps that the param's y and
    # x average; started from the weight.
    Slot(
        key="z",
        held=lambda group, dtype: bool(group["schedule_free"]),
        dtype=_stream_dtype,
        seed="weight",
        option="schedule_free",
        missing_said=True,
        stale_unheld=True,
    ),
)
"""Every kind of per-parameter state, in the kernels' order (``LFSGD_SLOTS``): the op's ``state`` holds each
param's slots in this order."""


def slot_keys() -> tuple[str, ...]:
    """The slots' state keys, in order."""
    return tuple(s.key for s in SLOTS)


def state_slots(held: Sequence[bool], fresh: Sequence[bool]) -> int:
    """A tensor's entry of the ops' ``state_slots``: bit ``s`` where it holds ``SLOTS[s]`` (its state entries
    follow in that order), bit ``len(SLOTS) + s`` where the kernel seeds that slot this step (``"gradient"``
    slots on the param's first step)."""
    return sum(1 << s for s, h in enumerate(held) if h) | sum(
        1 << (len(SLOTS) + s) for s, f in enumerate(fresh) if f
    )


def slots_in(mask: int) -> tuple[list[bool], list[bool]]:
    """Which slots a ``state_slots`` entry holds, and which the kernel seeds this step."""
    return [bool(mask >> s & 1) for s in range(len(SLOTS))], [
        bool(mask >> (len(SLOTS) + s) & 1) for s in range(len(SLOTS))
    ]


def slot(key: str) -> Slot:
    """The slot of a state key."""
    return SLOTS[slot_keys().index(key)]


def stored_weight(param: Tensor, state: Mapping[str, Any]) -> Tensor:
    """The weight a param's state holds, in fp32 (or the param's float64): a whole-weight slot's value where
    one is stored (a master), else the param plus a stored residual (a compensation), else the param."""
    stored = {
        s.weight: state[s.key] for s in SLOTS if s.weight is not None and isinstance(state.get(s.key), Tensor)
    }
    if "whole" in stored:
        return stored["whole"].to(param.device).float()
    weight = param if param.dtype == torch.float64 else param.float()
    if "residual" in stored:
        weight = weight + stored["residual"].to(param.device).float()
    return weight


def seeded(slot: Slot, param: Tensor, weight: Tensor, dtype: torch.dtype, zeros: bool = False) -> Tensor:
    """The values a new state tensor of ``slot`` starts from, for the dense (local) ``param`` whose weight is
    ``weight`` (:func:`stored_weight`), in ``dtype`` and the param's layout (a 0-d count on its device).
    ``"gradient"`` slots are left for the kernel to seed (uninitialized; ``zeros`` under tracing, where a
    skipped first step cannot be seen)."""
    if slot.count:
        return torch.zeros((), dtype=dtype, device=param.device)
    if slot.seed == "gradient":
        return (torch.zeros_like if zeros else torch.empty_like)(param, dtype=dtype)
    if slot.seed == "weight":
        return torch.empty_like(param, dtype=dtype).copy_(weight)
    if slot.seed == "residual":
        residual = torch.where(param == weight.to(param.dtype), weight - param.float(), 0.0)
        return torch.empty_like(param, dtype=dtype).copy_(residual)
    return torch.zeros_like(param, dtype=dtype)


def slot_rule_cases() -> tuple[list[dict[str, Any]], Tensor]:
    """Every combination of the plan options' ``examples``, each a group of those options alone (all that the
    slots' held and dtype rules may read), and their hyperparameter table (other columns 0): loading the
    library compares the kernels' rules (``LFSGD_SLOTS``) with ``SLOTS``' over them, for each of
    ``PARAM_DTYPES``."""
    deciding = [o for o in options() if o.plan is not None]
    groups = [
        dict(zip((o.key for o in deciding), values))
        for values in itertools.product(*(o.examples for o in deciding))
    ]
    rows = [
        [column.encode(group[column.key]) if column.key in group else 0.0 for column in HPARAMS]
        for group in groups
    ]
    return groups, torch.tensor(rows, dtype=torch.float64)


@dataclass(frozen=True)
class StepValue:
    """One value of the step row: its name, dtype and shape (``"one"`` element, one per ``"groups"``, or a
    ``"lars_sums"`` row per tensor of the bucket), on the params' device; ``paired_with``: a value it comes
    with (both or neither), which a step computes where the other is given; ``doc``: what the ops do with it
    (their contract)."""

    name: str
    dtype: torch.dtype
    shape: str = "one"
    paired_with: str | None = None
    doc: str = ""


STEP_ROW: tuple[StepValue, ...] = (
    StepValue("grad_scale", torch.float32, doc="GradScaler's scale: gradients are unscaled in the kernel."),
    StepValue(
        "found_inf", torch.float32, doc="GradScaler's flag: a step with found_inf != 0 changes nothing."
    ),
    StepValue(
        "grad_sq_sum",
        torch.float64,
        paired_with="max_grad_norm",
        doc="The sum of squares of every gradient the optimizer steps (all its buckets): the global norm.",
    ),
    StepValue(
        "max_grad_norm",
        torch.float64,
        paired_with="grad_sq_sum",
        doc="The step's one threshold of clipping by the global norm of every gradient.",
    ),
    StepValue(
        "lars_sq_sums",
        torch.float64,
        "lars_sums",
        doc="The lars_sq_sums op's rows all-reduced over the shards of sharded params: the trust ratios "
        "are taken from them instead of the kernel's own norm pass.",
    ),
    StepValue(
        "lrs",
        torch.float64,
        "groups",
        doc="Each group's lr, read here instead of the table's lr column (NaN then): capturable steps, "
        "and tensor lrs under torch.compile.",
    ),
    StepValue(
        "ckp1",
        torch.float64,
        "groups",
        doc="Schedule-free groups' weight of z in this step's average of y, from schedule_free_scalars "
        "(as the lrs after warmup in lrs).",
    ),
)
"""The step row, in the kernels' order (``LFSGD_STEP_ROW``)."""


def step_row_names() -> tuple[str, ...]:
    """The step row's value names, in order."""
    return tuple(value.name for value in STEP_ROW)


class StepRow:
    """A step's row: each ``STEP_ROW`` value by name (a tensor, a number, or None where absent), starting
    from the step-wide options of the groups."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        unknown = set(values) - set(step_row_names())
        if unknown:
            raise KeyError(f"not values of the step row: {sorted(unknown)}")
        self.values = dict.fromkeys(step_row_names()) | dict(values)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def with_values(self, **values: Any) -> StepRow:
        return StepRow(self.values | values)

    def wants(self, name: str) -> bool:
        """Whether the step must compute ``name``: absent, and the value it is paired with given."""
        pair = next(value.paired_with for value in STEP_ROW if value.name == name)
        return self.values[name] is None and pair is not None and self.values[pair] is not None

    def on(self, device: torch.device) -> list[Tensor | None]:
        """The row as the ops take it: every value a tensor of its declared dtype on ``device``, in order."""
        return [
            None
            if (v := self.values[value.name]) is None
            else torch.as_tensor(v, dtype=value.dtype).to(device)
            for value in STEP_ROW
        ]


def step_row(groups: Sequence[Mapping[str, Any]], **values: Any) -> StepRow:
    """The row of a step of these groups: their step-wide options (equal in every group, as
    ``_checks.check_groups`` requires) and ``values``."""
    return StepRow({o.key: groups[0][o.key] for o in GROUP_OPTIONS if o.step_wide} | values)


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
    "milestone_count",
)
"""A schedule row's leading values, ``WarmupSchedule``'s fields of these names (the decay as its index in
``DECAYS``, ``milestone_count`` the number of milestones), in the order of ``LFSGD_SCHEDULE_HEADER`` in
ops/csrc/schedule.h; the milestones and the decay's factors follow (``WarmupSchedule.as_row``)."""

LARS_SUM_NAMES: tuple[str, ...] = ("w_sq", "term_sq", "w_term", "grad_sq")
"""A ``lars_sq_sums`` row, per tensor: the sums of w^2, of the LARS norm term squared, of w times it and of
the gradient squared (unscaled, sign-corrected, clipped by value, before the norm clip: the term itself for
the default denominator), in the order of ``kLarsSumNames`` in ops/csrc/sgd_math.h."""

LARS_SUMS = len(LARS_SUM_NAMES)

SCHEDULE_FREE_SCALARS: tuple[str, ...] = ("k", "lr_max", "weight_sum", "scheduled_lr", "ckp1")
"""A schedule-free optimizer's per-group scalars, the rows of one float64 ``[len, groups]`` tensor on the
params' device that the ``schedule_free_scalars`` op advances each applied step: the group keys of these names
of schedulefree.SGDScheduleFree (the step count, the largest lr so far, the sum of the average's weights, this
step's lr after warmup) and ``ckp1``, this step's weight of z in the average; in the order of
``LFSGD_SCHEDULE_FREE_SCALARS`` in ops/csrc/schedule_free.h."""


GROUP_STATE: dict[str, Any] = {
    "k": 0,
    "train_mode": False,
    "weight_sum": 0.0,
    "lr_max": -1.0,
    "scheduled_lr": 0.0,
}
"""The values a group holds as state rather than as hyperparameters, at their values before the first step:
schedule-free SGD's mode and scalars, under schedulefree.SGDScheduleFree's keys (its defaults hold them). A
load regrouped by name carries them from the saved groups that held the params (checkpoint/remap.py)."""


def kernel_tables() -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """Every table the kernels read, as (the library op that exports the kernels' order, the order here, what
    it is): loading the library compares each."""
    return (
        ("hparam_names", hparam_names(), "hyperparameter columns"),
        ("slot_names", slot_keys(), "state slots"),
        ("slot_seeds", tuple(s.seed for s in SLOTS), "state slots' seeds"),
        ("step_row_names", step_row_names(), "step row"),
        ("decay_names", DECAYS, "decays"),
        ("update_rounding_names", UPDATE_ROUNDINGS, "update roundings"),
        ("lars_denominator_names", LARS_DENOMINATORS, "LARS denominators"),
        ("lars_zero_norm_names", LARS_ZERO_NORMS, "LARS zero-norm rules"),
        ("schedule_header_names", SCHEDULE_HEADER, "schedule row"),
        ("lars_sum_names", LARS_SUM_NAMES, "LARS sums"),
        ("schedule_free_scalar_names", SCHEDULE_FREE_SCALARS, "schedule-free scalars"),
    )
