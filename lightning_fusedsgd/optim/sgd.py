"""FusedSGD: a drop-in ``torch.optim.SGD`` whose update runs in one compiled call per bucket."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fusedsgd import _abi, _checks
from lightning_fusedsgd.optim import _average, _backends, _state_dict, _step, _zero
from lightning_fusedsgd.optim._lrs import LrStorage, as_numbers, stacked_lrs
from lightning_fusedsgd.optim._plan import StepInputs


class FusedSGD(Optimizer):
    """SGD with momentum whose update runs in one compiled multi-tensor call per (device, dtype): a drop-in
    ``torch.optim.SGD`` (same arguments, defaults, state format and, on the plain fp32/fp64 path, bits), with
    LARS, clipping, fp32 master weights and GradScaler unscaling fused into the same call.

    The update of each element, computed in one place (``ops/csrc/sgd_math.h``: ``sgd_element``,
    ``trust_ratio``, ``averaged``; ``ops/reference.py`` mirrors it)::

        g <- sign * g / scale                         (sign -1 with maximize; scale: a GradScaler's)
        g <- clip(g)                                  (max_grad_value; max_grad_norm: g min(1, c / ||G||))
        g <- g + wd w                                 (coupled decay, unless wd_after_momentum)
        g <- r g,  r = eta ||w|| / (||g|| + wd ||w|| + eps)        (lars; lars_denominator, trust_clip)
        b <- g at the first step, else mu b + (1 - dampening) g     (momentum)
        d <- g + mu b with nesterov, else b
        d <- d + wd w                                 (wd_after_momentum)
        w <- w - lr d
        a <- w at its first update, else decay a + (1 - decay) w    (ema_decay, at the steps ema_* name)

    Example::

        optimizer = FusedSGD(param_groups(model, weight_decay=1e-4), lr=0.4, momentum=0.9, nesterov=True)

    Args:
        params: Parameters, named parameters, or parameter-group dicts (an iterable, as torch takes them).
        lr: Learning rate (float or 0-d tensor); 1e-3 by default, as ``torch.optim.SGD``.
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: Coupled L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: Maximize the objective instead of minimizing it.
        wd_after_momentum: Add the decay after the momentum update, keeping it out of the buffer
            (TransformerEngine's option).
        master_weights: fp32 master weights and momentum for bf16/fp16 params (``state[p]["master_param"]``).
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        backend: ``"auto"``, ``"compiled"`` or ``"reference"`` (the same math in plain PyTorch).
        lars: The LARS trust ratio (You et al. 2017), per group (``param_groups`` turns it off for biases
            and norms).
        trust_coefficient: LARS eta.
        lars_eps: LARS epsilon in the denominator.
        trust_clip: LARC's clip, ``r <- min(r / lr, 1)``.
        lars_denominator: ``"grad_plus_decay"`` (``||g|| + wd ||w||``) or ``"decayed_grad"``
            (``||g + wd w||``).
        always_adapt: False leaves a LARS group without weight decay unadapted (timm's switch).
        lars_zero_norm: Where a norm is 0: ``"unit_ratio"`` (a ratio of 1) or ``"plain_grad"`` (the plain
            gradient, no decay).
        max_grad_norm: Clip by the global norm of every gradient, as ``clip_grad_norm_`` does, inside the
            step (one value for every group).
        max_grad_value: Clip each gradient element, as ``clip_grad_value_`` does (per group).
        update_rounding: How bf16 params without master weights take their update: ``"nearest"``,
            ``"stochastic"`` or ``"kahan"`` (a bf16 compensation per param).
        rounding_seed: The seed of stochastic rounding (an int in [0, 2**53)).
        ema_decay: Keep an average of the weights, updated in the step, ``avg <- decay avg + (1 - decay) w``
            (``state[p]["ema"]``, fp32 beside 16-bit params); None keeps none.
        ema_every: Update the average at every n-th step (Lightning's ``update_every_n_steps``).
        ema_start: The first step (0-based) that updates the average, which copies the weights then
            (Lightning's ``update_starting_at_step``).
        ema_warmup_gamma: timm's warmup of the decay, ``min(decay, 1 - (1 + n / gamma) ** -power)`` after
            ``n`` updates; None for none.
        ema_warmup_power: The power of that warmup.
        capturable: Keep every per-step value on the params' device, for CUDA graphs
            (:meth:`lr_tensor` holds the lrs there).
        foreach: Accepted as ``torch.optim.SGD`` takes it; chooses nothing (every step runs the kernel).
        fused: As ``foreach``.
        differentiable: Only False: the step writes the params in place, outside autograd.

    Attributes:
        last_step_applied: Whether the last ``step()`` changed the parameters: ``True``, or under a
            GradScaler a 0-d bool tensor on the params' device (``WarmupLR`` reads it, so that skipped steps
            do not advance the schedule).
        last_grad_norm: The L2 norm of every gradient the last ``step()`` took, unscaled (as
            ``clip_grad_norm_`` returns it), where that step took one: the norm it clipped by
            (``max_grad_norm``, or a Trainer's ``gradient_clip_val``), else, in a LARS step, the one its LARS
            norm pass took (every tensor's gradient, the LARS tensors' from the sums their trust ratios come
            from; clipped by value where ``max_grad_value`` is set), under sharding the global one. A 0-d
            float64 tensor on the params' device, read without a host sync; None where the step took no norm
            (no extra pass over the gradients is made for it) or a GradScaler's skip ended it on the host; NaN
            where a LARS step was skipped on the device.

    The guide says the rest: semantics and bits (docs/guide/semantics.md), LARS (lars.md), clipping
    (clipping.md), precision (precision.md), capturable steps (capturable.md), backends (backends.md).
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
        ema_decay: float | None = None,
        ema_every: int = 1,
        ema_start: int = 0,
        ema_warmup_gamma: float | None = None,
        ema_warmup_power: float = 2 / 3,
        capturable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        # The group options (_abi.options()) are the arguments of their names, others their declared defaults.
        self._start(params, _abi.defaults(dict(locals())), set_grad_none, backend, capturable)

    def _start(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        set_grad_none: bool,
        backend: str,
        capturable: bool,
    ) -> None:
        """The constructor, from the groups' defaults (a subclass with other arguments makes its own)."""
        _checks.check_flag("set_grad_none", set_grad_none)
        _checks.check_flag("capturable", capturable)
        backend = _backends.checked(backend)
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                f"{torch.typename(params)}: pass [tensor] (or model.parameters())."
            )
        params = list(params)
        if not params:
            raise ValueError(
                f"{type(self).__name__} got an empty parameter list: pass model.parameters() (or parameter "
                "groups) containing at least one tensor; check that not every parameter is frozen or "
                "filtered out."
            )
        _checks.check_group(defaults)
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self._steps = _step.Steps(backend)
        self._group_checks = _checks.GroupChecks()
        # A dict, updated in place: dynamo replays dict updates of a traced step, not attribute stores. What
        # the last step leaves to read: whether it applied, its gradients' sum of squares and their scale.
        self._last_step: dict[str, Tensor | bool | None] = {"applied": True}
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

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The last step's gradient norm, where it took one (see the class's Attributes): its sum of squares,
        kept on the device, turned into the unscaled norm there when read."""
        norm: _step.StepNorm = self._last_step.get("norm", _step.StepNorm())
        if norm.unscaled_grad_sq_sum is not None:
            applied = self._last_step["applied"]
            taken = norm.unscaled_grad_sq_sum.sqrt()
            # A skipped step's norm pass took nothing (found_inf, read on the device).
            return taken if applied is True else torch.where(applied.to(taken.device), taken, torch.nan)
        if norm.grad_sq_sum is None:
            return None
        # The kernel's unscaling: GradScaler's float32 reciprocal of the scale (ops/reference.inverse_scale).
        return norm.grad_sq_sum.sqrt() * _step.inverse_scale(
            self._last_step.get("grad_scale"), norm.grad_sq_sum.device
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validates the group's hyperparameters, alone and beside the other groups', and its devices before
        adding it (nothing added on error)."""
        _checks.check_groups([*self.param_groups, {**self.defaults, **param_group}])
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
        _average.check_group(self.defaults, param_group)
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
        """The lrs a capturable step reads: one float64 ``[groups]`` tensor on the params' device, of which
        each ``group["lr"]`` is a view (an lr the user replaced is copied in first)."""
        if self._lrs is None:
            raise RuntimeError(
                "lr_tensor() is the lr storage of capturable steps: pass FusedSGD(capturable=True)."
            )
        return self._lrs.of(self.param_groups)

    def schedule_lrs(self, position: Tensor, schedule: Tensor, peaks: Tensor, advance: bool) -> None:
        """``WarmupLR``'s schedule on the device: the ``schedule_lrs`` op on :meth:`lr_tensor`, advancing
        after an applied step (``last_step_applied``, read on the device)."""
        lrs = self.lr_tensor()
        ops = _backends.implementation(self.backend, lrs.device)[1]
        applied = self.last_step_applied
        ops.schedule_lrs(lrs, position, schedule, peaks, None if applied is True else applied, advance)

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """A context in which every param with an average of its weights (``ema_decay``) holds it, for
        evaluation or export; on leaving, each holds its own values again, bit for bit (docs/guide/ema.md)."""
        yield from _average.iterate(self.averaged_params())

    def averaged_params(self) -> list[tuple[Tensor, Tensor]]:
        """Each param with an average of its weights, with it (local shards of DTensors), in group order."""
        return _average.averaged_params((p for g in self.param_groups for p in g["params"]), self.state)

    def update_average(self) -> None:
        """Updates every average once outside a step (an epoch's end under ``EMAWeightAveraging``) by
        ``torch.optim.swa_utils.get_ema_avg_fn``'s formula with its group's decay, counted as an update."""
        _average.update_outside_step(self.param_groups, self.state)

    def seed_averages(self, averages: dict[Tensor, Tensor], step: int, updates: int) -> int:
        """Gives each param whose group averages its weights but whose state has no average the one in
        ``averages`` (by param: e.g. a checkpoint's averaged model), as of ``step`` applied steps and
        ``updates`` updates, in its slot's dtype; returns how many it gave one."""
        return _average.seed(self.param_groups, self.state, averages, step, updates)

    def averaged_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` with each param's average, in its dtype: the averaged model, as
        ``torchvision`` or ``timm`` code loads it. Buffers are the module's."""
        return _average.averaged_state_dict(module, self.state)

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
        # Unpickled: its params are new tensors (after load_state_dict, an engine's are not).
        if "_steps" in state:
            _zero.register_given(p for group in self.param_groups for p in group["params"])
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("_lrs", LrStorage() if self.capturable else None)  # bound at the first step
        self._steps.kept = None
        self._group_checks = _checks.GroupChecks()
        self._last_step = {"applied": True}

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
        # First: a refused lr must not reach the lr storage.
        self._group_checks(self.param_groups, self.defaults)
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
            self._schedule_free_scalars(),
        )
        applied = True if found_inf is None else self._applied(found_inf)
        norm = self._steps.step(self.param_groups, self.state, inputs)
        self._last_step["applied"] = applied  # set once the step went through: a refused one changes nothing
        self._last_step.update(norm=norm, grad_scale=inputs.row["grad_scale"])
        return loss

    def _schedule_free_scalars(self) -> Tensor | None:
        """The per-group scalars a schedule-free step advances (FusedSGDScheduleFree); SGD has none."""
        return None

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
        """Loads optimizer state, checked first (nothing changes on error). A state dict grouped differently
        (``torch.optim.SGD``'s one group for ``param_groups``' two) is remapped by parameter name; state keeps
        its slot's dtype (fp32 masters, int64 counts); hyperparameters a ``torch.optim.SGD`` checkpoint lacks
        come from the current groups; load hooks run as in torch (docs/checkpoints.md)."""
        _state_dict.load(self, state_dict, super().load_state_dict)
