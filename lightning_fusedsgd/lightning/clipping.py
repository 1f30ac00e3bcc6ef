"""Clipping inside the fused step under Lightning: ``Trainer(gradient_clip_val=...)`` with FusedSGD.

Lightning clips in Python before the optimizer step, and its mixed-precision plugins refuse clipping for an
optimizer that unscales gradients itself (``_step_supports_amp_scaling``, as FusedSGD does): under
``16-mixed`` and ``bf16-mixed`` a ``gradient_clip_val`` would raise. The supported way to change how a module
clips is its ``configure_gradient_clipping`` hook, which Lightning calls once per optimizer step with the
trainer's clip settings: :func:`clip_gradients` is that hook for FusedSGD, handing the threshold to the
optimizer. :func:`clip_in_the_step` (the one place this is done) binds it on a module instance unless its
class defines its own hook, and two things call it: :func:`configure_fused_sgd
<lightning_fusedsgd.lightning.configure_fused_sgd>`, and the :class:`ClipInTheStep` callback, which Lightning
adds to every ``Trainer`` through this package's ``lightning.pytorch.callbacks_factory`` entry point and which
binds the hook when a FusedSGD is trained. So a module that builds FusedSGD itself, and a LightningCLI run
that names it (``--optimizer lightning_fusedsgd.FusedSGD``), clip in the step with no code. Modules of the
older ``pytorch_lightning`` package, which reads its own entry points, add one line to their class:
``configure_gradient_clipping = lightning_fusedsgd.lightning.clip_gradients``."""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_fusedsgd import _abi
from lightning_fusedsgd.lightning._wrapped import fused_sgd_of
from lightning_fusedsgd.lightning.deepspeed import AttachDeepSpeed
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.lightning.schedule_free import ScheduleFreeModes
from lightning_fusedsgd.optim import FusedSGD

__all__ = ["ClipInTheStep", "callbacks", "clip_gradients", "clip_in_the_step", "package_callbacks"]

# The clip thresholds (_abi.clip_thresholds' values, in order) each FusedSGD holds because a Trainer handed
# them over, not its own.
_HANDED_OVER: weakref.WeakKeyDictionary[FusedSGD, tuple[float | None, ...]] = weakref.WeakKeyDictionary()


def clip_gradients(
    module: Any,
    optimizer: torch.optim.Optimizer,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
) -> None:
    """Lightning's gradient clipping, done inside FusedSGD's step: a ``configure_gradient_clipping``.

    Lightning's ``MixedPrecision.clip_gradients`` refuses every optimizer that unscales gradients itself
    (``_step_supports_amp_scaling``, as FusedSGD), under ``16-mixed`` and ``bf16-mixed`` alike. For a
    FusedSGD this hands the threshold to the optimizer instead (its group key of the algorithm's name, on
    every group), and the step that follows clips the unscaled gradients in the kernel: one fused call under
    every precision, no extra pass over the gradients in Python. Lightning calls it once per optimizer
    step, so with ``accumulate_grad_batches`` the accumulated gradient is clipped. Other optimizers go
    through Lightning's own ``clip_gradients``.

    The Trainer and the optimizer each may say how to clip; one rule decides:

    - a Trainer that does not clip (``gradient_clip_val`` None or 0) leaves the optimizer's own settings as
      they are (a FusedSGD built with a clip threshold keeps clipping), and takes back a threshold it handed
      over;
    - a Trainer threshold goes into an optimizer with no clipping of its own;
    - a Trainer threshold and the optimizer's own clipping must be the same, else :class:`ConfigError` before
      the step;
    - under ``DeepSpeedStrategy`` DeepSpeed clips (Lightning puts ``gradient_clip_val`` in its config), so the
      optimizer is left alone; its own clipping beside DeepSpeed's is refused when the fit starts
      (:class:`~lightning_fusedsgd.lightning.deepspeed.AttachDeepSpeed`).

    ``configure_fused_sgd`` and the :class:`ClipInTheStep` callback install it on the module unless the
    module's class defines its own ``configure_gradient_clipping`` (:func:`clip_in_the_step`); a module of the
    older ``pytorch_lightning`` package that builds FusedSGD itself adds one line to its class::

        configure_gradient_clipping = lightning_fusedsgd.lightning.clip_gradients

    Args:
        module: The LightningModule being trained.
        optimizer: The optimizer about to step.
        gradient_clip_val: Clip threshold (``trainer.gradient_clip_val``); None or 0: the Trainer does not
            clip.
        gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.

    Raises:
        ConfigError: If the algorithm is neither ``"norm"`` nor ``"value"``, or the Trainer's clipping and the
            optimizer's own disagree.
    """
    fused = fused_sgd_of(optimizer)
    if fused is None:
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return
    keys = _abi.clip_thresholds()
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm or "norm"))
    if algorithm not in keys:
        raise ConfigError(
            f"gradient_clip_algorithm must be one of {tuple(keys)}, got {gradient_clip_algorithm!r}"
        )
    if isinstance(module.trainer.strategy, DeepSpeedStrategy):
        # DeepSpeed clips, by the value Lightning put in its config; AttachDeepSpeed refused a second clipper.
        return
    threshold = float(gradient_clip_val) if gradient_clip_val else None
    wanted = tuple(threshold if clips == algorithm else None for clips in keys)
    settings = [tuple(group[key] for key in keys.values()) for group in fused.param_groups]
    handed = _HANDED_OVER.get(fused)
    unclipped = (None,) * len(keys)
    own = sorted({s for s in settings if s != unclipped and s != handed}, key=str)
    if own:
        if threshold is None or all(s == wanted for s in settings):
            return
        raise ConfigError(
            f"Trainer(gradient_clip_val={gradient_clip_val}, gradient_clip_algorithm={algorithm!r}) and the "
            f"optimizer's own clipping ({_describe(own, keys.values())}) disagree: set one of them "
            "(gradient_clip_val=None or 0 leaves the optimizer's clipping as it is), or the same in both."
        )
    for group in fused.param_groups:
        group.update(zip(keys.values(), wanted))
    if threshold is None:
        _HANDED_OVER.pop(fused, None)
    else:
        _HANDED_OVER[fused] = wanted


def _describe(settings: list[tuple[float | None, ...]], keys: Iterable[str]) -> str:
    keys = tuple(keys)
    return ", ".join(
        f"{key}={value}" for setting in settings for key, value in zip(keys, setting) if value is not None
    )


def clip_in_the_step(module: Any) -> None:
    """Makes :func:`clip_gradients` the module's ``configure_gradient_clipping`` unless its class defines its
    own; for a module of ``lightning.pytorch`` and of the older ``pytorch_lightning`` package alike."""
    defaults = {
        package.LightningModule.configure_gradient_clipping
        for package in (pl, sys.modules.get("pytorch_lightning"))
        if package is not None
    }
    if getattr(type(module), "configure_gradient_clipping", None) in defaults:
        module.configure_gradient_clipping = types.MethodType(clip_gradients, module)


class ClipInTheStep(pl.Callback):
    """Clips inside FusedSGD's step whatever built the optimizer: when a fit starts with a FusedSGD among the
    trainer's optimizers, :func:`clip_in_the_step` makes :func:`clip_gradients` the module's
    ``configure_gradient_clipping`` (unless its class defines one). Every ``Trainer`` gets it through this
    package's ``lightning.pytorch.callbacks_factory`` entry point (:func:`callbacks`); with no FusedSGD it
    does nothing.

    Its state in a checkpoint is the threshold a Trainer handed to the optimizer, which the optimizer's groups
    hold beside its own settings: a resumed fit tells the two apart as the interrupted one did (a resume with
    ``gradient_clip_val=None`` stops clipping, where the optimizer had no clipping of its own)."""

    def __init__(self) -> None:
        self._optimizer: FusedSGD | None = None
        self._restored: tuple[float | None, float | None] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._optimizer = next(filter(None, map(fused_sgd_of, trainer.optimizers)), None)
        if self._optimizer is not None:
            clip_in_the_step(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint's optimizer state is loaded: its groups hold what the Trainer had handed over.
        if self._restored is not None and self._optimizer is not None:
            _HANDED_OVER[self._optimizer] = self._restored
        self._restored = None

    def state_dict(self) -> dict[str, Any]:
        handed = None if self._optimizer is None else _HANDED_OVER.get(self._optimizer)
        return {} if handed is None else {"handed_over": list(handed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        handed = state_dict.get("handed_over")
        self._restored = None if handed is None else (handed[0], handed[1])


CALLBACKS_ENV = "LIGHTNING_FUSEDSGD_CALLBACKS"
"""``0`` (or ``false``, ``no``, ``off``): the entry point adds no callback to Lightning's Trainers."""


def callbacks() -> list[pl.Callback]:
    """The callbacks Lightning adds to every ``Trainer`` (the package's
    ``lightning.pytorch.callbacks_factory`` entry point): :func:`package_callbacks`, or none where
    ``LIGHTNING_FUSEDSGD_CALLBACKS=0`` (Lightning has no switch of its own for a package's callbacks).

    Raises:
        ConfigError: If the variable holds another value than 0/1, false/true, no/yes or off/on.
    """
    setting = os.environ.get(CALLBACKS_ENV, "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return []
    if setting not in ("1", "true", "yes", "on", ""):
        raise ConfigError(
            f"{CALLBACKS_ENV}={os.environ[CALLBACKS_ENV]!r}: set it to 0 (Lightning's Trainers get none of "
            "lightning_fusedsgd's callbacks) or 1 (they do, the default)"
        )
    return package_callbacks()


def package_callbacks() -> list[pl.Callback]:
    """Clipping in FusedSGD's step, its norms under DeepSpeed, schedule-free SGD's modes; each does nothing in
    a fit whose optimizer is no FusedSGD."""
    return [ClipInTheStep(), AttachDeepSpeed(), ScheduleFreeModes()]
