"""What a run logs beside its loss and accuracy, to every logger: the gradient norm (the step's own, or an
extra pass where asked), each epoch's time and the model's parameter counts."""

from __future__ import annotations

from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["TrainMetrics"]


class TrainMetrics(pl.Callback):
    """Logs ``train/grad_norm``, ``train/epoch_time_s``, ``model/params_total`` and
    ``model/params_trainable``.

    - ``train/grad_norm``, each optimizer step: the L2 norm of every unscaled gradient the step took. Where
      the step clips by norm (``trainer.gradient_clip_val``, or the optimizer's own ``max_grad_norm``) or uses
      LARS (whose norm pass takes it), it is the norm the step computed itself (FusedSGD's ``last_grad_norm``,
      on the device), at no cost. Elsewhere
      only with ``log_grad_norm``: an extra pass over the gradients before the step (``get_total_norm``, on
      the device: no host sync), which reads each gradient once more, 4 bytes a parameter for fp32 gradients
      where SGD with momentum moves about 20.
    - ``train/epoch_time_s``, at each epoch's end: its wall time, from its first batch to the end of the
      validation that closes it.
    - ``model/params_total`` and ``model/params_trainable``, once when training starts: the model's
      parameters, and those that require gradients.

    Args:
        log_grad_norm: Take the gradient norm where the step takes none (the extra pass above).
    """

    def __init__(self, log_grad_norm: bool = False) -> None:
        self.log_grad_norm = log_grad_norm
        self._extra_norm: torch.Tensor | None = None
        self._step_took_norm = False  # whether the last step computed a norm itself
        self._last_step = 0
        self._epoch_start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # > 0 when resuming
        params = list(pl_module.parameters())
        counts = {
            "model/params_total": float(sum(p.numel() for p in params)),
            "model/params_trainable": float(sum(p.numel() for p in params if p.requires_grad)),
        }
        for logger in trainer.loggers:
            logger.log_metrics(counts, step=trainer.global_step)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("train/epoch_time_s", perf_counter() - self._epoch_start, on_step=False, on_epoch=True)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The extra pass where the last step computed no norm (the first step's norm is taken both ways).
        self._extra_norm = None
        if self.log_grad_norm and not self._step_took_norm:
            self._extra_norm = _unscaled_grad_norm(trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step after this batch
            return
        self._last_step = trainer.global_step
        norm = getattr(trainer.optimizers[0], "last_grad_norm", None)
        self._step_took_norm = norm is not None
        if norm is None:
            norm = self._extra_norm
        if norm is not None:
            pl_module.log("train/grad_norm", norm.float(), on_step=True, on_epoch=False)


def _unscaled_grad_norm(
    trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
) -> torch.Tensor | None:
    """The L2 norm of the module's gradients as the step will take them, unscaled; None where no param has one
    (DeepSpeed keeps the gradients in its own partitions)."""
    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        # Lightning has unscaled other optimizers' gradients before this hook; an optimizer that unscales them
        # itself (FusedSGD) still holds them scaled. The scale as a device tensor: get_scale() reads it back.
        norm = norm / scaler._scale
    return norm
