"""The run's loggers: built from the config's ``logger`` node (conf/logger/: one named logger per file, so
that ``logger=many`` or ``logger=[csv,tensorboard]`` composes several), each checked for its package before
any is built; an offline wandb run's files kept in the run dir; the config handed to each; their end."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig

from lightning_fusedsgd.lightning import ConfigError

__all__ = ["build_loggers", "check_loggers", "finish_loggers", "log_config"]

INSTALL = 'pip install -e ".[loggers]"'

# What each of Lightning's loggers needs beyond the runner's packages, by its _target_: a tuple of
# alternatives per need (TensorBoardLogger writes with tensorboard or tensorboardX).
_NEEDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "lightning.pytorch.loggers.TensorBoardLogger": (("tensorboard", "tensorboardX"),),
    "lightning.pytorch.loggers.WandbLogger": (("wandb",),),
    "lightning.pytorch.loggers.MLFlowLogger": (("mlflow",),),
}
# MLflow's SQL stores (a sqlite:/// tracking_uri, as conf/logger/mlflow.yaml's) need these, which
# mlflow-skinny does not install.
_SQL_STORE_NEEDS = (("sqlalchemy",), ("alembic",), ("cryptography",))

# Where an offline wandb run keeps what wandb writes beside the run's own files (its service's logs, its
# settings, staged data), each under <run dir>/wandb/, by the variable that moves it.
_WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data"}
# The environment as it was before an offline wandb run changed it, restored by finish_loggers.
_ENVIRONMENT_BEFORE: dict[str, str | None] = {}


def check_loggers(node: DictConfig | None) -> None:
    """Checks the ``logger`` node (name -> a logger's node; None or empty: no logger) without building
    anything (MLflow's logger creates its store when built).

    Raises:
        ConfigError: If a node is not a logger's, or a logger's package is not installed (the message names
            the logger, the package and the extra that installs it).
    """
    for name, logger in _named(node).items():
        if not isinstance(logger, DictConfig) or "_target_" not in logger:
            raise ConfigError(
                f"logger.{name} is not a logger: each entry of the logger node is a logger's node with a "
                "_target_ (conf/logger/<name>.yaml), chosen with logger=<name>, logger=[csv,tensorboard] or "
                "logger=many"
            )
        missing = _missing_package(logger)
        if missing is not None:
            raise ConfigError(
                f"logger.{name} ({logger._target_.rsplit('.', 1)[-1]}) needs the {missing} package, which is "
                f"not installed: {INSTALL}, or choose another logger (logger=csv)"
            )


def build_loggers(node: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` node, checked first (:func:`check_loggers`)."""
    check_loggers(node)
    loggers = []
    for logger in _named(node).values():
        built = instantiate(logger)
        if isinstance(built, WandbLogger) and logger.get("offline", False):
            _keep_wandb_in(Path(built.save_dir or ".") / "wandb")
        loggers.append(built)
    return loggers


def log_config(loggers: list[Logger], config: dict[str, Any]) -> None:
    """Hands every logger the resolved config as its hyperparameters (the runner's modules keep theirs out of
    the loggers: the config holds them, as its ``model`` node)."""
    for logger in loggers:
        logger.log_hyperparams(config)


def finish_loggers(loggers: list[Logger]) -> None:
    """Ends what the loggers left running: a wandb run is finished (its files complete) and wandb's service
    process stopped, and the environment an offline run changed is restored."""
    if any(isinstance(logger, WandbLogger) for logger in loggers) and "wandb" in sys.modules:
        import wandb

        wandb.finish()
        wandb.teardown()
    for variable, value in _ENVIRONMENT_BEFORE.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    _ENVIRONMENT_BEFORE.clear()


def _named(node: DictConfig | None) -> dict[str, Any]:
    """The ``logger`` node's loggers by name, those set to null left out."""
    return {name: logger for name, logger in (node or {}).items() if logger is not None}


def _missing_package(node: DictConfig) -> str | None:
    """The first package the logger of ``node`` needs that is not installed (one of the alternatives
    named ``a or b``), or None."""
    needs = _NEEDS.get(node._target_, ())
    if str(node.get("tracking_uri") or "").startswith("sqlite:"):
        needs += _SQL_STORE_NEEDS
    for alternatives in needs:
        if not any(importlib.util.find_spec(package) is not None for package in alternatives):
            return " or ".join(alternatives)
    return None


def _keep_wandb_in(directory: Path) -> None:
    """Points the files wandb writes outside its run's folder into ``directory`` and keeps it offline, its
    error reports (which would go to the network) included, for this run (:func:`finish_loggers` restores
    the environment)."""
    values = {variable: str(directory / name) for variable, name in _WANDB_DIRS.items()}
    values.update(WANDB_MODE="offline", WANDB_ERROR_REPORTING="false")
    for variable, value in values.items():
        _ENVIRONMENT_BEFORE.setdefault(variable, os.environ.get(variable))
        os.environ[variable] = value
