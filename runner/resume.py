"""Resuming in an epoch that a run's stop cut short.

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

__all__ = ["ResumeInCutEpoch"]


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
