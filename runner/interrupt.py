"""Stopping a run on a signal at the end of a training step, with a checkpoint there.

Ctrl-C (SIGINT), SIGTERM and a SLURM job's requeue signal (:mod:`runner.slurm`) arrive at any moment, in
the middle of an optimizer step too, where a checkpoint would hold a half-applied step: Python raises
``KeyboardInterrupt`` wherever it is, and Lightning's SLURM handler saves from inside the signal handler.
:class:`Interruption` takes these signals over during training and acts at the end of the training step in
progress (where a step checkpoint is saved, which resumes exactly); one that arrives during validation acts
after the next training step, so validation is never cut:

* it saves ``<run dir>/checkpoints/last.ckpt``;
* for the requeue signal it then runs the requeuer's own handler: Lightning's saves ``hpc_ckpt_<n>.ckpt`` and
  calls ``scontrol requeue``, submitit's calls it and exits;
* for SIGINT and SIGTERM it hands the stop to Lightning's own SIGTERM handling, which ends ``fit`` there
  (``SIGTERMException``, on every rank at once), and writes the run's summary so far (``metrics.json``,
  ``curves.png``, the summary line) after a line with the command that resumes the run.

A second Ctrl-C stops at once, as Python's own handler does (``KeyboardInterrupt``, no checkpoint). Under
DDP the ranks agree at each step's end on whether any of them received a signal, so all save and stop at the
same step.
"""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import OmegaConf

from runner.auto_resume import LAST_CHECKPOINT
from runner.summary import RunSummary

__all__ = ["Interruption", "resume_command"]

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
_STOPS = (signal.SIGINT, signal.SIGTERM)
# Hydra overrides that make a run a job of a sweep: the resume command is a single run.
_SWEEP_KEYS = (
    "hydra.mode",
    "hydra/launcher",
    "hydra/sweeper",
    "hydra.launcher.",
    "hydra.sweeper.",
    "hydra.sweep.",
)


class Interruption(Checkpoint):
    """Saves ``last.ckpt`` at the end of the training step in progress when a signal arrives, then stops the
    run or lets the job's requeuer requeue it (see the module docstring).

    A :class:`~lightning.pytorch.callbacks.Checkpoint`, so that Lightning calls it after every other callback
    at a step's end (the weight average's update, the summary's record of the step), as it does
    ModelCheckpoint.

    Args:
        requeue_signal: The signal of the job's requeuer (:func:`runner.slurm.requeue_signal`); None: none.
    """

    def __init__(self, requeue_signal: signal.Signals | None = None) -> None:
        self.requeue_signal = requeue_signal
        self.last_model_path = ""  # the checkpoint saved at a signal (RunSummary reports it)
        self.stop_signal: signal.Signals | None = None  # the signal the run stopped on, once it did
        self._handlers: dict[int, Any] = {}  # the signals taken over: the handler each had
        self._pending: set[int] = set()  # received, not acted on yet
        self._received: list[str] = []  # every signal received in this fit, for the report
        self._saved_step: int | None = None
        self._last_step = 0
        self._announce = False

    @property
    def exit_status(self) -> int:
        """128 + the signal that stopped the run, as a shell reports it: SIGTERM where Lightning stopped on
        one itself, before training started and these signals were taken over."""
        return 128 + (self.stop_signal or signal.SIGTERM)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has installed its handlers by now, and restores those from before fit at its teardown.
        if not callable(signal.getsignal(signal.SIGTERM)):
            return  # not the main thread (Python runs signal handlers there only), or no Lightning handler
        self._announce, self._last_step = trainer.is_global_zero, trainer.global_step
        for signum in (*_STOPS, self.requeue_signal):
            if signum is not None and callable(signal.getsignal(signum)):
                self._handlers[signum] = signal.getsignal(signum)
                signal.signal(signum, self._receive)

    def _receive(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self._pending:
            raise KeyboardInterrupt  # the second Ctrl-C: at once, as Python's own handler
        if signum == signal.SIGINT and self._announce:
            # os.write to stderr's descriptor, not print: a handler that prints while the main code prints
            # raises a reentrant call.
            os.write(
                2,
                b"\nCtrl-C: stopping at the end of this training step, with a checkpoint "
                b"(Ctrl-C again stops at once, without one)\n",
            )
        self._pending.add(signum)
        self._received.append(signal.Signals(signum).name)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: no step taken, nothing a checkpoint could hold
        self._last_step = trainer.global_step
        stop, requeue = self._agreed(trainer)
        if not (stop or requeue):
            return
        self._save(trainer)
        if requeue:
            self._pending.discard(self.requeue_signal)
            self._handlers[self.requeue_signal](self.requeue_signal, None)
            stop = stop or bool(self._pending & set(_STOPS))  # SLURM's SIGTERM as the requeue ends the job
        if stop:
            self.stop_signal = signal.SIGINT if signal.SIGINT in self._pending else signal.SIGTERM
            self._handlers[signal.SIGTERM](signal.SIGTERM, None)  # Lightning's: the fit ends at this step

    def _agreed(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """Whether any rank received a stop signal, and the requeue signal."""
        pending = [bool(self._pending & set(_STOPS)), self.requeue_signal in self._pending]
        if trainer.world_size > 1:
            flags = torch.tensor(pending, dtype=torch.int32, device=trainer.strategy.root_device)
            pending = [bool(flag) for flag in trainer.strategy.reduce(flags, reduce_op="max").tolist()]
        return pending[0], pending[1]

    def _save(self, trainer: pl.Trainer) -> None:
        if self._saved_step == trainer.global_step:
            return
        path = Path(trainer.default_root_dir, LAST_CHECKPOINT)
        trainer.save_checkpoint(path, weights_only=False)
        self.last_model_path, self._saved_step = str(path), trainer.global_step

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The fit ended at a signal (Lightning's SIGTERMException, or the requeuer's exit) after the save; a
        # second Ctrl-C (KeyboardInterrupt) or an error after it is not a stop to report.
        if self._saved_step is None or not isinstance(exception, SystemExit):
            return
        if trainer.is_global_zero:
            saved = _shown(Path(self.last_model_path))
            where = (
                f"{', '.join(self._received)} at step {trainer.global_step} (epoch {trainer.current_epoch})"
            )
            if self.stop_signal is not None:
                print(f"stopped by {where}: saved {saved}", flush=True)
                print(f"resume: {resume_command(self.last_model_path)}", flush=True)
            else:  # the requeuer exited: the requeued job runs this command again
                print(
                    f"requeued on {where}: saved {saved}, which the job resumes with ckpt_path=auto",
                    flush=True,
                )
        for callback in trainer.callbacks:
            if isinstance(callback, RunSummary):  # the run's outputs so far, as at a fit's end
                callback.on_fit_end(trainer, pl_module)


def resume_command(checkpoint: str) -> str:
    """The command that resumes this run from ``checkpoint``: ``python train.py`` with the run's overrides as
    typed (those that made it a job of a sweep left out) and ``ckpt_path=<checkpoint>``."""
    overrides: list[str] = []
    if HydraConfig.initialized():
        typed = HydraConfig.get().overrides
        hydra = OmegaConf.to_container(typed.hydra, resolve=False)
        overrides = [o for o in hydra if not _key(o).startswith(_SWEEP_KEYS)]
        overrides += [o for o in OmegaConf.to_container(typed.task, resolve=False) if _key(o) != "ckpt_path"]
    words = ["python", str(_shown(TRAIN_SCRIPT)), *overrides, f"ckpt_path={_shown(Path(checkpoint))}"]
    return shlex.join(words)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _shown(path: Path) -> Path:
    """``path`` relative to the directory the run was started in where it lies in it, else absolute."""
    start = Path(HydraConfig.get().runtime.cwd if HydraConfig.initialized() else Path.cwd()).resolve()
    path = path.resolve()
    return path.relative_to(start) if path.is_relative_to(start) else path
