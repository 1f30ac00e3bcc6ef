"""FusedSGD under Lightning's precision plugins on CPU.

bf16-mixed, bf16-true with master weights, 16-mixed with a GradScaler; Lightning's gradient clipping done
inside the fused step under each of them (against torch.optim.SGD clipped by Lightning); skipped steps that
leave the schedule where it is.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import TinyClassifier, cpu_trainer

from lightning_fusedsgd import FusedSGD, param_groups
from lightning_fusedsgd.lightning import ClipInTheStep, Schedule, configure_fused_sgd
from runner.summary import RunSummary

CONSTANT = Schedule(decay="constant")


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in module.parameters()]


def test_bf16_mixed_trains_fp32_weights():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    before = _params(module)
    trainer = cpu_trainer(max_steps=3, precision="bf16-mixed")
    trainer.fit(module)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, _params(module)) if a.numel() > 8)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    optimizer = trainer.optimizers[0]
    assert not optimizer.param_groups[0]["master_weights"]


def test_bf16_true_uses_fp32_master_weights():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    trainer = cpu_trainer(max_steps=3, precision="bf16-true")
    trainer.fit(module)
    optimizer = trainer.optimizers[0]
    assert all(group["master_weights"] for group in optimizer.param_groups)  # turned on by the factory
    for param in module.parameters():
        assert param.dtype == torch.bfloat16
        state = optimizer.state[param]
        assert state["master_param"].dtype == torch.float32
        assert state["momentum_buffer"].dtype == torch.float32
        # The bf16 weight is the rounded master; the master holds updates bf16 would lose.
        assert torch.equal(param, state["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_true_with_update_rounding_keeps_no_masters(rounding):
    """optim.update_rounding=stochastic or kahan under bf16-true: the factory leaves master weights off (they
    would make the option a no-op), the buffers (and compensations) stay bf16, and the run matches FusedSGD's
    reference backend stepping the same batches, bit for bit."""
    runs = []
    for backend in ("compiled", "reference"):
        torch.manual_seed(0)
        module = TinyClassifier(schedule=CONSTANT, lr=1.0, update_rounding=rounding, backend=backend)
        trainer = cpu_trainer(max_steps=3, precision="bf16-true")
        trainer.fit(module)
        optimizer = trainer.optimizers[0]
        assert not any(group["master_weights"] for group in optimizer.param_groups)
        assert all(group["update_rounding"] == rounding for group in optimizer.param_groups)
        extra = {"kahan": {"kahan_compensation"}, "stochastic": {"rounding_step"}}[rounding]
        for param in module.parameters():
            assert param.dtype == torch.bfloat16 and set(optimizer.state[param]) == {
                "momentum_buffer",
                *extra,
            }
            tensors = {key: value for key, value in optimizer.state[param].items() if key != "rounding_step"}
            assert all(value.dtype == torch.bfloat16 for value in tensors.values())
            if rounding == "stochastic":  # 3 steps, each counted
                assert optimizer.state[param]["rounding_step"].item() == 3
        state = [
            value.clone() for p in module.parameters() for _, value in sorted(optimizer.state[p].items())
        ]
        runs.append([p.detach().clone() for p in module.parameters()] + state)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _fp16_trainer(**kwargs):
    # Trainer(precision="16-mixed") on CPU is switched to bf16-mixed by Lightning; the plugin keeps
    # float16 autocast and its GradScaler, so FusedSGD's in-kernel unscaling is exercised.
    return cpu_trainer(max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")], **kwargs)


def test_16_mixed_grad_scaler_steps_through_the_kernel():
    torch.manual_seed(0)
    module = TinyClassifier(schedule=CONSTANT, lr=1.0)
    before = _params(module)
    trainer = _fp16_trainer()
    trainer.fit(module)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 1
    assert trainer.global_step == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, _params(module)) if a.numel() > 8)


class TorchSGDClassifier(TinyClassifier):
    """The same module with torch.optim.SGD on the same groups: Lightning clips it itself."""

    def configure_optimizers(self):
        kwargs = self.factory_kwargs
        groups = param_groups(self, kwargs.get("weight_decay", 1e-4))
        return torch.optim.SGD(groups, lr=kwargs["lr"], momentum=0.9)


# What each Trainer precision needs on the CPU (16-mixed: see _fp16_trainer), and the weights' tolerance.
PRECISIONS = {
    "32-true": (dict(precision="32-true"), 1e-5),
    "bf16-mixed": (dict(precision="bf16-mixed"), 1e-4),
    "16-mixed": (dict(plugins=[MixedPrecision("16-mixed", "cpu")]), 1e-4),
    # bf16 weights stepped in bf16 by torch.optim.SGD, whose clip_grad_norm_ takes the norm in bf16: one
    # rounding of the weights apart at most.
    "bf16-true": (dict(precision="bf16-true"), 1e-2),
}
CLIP = {"norm": 0.05, "value": 0.002}  # both clip every step of these runs


def _fit(module, clip, accumulate=1, **trainer_kwargs):
    algorithm, value = clip if clip else (None, None)
    trainer = cpu_trainer(
        max_steps=4,
        gradient_clip_val=value,
        gradient_clip_algorithm=algorithm,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs,
    )
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("algorithm", list(CLIP))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_gradient_clip_val_clips_in_the_fused_step_like_lightning_clips_torch_sgd(precision, algorithm):
    """A module with no configure_gradient_clipping of its own: Trainer(gradient_clip_val=...) works under
    every precision, with one fused call per step, and equals torch.optim.SGD clipped by Lightning."""
    trainer_kwargs, tolerance = PRECISIONS[precision]
    factory = dict(schedule=CONSTANT, lr=0.5, master_weights=False)
    clip = (algorithm, CLIP[algorithm])
    torch.manual_seed(0)
    ours = TinyClassifier(**factory)
    torch.manual_seed(0)
    theirs = TorchSGDClassifier(**factory)
    initial = _params(ours)
    trainer = _fit(ours, clip, **trainer_kwargs)
    _fit(theirs, clip, **trainer_kwargs)
    assert not torch.equal(initial[0], _params(ours)[0])  # steps were applied, not all skipped
    optimizer = trainer.optimizers[0]
    assert optimizer.last_backends and all(b.startswith("compiled") for b in optimizer.last_backends.values())
    assert optimizer.param_groups[0][f"max_grad_{algorithm}"] == CLIP[algorithm]
    for a, b in zip(_params(ours), _params(theirs)):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


class SelfBuiltFusedSGD(TinyClassifier):
    """A module that builds FusedSGD itself and has no clipping hook (as LightningCLI's ``--optimizer`` does):
    the ClipInTheStep callback, which Lightning adds to every Trainer, routes the clipping into the step."""

    def configure_optimizers(self):
        kwargs = self.factory_kwargs
        return FusedSGD(param_groups(self, kwargs.get("weight_decay", 1e-4)), lr=kwargs["lr"], momentum=0.9)


@pytest.mark.parametrize("algorithm", list(CLIP))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_self_built_fused_sgd_clips_in_the_step_with_no_code(precision, algorithm):
    """Trainer(gradient_clip_val=...) under every precision, with no hook and no factory: equal to
    torch.optim.SGD clipped by Lightning."""
    trainer_kwargs, tolerance = PRECISIONS[precision]
    factory = dict(schedule=CONSTANT, lr=0.5)
    clip = (algorithm, CLIP[algorithm])
    torch.manual_seed(0)
    ours = SelfBuiltFusedSGD(**factory)
    torch.manual_seed(0)
    theirs = TorchSGDClassifier(**factory)
    trainer = _fit(ours, clip, **trainer_kwargs)
    _fit(theirs, clip, **trainer_kwargs)
    assert any(isinstance(callback, ClipInTheStep) for callback in trainer.callbacks)
    assert trainer.optimizers[0].param_groups[0][f"max_grad_{algorithm}"] == CLIP[algorithm]
    for a, b in zip(_params(ours), _params(theirs)):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_gradient_clip_val_changes_the_run():
    """The clip thresholds above are active: without clipping the weights differ."""
    factory = dict(schedule=CONSTANT, lr=0.5)
    runs = []
    for clip in (("norm", CLIP["norm"]), None):
        torch.manual_seed(0)
        module = TinyClassifier(**factory)
        _fit(module, clip)
        runs.append(_params(module))
    assert not torch.allclose(runs[0][0], runs[1][0], rtol=1e-3, atol=1e-4)


def test_clipping_with_accumulation_clips_the_accumulated_gradient_once_per_step():
    factory = dict(schedule=CONSTANT, lr=0.5)
    clip = ("norm", CLIP["norm"])
    torch.manual_seed(0)
    ours = TinyClassifier(**factory)
    torch.manual_seed(0)
    theirs = TorchSGDClassifier(**factory)
    trainer = _fit(ours, clip, accumulate=2)
    _fit(theirs, clip, accumulate=2)
    assert trainer.global_step == 4
    for a, b in zip(_params(ours), _params(theirs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_module_with_its_own_clipping_hook_keeps_it():
    calls = []

    class OwnClipping(TinyClassifier):
        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ):
            calls.append(gradient_clip_val)

    _fit(OwnClipping(schedule=CONSTANT), ("norm", 1.0))
    assert calls == [1.0] * 4


class OverflowAt(TinyClassifier):
    """Makes the loss of some batches inf, so the GradScaler skips those optimizer steps."""

    def __init__(self, overflow_steps, **kwargs):
        super().__init__(**kwargs)
        self.overflow_steps = set(overflow_steps)
        self.lrs = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss * float("inf") if self.trainer.global_step in self.overflow_steps else loss


def test_skipped_steps_do_not_advance_the_schedule_under_lightning(tmp_path):
    schedule = Schedule(decay="linear", warmup=3, unit="step")
    module = OverflowAt({1, 2}, schedule=schedule, lr=1.0)
    trainer = cpu_trainer(
        max_epochs=1, plugins=[MixedPrecision("16-mixed", "cpu")], callbacks=[RunSummary(str(tmp_path))]
    )
    trainer.fit(module)
    metrics = json.loads((tmp_path / "metrics.json").read_text())  # what train.py writes
    assert metrics["skipped_steps"] == 2 and metrics["metrics"]["train/skipped_steps"] == 2
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    steps = trainer.global_step
    assert scheduler.skipped_steps == 2 and scheduler.last_epoch == steps - 2
    applied = [lr for step, lr in enumerate(module.lrs) if step not in (1, 2)]
    expected = scheduler.schedule.curve(1.0, steps - 2)
    assert applied == pytest.approx(expected)
    assert module.lrs[1] == module.lrs[2] == module.lrs[3] == pytest.approx(expected[1])


def test_a_pytorch_lightning_module_clips_in_the_fused_step():
    """Modules written against the older ``pytorch_lightning`` package (lightly's and solo-learn's examples
    are) get the clipping hook too."""
    import pytorch_lightning

    class Module(pytorch_lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).sum()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
            )

        def configure_optimizers(self):
            return configure_fused_sgd(self, lr=0.1, schedule=CONSTANT)

    module = Module()
    trainer = pytorch_lightning.Trainer(
        accelerator="cpu",
        max_steps=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert [group["max_grad_norm"] for group in trainer.optimizers[0].param_groups] == [0.5, 0.5]
