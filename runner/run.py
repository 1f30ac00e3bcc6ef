"""The training run behind ``train.py``: instantiate the composed config's nodes and fit."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lightning_fusedsgd.checkpoint import CheckpointError, read_start_checkpoint
from lightning_fusedsgd.lightning import ConfigError, EMAWeightAveraging, InitFromCheckpoint
from lightning_fusedsgd.lightning.clipping import package_callbacks
from runner.auto_resume import resolve_ckpt_path
from runner.cpu_bf16 import check_cpu_bf16_convolutions
from runner.datamodule import DataNotFoundError
from runner.interrupt import Interruption
from runner.loggers import build_loggers, check_loggers, finish_loggers, log_config
from runner.options import check_flags
from runner.overrides import applied_schedule, check_typed_overrides
from runner.resume import RefuseFinishedRun, ResumeAfterEpochEnd, ResumeInCutEpoch
from runner.slurm import requeue_signal, trainer_plugins
from runner.summary import RunSummary
from runner.targets import trusted_targets

__all__ = ["train"]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` (``conf/train.yaml`` + a recipe + overrides) says.

    The data is checked before anything heavy is built, so a missing dataset fails in seconds; the
    checkpoint to resume from (``ckpt_path``) or to start from (``init.path``) is checked against the
    model before the Trainer exists, so a wrong or damaged file fails before anything is written.

    Args:
        cfg: The composed config, with nodes ``data``, ``model``, ``optim``, ``schedule``,
            ``trainer``, ``callbacks``, ``logger``, ``init`` and keys ``name``, ``seed``, ``ckpt_path``.

    Returns:
        :class:`RunSummary`'s summary (also written to ``metrics.json``); empty on ranks other than 0.

    Raises:
        ConfigError: For a user mistake (missing data, missing checkpoint, impossible schedule...).
        CheckpointError: If the checkpoint is damaged, of another model or of the wrong kind; the
            message names the file and, for another model, the parameters.
    """
    # The paths as every reader of them takes them (data.root is its DataModule's to expand).
    cfg.ckpt_path, cfg.init.path = _expanded(cfg.ckpt_path), _expanded(cfg.init.path)
    # The flags the runner reads itself, before any constructor that would check them sees them.
    check_flags("init", weights_only=cfg.init.weights_only, trusted=cfg.init.trusted)
    check_flags("optim", schedule_free=cfg.optim.get("schedule_free", False))
    check_flags("trainer", enable_progress_bar=cfg.trainer.get("enable_progress_bar", True))
    check_loggers(cfg.get("logger"))  # a missing package fails here, before anything is built
    check_typed_overrides(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    try:
        datamodule.check_data()
    except DataNotFoundError as err:
        raise ConfigError(err.describe(recipe=cfg.name)) from None
    cfg.ckpt_path = resolve_ckpt_path(cfg)  # auto, last: the newest checkpoint of the run directories
    _check_ckpt_path(cfg.ckpt_path)

    # Combined in Python: instantiate() would turn a Schedule passed as an override into a DictConfig.
    schedule = instantiate(applied_schedule(cfg.schedule))
    optimizer = functools.partial(instantiate(cfg.optim), schedule=schedule)
    model = instantiate(cfg.model, optimizer=optimizer)
    start = _checked_start(cfg, model)
    callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None] + start
    if not cfg.trainer.get("enable_progress_bar", True):
        # Lightning refuses a progress bar callback beside enable_progress_bar=false; the config adds one.
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    callbacks += _missing_package_callbacks(callbacks)
    # A run stopped by max_steps resumes in the epoch it stopped in, or at the next one's start.
    callbacks += [ResumeInCutEpoch(), ResumeAfterEpochEnd(), RefuseFinishedRun()]
    plugins = trainer_plugins(instantiate(cfg.trainer.get("plugins")))  # SLURM: who requeues
    interruption = Interruption(requeue_signal(plugins))  # Ctrl-C, SIGTERM, requeue: saved at a step's end
    callbacks.append(interruption)
    if cfg.ema.decay is not None:
        if cfg.optim.get("schedule_free", False):
            raise ConfigError(
                f"optim=schedule_free with ema.decay={cfg.ema.decay}: schedule-free SGD's weights x are an "
                "average of its iterates already, and it keeps no second one; add ema.decay=null"
            )
        model.average = EMAWeightAveraging(**cfg.ema)
        callbacks.append(model.average)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, plugins=plugins)
    loggers = build_loggers(cfg.get("logger"))
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    check_cpu_bf16_convolutions(trainer, model, cfg.data.in_channels, cfg.data.image_size)
    log_config(loggers, OmegaConf.to_container(cfg, resolve=True))
    with warnings.catch_warnings():
        # Lightning cannot see that the DataModules resume mid-epoch exactly (their state_dict holds
        # the position in the data), so it would warn on every resume from a step checkpoint.
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before the epoch"
        )
        # lightly's view transforms (the SimCLR recipe) call torchvision's deprecated to_tensor per image.
        warnings.filterwarnings("ignore", message=r"The function `to_tensor\(\.\.\.\)` is deprecated")
        if cfg.ckpt_path is not None:  # resumed in the run dir it was saved in: its checkpoints are its own
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        except SIGTERMException:  # stopped by a signal, saved (runner.interrupt): a shell's exit status
            raise SystemExit(interruption.exit_status) from None
    finish_loggers(loggers)
    return next((cb.summary for cb in callbacks if isinstance(cb, RunSummary)), {})


def instantiate(node: Any, **kwargs: Any) -> Any:
    """Hydra's ``instantiate``, with a user mistake a constructor refuses (``ConfigError``,
    ``CheckpointError``) raised as itself, for train.py's one-line message: Hydra wraps every error of a
    target in an ``InstantiationException``. The config's targets are whitelisted for Hydra 1.4
    (``runner.targets``)."""
    try:
        with trusted_targets():
            return hydra_instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        while isinstance(cause, InstantiationException):  # a nested node's error, wrapped once per level
            cause = cause.__cause__
        if isinstance(cause, (ConfigError, CheckpointError)):
            raise cause from None
        raise


def _missing_package_callbacks(configured: list[pl.Callback]) -> list[pl.Callback]:
    """The package's callbacks (clipping in the step, DeepSpeed's norms, schedule-free modes) that neither the
    config nor an installed entry point adds: a checkout that was not pip-installed registers no entry point,
    LIGHTNING_FUSEDSGD_CALLBACKS=0 turns it off (for other Trainers: the runner's needs them), and Lightning
    refuses two of one stateful callback, so each is added once."""
    present = {type(callback) for callback in configured}
    for factory in importlib.metadata.entry_points(group="lightning.pytorch.callbacks_factory"):
        made = factory.load()()
        present.update(type(callback) for callback in (made if isinstance(made, list) else [made]))
    return [callback for callback in package_callbacks() if type(callback) not in present]


def _checked_start(cfg: DictConfig, model: pl.LightningModule) -> list[pl.Callback]:
    """Check the checkpoint the run resumes from (``ckpt_path``) or starts from (``init.path``).

    Returns:
        The callback that applies ``init.path``, if the run starts from it; else nothing.
    """
    if cfg.ckpt_path is not None:
        _check_resume_checkpoint(cfg.ckpt_path, model, scheduled=not cfg.optim.get("schedule_free", False))
        if cfg.init.path is not None:
            rank_zero_info(f"Resuming from {cfg.ckpt_path}: init.path={cfg.init.path} is not applied.")
        return []
    if cfg.init.path is None:
        return []
    init = cfg.init
    max_epochs = cfg.trainer.get("max_epochs")
    if init.start_epoch < 0 or (max_epochs not in (None, -1) and init.start_epoch >= max_epochs):
        raise ConfigError(
            f"init.start_epoch={init.start_epoch} must be >= 0 and below trainer.max_epochs={max_epochs} "
            "(the length of the whole run, the epochs before start_epoch included)"
        )
    state = read_start_checkpoint(init.path, model, weights_only=init.weights_only, trusted=init.trusted)
    return [InitFromCheckpoint(state, weights_only=init.weights_only, start_epoch=init.start_epoch)]


def _check_resume_checkpoint(ckpt_path: str, model: pl.LightningModule, scheduled: bool) -> None:
    """Read a local ``ckpt_path`` (CRCs included) and check that it is a full checkpoint of ``model``, with an
    lr scheduler's state where the run has one (``scheduled``: schedule-free runs have none)."""
    if ckpt_path in ("best", "hpc") or "://" in ckpt_path:
        return  # Lightning resolves these itself
    state = read_start_checkpoint(ckpt_path, model)  # names the file and any mismatched parameters
    if state.kind != "lightning":
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is a {state.kind} checkpoint, not one written by a Lightning run; "
            f"ckpt_path resumes this CLI's runs. Start from it with init.path={ckpt_path} instead"
        )
    if state.optimizer_state is None:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} holds no optimizer state (saved weights-only), so it cannot resume "
            f"momentum; start from its weights with init.path={ckpt_path} init.weights_only=true"
        )
    if scheduled and not state.lr_scheduler_states:
        # Lightning would raise a KeyError for a missing entry and silently restart the schedule (warmup
        # included) from step 0 for an empty one.
        raise CheckpointError(
            f"ckpt_path={ckpt_path} holds no lr scheduler state, so resuming would restart the lr schedule "
            f"from step 0; resume from a checkpoint this CLI wrote, or start from this one with "
            f"init.path={ckpt_path} init.start_epoch=<the epoch to continue at>, which replays the schedule "
            "to that epoch"
        )


def _expanded(path: str | None) -> str | None:
    """``path`` with a leading ``~`` expanded to the home folder, as a shell would have."""
    return None if path is None else os.path.expanduser(path)


def _check_ckpt_path(ckpt_path: str | None) -> None:
    """A local checkpoint path must exist (Lightning's keywords and remote URLs are left to Lightning)."""
    if ckpt_path is None or ckpt_path in ("best", "hpc") or "://" in ckpt_path:
        return
    if not Path(ckpt_path).is_file():
        raise ConfigError(
            f"ckpt_path={ckpt_path} is not a file; point it at a checkpoint, "
            "e.g. <run dir>/checkpoints/last.ckpt"
        )
