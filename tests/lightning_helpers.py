"""Shared pieces of the Lightning/Hydra tests: a user's own small LightningModule and config composition."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd.checkpoint import read_checkpoint_file
from lightning_fusedsgd.lightning import configure_fused_sgd

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 3  # conf/debug/tiny.yaml's trainer.limit_train_batches
# A tiny train.py run (CPU, 3 steps an epoch, one validation batch, no progress bar): the config's own
# debug group, as a user would ask for it.
SMALL_RUN = ["debug=tiny"]


class UserModule(pl.LightningModule):
    """What a user writes: their own small module, with no ``configure_optimizers`` (LightningCLI's
    ``--optimizer`` gives one)."""

    def __init__(self, samples: int = 80, batch_size: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(samples, 3, 8, 8, generator=generator), torch.arange(samples) % 4
        )
        self.batch_size = batch_size

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        loss = F.cross_entropy(self.net(images), targets)
        self.log("train/loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class TinyClassifier(UserModule):
    """A user's module with ``configure_fused_sgd`` in ``configure_optimizers``."""

    def __init__(self, samples: int = 80, batch_size: int = 16, **factory_kwargs: Any) -> None:
        super().__init__(samples, batch_size)
        self.factory_kwargs = factory_kwargs

    def configure_optimizers(self) -> Any:
        return configure_fused_sgd(self, **self.factory_kwargs)


class StopAt(pl.Callback):
    """Interrupts ``fit`` (raises :class:`Interrupted`) just before the optimizer step number ``step + 1``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx
    ) -> None:
        if trainer.global_step == self.step:
            raise Interrupted(f"stopped at step {self.step}")


class Interrupted(RuntimeError):
    """Raised by :class:`StopAt`."""


class StartProbe(pl.Callback):
    """Saves what a run starts from (weights, optimizer state, lr, epoch, step) to ``path`` at train start."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        names = {id(p): name for name, p in pl_module.named_parameters()}
        probe = {
            "weights": {name: t.detach().clone() for name, t in pl_module.state_dict().items()},
            "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
            "lr": [group["lr"] for group in optimizer.param_groups],
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
        }
        torch.save(probe, self.path)


def cpu_trainer(**kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer for tests."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def _register_recipes() -> None:
    """train.py's own registration of recipes/ as the config group ``recipe`` (it runs at import)."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def compose_train(overrides: list[str], output_dir: Path) -> DictConfig:
    """``train.py``'s config as Hydra composes it, with the run dir set, ready for ``runner.run.train``."""
    _register_recipes()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} as in a real run
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def run_train_py(
    args: list[str], cwd: Path = ROOT, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` as a user runs it (with ``env`` added to this environment)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_checkpoint(run_dir: Path) -> Path:
    """A train.py run's ``last.ckpt``."""
    return run_dir / "checkpoints" / "last.ckpt"


def final_state(run_dir: Path) -> dict[str, Any]:
    """Weights, optimizer state by parameter name, lr per step and step count of a run's last.ckpt."""
    checkpoint = read_checkpoint_file(last_checkpoint(run_dir))
    optimizer = checkpoint["optimizer_states"][0]
    names = {
        index: name
        for group in optimizer["param_groups"]
        for index, name in zip(group["params"], group["param_names"])
    }
    return {
        "weights": checkpoint["state_dict"],
        "optimizer": {
            f"{names[index]}/{key}": tensor
            for index, state in optimizer["state"].items()
            for key, tensor in state.items()
        },
        "lrs": checkpoint["callbacks"]["RunSummary"]["lr"],
        "global_step": checkpoint["global_step"],
    }


def assert_identical(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two :func:`final_state` results agree bit for bit (and in dtype)."""
    assert actual["global_step"] == expected["global_step"]
    assert actual["lrs"] == expected["lrs"]
    for part in ("weights", "optimizer"):
        assert actual[part].keys() == expected[part].keys(), part
        for name, tensor in expected[part].items():
            assert actual[part][name].dtype == tensor.dtype, name
            assert torch.equal(actual[part][name], tensor), name


class SignalAt(pl.Callback):
    """Sends ``signal`` (a name: SIGINT, SIGTERM, SIGUSR1...) to this process in the middle of optimizer step
    number ``step``, after its backward and before the update, where a checkpoint would hold a half-applied
    step. With ``once``, a file: only where that file does not exist yet (then made), so that a requeued job
    that runs the same command does not signal again."""

    def __init__(self, step: int, signal: str, once: str | None = None) -> None:
        self.step = step
        self.signal = signal
        self.once = once

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if trainer.global_step + 1 != self.step or (self.once is not None and os.path.exists(self.once)):
            return
        if self.once is not None:
            Path(self.once).touch()
        os.kill(os.getpid(), getattr(signal, self.signal))
