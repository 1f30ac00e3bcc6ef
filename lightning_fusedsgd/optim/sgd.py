"""FusedSGD and FusedLARS: drop-in ``torch.optim.SGD`` whose update runs in one compiled call per bucket."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.sgd import sgd

from lightning_fusedsgd._abi import MOMENTUM_BUFFER, ROUNDING_STEP
from lightning_fusedsgd.checkpoint import (
    check_optimizer_state_dict,
    remap_optimizer_state_dict,
    same_param_layout,
)
from lightning_fusedsgd.optim import _backends, _hparams, _kept, _step
from lightning_fusedsgd.optim._plan import (
    FP32_MASTERS,
    LOW_PRECISION,
    MASTER_STATE,
    Plan,
    bucket_name,
    check_state_shapes,
    plan_step,
)


def _store_lr(view: Tensor, lr: float | Tensor) -> None:
    """Writes an lr into its slot of a capturable optimizer's lr tensor, on the device."""
    if isinstance(lr, Tensor):
        view.copy_(lr)
    else:
        view.fill_(lr)


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


def _rounding_steps_in_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict with the counts of stochastic steps in each param's state, where a checkpoint of an
    earlier version counts them per group (``group["rounding_step"]``, the same for each of its params). The
    input is not modified."""
    groups = state_dict["param_groups"]
    if not any("rounding_step" in group for group in groups):
        return state_dict
    state = dict(state_dict["state"])
    for group in groups:
        count = group.get("rounding_step", 0)
        for index in group["params"]:
            saved = state.get(index, {})
            if count and ROUNDING_STEP not in saved:
                state[index] = {**saved, ROUNDING_STEP: torch.tensor(count, dtype=torch.int64)}
    return {
        **state_dict,
        "state": state,
        "param_groups": [{k: v for k, v in group.items() if k != "rounding_step"} for group in groups],
    }


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
            or ``"torch"`` (the reference implementation in plain PyTorch).
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
        _hparams.check_group(defaults)
        self.set_grad_none = set_grad_none
        self.backend = backend
        self._kept: _kept.KeptSteps | _kept.KeptShardedPlan | None = None
        self._checked_hparams: list[tuple[Any, ...]] | None = None
        #: Which implementation ran each bucket of the last step, by "device/dtype": "compiled" (our
        #: kernel), "compiled (kept plan)" (a plan kept from an earlier step, its arguments held in C++),
        #: "torch" (the reference) or "cuda_emulated" (the CUDA kernels on the CPU, under emulation).
        self.last_backends: dict[str, str] = {}
        # A dict, updated in place: dynamo replays dict updates of a traced step, not attribute stores.
        self._last_step: dict[str, Tensor | bool] = {"applied": True}
        self.capturable = capturable
        # capturable: every group's lr as a view of one float64 tensor on the params' device (_bind_lrs).
        self._lrs: Tensor | None = None
        self._lr_views: list[Tensor] = []
        super().__init__(params, defaults)
        if capturable:
            self._bind_lrs()

    @property
    def last_step_applied(self) -> Tensor | bool:
        return self._last_step["applied"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validates the group's hyperparameters, alone and beside the other groups', and its devices before
        adding it (nothing added on error)."""
        _hparams.check_groups([*self.param_groups, {**self.defaults, **param_group}])
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
        if self._lrs is not None and devices and devices != {self._lrs.device}:
            raise ValueError(
                f"capturable=True keeps the lrs on the params' device, {self._lrs.device}, and this group's "
                f"params are on {devices.pop()}: move them there, or use one optimizer per device."
            )
        super().add_param_group(param_group)
        self._kept = None
        if self._lrs is not None:
            self._bind_lrs()

    def lr_tensor(self) -> Tensor:
        """The groups' lrs as one float64 ``[groups]`` tensor on the params' device, which a capturable step
        reads (each ``group["lr"]`` is a view of it). An lr the user replaced (a number, another tensor) is
        copied into it first, and its group's ``lr`` is the view again."""
        if not self.capturable:
            raise RuntimeError(
                "lr_tensor() is the lr storage of capturable steps: pass FusedSGD(capturable=True)."
            )
        if self._lrs is None or len(self._lr_views) != len(self.param_groups):
            self._bind_lrs()
        for group, view in zip(self.param_groups, self._lr_views, strict=True):
            if group["lr"] is not view:
                _store_lr(view, group["lr"])
                group["lr"] = view
        return self._lrs

    def _bind_lrs(self) -> None:
        """Makes every group's lr a view of a new [groups] float64 tensor on the params' device."""
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if len(devices) != 1:
            raise ValueError(
                f"capturable=True keeps the lrs on the params' device, and these params are on "
                f"{sorted(map(str, devices))}: move the model to one device, or use one optimizer per device."
            )
        lrs = torch.empty(len(self.param_groups), dtype=torch.float64, device=devices.pop())
        self._lr_views = list(lrs.unbind())
        for group, view in zip(self.param_groups, self._lr_views, strict=True):
            _store_lr(view, group["lr"])
            group["lr"] = view
        self._lrs = lrs

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults, state and groups; keep our settings too.
        return {
            **super().__getstate__(),
            "set_grad_none": self.set_grad_none,
            "backend": self.backend,
            "capturable": self.capturable,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also called by load_state_dict, with the state and groups only
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("_lrs", None)  # unpickled: bound again at the first step
        self.__dict__.setdefault("_lr_views", [])
        self._kept = None
        self._checked_hparams = None
        self.last_backends = {}
        self._last_step = {"applied": True}

    def _check_groups(self) -> None:
        """Validates the groups' hyperparameters when they changed since the last check: a group dict can
        be edited at any time, and a bad value must fail before anything is written."""
        values = [tuple(map(group.get, self.defaults)) for group in self.param_groups]
        if not _same_values(values, self._checked_hparams):
            _hparams.check_groups(self.param_groups)
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
        lrs = self.lr_tensor() if self.capturable else _hparams.stacked_lrs(self.param_groups)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | int | None = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # GradScaler sums no per-device flags to the int 0 when no param of this optimizer has a grad.
            found_inf = torch.tensor(float(found_inf))
        applied = True if found_inf is None else self._applied(found_inf)
        # Under torch.compile the step is traced from a new plan (no kept plan, no address checks).
        tracing = torch.compiler.is_compiling()
        kept = None if tracing or self._kept is None else self._kept_buckets()
        plan = None if kept is not None else plan_step(self.param_groups, self.state, tracing)
        if (
            not tracing
            and found_inf is not None
            and (found_inf.device.type == "cpu" or (plan is not None and (plan.new_state or plan.sparse)))
            and bool(found_inf.item())
        ):
            # Skipped step: nothing is written, and no (uninitialized) buffer is stored. On CUDA this syncs
            # only on steps that would create state or step sparse gradients; otherwise the kernels skip
            # themselves.
            self._last_step["applied"] = applied
            return loss
        if kept is not None:
            buckets, sharded, names = kept
        else:
            buckets, names = self._planned_buckets(plan)
            sharded = plan.sharded
        scalars = _step.Scalars(
            _hparams.table(self.param_groups, lr_on_device=lrs is not None),
            grad_scale,
            found_inf,
            lrs,
            **_hparams.step_hparams(self.param_groups),
        )
        _step.run(buckets, scalars, sharded, [bool(group["lars"]) for group in self.param_groups])
        # Updated in place: dynamo replays in-place dict updates of a traced step, not attribute stores.
        self.last_backends.clear()
        self.last_backends.update(names)
        if plan is not None:
            self._finish(plan, grad_scale, tracing, buckets)
        self._last_step["applied"] = applied  # set once the step went through: a refused one changes nothing
        return loss

    def _kept_buckets(self) -> tuple[list[Any], bool, dict[str, str]] | None:
        """The buckets of the plan kept from an earlier step, if it still holds (else None, nothing
        changed)."""
        kept = self._kept
        if isinstance(kept, _kept.KeptSteps):
            buckets = kept.buckets_for(self.param_groups, self.state)
            if buckets is None:
                return None
            return buckets, False, {bucket_name(b.key): f"{kept.backend} (kept plan)" for b in buckets}
        plan = kept.plan_for(self.param_groups, self.state)
        if plan is None:
            return None
        buckets, names = self._planned_buckets(plan)
        return buckets, plan.sharded, names

    def _planned_buckets(self, plan: Plan) -> tuple[list[_step.PlannedBucket], dict[str, str]]:
        """The plan's buckets with the implementation that runs each, all resolved before any runs, so a
        refusal leaves every bucket untouched."""
        chosen = {key: _backends.implementation(self.backend, key[0]) for key in plan.buckets}
        buckets = [
            _step.PlannedBucket(key, bucket, ops, name)
            for key, bucket in plan.buckets.items()
            for name, ops in [chosen[key]]
        ]
        return buckets, {bucket_name(key): name for key, (name, _) in chosen.items()}

    def _finish(
        self, plan: Plan, grad_scale: Tensor | None, tracing: bool, buckets: list[_step.PlannedBucket]
    ) -> None:
        """What a new plan does after its buckets ran: sparse gradients, params updated through a copy, the
        new state; and the plan kept for the next steps where it can be."""
        if plan.sparse:
            self._step_sparse(plan.sparse, grad_scale)
        for param, dense in plan.staged:
            param.copy_(dense)
        for param, key, value in plan.new_state:
            if value is None:
                del self.state[param][key]
            else:
                self.state[param][key] = value
        if not tracing:
            ran_by = {(bucket.backend, bucket.ops) for bucket in buckets}
            kept_by = ran_by.pop() if len(ran_by) == 1 else None
            self._kept = _kept.keep(self.param_groups, self.state, plan, kept_by)

    def _step_sparse(self, sparse: list[tuple[Tensor, int]], grad_scale: Tensor | None) -> None:
        """Steps params with sparse gradients (``nn.Embedding(sparse=True)``) through torch.optim.SGD's own
        single-tensor path, with their group's hyperparameters and momentum buffers; under a GradScaler
        their gradients are unscaled first, as GradScaler.unscale_ does."""
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        for group_index in dict.fromkeys(index for _, index in sparse):
            group = self.param_groups[group_index]
            params = [param for param, index in sparse if index == group_index]
            grads = [p.grad if inv_scale is None else p.grad * inv_scale.to(p.grad.device) for p in params]
            buffers = [self.state.get(p, {}).get(MOMENTUM_BUFFER) for p in params]
            sgd(
                params,
                grads,
                buffers,
                has_sparse_grad=True,
                foreach=False,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
            )
            if group["momentum"] != 0:
                for param, buffer in zip(params, buffers):
                    self.state[param][MOMENTUM_BUFFER] = buffer

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

    def schedule_lrs(self, position: Tensor, schedule: Tensor, peaks: Tensor, advance: bool) -> None:
        """Runs the ``schedule_lrs`` op on this capturable optimizer's lrs (``WarmupLR``'s device schedule):
        after an applied step (``last_step_applied``, read on the device) the position advances and every lr
        becomes f(position) of its group's peak."""
        lrs = self.lr_tensor()
        ops = _backends.implementation(self.backend, lrs.device)[1]
        applied = self.last_step_applied
        ops.schedule_lrs(lrs, position, schedule, peaks, None if applied is True else applied, advance)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict; a capturable optimizer's lrs (and the ``initial_lr`` a scheduler keeps)
        are saved as numbers, read from the device."""
        state = super().state_dict()
        if self.capturable:
            for group in state["param_groups"]:
                for key in ("lr", "initial_lr"):
                    if isinstance(group.get(key), Tensor) and group[key].numel() == 1:
                        group[key] = float(group[key])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads optimizer state, validating shapes first (nothing changes on error).

        A state dict grouped differently from this optimizer (for example ``torch.optim.SGD``'s single
        group where ``param_groups`` makes two) is remapped by parameter name; this optimizer's group
        hyperparameters are kept in that case.

        Keeps fp32 master weights and fp32 momentum of master-weighted params in fp32, and the counts of
        stochastic steps in int64 (torch's loader would cast them to the param's dtype), and fills
        hyperparameters that a ``torch.optim.SGD`` checkpoint lacks (``lars``, ``master_weights``, ...) from
        the current groups.

        Hooks work as in torch, for every dtype: ``register_load_state_dict_pre_hook`` hooks run first and
        what they return or edit is what is checked and loaded; post hooks run once the state is in place,
        fp32 masters and buffers included.
        """
        state_dict = state_dict.copy()  # shallow, as torch: a pre-hook may edit it
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_loadable(state_dict)
        state_dict = _rounding_steps_in_state(state_dict)
        if not same_param_layout(state_dict, self.param_groups):
            # A different grouping (e.g. torch.optim.SGD's one group for our two): move state by name.
            state_dict = remap_optimizer_state_dict(state_dict, self.param_groups, source="optimizer state")
        kept_dtypes = self._state_in_its_dtypes(state_dict)
        current = [dict(group) for group in self.param_groups]
        # torch's loader casts every state tensor to its param's dtype; the hooks already ran above, and the
        # post hooks run below, once the fp32 and int64 state is back.
        pre_hooks, post_hooks = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        self._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()
        self._optimizer_load_state_dict_post_hooks = type(post_hooks)()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        self._kept = None
        for group, before in zip(self.param_groups, current):
            for key, value in before.items():
                group.setdefault(key, value)
        for param, values in kept_dtypes.items():
            self.state[param].update(values)
        self._checked_hparams = None
        for hook in post_hooks.values():
            hook(self)

    def _state_in_its_dtypes(self, state_dict: dict[str, Any]) -> dict[Tensor, dict[str, Tensor]]:
        """The state whose dtype is not its param's, as it will be stored (torch's loader would cast it to the
        param's dtype): the fp32 momentum buffers and masters of master-weighted bf16/fp16 params, and the
        int64 counts of stochastic steps; checks every state's shapes first. Whether a group keeps masters is
        the group as loaded (the saved one, or this optimizer's where the state was remapped by name), not as
        constructed."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
        ):
            return {}  # torch's loader refuses it
        id_to_param = {
            saved_id: (group_index, param_index, param)
            for group_index, (group, saved) in enumerate(zip(groups, saved_groups))
            for param_index, (saved_id, param) in enumerate(zip(saved["params"], group["params"]))
        }
        kept = {}
        for saved_id, saved_state in state_dict["state"].items():
            if saved_id not in id_to_param:
                continue
            group_index, param_index, param = id_to_param[saved_id]
            check_state_shapes(saved_state, groups[group_index], group_index, param_index, param)
            master_weights = saved_groups[group_index].get(
                "master_weights", groups[group_index]["master_weights"]
            )
            dtypes = {ROUNDING_STEP: torch.int64}
            if master_weights and param.dtype in LOW_PRECISION:
                dtypes |= {MOMENTUM_BUFFER: torch.float32, MASTER_STATE[FP32_MASTERS][0]: torch.float32}
            kept[param] = {
                key: saved_state[key].to(device=param.device, dtype=dtype, copy=True)
                for key, dtype in dtypes.items()
                if isinstance(saved_state.get(key), Tensor)
            }
        return kept

    def _check_loadable(self, state_dict: Any) -> None:
        """Refuses, before anything changes, a state dict that is not an optimizer's, holds values that
        cannot be optimizer state, or whose groups have hyperparameters FusedSGD refuses."""
        check_optimizer_state_dict(state_dict)
        groups = [
            {**self.defaults, **{k: v for k, v in group.items() if k in self.defaults}}
            for group in state_dict["param_groups"]
        ]
        for index, group in enumerate(groups):
            try:
                _hparams.check_group(group)
            except ValueError as error:
                raise ValueError(f"saved param_groups[{index}]: {error}") from None


class FusedLARS(FusedSGD):
    """FusedSGD with LARS on by default, for configs that name an optimizer class.

    Its signature is FusedSGD's with ``lars=True`` (set as ``__signature__``, which LightningCLI, Hydra and
    ``inspect`` read), so the two cannot drift. Groups can still turn LARS off per group (``lars=False``), as
    ``param_groups`` does for biases and normalization parameters.
    """

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("lars", True)
        super().__init__(params, *args, **kwargs)


def _with_default(function: Callable[..., Any], **defaults: Any) -> inspect.Signature:
    signature = inspect.signature(function)
    return signature.replace(
        parameters=[
            parameter.replace(default=defaults[name]) if name in defaults else parameter
            for name, parameter in signature.parameters.items()
        ]
    )


FusedLARS.__init__.__signature__ = _with_default(FusedSGD.__init__, lars=True)
