"""The tables the optimizer tests cross with backends, dtypes, devices and oracles (torch's OptimizerInfo and
optax's ``_OPTIMIZERS_UNDER_TEST`` in spirit): the option combinations of the update, and the refusals that
must change nothing."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers import make_params
from torch import nn

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree


@dataclass(frozen=True)
class OptimCase:
    """One combination of FusedSGD's options.

    ``oracle`` names what the case is checked against: ``"torch"`` (``torch.optim.SGD`` given the same
    arguments: bit for bit in fp32 and fp64), ``"lars"`` (the LARS formula in float64, tests/oracles.py) or
    ``"clip"`` (torch's clip function, then ``torch.optim.SGD``).
    """

    id: str
    hparams: dict[str, Any]
    oracle: str = "torch"


def _torch_cases() -> list[OptimCase]:
    cases = []
    for momentum, dampening, nesterov, weight_decay, maximize in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 1e-2), (False, True)
    ):
        if nesterov and (momentum == 0 or dampening != 0):
            continue  # torch refuses it (a refusal case below)
        hparams = dict(
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
        )
        cases.append(OptimCase("-".join(f"{k}={v}" for k, v in hparams.items()), hparams))
    return cases


TORCH_CASES = _torch_cases()
"""Every combination of torch.optim.SGD's options (20): FusedSGD gives its bits on the plain path."""

LARS_CASES = [
    OptimCase(
        f"lars-nesterov={nesterov}-trust_clip={trust_clip}-decayed={decayed}-maximize={maximize}",
        dict(
            lars=True,
            momentum=0.9,
            nesterov=nesterov,
            trust_clip=trust_clip,
            lars_denominator="decayed_grad" if decayed else "grad_plus_decay",
            maximize=maximize,
            weight_decay=5e-4,
        ),
        "lars",
    )
    for nesterov, trust_clip, decayed, maximize in itertools.product((False, True), repeat=4)
]
"""LARS options against the float64 formula of You et al. (16)."""

CLIP_CASES = [
    OptimCase(f"clip-{name}-{algorithm}", dict(hparams, **{f"max_grad_{algorithm}": threshold}), "clip")
    for (name, hparams), (algorithm, threshold) in itertools.product(
        {
            "plain": dict(momentum=0.9, weight_decay=1e-4),
            "nesterov-maximize": dict(momentum=0.9, nesterov=True, maximize=True),
            "no-momentum": dict(),
        }.items(),
        [("norm", 0.5), ("norm", 1e6), ("value", 0.005)],
    )
]
"""Clipping inside the step against torch's clip function, then torch.optim.SGD (9)."""


@dataclass
class Scenario:
    """An optimizer about to be asked something it must refuse: ``act()`` raises, and afterwards the optimizer
    and ``params`` are as :func:`helpers.snapshot` saw them before."""

    optimizer: FusedSGD
    params: list[torch.Tensor]
    act: Callable[[], Any]


@dataclass(frozen=True)
class Refusal:
    """A refused input: how to set it up, the error's type and what its message says (the problem and the
    fix)."""

    id: str
    scenario: Callable[[], Scenario]
    error: type[Exception]
    match: str
    marks: tuple = field(default=())


def _stepped(params: list[nn.Parameter], named: bool = False, **hparams: Any) -> FusedSGD:
    """A FusedSGD over ``params`` that took three steps (its plan is kept: a refusal must not slip past
    it)."""
    arguments = list(zip("abcdefgh", params)) if named else params
    optimizer = FusedSGD(arguments, **{"lr": 0.1, "momentum": 0.9, **hparams})
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    return optimizer


def _step_refusal(params: list[nn.Parameter], edit: Callable[[FusedSGD], Any], **hparams: Any) -> Scenario:
    optimizer = _stepped(params, **hparams)
    edit(optimizer)
    return Scenario(optimizer, params, optimizer.step)


def _loaded(edit: Callable[[dict], Any]) -> Callable[[], Scenario]:
    """A named two-param FusedSGD asked to load its own state dict, edited."""

    def scenario() -> Scenario:
        params = make_params([(5,), (3,)])
        optimizer = _stepped(params, named=True)
        state = copy.deepcopy(optimizer.state_dict())
        edit(state)
        return Scenario(optimizer, params, lambda: optimizer.load_state_dict(state))

    return scenario


def _overlapping_views() -> Scenario:
    base = torch.randn(10)
    first, second = nn.Parameter(base[:6]), nn.Parameter(base[4:])
    other = nn.Parameter(torch.randn(70_000))
    optimizer = FusedSGD([{"params": [("other", other)]}, {"params": [("a", first), ("b", second)]}], lr=0.1)
    for p in (other, first, second):
        p.grad = torch.ones_like(p)
    return Scenario(optimizer, [other, first, second], optimizer.step)


def _with_grad(optimizer: FusedSGD, *params: torch.Tensor) -> FusedSGD:
    for p in params:
        p.grad = torch.ones_like(p)
    return optimizer


def _sparse(dtype: torch.dtype = torch.float32, **hparams: Any) -> Callable[[], Scenario]:
    def scenario() -> Scenario:
        model = nn.ModuleDict({"proj": nn.Linear(4, 4), "emb": nn.Embedding(10, 4, sparse=True)}).to(dtype)
        optimizer = FusedSGD(model.named_parameters(), lr=0.1, momentum=0.9, **hparams)
        model["proj"].weight.grad = torch.ones(4, 4, dtype=dtype)
        model["emb"](torch.tensor([1, 2])).sum().backward()
        return Scenario(optimizer, list(model.parameters()), optimizer.step)

    return scenario


def _float8() -> Scenario:
    good = nn.Parameter(torch.randn(5))
    odd = nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn), requires_grad=False)
    optimizer = _stepped([good])
    optimizer.add_param_group({"params": [odd]})
    good.grad, odd.grad = torch.ones(5), torch.zeros(3, dtype=torch.float8_e4m3fn)
    return Scenario(optimizer, [good], optimizer.step)


def _expanded() -> Scenario:
    good, expanded = nn.Parameter(torch.randn(70_000)), nn.Parameter(torch.randn(1, 3).expand(4, 3))
    optimizer = FusedSGD([good, expanded], lr=0.1, momentum=0.9)
    good.grad, expanded.grad = torch.ones_like(good), torch.ones(4, 3)
    return Scenario(optimizer, [good], optimizer.step)


def _complex_value_clip() -> Scenario:
    params = [nn.Parameter(torch.randn(4, dtype=torch.complex64)), nn.Parameter(torch.randn(3))]
    optimizer = _with_grad(FusedSGD(params, lr=0.1, momentum=0.9, max_grad_value=0.5), *params)
    return Scenario(optimizer, params, optimizer.step)


def _fsdp1(**hparams: Any) -> Callable[[], Scenario]:
    """FSDP1 needs a GPU here, so the param carries FSDP's own flattened marker (set by FSDP's helper)."""

    def scenario() -> Scenario:
        from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

        params = make_params([(300, 70), (50,)])
        _set_fsdp_flattened(params[0])
        optimizer = _with_grad(FusedSGD(params, lr=0.1, momentum=0.9, **hparams), *params)
        return Scenario(optimizer, params, optimizer.step)

    return scenario


def _engine_flat_buffer(**hparams: Any) -> Callable[[], Scenario]:
    """What DeepSpeed's ZeRO does, without DeepSpeed: the group's params replaced by one flat buffer of them
    (an engine's partition, unattached)."""

    def scenario() -> Scenario:
        params = make_params([(300, 70), (50,)])
        optimizer = FusedSGD(params, lr=0.1, momentum=0.9, **hparams)
        flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
        optimizer.param_groups[0]["params"] = [flat]
        return Scenario(_with_grad(optimizer, flat), [flat], optimizer.step)

    return scenario


def _capturable_group_elsewhere() -> Scenario:
    params = make_params([(4, 3), (3,)])
    optimizer = _with_grad(FusedSGD(params, lr=0.1, momentum=0.9, capturable=True), *params)
    on_meta = nn.Parameter(torch.empty(3, device="meta"))
    return Scenario(optimizer, params, lambda: optimizer.add_param_group({"params": [on_meta]}))


def _norm_clip_per_group() -> Scenario:
    params = make_params([(5,), (3,)])
    optimizer = FusedSGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1, momentum=0.9)
    _with_grad(optimizer, *params).step()
    optimizer.param_groups[1]["max_grad_norm"] = 1.0
    return Scenario(optimizer, params, optimizer.step)


def _fp16_rounded(rounding: str) -> Callable[[], Scenario]:
    def scenario() -> Scenario:
        params = make_params([(5,), (3,)], dtype=torch.float16)
        optimizer = FusedSGD(params, lr=0.1, momentum=0.9, update_rounding=rounding)
        return Scenario(optimizer, params, _with_grad(optimizer, *params).step)

    return scenario


def _add_group(group: dict[str, Any], **hparams: Any) -> Scenario:
    """A stepped optimizer asked to add a group it must refuse (nothing added)."""
    params = make_params([(5,), (3,)])
    optimizer = _stepped(params[:1], **hparams)
    return Scenario(optimizer, params, lambda: optimizer.add_param_group({"params": params[1:], **group}))


def _schedule_free(act: Callable[[FusedSGDScheduleFree, list[nn.Parameter]], Any]) -> Callable[[], Scenario]:
    """A named two-param FusedSGDScheduleFree that took three steps in train mode (its plan kept), then asked
    ``act(optimizer, params)`` (which may edit it first and returns what to call)."""

    def scenario() -> Scenario:
        params = make_params([(5,), (3,)])
        optimizer = FusedSGDScheduleFree(list(zip("ab", params)), lr=0.1, weight_decay=1e-4, warmup_steps=2)
        optimizer.train()
        for _ in range(3):
            _with_grad(optimizer, *params).step()
        return Scenario(optimizer, params, act(optimizer, params))

    return scenario


def _edited_step(key: str, value: Any) -> Callable[[FusedSGDScheduleFree, list], Any]:
    def act(optimizer: FusedSGDScheduleFree, params: list) -> Any:
        optimizer.param_groups[0][key] = value
        return optimizer.step

    return act


def _loaded_with(edit: Callable[[dict], Any]) -> Callable[[FusedSGDScheduleFree, list], Any]:
    def act(optimizer: FusedSGDScheduleFree, params: list) -> Any:
        state = copy.deepcopy(optimizer.state_dict())
        edit(state)
        return lambda: optimizer.load_state_dict(state)

    return act


def _set(key: str, value: Any) -> Callable[[FusedSGD], None]:
    return lambda optimizer: optimizer.param_groups[0].__setitem__(key, value)


def _set_state(index: int, value: Any) -> Callable[[dict], None]:
    return lambda state: state["state"][index].__setitem__("momentum_buffer", value)


REFUSALS = [
    *(
        Refusal(
            f"fp16-without-masters-rounded-{rounding}",
            _fp16_rounded(rounding),
            ValueError,
            rf"update_rounding='{rounding}' rounds updates to bfloat16, and .* is float16 without master "
            "weights: set master_weights=True",
        )
        for rounding in ("stochastic", "kahan")
    ),
    Refusal(
        "group-edited-to-an-unknown-rounding",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("update_rounding", "round_up")),
        ValueError,
        r"param_groups\[0\]: Invalid update_rounding: 'round_up'. "
        r"Choose one of \('nearest', 'stochastic', 'kahan'\)",
    ),
    *(
        Refusal(
            f"sparse-grad-of-bf16-rounded-{rounding}",
            _sparse(update_rounding=rounding, dtype=torch.bfloat16),
            RuntimeError,
            f"without update_rounding='{rounding}'",
        )
        for rounding in ("stochastic", "kahan")
    ),
    Refusal(
        "group-edited-to-an-unknown-denominator",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("lars_denominator", "decayed")),
        ValueError,
        r"param_groups\[0\]: Invalid lars_denominator: 'decayed'. Choose one of",
    ),
    Refusal(
        "group-edited-to-a-negative-lr",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("lr", -1.0)),
        ValueError,
        r"param_groups\[0\]: Invalid learning rate: -1.0. It must be >= 0",
    ),
    Refusal(
        "group-edited-to-a-nan-dampening",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("dampening", float("nan"))),
        ValueError,
        r"param_groups\[0\]: Invalid dampening: nan. It must be a finite number",
    ),
    Refusal(
        "group-edited-to-a-dampening-of-none",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("dampening", None)),
        ValueError,
        r"param_groups\[0\]: Invalid dampening: None. It must be a number .*got a NoneType",
    ),
    *(
        Refusal(
            f"group-edited-to-a-two-element-lr{'-capturable' if capturable else ''}",
            lambda capturable=capturable: _step_refusal(
                make_params([(5,), (3,)]), _set("lr", torch.tensor([0.1, 0.2])), capturable=capturable
            ),
            ValueError,
            r"Tensor lr must be 1-element, got shape \(2,\)",
        )
        for capturable in (False, True)
    ),
    Refusal(
        "added-group-with-its-own-max-grad-norm",
        lambda: _add_group({"max_grad_norm": 2.0}, max_grad_norm=1.0),
        ValueError,
        r"max_grad_norm differs between parameter groups \(\['1.0', '2.0'\]\)",
    ),
    Refusal(
        "added-group-with-a-nan-dampening",
        lambda: _add_group({"dampening": float("nan")}),
        ValueError,
        r"param_groups\[1\]: Invalid dampening: nan",
    ),
    Refusal(
        "max-grad-norm-differs-between-groups", _norm_clip_per_group, ValueError, "max_grad_norm differs"
    ),
    Refusal(
        "added-group-that-is-schedule-free",
        lambda: _add_group({"schedule_free": True}),
        ValueError,
        "schedule_free differs between parameter groups: it is the optimizer's, not a group's",
    ),
    Refusal(
        "schedule-free-groups-stepped-by-fused-sgd",
        lambda: _step_refusal(make_params([(5,), (3,)]), _set("schedule_free", True), momentum=0.5),
        RuntimeError,
        "a schedule-free step takes the step row's ckp1 and lrs, which the schedule_free_scalars op gives",
    ),
    Refusal(
        "state-buffer-of-another-shape",
        lambda: _step_refusal(
            make_params([(5,), (4, 3)]),
            lambda o: o.state[o.param_groups[0]["params"][1]].__setitem__(
                "momentum_buffer", torch.zeros(5, 3)
            ),
        ),
        ValueError,
        r"parameter 1 of group 0 \(shape \(4, 3\)\).*belongs to a different model",
    ),
    Refusal("overlapping-views", _overlapping_views, ValueError, "'a' and 'b' are overlapping views"),
    Refusal("float8-param", _float8, TypeError, r"parameter 0 of group 1 .*float8_e4m3fn.*convert it"),
    Refusal("expanded-param", _expanded, ValueError, r"parameter 1 of group 0 .*expand\(\)ed view"),
    Refusal(
        "sparse-with-lars",
        _sparse(lars=True),
        RuntimeError,
        "'emb.weight' has a sparse gradient.*without lars",
    ),
    Refusal(
        "sparse-with-value-clip",
        _sparse(max_grad_value=1.0),
        RuntimeError,
        "'emb.weight' has a sparse gradient.*without max_grad_value",
    ),
    Refusal(
        "sparse-with-an-average-of-the-weights",
        _sparse(ema_decay=0.99),
        RuntimeError,
        r"'emb.weight' has a sparse gradient.*without ema_decay \(set in its group\)",
    ),
    Refusal(
        "average-edited-into-a-group-with-a-complex-param",
        lambda: _step_refusal(
            [nn.Parameter(torch.randn(4, dtype=torch.complex64)), nn.Parameter(torch.randn(3))],
            _set("ema_decay", 0.9),
        ),
        ValueError,
        r"ema_decay=0.9: an average of the weights is kept of dense real params, and parameter 0 of group 0 "
        r".*is torch.complex64: put it in a group with ema_decay=None",
    ),
    Refusal(
        "sparse-with-weight-decay",
        _sparse(weight_decay=1e-4),
        RuntimeError,
        "'emb.weight' has a sparse gradient.*neither adds weight decay",
    ),
    Refusal(
        "value-clip-on-complex",
        _complex_value_clip,
        ValueError,
        "max_grad_value clips each gradient element.*complex.*max_grad_norm",
    ),
    Refusal("fsdp1-with-lars", _fsdp1(lars=True), ValueError, "FSDP1 .* Use FSDP2"),
    Refusal("fsdp1-with-norm-clip", _fsdp1(max_grad_norm=1.0), ValueError, "FSDP1 .* Use FSDP2"),
    Refusal(
        "engine-flat-buffer-with-lars",
        _engine_flat_buffer(lars=True),
        ValueError,
        r"parameter 0 of group 0 \(shape \(21050,\)\) was not given to this optimizer"
        r".*call lightning_fusedsgd.attach_deepspeed\(engine\)",
    ),
    Refusal(
        "engine-flat-buffer-with-norm-clip",
        _engine_flat_buffer(max_grad_norm=1.0),
        ValueError,
        "was not given to this optimizer.*lars=False and clip with DeepSpeed's gradient_clipping",
    ),
    Refusal(
        "capturable-group-on-another-device",
        _capturable_group_elsewhere,
        ValueError,
        "capturable=True keeps the lrs on the params' device.*one optimizer per device",
    ),
    Refusal(
        "state-dict-buffer-of-another-shape",
        _loaded(_set_state(1, torch.zeros(7, 3))),
        ValueError,
        r"momentum_buffer of 'b' has shape \(7, 3\)",
    ),
    Refusal(
        "state-dict-buffer-on-meta",
        _loaded(_set_state(1, torch.empty(3, device="meta"))),
        ValueError,
        "meta device",
    ),
    Refusal(
        "state-dict-buffer-an-int",
        _loaded(_set_state(1, 3)),
        ValueError,
        "momentum_buffer of 'b' is a int, not a tensor",
    ),
    Refusal(
        "state-dict-buffer-a-list", _loaded(_set_state(1, [1.0, 2.0])), ValueError, "is a list, not a tensor"
    ),
    Refusal("state-dict-without-state", _loaded(lambda s: s.pop("state")), ValueError, "no 'state' entry"),
    Refusal(
        "state-dict-group-with-an-unknown-denominator",
        _loaded(lambda s: s["param_groups"][0].__setitem__("lars_denominator", "decayed")),
        ValueError,
        r"saved param_groups\[0\]: Invalid lars_denominator",
    ),
    Refusal(
        "state-dict-group-with-a-nan-dampening",
        _loaded(lambda s: s["param_groups"][0].__setitem__("dampening", float("nan"))),
        ValueError,
        r"saved param_groups\[0\]: Invalid dampening: nan. It must be a finite number",
    ),
]
"""Inputs FusedSGD refuses before anything is written, with an error that names the problem and the fix."""

SCHEDULE_FREE_REFUSALS = [
    Refusal(
        "step-in-eval-mode",
        _schedule_free(lambda optimizer, params: (optimizer.eval(), optimizer.step)[1]),
        RuntimeError,
        r"Optimizer was not in train mode when step is called\. Please insert \.train\(\) and \.eval\(\)",
    ),
    Refusal(
        "group-edited-to-a-momentum-of-one",
        _schedule_free(_edited_step("momentum", 1.0)),
        ValueError,
        r"param_groups\[0\]: Momentum must be between 0 and 1 exclusive: 1.0\. .*choose one in \(0, 1\)",
    ),
    Refusal(
        "eval-after-a-momentum-edited-to-zero",
        _schedule_free(lambda optimizer, params: (_set("momentum", 0.0)(optimizer), optimizer.eval)[1]),
        ValueError,
        r"Momentum must be between 0 and 1 exclusive: 0.0",
    ),
    Refusal(
        "group-edited-to-a-negative-warmup",
        _schedule_free(_edited_step("warmup_steps", -5)),
        ValueError,
        r"param_groups\[0\]: Invalid warmup_steps: -5\. It must be >= 0",
    ),
    Refusal(
        "group-edited-to-an-average-of-the-weights",
        _schedule_free(_edited_step("ema_decay", 0.99)),
        ValueError,
        "A schedule-free group steps without ema_decay .*its x is an average already",
    ),
    Refusal(
        "group-edited-to-nesterov",
        _schedule_free(_edited_step("nesterov", True)),
        ValueError,
        "A schedule-free group steps without nesterov .*or step it with FusedSGD",
    ),
    Refusal(
        "state-dict-z-of-another-shape",
        _schedule_free(_loaded_with(lambda state: state["state"][1].__setitem__("z", torch.zeros(7, 3)))),
        ValueError,
        r"The z of 'b' has shape \(7, 3\) but the parameter has shape \(3,\)",
    ),
    Refusal(
        "state-dict-group-with-a-momentum-of-one",
        _schedule_free(_loaded_with(lambda state: state["param_groups"][0].__setitem__("momentum", 1))),
        ValueError,
        r"saved param_groups\[0\]: Momentum must be between 0 and 1 exclusive: 1",
    ),
]
"""Inputs FusedSGDScheduleFree refuses before anything is written (its scalars and mode included)."""

SCHEDULE_FREE_CONSTRUCTION_REFUSALS = [
    (dict(momentum=0.0), r"Momentum must be between 0 and 1 exclusive: 0.0"),
    (dict(momentum=1.0), r"Momentum must be between 0 and 1 exclusive: 1.0"),
    (dict(momentum=-0.1), r"Momentum must be between 0 and 1 exclusive: -0.1"),
    (dict(momentum=1.5), r"Momentum must be between 0 and 1 exclusive: 1.5"),
    (dict(lr=-1.0), r"Invalid learning rate: -1.0\. It must be >= 0"),
    (dict(weight_decay=-1e-4), r"Invalid weight_decay value: -0.0001\. It must be >= 0"),
    (dict(warmup_steps=-1), r"Invalid warmup_steps: -1\. It must be >= 0"),
    (dict(warmup_steps="10"), r"Invalid warmup_steps: '10'\. It must be a number .*got a str"),
    (dict(weight_lr_power=-2.0), r"Invalid weight_lr_power: -2.0\. It must be >= 0"),
    (dict(r=float("nan")), r"Invalid r: nan\. It must be a finite number"),
    (dict(update_rounding="up"), r"Invalid update_rounding: 'up'"),
    (dict(max_grad_norm=0.0), r"Invalid max_grad_norm: 0.0"),
]
"""FusedSGDScheduleFree's arguments it refuses at construction: (kwargs, what the message says)."""

CONSTRUCTION_REFUSALS = [
    (dict(lr=-0.1), "Invalid learning rate: -0.1. It must be >= 0"),
    (dict(lr=torch.tensor(-0.1)), "Invalid learning rate"),
    (dict(lr=torch.ones(2)), r"Tensor lr must be 1-element, got shape \(2,\)"),
    (dict(lr="0.1"), r"Invalid learning rate: '0.1'. It must be a number .*got a str"),
    (dict(momentum=-0.9), "Invalid momentum value: -0.9"),
    (dict(weight_decay=-1e-4), "Invalid weight_decay value"),
    (dict(weight_decay=None), "Invalid weight_decay value: None. It must be a number .*got a NoneType"),
    (dict(dampening=float("nan")), "Invalid dampening: nan. It must be a finite number"),
    (dict(dampening=float("inf")), "Invalid dampening: inf. It must be a finite number"),
    (dict(dampening="x"), "Invalid dampening: 'x'. It must be a number .*got a str"),
    (dict(lars_eps="x"), "Invalid lars_eps: 'x'. It must be a number .*got a str"),
    (dict(nesterov="false", momentum=0.9), "Invalid nesterov: 'false'. It must be True or False, got a str"),
    (dict(foreach="yes"), "Invalid foreach: 'yes'. It must be None, True or False"),
    (dict(differentiable=True), r"differentiable=True\): the fused step is not differentiable"),
    (dict(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), "dampening = 0"),
    (dict(lars_denominator="nope"), r"Invalid lars_denominator: 'nope'. Choose one of \('grad_plus_decay'"),
    (dict(trust_coefficient=0.0), r"Invalid trust_coefficient: 0.0. It must be > 0"),
    (dict(lars_eps=-1e-8), r"Invalid lars_eps: -1e-08. It must be >= 0"),
    (dict(max_grad_norm=-1), "Invalid max_grad_norm: -1. It must be a number > 0, or None"),
    (dict(max_grad_value="1"), "Invalid max_grad_value: '1'"),
    (dict(max_grad_norm=1.0, max_grad_value=0.1), "max_grad_norm and max_grad_value are alternatives"),
    (dict(backend="cuda_magic"), "Unknown backend"),
    (dict(update_rounding="up"), r"Invalid update_rounding: 'up'. Choose one of"),
    (dict(rounding_seed=-1), r"Invalid rounding_seed: -1. It must be an int in \[0, 2\*\*53\)"),
    (dict(rounding_seed=0.5), "Invalid rounding_seed: 0.5"),
    (dict(ema_decay=1.0), r"Invalid ema_decay: 1.0. It must be a number in \[0, 1\), or None"),
    (dict(ema_decay=-0.1), r"Invalid ema_decay: -0.1. It must be a number in \[0, 1\)"),
    (dict(ema_decay="0.999"), "Invalid ema_decay: '0.999'"),
    (dict(ema_decay=0.9, ema_every=0), "Invalid ema_every: 0. It must be an int >= 1"),
    (dict(ema_decay=0.9, ema_start=-1), "Invalid ema_start: -1. It must be an int >= 0"),
    (
        dict(ema_decay=0.9, ema_warmup_gamma=0.0),
        "Invalid ema_warmup_gamma: 0.0. It must be a number > 0, or None",
    ),
]
"""FusedSGD's arguments it refuses at construction: (kwargs, what the message says)."""
