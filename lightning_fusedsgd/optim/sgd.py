"""FusedSGD: a drop-in ``torch.optim.SGD`` whose update runs in one compiled call per bucket."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fusedsgd import _abi
from lightning_fusedsgd.optim import _backends, _state_dict, _step, _zero
from lightning_fusedsgd.optim._lrs import LrStorage, as_numbers, stacked_lrs
from lightning_fusedsgd.optim._plan import StepInputs


def _same_values(values: list[tuple[Any, ...]], checked: list[tuple[Any, ...]] | None) -> bool:
    """Whether the groups' values are those last checked: tensors (an lr) by identity, as their elements may
    be many (a refused lr), the others by value."""
    return (
        checked is not None
        and len(values) == len(checked)
        and all(
            len(a) == len(b) and all(x is y or (not isinstance(x, Tensor) and x == y) for x, y in zip(a, b))
            for a, b in zip(values, checked)
        )
    )


class FusedSGD(Optimizer):
    """SGD with momentum whose update runs in one compiled multi-tensor call per (device, dtype).

    The semantics are those of ``torch.optim.SGD`` (per-parameter first-step seeding of the momentum
    buffer, no buffer when momentum is 0, per-group hyperparameters, closures, named parameters), plus
    TransformerEngine's ``wd_after_momentum``, fp32 master weights for bf16/fp16 params, in-kernel
    GradScaler unscaling, and LARS (You et al. 2017) fused into the same call. State is stored as torch
    stores it (``state[p]["momentum_buffer"]``), with master weights in ``state[p]["master_param"]``, so
    checkpoints move both ways between ``torch.optim.SGD`` and this class.

    Args:
        params: Parameters, named parameters, or parameter-group dicts (an iterable, as torch takes them).
        lr: Learning rate (float or 0-d tensor); 1e-3 by default, as ``torch.optim.SGD``.
        momentum: Momentum factor mu.
        dampening: Dampening tau for momentum.
        weight_decay: Coupled L2 penalty lambda.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: Maximize the objective instead of minimizing it.
        wd_after_momentum: Add ``lambda * w`` after the momentum update instead of to the gradient, so
            the decay stays out of the buffer (TransformerEngine's option).
        master_weights: Keep an fp32 copy and fp32 momentum for bf16/fp16 params; the kernel updates the
            copy and writes the rounded value back to the param. A param written outside the optimizer
            (``load_state_dict``, ``p.data.copy_``, EMA swaps) no longer holds its copy's rounding: the
            kernel then takes the param's value as the copy, element by element.
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        backend: ``"auto"`` (the compiled kernel, or the reference where it cannot be built), ``"compiled"``
            or ``"reference"`` (the same math in plain PyTorch, ``ops/reference.py``).
        lars: Apply the LARS trust ratio (a per-group key too: ``param_groups`` sets ``lars=False`` on the
            groups it excludes, and this argument decides for the others).
        trust_coefficient: LARS eta.
        lars_eps: LARS epsilon in the denominator.
        trust_clip: LARC's clip, ``r <- min(r / lr, 1)``.
        lars_denominator: ``"grad_plus_decay"`` (``||g|| + lambda ||w||``, You et al., MLPerf) or
            ``"decayed_grad"`` (``||g + lambda w||``).
        always_adapt: LARS adapts every group with ``lars`` on; False leaves a group whose weight decay is 0
            unadapted (timm's switch: lightly, lightning-bolts and, by default, timm do so).
        lars_zero_norm: Where ``||w||`` or ``||g||`` is 0: ``"unit_ratio"`` takes a ratio of 1 and still
            applies the decay (timm, torchlars); ``"plain_grad"`` steps the plain gradient, no decay
            (lightly, lightning-bolts).
        max_grad_norm: Clip the gradients as ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)``
            does, inside the step: one L2 norm over every stepped gradient, unscaled under a GradScaler,
            and the coefficient ``min(1, max_grad_norm / (norm + 1e-6))`` applied before weight decay and
            LARS. The norm is computed on the device (no host sync) by one more read of the gradients.
            The same for every group.
        max_grad_value: Clip each unscaled gradient element to ``[-max_grad_value, max_grad_value]``, as
            ``torch.nn.utils.clip_grad_value_`` does (per group; an alternative to ``max_grad_norm``).
        update_rounding: How bf16 params without master weights take their update (computed in fp32):
            ``"nearest"`` rounds it to nearest, as torch does, and an update below half a bf16 ulp of the
            weight is lost; ``"stochastic"`` rounds up with probability (the dropped bits) / 2^16, so the
            weight moves by the update on average (Zamirai et al. 2020, arXiv:2010.06192), and rounds the
            bf16 momentum buffer the same way. The random bits are a pure function of ``rounding_seed``, the
            param's count of stochastic steps (``state[p]["rounding_step"]``, a one-element int64 tensor on
            its device, as torch keeps ``step``), the tensor's position in the step and the element's index:
            the same on any thread count, on CPU and CUDA, after a resume, captured and under
            ``torch.compile``. ``"kahan"`` keeps a bf16 compensation per param
            (``state[p]["kahan_compensation"]``, 2 bytes per element): the weight is param + compensation,
            the param takes the update rounded to nearest and the compensation what that rounding dropped, so
            small updates accumulate until they move the param (deterministic; the buffer is rounded to
            nearest). Other params of the group are unaffected; fp16 params need master weights.
        rounding_seed: The seed of stochastic rounding (an int in [0, 2**53)).
        capturable: Keep every per-step value on the params' device, so that a step can be captured in a CUDA
            graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) and replayed. Each group's
            lr becomes a 0-d float64 tensor on that device, a view of one ``[groups]`` tensor
            (:meth:`lr_tensor`) that the kernel reads there; fill it in place to change the lr without a
            sync (an lr assigned as a number is copied into it at the next step). ``WarmupLR`` then runs
            its schedule on the device. After the first step (which creates the momentum buffers) a step
            reads nothing back to the host. All params must be on one device. ``state_dict()`` saves the
            lrs as numbers, so checkpoints are those of a plain step.
        foreach: ``torch.optim.SGD``'s choice of implementation, accepted so that code and configs written
            for it work unchanged; it chooses nothing here, where every step runs the fused kernel
            (``backend`` chooses between it and the reference).
        fused: As ``foreach``: accepted, choosing nothing.
        differentiable: Only False: the fused step writes the params in place, outside autograd
            (``torch.optim.SGD(differentiable=True)`` differentiates through steps).

    Attributes:
        last_step_applied: Whether the last ``step()`` changed the parameters: ``True``, or under a
            GradScaler a 0-d bool tensor on the params' device, computed from ``found_inf`` there
            (reading it synchronizes on CUDA; a capturable optimizer writes the same tensor every step).
            ``WarmupLR`` reads it so that skipped steps do not advance the schedule.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        wd_after_momentum: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        backend: str = "auto",
        lars: bool = False,
        trust_coefficient: float = 0.001,
        lars_eps: float = 0.0,
        trust_clip: bool = False,
        lars_denominator: str = "grad_plus_decay",
        always_adapt: bool = True,
        lars_zero_norm: str = "unit_ratio",
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
        update_rounding: str = "nearest",
        rounding_seed: int = 0,
        capturable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        _abi.check_flag("set_grad_none", set_grad_none)
        _abi.check_flag("capturable", capturable)
        if backend not in _backends.BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}; choose one of {_backends.BACKENDS}.")
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                f"{torch.typename(params)}: pass [tensor] (or model.parameters())."
            )
        params = list(params)
        if not params:
            raise ValueError(
                "FusedSGD got an empty parameter list: pass model.parameters() (or parameter groups) "
                "containing at least one tensor; check that not every parameter is frozen or filtered out."
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            wd_after_momentum=wd_after_momentum,
            master_weights=master_weights,
            lars=lars,
            trust_coefficient=trust_coefficient,
            lars_eps=lars_eps,
            trust_clip=trust_clip,
            lars_denominator=lars_denominator,
            always_adapt=always_adapt,
            lars_zero_norm=lars_zero_norm,
            max_grad_norm=max_grad_norm,
            max_grad_value=max_grad_value,
            update_rounding=update_rounding,
            rounding_seed=rounding_seed,
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
        )
        _abi.check_group(defaults)
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self._steps = _step.Steps(backend)
        self._checked_hparams: list[tuple[Any, ...]] | None = None
        # A dict, updated in place: dynamo replays dict updates of a traced step, not attribute stores.
        self._last_step: dict[str, Tensor | bool] = {"applied": True}
        # capturable: every group's lr a view of one float64 tensor on the params' device.
        self._lrs = LrStorage() if capturable else None
        super().__init__(params, defaults)
        if self._lrs is not None:
            self._lrs.bind(self.param_groups)

    @property
    def backend(self) -> str:
        return self._steps.backend

    @property
    def last_backends(self) -> dict[str, str]:
        """Which implementation ran each bucket of the last step, by "device/dtype": "compiled" (our kernel),
        "compiled (kept plan)" (a plan kept from an earlier step, its arguments held in C++), "reference"
        (plain PyTorch) or "cuda_emulated" (the CUDA kernels on the CPU, under emulation)."""
        return self._steps.last_backends

    @property
    def last_step_applied(self) -> Tensor | bool:
        return self._last_step["applied"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validates the group's hyperparameters, alone and beside the other groups', and its devices before
        adding it (nothing added on error)."""
        _abi.check_groups([*self.param_groups, {**self.defaults, **param_group}])
        params = param_group["params"]
        # Materialized once: a generator (model.parameters()) would be used up by the checks below.
        params = param_group["params"] = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        devices = {p.device for p in tensors if isinstance(p, Tensor)}
        if len(devices) > 1:
            raise ValueError(
                f"All parameters of one group must be on one device, got {sorted(map(str, devices))}: "
                "move the model to one device before building the optimizer, or use one group per device."
            )
        if len({id(p) for p in tensors}) != len(tensors):
            # torch.optim only warns; in one fused call a repeated tensor would be updated twice at once.
            raise ValueError("A parameter group lists the same parameter twice: pass each parameter once.")
        if self._lrs is not None:
            self._lrs.check_device(devices)
        super().add_param_group(param_group)
        _zero.register_given(tensors)
        self._steps.kept = None
        if self._lrs is not None and self._lrs.tensor is not None:
            self._lrs.bind(self.param_groups)

    def lr_tensor(self) -> Tensor:
        """The groups' lrs as one float64 ``[groups]`` tensor on the params' device, which a capturable step
        reads (each ``group["lr"]`` is a view of it). An lr the user replaced (a number, another tensor) is
        copied into it first, and its group's ``lr`` is the view again."""
        if self._lrs is None:
            raise RuntimeError(
                "lr_tensor() is the lr storage of capturable steps: pass FusedSGD(capturable=True)."
            )
        return self._lrs.of(self.param_groups)

    def schedule_lrs(self, position: Tensor, schedule: Tensor, peaks: Tensor, advance: bool) -> None:
        """Runs the ``schedule_lrs`` op on this capturable optimizer's lrs (``WarmupLR``'s device schedule):
        after an applied step (``last_step_applied``, read on the device) the position advances and every lr
        becomes f(position) of its group's peak."""
        lrs = self.lr_tensor()
        ops = _backends.implementation(self.backend, lrs.device)[1]
        applied = self.last_step_applied
        ops.schedule_lrs(lrs, position, schedule, peaks, None if applied is True else applied, advance)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults, state and groups; keep our settings too.
        return {
            **super().__getstate__(),
            "set_grad_none": self.set_grad_none,
            "capturable": self.capturable,
            "_steps": _step.Steps(self.backend),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also called by load_state_dict, with the state and groups only
        if (
            "_steps" in state
        ):  # unpickled: its params are new tensors (an engine's, after load_state_dict, not)
            _zero.register_given(p for group in self.param_groups for p in group["params"])
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("_lrs", LrStorage() if self.capturable else None)  # bound at the first step
        self._steps.kept = None
        self._checked_hparams = None
        self._last_step = {"applied": True}

    def _check_groups(self) -> None:
        """Validates the groups' hyperparameters when they changed since the last check: a group dict can
        be edited at any time, and a bad value must fail before anything is written."""
        values = [tuple(map(group.get, self.defaults)) for group in self.param_groups]
        if not _same_values(values, self._checked_hparams):
            _abi.check_groups(self.param_groups)
            self._checked_hparams = values

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears gradients; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step.

        Under a GradScaler (``optimizer.grad_scale`` / ``optimizer.found_inf`` set by it), gradients are
        unscaled inside the kernel and a step with ``found_inf`` changes nothing at all (see
        ``last_step_applied``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()  # first: a refused lr must not reach the lr storage
        lrs = self.lr_tensor() if self._lrs is not None else stacked_lrs(self.param_groups)
        found_inf: Tensor | int | None = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # GradScaler sums no per-device flags to the int 0 when no param of this optimizer has a grad.
            found_inf = torch.tensor(float(found_inf))
        inputs = StepInputs(
            _abi.table(self.param_groups, lr_on_device=lrs is not None),
            _abi.step_row(
                self.param_groups, grad_scale=getattr(self, "grad_scale", None), found_inf=found_inf, lrs=lrs
            ),
        )
        applied = True if found_inf is None else self._applied(found_inf)
        self._steps.step(self.param_groups, self.state, inputs)
        self._last_step["applied"] = applied  # set once the step went through: a refused one changes nothing
        return loss

    def _applied(self, found_inf: Tensor) -> Tensor:
        """``found_inf == 0`` as a 0-d bool; a capturable step writes it into the same tensor every step."""
        if not self.capturable:
            return (found_inf == 0).reshape(())
        applied = self._last_step.get("applied_buffer")
        if not isinstance(applied, Tensor) or applied.device != found_inf.device:
            applied = self._last_step["applied_buffer"] = torch.empty(
                (), dtype=torch.bool, device=found_inf.device
            )
        return torch.eq(found_inf.reshape(()), 0, out=applied)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict; a capturable optimizer's lrs (and the ``initial_lr`` a scheduler keeps)
        are saved as numbers, read from the device."""
        state = super().state_dict()
        return as_numbers(state) if self.capturable else state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads optimizer state, validating shapes first (nothing changes on error).

        A state dict grouped differently from this optimizer (for example ``torch.optim.SGD``'s single
        group where ``param_groups`` makes two) is remapped by parameter name; this optimizer's group
        hyperparameters are kept in that case.

        Keeps fp32 master weights and fp32 momentum of master-weighted params in fp32, and the counts of
        stochastic steps in int64 (torch's loader would cast them to the param's dtype), as the loaded groups
        ask, and fills hyperparameters that a ``torch.optim.SGD`` checkpoint lacks (``lars``,
        ``master_weights``, ...) from the current groups.

        Hooks work as in torch, for every dtype: ``register_load_state_dict_pre_hook`` hooks run first and
        what they return or edit is what is checked and loaded; post hooks run once the state is in place,
        fp32 masters and buffers included.
        """
        _state_dict.load(self, state_dict, super().load_state_dict)
