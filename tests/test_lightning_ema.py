"""lightning_fusedsgd.lightning.EMAWeightAveraging, a drop-in for Lightning's: with FusedSGD the same final
weights and validation metrics as Lightning's callback with torch.optim.SGD, bit for bit (CPU, fp32); a
checkpoint of either callback resumes the other exactly; with another optimizer it is Lightning's
callback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging as LightningEMA
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import UserModule, cpu_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree
from lightning_fusedsgd.lightning import EMAWeightAveraging

HPARAMS = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
SCHEDULE = dict(decay=0.8, update_starting_at_step=2, update_every_n_steps=2)


class Classifier(UserModule):
    """The user's module with validation (its loss and accuracy logged per epoch) and an optimizer."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(samples=64, batch_size=16)
        self.optimizer_name = optimizer
        self.validation: list[tuple[float, float]] = []

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        logits = self.net(images)
        loss = F.cross_entropy(logits, targets)
        accuracy = (logits.argmax(1) == targets).float().mean()
        self.validation.append((loss.item(), accuracy.item()))
        self.log("val/loss", loss)

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 3, 8, 8, generator=generator), torch.arange(32) % 4)
        return DataLoader(data, batch_size=16)

    def configure_optimizers(self) -> Any:
        kind = FusedSGD if self.optimizer_name == "fused" else torch.optim.SGD
        return kind(self.parameters(), **HPARAMS)


def _fit(optimizer: str, callback: pl.Callback, tmp_path, epochs: int = 3, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    module = Classifier(optimizer)
    trainer = cpu_trainer(
        max_epochs=epochs, callbacks=[callback], default_root_dir=tmp_path, **trainer_kwargs
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, fused",
    [
        pytest.param(SCHEDULE, True, id="buffers-averaged"),
        # AveragedModel copies the buffers at each update: validation between updates runs on older ones.
        pytest.param({**SCHEDULE, "use_buffers": False}, True, id="buffers-as-of-the-last-update"),
        pytest.param(
            dict(decay=0.8, update_starting_at_step=-1, update_every_n_steps=3), True, id="start-below-0"
        ),
        # Steps and, from the second epoch on, epoch ends: those update the averages outside a step.
        pytest.param(
            dict(decay=0.8, update_every_n_steps=3, update_starting_at_epoch=1), True, id="steps-and-epochs"
        ),
        # No step updates, only epoch ends: nothing to fuse, Lightning's callback runs.
        pytest.param(
            dict(decay=0.8, update_every_n_steps=0, update_starting_at_epoch=1), False, id="epochs-only"
        ),
    ],
)
def test_fused_runs_give_lightnings_weights_and_metrics_bit_for_bit(schedule, fused, tmp_path):
    """Training ends with the averaged weights in the module, and every validation ran on the averages: the
    same bits as Lightning's callback with torch.optim.SGD."""
    theirs, _ = _fit("torch", LightningEMA(**schedule), tmp_path / "theirs")
    callback = EMAWeightAveraging(**schedule)
    ours, trainer = _fit("fused", callback, tmp_path / "ours")
    assert callback.fused == fused
    # The average was kept in FusedSGD's step, or by Lightning's callback.
    assert any("ema" in state for state in trainer.optimizers[0].state.values()) == fused
    _same_bits(ours.state_dict(), theirs.state_dict())
    assert ours.validation == theirs.validation and len(ours.validation) == 2 * 4  # sanity check + 3 epochs


@pytest.mark.slow
def test_with_another_optimizer_it_is_lightnings_callback(tmp_path):
    theirs, _ = _fit("torch", LightningEMA(**SCHEDULE), tmp_path / "theirs")
    callback = EMAWeightAveraging(**SCHEDULE)
    ours, _ = _fit("torch", callback, tmp_path / "ours")
    assert not callback.fused
    _same_bits(ours.state_dict(), theirs.state_dict())
    assert ours.validation == theirs.validation


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [("ours", "lightning"), ("lightning", "ours")])
def test_a_checkpoint_of_either_callback_resumes_the_other_exactly(first, second, tmp_path):
    """A run of 3 epochs, checkpointed after 1 by one callback and resumed by the other: the final weights of
    an uninterrupted run of either (they are the same bits)."""
    make = {
        "ours": lambda: ("fused", EMAWeightAveraging(**SCHEDULE)),
        "lightning": lambda: ("torch", LightningEMA(**SCHEDULE)),
    }
    uninterrupted, _ = _fit(*make[second](), tmp_path / "whole")
    optimizer, callback = make[first]()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    torch.manual_seed(0)
    module = Classifier(optimizer)
    trainer = cpu_trainer(
        max_epochs=1,
        callbacks=[callback, saver],
        default_root_dir=tmp_path / "first",
        enable_checkpointing=True,
    )
    trainer.fit(module)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert {"state_dict", "current_model_state", "averaging_state"} <= checkpoint.keys()
    optimizer, callback = make[second]()
    resumed, _ = _fit(optimizer, callback, tmp_path / "second", ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    _same_bits(resumed.state_dict(), uninterrupted.state_dict())


class EvaluatesInTheAveragedWeights(Classifier):
    """A validation step that enters ``averaged_weights()`` itself, as an evaluation helper does, inside the
    validation the callback runs on the averages."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        with self.trainer.optimizers[0].averaged_weights():
            super().validation_step(batch, batch_idx)


@pytest.mark.slow
def test_averaged_weights_entered_during_validation_still_validates_the_averages(tmp_path):
    theirs, _ = _fit("torch", LightningEMA(**SCHEDULE), tmp_path / "theirs")
    torch.manual_seed(0)
    ours = EvaluatesInTheAveragedWeights("fused")
    cpu_trainer(max_epochs=3, callbacks=[EMAWeightAveraging(**SCHEDULE)], default_root_dir=tmp_path).fit(ours)
    assert ours.validation == theirs.validation
    _same_bits(ours.state_dict(), theirs.state_dict())


class Masked(Classifier):
    """A module with masks and counters among its buffers: bool, uint8 and int8 tensors, used in forward."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        self.register_buffer("keep", torch.tensor([True, False, True, True]))
        self.register_buffer("scale", torch.tensor([1, 2, 1, 3], dtype=torch.uint8))
        self.register_buffer("shift", torch.tensor([-1, 0, 2, 0], dtype=torch.int8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (self.net(images) * self.scale + self.shift).masked_fill(~self.keep, 0.0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        return F.cross_entropy(self(images), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        self.validation.append((F.cross_entropy(self(images), targets).item(), 0.0))


@pytest.mark.slow
@pytest.mark.parametrize("use_buffers", [True, False])
def test_buffers_of_every_dtype_swap_as_lightnings_callback_keeps_them(use_buffers, tmp_path):
    """Bool, uint8, int8 and int64 buffers: validation and the final module as Lightning's callback with
    torch.optim.SGD gives them."""
    runs = {}
    for optimizer, callback in (("torch", LightningEMA), ("fused", EMAWeightAveraging)):
        torch.manual_seed(0)
        module = Masked(optimizer)
        trainer = cpu_trainer(
            max_epochs=2,
            callbacks=[callback(**SCHEDULE, use_buffers=use_buffers)],
            default_root_dir=tmp_path / optimizer,
        )
        trainer.fit(module)
        runs[optimizer] = module
    assert runs["fused"].validation == runs["torch"].validation
    _same_bits(runs["fused"].state_dict(), runs["torch"].state_dict())


class ScheduleFree(Classifier):
    def configure_optimizers(self) -> Any:
        return FusedSGDScheduleFree(self.parameters(), lr=0.1, momentum=0.9, warmup_steps=2)


@pytest.mark.slow
def test_with_a_schedule_free_optimizer_it_is_lightnings_callback(tmp_path):
    """FusedSGDScheduleFree's step keeps no average of the weights: the callback is Lightning's, with the
    same validation and final module as Lightning's own on the same module."""
    runs = {}
    for name, callback in (("theirs", LightningEMA(**SCHEDULE)), ("ours", EMAWeightAveraging(**SCHEDULE))):
        torch.manual_seed(0)
        module = ScheduleFree("schedule_free")
        cpu_trainer(max_epochs=2, callbacks=[callback], default_root_dir=tmp_path / name).fit(module)
        runs[name] = module
    assert not callback.fused
    assert runs["ours"].validation == runs["theirs"].validation
    _same_bits(runs["ours"].state_dict(), runs["theirs"].state_dict())


class BuildsInConfigureModel(Classifier):
    """Its layers are built in configure_model(), at each call, as Lightning's own test module does."""

    def configure_model(self) -> None:
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(512, 4)
        )


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["torch", "fused"])
def test_layers_built_in_configure_model_are_the_ones_trained_as_with_lightnings(optimizer, tmp_path):
    """configure_model() runs where Lightning's callback runs it, before the optimizer takes the params: the
    params trained and the averaged model are the ones Lightning's callback gives. (No sanity check: there
    Lightning's callback validates its copy of the first call's layers, which nothing trains.)"""
    runs = {}
    for name, callback in (("theirs", LightningEMA(**SCHEDULE)), ("ours", EMAWeightAveraging(**SCHEDULE))):
        torch.manual_seed(0)
        module = BuildsInConfigureModel("torch" if name == "theirs" else optimizer)
        trainer = cpu_trainer(
            max_epochs=2, callbacks=[callback], default_root_dir=tmp_path / name, num_sanity_val_steps=0
        )
        trainer.fit(module)
        runs[name] = module
    assert runs["ours"].validation == runs["theirs"].validation
    _same_bits(runs["ours"].state_dict(), runs["theirs"].state_dict())


@pytest.mark.parametrize("decay", [1.0, -0.1, float("nan"), "0.9"])
def test_a_decay_outside_0_1_is_refused_when_the_callback_is_made(decay):
    with pytest.raises(ValueError, match=r"EMAWeightAveraging\(decay=.*\): .*0\.999 is the usual choice"):
        EMAWeightAveraging(decay=decay)


@pytest.mark.slow
def test_a_complex_param_is_refused_by_name_before_the_first_step(tmp_path):
    """FusedSGD averages dense real params; the callback sets the average on every group and checks them."""

    class WithComplex(Classifier):
        def __init__(self) -> None:
            super().__init__("fused")
            self.phase = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))

    module = WithComplex()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = cpu_trainer(max_epochs=1, callbacks=[EMAWeightAveraging()], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"parameter 'phase' \(shape \(4,\)\) is torch.complex64.*lightning"):
        trainer.fit(module)
    _same_bits({name: p.detach() for name, p in module.named_parameters()}, before)
