"""Whole runs over image folders with unreadable files left out (``data.skip_unreadable=true``): batches left
empty in training and in validation, on one device and under DDP."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import compose_train, run_train_py

from lightning_fusedsgd.lightning import ConfigError
from runner.files import EncodedFolder
from runner.jpeg_folder import make_jpeg_folder
from runner.model import ImageClassifier
from runner.run import train
from runner.sampling import EpochSampler

SKIPPING = ["recipe=resnet50", "model.arch=resnet18", "debug=tiny", "data.skip_unreadable=true"]


def _emptied(paths) -> None:
    for path in paths:
        Path(path).write_bytes(b"")


@pytest.mark.slow
def test_a_run_goes_on_past_a_batch_whose_every_file_is_unreadable(tmp_path, capsys):
    """data.skip_unreadable: epoch 0's second batch (8 of the 24 images) made of unreadable files only trains
    nothing, and the run goes on; the summary counts the files."""
    root = make_jpeg_folder(tmp_path / "data", classes=3, train=8, val=2)
    files = EncodedFolder(root / "train")
    sampler = EpochSampler(files, seed=0)  # the run's order of epoch 0 (seed=0)
    _emptied(files.samples[index][0] for index, _ in list(sampler)[16:])
    overrides = [*SKIPPING, f"data.root={root}", "data.num_classes=3"]
    with pytest.warns(UserWarning, match="left out"):
        summary = train(compose_train(overrides, tmp_path / "run"))
    assert summary["global_step"] == 4 and summary["epochs"] == 2
    # Met in both epochs, counted once each, in the summary line and metrics.json with their reasons.
    assert summary["unreadable_files"] == 8
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["unreadable_files"] == 8 and set(written["files"]["unreadable_files"].values()) == {
        "the file is empty (0 bytes)"
    }
    assert " unreadable_files=8" in capsys.readouterr().out.strip().splitlines()[-1]


def test_an_empty_batch_skips_the_step_on_one_device_and_gives_zero_gradients_under_ddp(monkeypatch):
    model = ImageClassifier(arch="resnet18", num_classes=3)
    model.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    images, targets = torch.empty(0, 3, 32, 32), torch.empty(0, dtype=torch.long)
    assert model.training_step((images, targets), 0) is None  # Lightning steps no gradient
    assert model.validation_step((images, targets), 0) is None
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda trainer: 2))
    loss = model.training_step((images, targets), 0)  # DDP refuses None: every rank must reduce
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_a_validation_pass_that_would_score_no_image_stops_the_run_before_training(tmp_path):
    """Every file validation reads (its one batch under debug=tiny) is unreadable: nothing to score, so no
    val/acc to report or monitor. The sanity check reads that whole pass, so the run stops there, before any
    step or file, in one message naming the cause and the fix (it was ModelCheckpoint's traceback at the
    first epoch's end)."""
    root = make_jpeg_folder(tmp_path / "data", classes=2, train=4, val=2)
    _emptied(sorted((root / "val" / "class_000").iterdir()))
    overrides = [*SKIPPING, f"data.root={root}", "data.num_classes=2", "data.batch_size=2"]
    with pytest.warns(UserWarning, match="left out"), pytest.raises(ConfigError) as refused:
        train(compose_train(overrides, tmp_path / "run"))
    assert str(refused.value) == (
        "validation scored no image: each of the 2 validation file(s) it read is unreadable and was left out "
        f"(data.skip_unreadable=true), e.g. {root / 'val' / 'class_000' / '00000.JPEG'}: the file is empty "
        "(0 bytes); remove or re-encode them, or let it read more files (trainer.limit_val_batches; it reads "
        "1 batch(es) now)"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_validation_pass_that_scored_no_image_stops_the_run_after_it(tmp_path):
    """Without the sanity check, the first validation pass finds it, after the first epoch's training: the
    same message, and no checkpoint of a run that cannot be monitored."""
    root = make_jpeg_folder(tmp_path / "data", classes=2, train=4, val=2)
    _emptied(sorted((root / "val").rglob("*.JPEG")))
    overrides = [*SKIPPING, f"data.root={root}", "data.num_classes=2", "data.batch_size=2"]
    overrides += ["trainer.limit_val_batches=1.0", "+trainer.num_sanity_val_steps=0"]
    with pytest.warns(UserWarning, match="left out"), pytest.raises(ConfigError) as refused:
        train(compose_train(overrides, tmp_path / "run"))
    assert str(refused.value) == (
        "validation scored no image: each of the 4 validation file(s) it read is unreadable and was left out "
        f"(data.skip_unreadable=true), e.g. {root / 'val' / 'class_000' / '00000.JPEG'}: the file is empty "
        "(0 bytes); remove or re-encode them"
    )
    assert not list((tmp_path / "run").rglob("*.ckpt"))


@pytest.mark.slow
def test_under_ddp_a_rank_whose_validation_files_are_all_unreadable_validates_with_the_others(tmp_path):
    """Two processes: rank 1's validation files (every second one, its DistributedSampler's share) are all
    unreadable. It scores nothing, rank 0 scores its three: the pass reports rank 0's, and the run ends (a
    rank that logged nothing left the other's reductions unpaired)."""
    root = make_jpeg_folder(tmp_path / "data", classes=3, train=4, val=2)
    files = EncodedFolder(root / "val")
    _emptied(path for path, _ in files.samples[1::2])
    result = run_train_py(
        [*SKIPPING, f"data.root={root}", "data.num_classes=3", "data.batch_size=4", "trainer.devices=2",
         "trainer.strategy=ddp", "trainer.max_epochs=1", "trainer.limit_val_batches=1.0",
         f"hydra.run.dir={tmp_path / 'run'}"],
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["unreadable_files"] == 3 and 0.0 <= metrics["val/acc"] <= 1.0
