"""The training run behind ``train.py``: instantiate the composed config's nodes and fit."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_fusedsgd.lightning.callbacks import RunSummary
from lightning_fusedsgd.lightning.errors import ConfigError, DataNotFoundError

__all__ = ["train"]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` (``conf/train.yaml`` + a recipe + overrides) says.

    The data is checked before anything heavy is built, so a missing dataset fails in seconds.

    Args:
        cfg: The composed config, with nodes ``data``, ``model``, ``optim``, ``schedule``,
            ``trainer``, ``callbacks``, ``logger`` and keys ``name``, ``seed``, ``ckpt_path``.

    Returns:
        :class:`RunSummary`'s summary (also written to ``metrics.json``); empty on ranks other than 0.

    Raises:
        ConfigError: For a user mistake (missing data, missing checkpoint, impossible schedule...).
    """
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    try:
        datamodule.check_data()
    except DataNotFoundError as err:
        raise ConfigError(err.describe(recipe=cfg.name)) from None
    _check_ckpt_path(cfg.ckpt_path)
    _check_model_fits_data(cfg, datamodule)

    # Combined in Python: instantiate() would turn a Schedule passed as an override into a DictConfig.
    optimizer = functools.partial(instantiate(cfg.optim), schedule=instantiate(cfg.schedule))
    model = instantiate(cfg.model, optimizer=optimizer)
    callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger)
    if logger:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    return next((cb.summary for cb in callbacks if isinstance(cb, RunSummary)), {})


def _check_model_fits_data(cfg: DictConfig, datamodule: pl.LightningDataModule) -> None:
    """Catch a model/data mismatch (e.g. a recipe's model with another dataset) before any compute."""
    channels = getattr(datamodule, "in_channels", None)
    if channels is not None and channels != cfg.model.in_channels:
        raise ConfigError(
            f"{type(datamodule).__name__} gives {channels}-channel images but model.in_channels="
            f"{cfg.model.in_channels}; set model.in_channels={channels}"
        )
    classes = getattr(datamodule, "num_classes", 0)
    if classes > cfg.model.num_classes:
        raise ConfigError(
            f"{type(datamodule).__name__} has {classes} classes but "
            f"model.num_classes={cfg.model.num_classes}; set model.num_classes={classes}"
        )


def _check_ckpt_path(ckpt_path: str | None) -> None:
    """A local checkpoint path must exist (Lightning's keywords and remote URLs are left to Lightning)."""
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc") or "://" in ckpt_path:
        return
    if not Path(ckpt_path).is_file():
        raise ConfigError(
            f"ckpt_path={ckpt_path} is not a file; point it at a checkpoint, "
            "e.g. <run dir>/checkpoints/last.ckpt"
        )
