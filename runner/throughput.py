"""Training images per second, through Lightning's ``Throughput`` utility (the measure its
``ThroughputMonitor`` logs), for the log and the run's summary line.

Lightning's ``ThroughputMonitor`` itself synchronizes the GPU after every batch, which costs the step the
overlap of the host with the device it measures; this callback reads the host's clock without a sync, over a
window of steps, where the host can run ahead of the device by its launch queue only, so the window's rate is
the device's. Time spent validating is left out, as ``ThroughputMonitor`` leaves it out."""

from __future__ import annotations

from time import perf_counter
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.throughput import Throughput

__all__ = ["ImagesPerSecond"]


class ImagesPerSecond(pl.Callback):
    """Logs ``train/images_per_sec`` (this device's training images per second over the last
    ``window_size`` steps) once the window is full; :class:`~runner.summary.RunSummary` prints the last value.

    Args:
        window_size: Steps the rate is taken over (Lightning's ``Throughput`` window).
    """

    def __init__(self, window_size: int = 20) -> None:
        if window_size < 2:
            raise ValueError(f"window_size={window_size}: a rate needs a window of at least 2 steps")
        self.window_size = window_size
        self._throughput = Throughput(window_size=window_size)
        self._start = 0.0
        self._paused_at = 0.0
        self._images = 0
        self._batches = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._throughput.reset()
        self._images = self._batches = 0
        self._start = perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._paused_at = perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:  # the sanity check runs before on_train_start
            self._start += perf_counter() - self._paused_at

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if not len(batch[1]):  # every file unreadable (data.skip_unreadable): its time goes to the next
            return
        self._images += len(batch[1])  # the labels: one per image, whatever the images are (views included)
        self._throughput.update(
            time=perf_counter() - self._start, batches=self._batches, samples=self._images
        )
        rate = self._throughput.compute().get("device/samples_per_sec")
        if rate is not None:
            pl_module.log("train/images_per_sec", rate, on_step=True, on_epoch=False)
