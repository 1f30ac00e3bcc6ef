"""FusedSGDScheduleFree: schedule-free SGD, a drop-in ``schedulefree.SGDScheduleFree`` whose step is one
fused pass in FusedSGD's kernels."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi
from lightning_fusedsgd.optim.sgd import FusedSGD

# The scalars a group holds (as schedulefree's groups do), views of the device tensor (ScheduleFreeScalars).
_IN_GROUPS = tuple(name for name in _abi.SCHEDULE_FREE_SCALARS if name in _abi.GROUP_STATE)

_NOT_IN_TRAIN_MODE = (
    "Optimizer was not in train mode when step is called. Please insert .train() and .eval() calls on the "
    "optimizer. See documentation for details. (Under Lightning, the ScheduleFreeModes callback, which every "
    "Trainer gets, makes them: the optimizer is in eval mode outside a fit's training.)"
)


class FusedSGDScheduleFree(FusedSGD):
    """Schedule-free SGD (Defazio et al. 2024, "The Road Less Scheduled") in one fused pass per bucket: a
    drop-in ``schedulefree.SGDScheduleFree`` (same arguments, defaults, ``train()`` / ``eval()``, refusals,
    state format and, in fp32 and fp64, bits), with FusedSGD's clipping, GradScaler unscaling and fp32 master
    weights in the same call. No lr schedule: a linear warmup (``warmup_steps``) and the average do its work.

    The parameters hold ``y`` while training (``train()``) and their average ``x`` otherwise (``eval()``: for
    evaluation and checkpoints); a step in eval mode is refused. The optimizer starts in eval mode, as
    schedulefree's does; under Lightning the
    :class:`~lightning_fusedsgd.lightning.ScheduleFreeModes` callback, which every Trainer gets, switches at
    the right hooks.

    The update of each element, in y (the params in train mode) and z (``state[p]["z"]``), x never formed
    (``ops/csrc/sgd_math.h``: ``schedule_free_element``; the scalars in ``schedule_free.h``)::

        g <- clip(g / scale) + wd y                   (decay taken at y)
        lr_t = lr min(1, (k + 1) / warmup_steps)      (k: the applied steps before this one)
        c = w_k / (w_0 + ... + w_k),  w_k = (k + 1)^r max(lr_0..lr_t)^weight_lr_power
        y <- (1 - c) y + c z + lr_t (momentum (1 - c) - 1) g
        z <- z - lr_t g
        x = (y - (1 - momentum) z) / momentum         (eval() puts x in the params, train() y back)

    Example::

        optimizer = FusedSGDScheduleFree(param_groups(model, weight_decay=5e-4), lr=1.0, warmup_steps=500)
        optimizer.train()
        ...  # training steps
        optimizer.eval()  # x, for validation and checkpoints

    Args:
        params: Parameters, named parameters, or parameter-group dicts.
        lr: Learning rate (after warmup); 1.0 by default, as ``schedulefree.SGDScheduleFree``.
        momentum: The interpolation between the average ``x`` and the SGD sequence ``z``, in (0, 1).
        weight_decay: Coupled L2 penalty, taken at ``y``.
        warmup_steps: Steps of linear lr warmup.
        r: Polynomial weighting of the average, ``(k + 1) ** r``.
        weight_lr_power: The average's weights are ``lr_max ** weight_lr_power`` (0: unweighted).
        foreach: Accepted as schedulefree takes it (its default, True, too, so the groups match); chooses
            nothing (every step runs the kernel).
        master_weights: fp32 master weights and ``z`` for bf16/fp16 params (``state[p]["master_param"]``).
        update_rounding: How bf16 params without master weights take their update (FusedSGD's).
        rounding_seed: The seed of stochastic rounding.
        max_grad_norm: Clip by the global norm of every gradient inside the step (one value for every group).
        max_grad_value: Clip each gradient element (per group).
        set_grad_none: Default of ``zero_grad(set_to_none=...)``.
        backend: ``"auto"``, ``"compiled"`` or ``"reference"`` (the same math in plain PyTorch).
        capturable: Keep the lrs on the params' device too (the schedule-free scalars always are), for CUDA
            graphs.

    Its per-group scalars (``k``, ``lr_max``, ``weight_sum``, ``scheduled_lr``) live on the params' device,
    each group's a 0-d tensor there, advanced by the step without a host sync (a captured step replays them);
    a state dict holds them as numbers, as schedulefree's does. The guide: docs/guide/schedule_free.md.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        r: float = 0.0,
        weight_lr_power: float = 2.0,
        foreach: bool | None = True,
        *,
        master_weights: bool = False,
        update_rounding: str = "nearest",
        rounding_seed: int = 0,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
        set_grad_none: bool = True,
        backend: str = "auto",
        capturable: bool = False,
    ) -> None:
        arguments = dict(locals())
        # FusedSGD's options that schedule-free SGD does not take stay at FusedSGD's defaults (off).
        fused_sgd = {
            name: parameter.default
            for name, parameter in inspect.signature(FusedSGD.__init__).parameters.items()
        }
        defaults = _abi.defaults(fused_sgd | arguments | {"schedule_free": True}) | _abi.GROUP_STATE
        self._scalars = ScheduleFreeScalars()
        self._start(params, defaults, set_grad_none, backend, capturable)

    @torch.no_grad()
    def train(self) -> None:
        """Puts the parameters at ``y``, where the gradients are taken (a no-op in train mode)."""
        self._switch(train=True)

    @torch.no_grad()
    def eval(self) -> None:
        """Puts the parameters at ``x``, the average to evaluate and save (a no-op in eval mode)."""
        self._switch(train=False)

    @property
    def training(self) -> bool:
        """Whether every group is in train mode (the parameters hold ``y``)."""
        return all(group["train_mode"] for group in self.param_groups)

    def _switch(self, train: bool) -> None:
        """The groups not in the mode asked for, switched in one pass over each weight and its ``z`` (a kind
        of step on the one step path: ``_step.Steps.switch``), checked and planned before anything is
        written; a param without a ``z`` (never stepped) is at ``x = y`` already."""
        switching = [i for i, group in enumerate(self.param_groups) if bool(group["train_mode"]) != train]
        if not switching:
            return
        self._group_checks(self.param_groups, self.defaults)
        self._steps.switch(self.param_groups, self.state, switching, train)
        for index in switching:
            self.param_groups[index]["train_mode"] = train

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One schedule-free step (refused in eval mode, as schedulefree refuses it); see FusedSGD.step."""
        if not self.training:
            raise RuntimeError(_NOT_IN_TRAIN_MODE)
        return super().step(closure)

    def _schedule_free_scalars(self) -> Tensor:
        return self._scalars.of(self.param_groups)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_scalars", ScheduleFreeScalars())

    def state_dict(self) -> dict[str, Any]:
        """FusedSGD's state dict, the groups' scalars as numbers (read from the device), as schedulefree saves
        them."""
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in _IN_GROUPS:
                if isinstance(group.get(key), Tensor):
                    group[key] = int(group[key]) if key == "k" else float(group[key])
        return state


class ScheduleFreeScalars:
    """The groups' schedule-free scalars on the params' device: one float64
    ``[len(SCHEDULE_FREE_SCALARS), groups]`` tensor, the ``schedule_free_scalars`` op's, of which each group's
    ``k``, ``lr_max``, ``weight_sum`` and ``scheduled_lr`` are 0-d views (as a capturable optimizer's lrs
    are); a value replaced in a group (a loaded state dict, the user) is copied in at the next :meth:`of`."""

    def __init__(self) -> None:
        self.tensor: Tensor | None = None
        self.views: list[dict[str, Tensor]] = []

    def of(self, groups: Sequence[dict[str, Any]]) -> Tensor:
        """The scalars of ``groups``, bound anew where groups were added or the params moved."""
        device = groups[0]["params"][0].device
        if self.tensor is None or len(self.views) != len(groups) or self.tensor.device != device:
            self._bind(groups, device)
            return self.tensor
        for group, views in zip(groups, self.views):
            for key, view in views.items():
                if group[key] is not view:
                    view.copy_(torch.as_tensor(group[key], dtype=torch.float64))
                    group[key] = view
        return self.tensor

    def _bind(self, groups: Sequence[dict[str, Any]], device: torch.device) -> None:
        rows = [
            [float(group[name]) if name in _IN_GROUPS else 0.0 for group in groups]
            for name in _abi.SCHEDULE_FREE_SCALARS
        ]
        self.tensor = torch.tensor(rows, dtype=torch.float64, device=device)
        self.views = [
            {
                name: self.tensor[row, g]
                for row, name in enumerate(_abi.SCHEDULE_FREE_SCALARS)
                if name in _IN_GROUPS
            }
            for g in range(len(groups))
        ]
        for group, views in zip(groups, self.views):
            group.update(views)
