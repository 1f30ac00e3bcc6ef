"""Lightning glue for checkpoints: atomic checkpoint files and starting a fit from a foreign checkpoint.

* :class:`AtomicCheckpointIO` (``Trainer(plugins=[AtomicCheckpointIO()])``) makes every local
  checkpoint file, ``last.ckpt`` included, always a complete checkpoint, and reports a damaged file as a
  :class:`~lightning_fusedsgd.checkpoint.CheckpointError` naming it.
* :class:`InitFromCheckpoint` (a ``Callback``) starts ``Trainer.fit`` from a torchvision-reference,
  Lightning or weights-only checkpoint made elsewhere, keeping its momentum. Lightning's own
  ``ckpt_path`` is for resuming a run of the same module and optimizer; this is for bringing a
  checkpoint from elsewhere.

The checks, remapping and file handling themselves are plain PyTorch, in
:mod:`lightning_fusedsgd.checkpoint`.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fusedsgd.checkpoint import (
    CheckpointError,
    StartState,
    load_optimizer_state,
    read_checkpoint_file,
    read_start_checkpoint,
    save_checkpoint_file,
    seed_state_from_weights,
)

__all__ = ["AtomicCheckpointIO", "InitFromCheckpoint"]


class InitFromCheckpoint(pl.Callback):
    """Start ``Trainer.fit`` from a checkpoint made elsewhere, keeping its momentum.

    At ``on_fit_start``, once ``configure_optimizers`` has built the optimizer and before the first
    step or checkpoint write, it validates the checkpoint against the module, loads the optimizer state
    remapped by name into the run's grouping, loads the weights, gives master-weighted bf16/fp16
    parameters the checkpoint's fp32 weights as master copy (under ``bf16-true`` the module was cast
    before) and, with ``start_epoch``, continues the run at that epoch. A checkpoint that does not fit
    raises :class:`~lightning_fusedsgd.checkpoint.CheckpointMismatchError` there, with nothing changed.

    ``start_epoch=E`` makes the fit continue as if its first ``E`` epochs had run here: the trainer's
    epoch counter and global step start at ``E`` and ``E x steps per epoch``, so ``max_epochs`` stays
    the length of the whole run and the data order is that of epoch ``E``, and the lr schedulers are
    stepped to the same point (Lightning's ``interval`` and ``frequency`` respected), so warmup is not
    re-applied. A torchvision-reference checkpoint records the last completed epoch: continue its run
    with ``start_epoch = epoch + 1``.

    Lightning's ``ckpt_path`` (or its SLURM auto-resume) wins: when the fit resumes from a checkpoint
    of its own, this callback does nothing, so a resumed run never re-applies its start checkpoint
    (which need not even exist any more). That is why nothing happens in ``setup``: Lightning only
    reveals the resume path after it.

    Args:
        checkpoint: A checkpoint path, or a :class:`~lightning_fusedsgd.checkpoint.StartState` already
            read (and so validated) by :func:`~lightning_fusedsgd.checkpoint.read_start_checkpoint`,
            e.g. by a CLI that checks its inputs before building the Trainer.
        weights_only: Ignore the optimizer state in the file: momentum restarts from zero (warns).
        start_epoch: The epoch the run continues at (0: a new run that starts from these weights).
        trusted: See :func:`~lightning_fusedsgd.checkpoint.read_checkpoint_file`; used when
            ``checkpoint`` is a path.

    Raises:
        ValueError: If ``start_epoch`` is negative.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | StartState,
        *,
        weights_only: bool = False,
        start_epoch: int = 0,
        trusted: bool = False,
    ) -> None:
        if start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {start_epoch}")
        self.checkpoint = checkpoint
        self.weights_only = weights_only
        self.start_epoch = start_epoch
        self.trusted = trusted

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validate the checkpoint, then load weights and optimizer state and position the run."""
        if trainer.ckpt_path is not None:
            rank_zero_info(f"Resuming from {trainer.ckpt_path}: the start checkpoint is not applied.")
            return
        state = self.checkpoint
        if not isinstance(state, StartState):
            state = read_start_checkpoint(
                state, pl_module, weights_only=self.weights_only, trusted=self.trusted
            )
        optimizer_state = None if self.weights_only else state.optimizer_state
        if optimizer_state is not None and len(trainer.optimizers) != 1:
            raise CheckpointError(
                f"the module has {len(trainer.optimizers)} optimizers; starting from {state.path} with its "
                "optimizer state supports exactly one. Use weights_only=True."
            )
        steps = self.start_epoch * self._steps_per_epoch(trainer) if self.start_epoch else 0
        # Optimizer first: it validates by name before changing anything, so a mismatch leaves the
        # module untouched too.
        if optimizer_state is not None:
            load_optimizer_state(trainer.optimizers[0], optimizer_state, module=pl_module, source=state.path)
        pl_module.load_state_dict(state.model_state)
        for optimizer in trainer.optimizers:
            seed_state_from_weights(optimizer, pl_module, state.model_state)
        if self.start_epoch:
            self._continue_at(trainer, pl_module, steps)

        position = f"epoch {self.start_epoch} (step {steps})"
        recorded = "" if state.epoch is None else f"; the file records epoch {state.epoch}"
        if optimizer_state is None:
            rank_zero_warn(
                f"Starting from the weights of {state.path} only: momentum buffers restart from zero "
                f"(rebuilt from the first gradients, a warm restart) and the run, lr schedule included, "
                f"starts at {position}{recorded}. To keep momentum, start from a checkpoint that includes "
                "the optimizer state."
            )
        else:
            rank_zero_info(
                f"Started from {state.path} ({state.kind}): weights and momentum; the run, lr schedule "
                f"included, starts at {position}{recorded}."
            )

    @staticmethod
    def _steps_per_epoch(trainer: pl.Trainer) -> int:
        if not math.isfinite(trainer.num_training_batches):
            trainer.fit_loop.setup_data()  # as Trainer.estimated_stepping_batches does
        batches = trainer.num_training_batches
        if not math.isfinite(batches):
            raise ValueError("start_epoch needs a training dataloader with a length (epochs of known size)")
        return max(1, math.ceil(batches / trainer.accumulate_grad_batches))

    def _continue_at(self, trainer: pl.Trainer, pl_module: pl.LightningModule, steps: int) -> None:
        """Advance the loop counters and the lr schedulers as ``start_epoch`` whole epochs would have."""
        # These progress counters are what Lightning restores on a resume; advancing them makes the
        # epoch counter, the sampler's epoch, max_epochs/max_steps and checkpoint triggers continue here.
        epoch_loop = trainer.fit_loop.epoch_loop
        trainer.fit_loop.epoch_progress.increment_by(self.start_epoch)
        if pl_module.automatic_optimization:
            epoch_loop.automatic_optimization.optim_progress.optimizer.step.increment_by(steps)
        else:
            epoch_loop.manual_optimization.optim_step_progress.increment_by(steps)
        epoch_loop._batches_that_stepped += steps  # the loggers' step axis
        # Stepping replays any schedule exactly, chained schedulers included; torch's "scheduler stepped
        # before the optimizer" warning is expected here. A plateau scheduler has no position to restore.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            for config in trainer.lr_scheduler_configs:
                if config.reduce_on_plateau:
                    continue
                count = steps if config.interval == "step" else self.start_epoch
                for _ in range(count // config.frequency):
                    config.scheduler.step()


def _local_path(path: str | os.PathLike[str]) -> Path | None:
    """The local filesystem path behind ``path``, or None for remote storage (s3://, gs://, ...)."""
    filesystem, local = fsspec.core.url_to_fs(os.fspath(path))
    return Path(local) if isinstance(filesystem, LocalFileSystem) else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` whose local checkpoint files are always complete.

    Lightning's default writes through an fsspec transaction whose temporary file lives in the system
    temp directory (a copy, not an atomic rename, when that is another filesystem) and never fsyncs: a
    crash or power loss can leave a torn ``last.ckpt``. This plugin saves with
    :func:`~lightning_fusedsgd.checkpoint.save_checkpoint_file`: a hidden temporary file next to the
    target, flushed and fsynced, renamed over the target, directory fsynced. Remote paths (``s3://``...)
    keep Lightning's behaviour.

    Loading checks a local file as ``torch.load`` will read it
    (:func:`~lightning_fusedsgd.checkpoint.read_checkpoint_file`) and reports a damaged file as a
    :class:`~lightning_fusedsgd.checkpoint.CheckpointError` naming it. Use with
    ``Trainer(plugins=[AtomicCheckpointIO()])``; ``conf/trainer/default.yaml`` does.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically and durably.

        Raises:
            TypeError: If ``storage_options`` is given (as :class:`TorchCheckpointIO`).
        """
        local = _local_path(path)
        if storage_options is not None or local is None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        save_checkpoint_file(checkpoint, local)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint, first verifying a local file's integrity.

        ``weights_only=None`` loads weights-only, as ``torch.load``'s default does.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            CheckpointError: If the file is truncated, corrupted or refused by a weights-only load.
        """
        local = _local_path(path)
        if local is None:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not local.is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return read_checkpoint_file(local, map_location=map_location, trusted=weights_only is False)
