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

import sys
import types
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.optim import FusedSGD

__all__ = ["ClipInTheStep", "callbacks", "clip_gradients", "clip_in_the_step"]


def clip_gradients(
    module: Any,
    optimizer: torch.optim.Optimizer,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
) -> None:
    """Lightning's gradient clipping, done inside FusedSGD's step: a ``configure_gradient_clipping``.

    Lightning's ``MixedPrecision.clip_gradients`` refuses every optimizer that unscales gradients itself
    (``_step_supports_amp_scaling``, as FusedSGD), under ``16-mixed`` and ``bf16-mixed`` alike. For a
    FusedSGD this hands the threshold to the optimizer instead (``max_grad_norm`` or ``max_grad_value`` on
    every group), and the step that follows clips the unscaled gradients in the kernel: one fused call under
    every precision, no extra pass over the gradients in Python. Lightning calls it once per optimizer
    step, so with ``accumulate_grad_batches`` the accumulated gradient is clipped. Other optimizers go
    through Lightning's own ``clip_gradients``. With no ``gradient_clip_val`` (None) the optimizer's own
    clipping settings are left as they are.

    ``configure_fused_sgd`` and the :class:`ClipInTheStep` callback install it on the module unless the
    module's class defines its own ``configure_gradient_clipping`` (:func:`clip_in_the_step`); a module of the
    older ``pytorch_lightning`` package that builds FusedSGD itself adds one line to its class::

        configure_gradient_clipping = lightning_fusedsgd.lightning.clip_gradients

    Args:
        module: The LightningModule being trained.
        optimizer: The optimizer about to step.
        gradient_clip_val: Clip threshold (``trainer.gradient_clip_val``); 0 turns clipping off.
        gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.

    Raises:
        ConfigError: If the algorithm is neither ``"norm"`` nor ``"value"``.
    """
    optimizer = getattr(
        optimizer, "optimizer", optimizer
    )  # a LightningOptimizer wraps it (its public property)
    if not isinstance(optimizer, FusedSGD):
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return
    if gradient_clip_val is None:
        return
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm or "norm"))
    if algorithm not in ("norm", "value"):
        raise ConfigError(
            f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}"
        )
    threshold = float(gradient_clip_val) or None
    for group in optimizer.param_groups:
        group["max_grad_norm"] = threshold if algorithm == "norm" else None
        group["max_grad_value"] = threshold if algorithm == "value" else None


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
    does nothing."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if any(isinstance(getattr(o, "optimizer", o), FusedSGD) for o in trainer.optimizers):
            clip_in_the_step(pl_module)


def callbacks() -> list[pl.Callback]:
    """The callbacks Lightning adds to every ``Trainer`` (the package's
    ``lightning.pytorch.callbacks_factory`` entry point)."""
    return [ClipInTheStep()]
