"""configure_fused_sgd in a user's own LightningModule: groups, linear scaling, schedule in epochs/steps."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import TinyClassifier, cpu_trainer
from lightning_utilities.core import rank_zero as lightning_utilities_rank_zero

from lightning_fusedsgd.lightning import ConfigError, Schedule, configure_fused_sgd, factory
from lightning_fusedsgd.optim import FusedSGD
from lightning_fusedsgd.schedule import WarmupLR


class LrRecorder(pl.Callback):
    """The lr each optimizer step used."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append([group["lr"] for group in optimizer.param_groups])


@pytest.fixture
def factory_log():
    """The factory's log line (Lightning's rank-zero logger may not propagate to the root logger). The logger
    is whichever lightning_utilities' rank_zero_info writes to: importing the standalone pytorch_lightning
    package (lightly does) switches it from lightning.pytorch's to its own."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = lightning_utilities_rank_zero.log
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_factory_in_own_module_scales_lr_and_follows_schedule(factory_log):
    # 80 samples / batch 16 = 5 batches per epoch; accumulating 2 -> ceil(5/2) = 3 steps per epoch.
    module = TinyClassifier(
        base_lr=0.2,
        reference_batch_size=256,
        momentum=0.9,
        weight_decay=5e-4,
        schedule=Schedule(decay="multistep", warmup=1, milestones=[2], unit="epoch"),
    )
    recorder = LrRecorder()
    trainer = cpu_trainer(max_epochs=3, accumulate_grad_batches=2, callbacks=[recorder])
    trainer.fit(module)

    peak = 0.2 * (16 * 1 * 2) / 256  # base lr x (per-device batch x processes x accumulation) / reference
    assert peak == pytest.approx(0.025)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FusedSGD)
    scheduler = trainer.lr_scheduler_configs[0]
    assert isinstance(scheduler.scheduler, WarmupLR) and scheduler.interval == "step"
    # Warmup: 1 epoch = 3 steps from 0; then the peak; x0.1 from epoch 2 = step 6.
    expected = [0.0, peak / 3, 2 * peak / 3, peak, peak, peak, peak / 10, peak / 10, peak / 10]
    assert [lrs[0] for lrs in recorder.lrs] == pytest.approx(expected)
    assert all(len(set(lrs)) == 1 for lrs in recorder.lrs)  # both groups share the schedule

    # Weights decayed, biases and BatchNorm not; no LARS anywhere.
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert set(groups) == {"decay", "no_decay"}
    assert groups["decay"]["weight_decay"] == 5e-4 and groups["no_decay"]["weight_decay"] == 0.0
    assert groups["decay"]["param_names"] == ["net.0.weight", "net.5.weight"]
    assert set(groups["no_decay"]["param_names"]) == {
        "net.0.bias",
        "net.1.weight",
        "net.1.bias",
        "net.5.bias",
    }
    assert not any(group["lars"] for group in optimizer.param_groups)
    assert all(group["momentum"] == 0.9 for group in optimizer.param_groups)

    [line] = [r.getMessage() for r in factory_log if r.getMessage().startswith("configure_fused_sgd:")]
    assert "peak lr 0.025 = base_lr 0.2 x 32/256" in line
    assert "global batch 32 (16 per device x 1 processes x 2 accumulated)" in line
    assert "warmup 3 of 9 steps" in line
    assert "decay 2 tensors" in line and "no_decay 4 tensors" in line


def test_factory_lars_groups_and_lr_as_given():
    module = TinyClassifier(lr=0.3, lars=True, schedule=Schedule(decay="constant"))
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(module)
    groups = {group["name"]: group for group in trainer.optimizers[0].param_groups}
    assert groups["decay_lars"]["lars"] is True
    assert groups["no_decay_no_lars"]["lars"] is False
    # lr is the peak as given: no linear scaling.
    assert all(group["lr"] == pytest.approx(0.3) for group in groups.values())


def test_factory_warmup_and_milestones_in_steps():
    module = TinyClassifier(
        schedule=Schedule(decay="multistep", warmup=2, milestones=[4], unit="step", start_factor=0.5)
    )
    recorder = LrRecorder()
    trainer = cpu_trainer(max_steps=6, callbacks=[recorder])
    trainer.fit(module)
    peak = 0.1 * 16 / 256
    expected = [peak / 2, 0.75 * peak, peak, peak, peak / 10, peak / 10]
    assert [lrs[0] for lrs in recorder.lrs] == pytest.approx(expected)


def test_factory_needs_a_trainer():
    with pytest.raises(ConfigError, match="attached to a Trainer"):
        configure_fused_sgd(TinyClassifier())


def _optimizer() -> FusedSGD:
    return FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def test_schedule_converts_epochs_and_drops_milestones_past_the_end():
    schedule = Schedule(decay="multistep", warmup=0.5, milestones=[3, 20], unit="epoch")
    scheduler = schedule.build(_optimizer(), total_steps=100, steps_per_epoch=10, peak_lr=1.0)
    assert scheduler.schedule.warmup_steps == 5
    assert scheduler.schedule.milestones == (30,)  # epoch 20 = step 200 never comes in 100 steps
    # Every milestone past the end: the same lrs as a constant schedule.
    constant = Schedule(decay="multistep", milestones=[30]).build(
        _optimizer(), total_steps=50, steps_per_epoch=10, peak_lr=1.0
    )
    assert constant.schedule.decay == "constant"


def test_schedule_start_lr_is_absolute():
    # Goyal et al.: warm up from the base lr 0.1 to the scaled peak 3.2.
    scheduler = Schedule(warmup=5, start_lr=0.1).build(
        _optimizer(), total_steps=90, steps_per_epoch=1, peak_lr=3.2
    )
    assert scheduler.schedule.start_factor == pytest.approx(0.1 / 3.2)
    # At or below the reference batch the peak is below the base lr: no ramp.
    flat = Schedule(warmup=5, start_lr=0.1).build(
        _optimizer(), total_steps=90, steps_per_epoch=1, peak_lr=0.05
    )
    assert flat.schedule.start_factor == 1.0


def test_schedule_warmup_longer_than_run_is_shortened_with_a_warning():
    with pytest.warns(UserWarning, match="does not fit"):
        scheduler = Schedule(warmup=5).build(_optimizer(), total_steps=3, steps_per_epoch=1, peak_lr=1.0)
    assert scheduler.schedule.warmup_steps == 2


def test_schedule_errors_are_config_errors():
    with pytest.raises(ConfigError, match="unit"):
        Schedule(unit="epochs")
    with pytest.raises(ConfigError, match="steps per epoch: 10"):
        Schedule(decay="multistep", warmup=2, milestones=[1]).build(
            _optimizer(), total_steps=100, steps_per_epoch=10, peak_lr=1.0
        )


def test_run_summary_records_the_lr_each_step_used(tmp_path):
    """RunSummary records f(0), f(1), ...: Lightning steps the scheduler before batch-end hooks."""
    from runner.summary import RunSummary

    summary = RunSummary(str(tmp_path))
    model = TinyClassifier(base_lr=0.2, schedule=Schedule(warmup=3, unit="step", decay="linear"))
    trainer = cpu_trainer(max_epochs=2, callbacks=[summary])
    trainer.fit(model)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    peak = scheduler.base_lrs[0]
    expected = [scheduler.schedule.lr_at(t, peak) for t in range(trainer.global_step)]
    assert [step for step, _ in summary.lr] == list(range(1, trainer.global_step + 1))
    assert [lr for _, lr in summary.lr] == pytest.approx(expected, rel=1e-12)
    assert summary.lr[0][1] == pytest.approx(0.0)  # warmup starts at start_factor 0 x peak


class LrAttributeClassifier(TinyClassifier):
    """The pattern lr_find expects: the module's ``lr`` attribute, passed to the factory as the peak lr."""

    def __init__(self, lr: float = 0.1, **factory_kwargs) -> None:
        super().__init__(**factory_kwargs)
        self.lr = lr

    def configure_optimizers(self):
        return configure_fused_sgd(self, lr=self.lr, **self.factory_kwargs)


def test_lr_find_suggestion_is_the_peak_lr_the_next_fit_uses():
    from lightning.pytorch.tuner import Tuner

    module = LrAttributeClassifier(samples=320, schedule=Schedule(decay="constant"))
    recorder = LrRecorder()
    trainer = cpu_trainer(max_epochs=1, callbacks=[recorder])
    finder = Tuner(trainer).lr_find(
        module, min_lr=1e-4, max_lr=1.0, num_training=20, update_attr=True, attr_name="lr"
    )
    suggestion = finder.suggestion()
    assert suggestion is not None and module.lr == suggestion
    recorder.lrs.clear()
    trainer.fit(module)
    # Every step of the fit runs at the suggested lr, in both groups: no batch scaling on top of it.
    assert recorder.lrs and all(lrs == [suggestion, suggestion] for lrs in recorder.lrs)


@pytest.mark.parametrize(
    "flags, native",
    [("fpu sse avx2 fma", False), ("fpu avx2 avx512f avx512_bf16", True), ("fp asimd bf16", True)],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert factory.cpu_has_native_bf16(str(cpuinfo)) is native
    assert factory.cpu_has_native_bf16(str(tmp_path / "missing")) is False


@pytest.mark.parametrize(
    "precision, native, warned",
    [("bf16-true", False, True), ("bf16-true", True, False), ("32-true", False, False)],
)
def test_a_bf16_run_on_a_cpu_without_bf16_gets_one_line_at_start_up(monkeypatch, precision, native, warned):
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: native)
    module = TinyClassifier(schedule=Schedule(decay="constant"))
    if precision.startswith("bf16"):
        module = module.to(torch.bfloat16) if precision == "bf16-true" else module
    trainer = cpu_trainer(max_steps=1, precision=precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    lines = [str(w.message) for w in caught if "without native bf16" in str(w.message)]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "The optimizer step is not the slow part" in lines[0] and "precision=32-true" in lines[0]
