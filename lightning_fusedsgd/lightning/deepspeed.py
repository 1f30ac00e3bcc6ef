"""FusedSGD under Lightning's ``DeepSpeedStrategy``: the :class:`AttachDeepSpeed` callback, which every
``Trainer`` gets, hands the strategy's engine to :func:`~lightning_fusedsgd.attach_deepspeed`, so that LARS
and clipping by the global norm take exact norms from ZeRO's flat partitions (docs: scaling, "DeepSpeed")."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_fusedsgd.lightning._wrapped import fused_sgd_of
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.optim import attach_deepspeed

__all__ = ["AttachDeepSpeed"]


class AttachDeepSpeed(pl.Callback):
    """When a fit under ``DeepSpeedStrategy`` starts, attaches its engine to the FusedSGD it wraps
    (:func:`~lightning_fusedsgd.attach_deepspeed`), which refuses there what the engine's partitions cannot
    give. Elsewhere, and with another optimizer, it does nothing."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) and any(map(fused_sgd_of, trainer.optimizers)):
            try:
                attach_deepspeed(strategy.deepspeed_engine)
            except ValueError as error:  # the configuration's to fix: train.py reports it in one line
                raise ConfigError(str(error)) from error
