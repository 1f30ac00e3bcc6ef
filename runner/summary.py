"""End-of-run outputs: ``metrics.json``, ``curves.png`` and a one-line summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

__all__ = ["RunSummary"]

# Shown after val_acc where logged; acc_random_init is the SimCLR kNN baseline of a random backbone.
_MORE_FIELDS = ("val/acc_random_init", "val/acc5", "val/loss", "val/acc_raw")


class RunSummary(pl.Callback):
    """Records lr, training loss and validation accuracy per step; writes the run's results at the end.

    On rank 0 at the end of ``fit``: ``<output_dir>/metrics.json`` (final logged metrics, best
    accuracy, steps, the optimizer steps skipped for inf/NaN gradients under a GradScaler, also logged as
    ``train/skipped_steps``, wall time, checkpoint paths, and the image folder's files this fit left out as
    unreadable on any rank, counted and listed with their reasons), ``<output_dir>/curves.png`` (lr,
    training loss and validation accuracy against the global step) and a last printed line
    ``summary: name=... val_acc=... ...``. The recorded curves are saved in checkpoints, so a resumed
    run's files cover the whole run.

    Args:
        output_dir: Where to write the files.
        name: Run name shown in the summary (the recipe).
        monitor: The validation accuracy metric.
    """

    def __init__(self, output_dir: str, name: str = "run", monitor: str = "val/acc") -> None:
        self.output_dir = Path(output_dir)
        self.name = name
        self.monitor = monitor
        self.lr: list[tuple[int, float]] = []
        self.train_loss: list[tuple[int, float]] = []
        self.val_acc: list[tuple[int, float]] = []
        self.val_acc_raw: list[tuple[int, float]] = []  # the training weights', where validation averages
        self.skipped_steps = 0
        self.start_time = 0.0
        self._last_step = 0
        self._seen_outcome: Any = None
        self.summary: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "train_loss": self.train_loss,
            "val_acc": self.val_acc,
            "val_acc_raw": self.val_acc_raw,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr = list(state_dict.get("lr", []))
        self.train_loss = list(state_dict.get("train_loss", []))
        self.val_acc = list(state_dict.get("val_acc", []))
        self.val_acc_raw = list(state_dict.get("val_acc_raw", []))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_time = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # > 0 when resuming

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step after this batch
            return
        self._last_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.train_loss.append((step, loss.item()))
        # FusedSGD's flag: a new tensor per step under a GradScaler (read once, as the loss above is).
        applied = getattr(trainer.optimizers[0], "last_step_applied", True)
        if applied is not self._seen_outcome:
            self._seen_outcome = applied
            self.skipped_steps += not bool(applied)
        pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Lightning steps the scheduler before on_train_batch_end: only here is this step's lr visible.
        self.lr.append((trainer.global_step + 1, float(optimizer.param_groups[0]["lr"])))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the pass's epoch-end hooks, the module's among them, have logged its metrics.
        if trainer.sanity_checking:
            return
        for series, key in ((self.val_acc, self.monitor), (self.val_acc_raw, f"{self.monitor}_raw")):
            value = trainer.callback_metrics.get(key)
            if value is not None:
                series.append((trainer.global_step, float(value)))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        files = _files_report(trainer)  # on every rank: each holds its own share
        if trainer.is_global_zero:
            self._write(trainer, files)

    def _write(self, trainer: pl.Trainer, files: dict[str, dict[str, str]]) -> None:
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
        checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        best = max((acc for _, acc in self.val_acc), default=None)  # None: no validation ran
        # The run's last validation: this fit's, or where it ran none (resumed, then stopped by max_steps
        # before the next), the last one recorded before it.
        last = metrics.get(self.monitor, self.val_acc[-1][1] if self.val_acc else None)
        self.summary = {
            "name": self.name,
            self.monitor: last,
            f"best_{self.monitor}": best,
            "epochs": trainer.current_epoch,
            "global_step": trainer.global_step,
            "skipped_steps": self.skipped_steps,
            **{kind: len(paths) for kind, paths in files.items()},
            "wall_time_s": round(time.perf_counter() - self.start_time, 1),
            "metrics": metrics,
            "last_checkpoint": _last_checkpoint(trainer.checkpoint_callbacks),
            "best_checkpoint": next(
                (cb.best_model_path for cb in checkpoints if cb.monitor == self.monitor), ""
            ),
            "files": files,
        }
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "metrics.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        self._plot(self.output_dir / "curves.png")
        print(self.summary_line(), flush=True)

    def summary_line(self) -> str:
        """``summary: name=quickstart val_acc=0.9833 ...`` from the last recorded run; ``validation=none``
        where the run ended before its first validation (``trainer.max_steps`` short of an epoch, say)."""
        metrics = self.summary["metrics"]
        if self.val_acc:
            fields = {
                "val_acc": self.summary[self.monitor],
                "best_val_acc": self.summary[f"best_{self.monitor}"],
            }
            fields.update({key.replace("/", "_"): metrics[key] for key in _MORE_FIELDS if key in metrics})
            parts = [f"{key}={value:.4f}" for key, value in fields.items()]
        else:
            parts = ["validation=none"]
        parts += [f"epochs={self.summary['epochs']}", f"steps={self.summary['global_step']}"]
        if "train/images_per_sec" in metrics:  # runner.throughput.ImagesPerSecond's last window
            parts.append(f"images_per_sec={metrics['train/images_per_sec']:.1f}")
        parts += [f"{kind}={len(paths)}" for kind, paths in self.summary["files"].items() if paths]
        parts += [
            f"time={self.summary['wall_time_s']}s",
            f"out={self.output_dir}",
        ]
        return f"summary: name={self.name} " + " ".join(parts)

    def _plot(self, path: Path) -> None:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

        # The validation panel: the averaged weights' and the training weights' curves, where both ran.
        val = [("averaged", self.val_acc), ("training weights", self.val_acc_raw)] if self.val_acc_raw else []
        series = (
            ("learning rate", [("", self.lr)]),
            ("train loss", [("", self.train_loss)]),
            (self.monitor, val or [("", self.val_acc)]),
        )
        fig = Figure(figsize=(13, 3.5), layout="constrained")
        axes = fig.subplots(1, 3)
        for ax, (title, curves) in zip(axes, series):
            for label, points in curves:
                if points:
                    steps, values = zip(*points)
                    ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=label or None)
            if len(curves) > 1:
                ax.legend()
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.suptitle(self.name)
        fig.savefig(path, dpi=100)


def _files_report(trainer: pl.Trainer) -> dict[str, dict[str, str]]:
    """The files every rank's data did not read as planned (the DataModule's ``files_report``: kind -> path
    -> why), each file once; empty for data without files. Under DDP every rank must call it."""
    report = getattr(trainer.datamodule, "files_report", None)
    local = report() if report is not None else {}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    gathered: list[dict[str, dict[str, str]]] = [{} for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, local)
    merged: dict[str, dict[str, str]] = {}
    for rank_report in gathered:
        for kind, paths in rank_report.items():
            merged.setdefault(kind, {}).update(paths)
    return merged


def _last_checkpoint(checkpoints: list[Checkpoint]) -> str:
    """The newest checkpoint: a ``save_last`` file or a signal's (``runner.interrupt``), else the file a
    ``monitor=None`` callback keeps."""
    paths = [getattr(cb, "last_model_path", "") for cb in checkpoints] + [
        cb.best_model_path for cb in checkpoints if isinstance(cb, ModelCheckpoint) and cb.monitor is None
    ]
    return next((path for path in paths if path), "")
