"""Resuming a run: the refusal of a checkpoint of a finished run (:class:`RefuseFinishedRun`), resuming at
the next epoch under ``trainer.max_steps`` (:class:`ResumeAfterEpochEnd`), and resuming in an epoch that a
run's stop cut short (:class:`ResumeInCutEpoch`).

A run stopped by ``trainer.max_steps`` before its epoch's last batch is saved by Lightning at
``on_train_epoch_end``, with the epoch counted as processed, and resuming from that checkpoint starts the next
epoch: the rest of the cut epoch is never trained, and Lightning says nothing (its loaders cannot resume
mid-epoch, so it counts the epoch done). The runner's DataModules can: their state holds the epoch and the
batches of it used. :class:`ResumeInCutEpoch` rewrites such a checkpoint's loop counters, as it is read, to
what a checkpoint saved after the same batch holds (a step checkpoint, which resumes mid-epoch exactly), so
the resumed run trains the epoch's remaining batches, as one run to the same end would."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fusedsgd.lightning import ConfigError

__all__ = ["RefuseFinishedRun", "ResumeAfterEpochEnd", "ResumeInCutEpoch"]


class RefuseFinishedRun(pl.Callback):
    """Refuses, as the checkpoint is read, to resume a run that already reached ``trainer.max_epochs`` or
    ``trainer.max_steps``: Lightning would train nothing, validate nothing and end with a summary of no
    validation, without a word on why."""

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        steps = checkpoint.get("global_step", 0)
        if trainer.max_steps != -1 and steps >= trainer.max_steps:
            raise ConfigError(_finished(trainer, f"reached step {steps}", "max_steps", trainer.max_steps))
        epochs = _epochs_trained(trainer, checkpoint)
        if trainer.max_epochs not in (None, -1) and epochs is not None and epochs >= trainer.max_epochs:
            raise ConfigError(
                _finished(trainer, f"trained {epochs} epoch(s)", "max_epochs", trainer.max_epochs)
            )


def _epochs_trained(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> int | None:
    """The epochs a checkpoint's run trained to their last batch: its DataModule's position (the epoch it
    trains in or, at an epoch's end, the next), else Lightning's count of epochs processed; None where it
    holds neither."""
    datamodule = trainer.datamodule
    position = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
    if position:
        return position["epoch"]
    try:
        return checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
    except (KeyError, TypeError):
        return None


def _finished(trainer: pl.Trainer, done: str, key: str, limit: int) -> str:
    return (
        f"ckpt_path={trainer.ckpt_path} is of a finished run: it {done}, and trainer.{key}={limit} ends the "
        f"resumed run there, before any step; raise trainer.{key} to train on"
    )


class ResumeAfterEpochEnd(pl.Callback):
    """Resumes a checkpoint saved at an epoch's end at the next epoch's first batch, under
    ``trainer.max_steps`` too. Lightning's iteration-based training (``max_steps`` set) takes such a
    checkpoint for a restart within the finished epoch: it finds the epoch's batches done, counts the epoch
    once more, and the next epoch goes untrained without a word (a run resumed with ``max_epochs=2`` trained
    no step). The loop counters are rewritten, as the checkpoint is read, to what Lightning's epoch-based
    resume makes of them: that epoch completed, no batch of the next one used."""

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        datamodule = trainer.datamodule
        position = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
        if trainer.max_steps == -1 or not position or position["batches"]:
            return  # epoch-based resumes are Lightning's; within an epoch ResumeInCutEpoch's
        try:
            loop = checkpoint["loops"]["fit_loop"]
            epochs, steps = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
            stepped = loop["epoch_loop.state_dict"]["_batches_that_stepped"]
            at_epoch_end = epochs["current"]["processed"] == position["epoch"] and all(
                counts["ready"] == counts["started"] == counts["processed"] == counts["completed"] + 1
                for counts in (epochs["current"], epochs["total"])
            )
        except (KeyError, TypeError):
            return  # not laid out as this Lightning writes it: left to Lightning
        if not at_epoch_end:
            return
        for counts in (epochs["current"], epochs["total"]):
            counts["completed"] = counts["processed"]
        steps["current"] = dict.fromkeys(steps["current"], 0)
        steps["is_last_batch"] = False
        # A restart counts one more batch stepped (Lightning's amends for saves that miss the last one); the
        # epoch-based resume does not.
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] = stepped - 1


class ResumeInCutEpoch(pl.Callback):
    """Continues, on resume, the epoch a checkpoint's run stopped in (see the module docstring); where the
    checkpoint's loop state is not laid out as this Lightning writes it, says at the resume which batches go
    untrained."""

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        datamodule = trainer.datamodule
        position = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
        if not position or not position.get("batches"):
            return  # at an epoch's end or start, or data that keeps no position
        epoch, batches = position["epoch"], position["batches"]
        try:
            loop = checkpoint["loops"]["fit_loop"]
            epochs, steps = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
            if epochs["current"]["processed"] != epoch + 1:
                return  # a checkpoint saved within the epoch: Lightning resumes in it
            cut = all(
                counts["ready"] == counts["started"] == counts["processed"] == counts["completed"] + 1
                for counts in (epochs["current"], epochs["total"])
            ) and all(
                counts["ready"] == counts["started"] == counts["processed"] == counts["completed"]
                for counts in (steps["current"], steps["total"])
            )
            cut = cut and steps["current"]["processed"] == batches
            stepped = loop["epoch_loop.state_dict"]["_batches_that_stepped"]
        except (KeyError, TypeError):
            cut = False
        if not cut:
            rank_zero_warn(
                f"the checkpoint's epoch {epoch} ended after {batches} of its batches (trainer.max_steps, "
                f"say); Lightning resumes at epoch {epoch + 1}, and the rest of epoch {epoch} is not trained"
            )
            return
        # As saved after the epoch's last batch trained (on_train_batch_end), before the epoch ended.
        for counts in (epochs["current"], epochs["total"]):
            counts["processed"] -= 1
        for counts in (steps["current"], steps["total"]):
            counts["completed"] -= 1
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] = stepped - 1
