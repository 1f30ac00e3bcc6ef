"""Whole runs over image folders with unreadable files left out (``data.skip_unreadable=true``): batches left
empty in training and in validation, on one device and under DDP."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning_helpers import compose_train, last_checkpoint, run_train_py

from lightning_fusedsgd.checkpoint import read_checkpoint_file
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
    nothing, and the run goes on; the summary counts the files. The lr schedule counts the steps taken: a
    skipped one does not use up warmup and milestones."""
    root = make_jpeg_folder(tmp_path / "data", classes=3, train=8, val=2)
    files = EncodedFolder(root / "train")
    sampler = EpochSampler(files, seed=0)  # the run's order (seed=0)
    emptied = {files.samples[index][0] for index, _ in list(sampler)[16:]}
    _emptied(emptied)
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
    # The steps taken: the batches (16 images, then 8) with a readable file, in each epoch's order.
    taken = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = [files.samples[index][0] for index, _ in sampler]
        taken += sum(not set(batch) <= emptied for batch in (order[:16], order[16:]))
    scheduler = read_checkpoint_file(last_checkpoint(tmp_path / "run"))["lr_schedulers"][0]
    assert scheduler["last_epoch"] == taken < summary["global_step"] and scheduler["skipped_steps"] == 0


def _classifier_on(**trainer_options) -> ImageClassifier:
    model = ImageClassifier(arch="resnet18", num_classes=3)
    model.trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **trainer_options
    )
    return model


EMPTY = (torch.empty(0, 3, 32, 32), torch.empty(0, dtype=torch.long))


def test_an_empty_batch_skips_the_step_on_one_device():
    model = _classifier_on()
    assert model.training_step(EMPTY, 0) is None  # Lightning steps no gradient
    assert model.validation_step(EMPTY, 0) is None


@pytest.mark.parametrize("where", ["ddp", "accumulating", "deepspeed"])
def test_an_empty_batch_gives_zero_gradients_where_its_step_cannot_be_skipped(where, monkeypatch):
    """Under DDP every rank must reduce its gradients; with accumulation the window's other batches must still
    be applied (a GradScaler would skip the whole step); DeepSpeed refuses a None. The empty batch's gradients
    are zero, and its step is not counted as skipped."""
    model = _classifier_on(accumulate_grad_batches=2 if where == "accumulating" else 1)
    if where == "ddp":
        monkeypatch.setattr(pl.Trainer, "world_size", property(lambda trainer: 2))
    if where == "deepspeed":
        monkeypatch.setattr(pl.Trainer, "strategy", property(lambda trainer: DeepSpeedStrategy()))
    loss = model.training_step(EMPTY, 0)
    loss.backward()
    assert loss.item() == 0.0 and not model._step_skipped
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_skipped_step_holds_a_per_step_schedule_only(interval):
    """After a batch that stepped nothing, a per-step scheduler stays where it is; one stepped per epoch still
    steps at the end of an epoch whose last batch was empty."""
    model = _classifier_on()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()  # a step taken before, as Lightning's order has it
    model.trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval=interval)]
    assert model.training_step(EMPTY, 0) is None
    model.lr_scheduler_step(scheduler, None)
    assert scheduler.last_epoch == (0 if interval == "step" else 1)


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
