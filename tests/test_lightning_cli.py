"""`python train.py` as users run it, and FusedSGD/FusedLARS by class name in LightningCLI."""

from __future__ import annotations

import inspect
import json
import time

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning_helpers import run_train_py

from lightning_fusedsgd import FusedLARS, FusedSGD
from lightning_fusedsgd.runner.data import DigitsDataModule
from lightning_fusedsgd.runner.model import ImageClassifier

pytestmark = pytest.mark.slow  # whole runs in subprocesses: make test runs them, make test-fast not

SHORT_RUN = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.accelerator=cpu",
    "data.batch_size=16",
    "trainer.log_every_n_steps=1",
]


def test_train_py_writes_every_output_and_ends_with_the_summary(tmp_path):
    result = run_train_py([*SHORT_RUN, "trainer.gradient_clip_val=1.0", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("summary: name=quickstart val_acc=")
    assert "steps=6" in last_line

    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "checkpoints" / "best.ckpt").is_file()
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "train/loss", "val/acc", "val/acc5"} <= set(header)
    assert any(column.startswith("lr-FusedSGD") for column in header)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["epochs"] == 2 and metrics["skipped_steps"] == 0
    # Lightning's gradient_clip_val reached the fused step (it is saved with the optimizer's groups).
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert {group["max_grad_norm"] for group in saved["optimizer_states"][0]["param_groups"]} == {1.0}
    assert 0.0 <= metrics["val/acc"] <= 1.0
    assert metrics["last_checkpoint"].endswith("last.ckpt")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    log = (tmp_path / "train.log").read_text()
    assert "configure_fused_sgd: SGD peak lr 0.0125 = base_lr 0.2 x 16/256" in log


def test_missing_data_fails_fast_with_one_clear_message(tmp_path):
    start = time.monotonic()
    result = run_train_py(["recipe=resnet50", "data.root=/nonexistent/imagenet", f"hydra.run.dir={tmp_path}"])
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    message = result.stderr.strip()
    assert message.startswith("error: recipe 'resnet50' needs ImageNet-style (ImageFolder) data")
    assert "/nonexistent/imagenet/train" in message
    assert "<root>/train/<class>/<image> and <root>/val/<class>/<image>" in message
    assert "python train.py recipe=resnet50 data=synthetic" in message
    assert elapsed < 60  # imports dominate; nothing is built before the check


def test_cfg_job_prints_the_composed_recipe():
    result = run_train_py(["recipe=resnet50_lars", "optim.base_lr=9.0", "--cfg", "job"])
    assert result.returncode == 0, result.stderr
    assert "lars: true" in result.stdout
    assert "base_lr: 9.0" in result.stdout
    assert "arch: resnet50" in result.stdout
    assert "decay: poly" in result.stdout


@pytest.mark.parametrize("class_path", ["lightning_fusedsgd.FusedLARS", "lightning_fusedsgd.optim.FusedLARS"])
def test_lightning_cli_takes_the_optimizer_by_class_name(class_path, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train"])  # the CLI reads args=, not pytest's own arguments
    cli = LightningCLI(
        ImageClassifier,
        DigitsDataModule,
        args=[
            "fit",
            "--model.in_channels=1",
            "--data.batch_size=8",
            "--data.image_size=16",
            f"--optimizer={class_path}",
            "--optimizer.lr=0.05",
            "--optimizer.momentum=0.9",
            "--optimizer.weight_decay=1e-4",
            "--optimizer.trust_coefficient=0.002",
            "--trainer.accelerator=cpu",
            "--trainer.fast_dev_run=2",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_kwargs={"overwrite": True},
    )
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, FusedLARS)
    assert optimizer.param_groups[0]["lars"] is True and optimizer.param_groups[0]["lr"] == 0.05
    assert optimizer.defaults["trust_coefficient"] == 0.002
    assert cli.trainer.global_step == 2
    assert all(state["momentum_buffer"] is not None for state in optimizer.state.values())


def test_fused_lars_has_fused_sgds_signature_with_lars_on():
    """FusedLARS restates nothing: its signature, which LightningCLI and Hydra read, is FusedSGD's with one
    default changed."""
    sgd, lars = (inspect.signature(cls) for cls in (FusedSGD, FusedLARS))
    assert list(lars.parameters) == list(sgd.parameters)
    differing = [name for name in sgd.parameters if sgd.parameters[name] != lars.parameters[name]]
    assert differing == ["lars"] and lars.parameters["lars"].default is True
