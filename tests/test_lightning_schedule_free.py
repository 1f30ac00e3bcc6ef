"""Schedule-free SGD under Lightning with no mode-switching code: the ScheduleFreeModes callback (every
Trainer's, through the entry point) against a loop that drives schedulefree.SGDScheduleFree by hand as its
README says, checkpoints that hold x and resume exactly as an uninterrupted fit, BatchNorm recalibrated at x,
and the ways in (LightningCLI's --optimizer, configure_fused_sgd)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins import MixedPrecision
from lightning_helpers import TinyClassifier, UserModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd import FusedSGDScheduleFree
from lightning_fusedsgd.lightning import ConfigError, Schedule, ScheduleFreeModes

schedulefree = pytest.importorskip("schedulefree")

HPARAMS = dict(lr=0.5, weight_decay=1e-3, warmup_steps=3)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    )


class Module(pl.LightningModule):
    """A user's module: FusedSGDScheduleFree in configure_optimizers and not one train()/eval() call. It
    records the optimizer's mode at each training step and the weights each validation sees."""

    def __init__(self, shuffle: str | None = None) -> None:
        super().__init__()
        self.net = _net()
        self.shuffle = shuffle
        self.modes: list[bool] = []
        self.validated: list[list[torch.Tensor]] = []
        self.statistics: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.modes.append(self.optimizers().optimizer.training)
        inputs, targets = batch
        return F.cross_entropy(self.net(inputs), targets)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append([p.detach().clone() for p in self.parameters()])
            norm = self.net[1]
            self.statistics.append((norm.running_mean.clone(), norm.running_var.clone()))
        inputs, targets = batch
        self.log("val_loss", F.cross_entropy(self.net(inputs), targets))

    def forward(self, inputs):
        return self.net(inputs)

    def configure_optimizers(self):
        return FusedSGDScheduleFree(self.parameters(), **HPARAMS)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(5) if self.shuffle == "loader-generator" else None
        return DataLoader(_data(), batch_size=16, shuffle=self.shuffle is not None, generator=generator)

    def val_dataloader(self):
        return DataLoader(_data(), batch_size=16)


def _trainer(tmp_path, epochs, callbacks=(), **kwargs) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last", enable_version_counter=False)
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        limit_val_batches=1,
        callbacks=[*callbacks, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _by_hand(epochs: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[torch.Tensor]]:
    """The same training with schedulefree.SGDScheduleFree, switched by hand where its README says: train for
    the epochs, eval for each validation and the checkpoint written after it; eval at the end. Returns the
    weights each validation saw, those each checkpoint held, and the final weights."""
    net = _net()
    optimizer = schedulefree.SGDScheduleFree(net.parameters(), **HPARAMS)
    loader = DataLoader(_data(), batch_size=16)
    validated, saved = [], []
    for _ in range(epochs):
        optimizer.train()
        net.train()
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(net(inputs), targets).backward()
            optimizer.step()
        optimizer.eval()
        validated.append([p.detach().clone() for p in net.parameters()])
        saved.append([p.detach().clone() for p in net.parameters()])  # the checkpoint at the epoch's end
    optimizer.eval()  # already: the fit ends as the last validation left it
    return validated, saved, [p.detach().clone() for p in net.parameters()]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_fit_needs_no_mode_switching_code_and_checkpoints_hold_x(tmp_path):
    """Each training step in train mode, each validation and checkpoint at x, the module at x after the fit:
    bit for bit the weights of the loop that drives the peer by hand."""
    module = Module()
    _trainer(tmp_path, epochs=2).fit(module)
    validated, saved, final = _by_hand(2)
    assert module.modes == [True] * 8
    assert all(_equal(a, b) for a, b in zip(module.validated[1:], validated))  # [0]: the sanity check's
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert _equal(list(checkpoint["state_dict"][f"net.{n}"] for n, _ in _net().named_parameters()), saved[-1])
    assert [g["train_mode"] for g in checkpoint["optimizer_states"][0]["param_groups"]] == [False]
    assert _equal(list(module.parameters()), final)
    assert not module.trainer.optimizers[0].training


def test_a_resumed_fit_continues_exactly_as_an_uninterrupted_one(tmp_path):
    straight = Module()
    _trainer(tmp_path / "straight", epochs=4).fit(straight)
    _trainer(tmp_path / "first", epochs=2).fit(Module())
    resumed = Module()
    _trainer(tmp_path / "resumed", epochs=4).fit(resumed, ckpt_path=tmp_path / "first" / "last.ckpt")
    assert _equal(list(resumed.parameters()), list(straight.parameters()))
    assert all(_equal(a, b) for a, b in zip(resumed.validated[-2:], straight.validated[-2:], strict=True))
    ours, theirs = (m.trainer.optimizers[0] for m in (resumed, straight))
    assert _equal(
        [ours.state[p]["z"] for p in resumed.parameters()],
        [theirs.state[p]["z"] for p in straight.parameters()],
    )
    assert ours.state_dict()["param_groups"][0]["k"] == theirs.state_dict()["param_groups"][0]["k"] == 16


def _fit_with_step_checkpoints(directory, save_last: bool, ckpt_path=None) -> Module:
    """3 epochs of 4 steps, a checkpoint at each epoch's last step (in train mode; with save_last a second one
    at the same step), no validation."""
    every = ModelCheckpoint(
        dirpath=directory, filename="{step}", save_top_k=-1, every_n_train_steps=4, save_last=save_last
    )
    module = Module()
    pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        limit_val_batches=0,
        callbacks=[every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, ckpt_path=ckpt_path)
    return module


def test_checkpoints_written_in_train_mode_resume_exactly_and_one_or_two_give_the_same_fit(tmp_path):
    """Two checkpoints at one step switch to x once: the fit is the one with one checkpoint there, and a fit
    resumed from the first written continues exactly."""
    one = _fit_with_step_checkpoints(tmp_path / "one", save_last=False)
    two = _fit_with_step_checkpoints(tmp_path / "two", save_last=True)
    assert _equal(list(two.parameters()), list(one.parameters()))
    resumed = _fit_with_step_checkpoints(
        tmp_path / "resumed", False, ckpt_path=tmp_path / "two" / "step=4.ckpt"
    )
    assert _equal(list(resumed.parameters()), list(two.parameters()))


def test_batchnorm_recalibrated_at_x(tmp_path):
    """bn_recalibration_batches=2: each validation sees running statistics averaged over the first two
    training batches at x (the oracle: the same forwards by hand, from the weights that validation saw)."""
    module = Module()
    _trainer(tmp_path, epochs=2, callbacks=[ScheduleFreeModes(bn_recalibration_batches=2)]).fit(module)
    assert len(module.statistics) == 3  # the sanity check's (not recalibrated), then one per epoch
    for weights, (mean, var) in zip(module.validated[1:], module.statistics[1:]):
        net = _net()
        for p, w in zip(net.parameters(), weights):
            p.data.copy_(w)
        norm = net[1]
        norm.reset_running_stats()
        norm.momentum = None
        with torch.no_grad():
            for inputs, _ in list(DataLoader(_data(), batch_size=16))[:2]:
                net(inputs)
        assert torch.equal(mean, norm.running_mean) and torch.equal(var, norm.running_var)
    assert module.net[1].momentum == 0.1  # restored


@pytest.mark.parametrize("shuffle", ["global-rng", "loader-generator"])
def test_batchnorm_recalibration_leaves_the_training_data_as_it_was(shuffle, tmp_path):
    """Its batches come from a new iterator of the shuffled training loader, whose order and seeds are drawn
    from the global RNG or the loader's generator: both are restored, so the weights equal a run's without."""
    runs = []
    for callbacks in ([ScheduleFreeModes(bn_recalibration_batches=2)], []):
        torch.manual_seed(3)
        module = Module(shuffle=shuffle)
        _trainer(tmp_path / str(len(runs)), epochs=3, callbacks=callbacks).fit(module)
        runs.append(module)
    assert _equal(list(runs[0].parameters()), list(runs[1].parameters()))
    assert not torch.equal(runs[0].statistics[-1][0], runs[1].statistics[-1][0])


def test_lightning_cli_reaches_it_by_class_name(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train"])
    cli = LightningCLI(
        UserModule,
        args=[
            "fit",
            "--optimizer=lightning_fusedsgd.FusedSGDScheduleFree",
            "--optimizer.lr=0.5",
            "--optimizer.warmup_steps=2",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=4",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_kwargs={"overwrite": True},
    )
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, FusedSGDScheduleFree) and optimizer.defaults["warmup_steps"] == 2
    assert optimizer.state_dict()["param_groups"][0]["k"] == 4
    assert not optimizer.training  # the fit ended in eval mode: the module holds x
    checkpoint = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=True)
    assert [g["train_mode"] for g in checkpoint["optimizer_states"][0]["param_groups"]] == [False]


def test_configure_fused_sgd_builds_it_with_the_schedules_warmup(tmp_path, caplog):
    """The schedule gives its warmup (in epochs: one epoch of 80 / 16 steps) and nothing else, which the log
    line says; param_groups' two groups; no lr scheduler."""
    schedule = Schedule(decay="multistep", warmup=1, milestones=(1,))
    module = TinyClassifier(lr=0.5, schedule_free=True, schedule=schedule)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    with caplog.at_level("INFO"):
        trainer.fit(module)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FusedSGDScheduleFree) and not trainer.lr_scheduler_configs
    assert [g["warmup_steps"] for g in optimizer.param_groups] == [5, 5]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.5]
    assert optimizer.state_dict()["param_groups"][0]["k"] == 10
    assert "warmup 5 of 10 steps (the schedule's warmup; its decay='multistep' is not used)" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lars=True), "steps without LARS: set lars=False"),
        (dict(momentum=1.0), "optimizer: Momentum must be between 0 and 1 exclusive: 1.0"),
        (dict(r=float("nan")), "optimizer: Invalid r: nan"),
    ],
)
def test_configure_fused_sgd_refuses_what_schedule_free_cannot_take(kwargs, message):
    module = TinyClassifier(lr=0.5, schedule_free=True, **kwargs)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match=message):
        trainer.fit(module)


class OverflowAt(Module):
    """Makes the loss of steps 1 and 2 inf: the GradScaler skips them."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step in (1, 2) else loss

    def on_before_optimizer_step(self, optimizer):
        self.before = [p.detach().clone() for p in self.parameters()], copy.deepcopy(optimizer.state_dict())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        optimizer = self.optimizers().optimizer
        if self.trainer.global_step in (2, 3):  # after the skipped steps
            weights, state = self.before
            assert _equal(list(self.parameters()), weights)
            assert optimizer.state_dict()["param_groups"] == state["param_groups"]
            assert all(
                _equal(list(a.values()), list(b.values()))
                for a, b in zip(optimizer.state_dict()["state"].values(), state["state"].values())
            )


def test_a_step_the_grad_scaler_skips_leaves_y_z_and_the_scalars(tmp_path):
    module = OverflowAt()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(module)
    assert trainer.optimizers[0].state_dict()["param_groups"][0]["k"] == 4  # 6 steps, 2 skipped


class Tuned(Module):
    """A module with the attributes Lightning's finders tune, ``lr`` and ``batch_size``."""

    def __init__(self, peer: bool = False) -> None:
        super().__init__()
        self.lr, self.batch_size, self.peer = HPARAMS["lr"], 16, peer

    def configure_optimizers(self):
        kind = schedulefree.SGDScheduleFree if self.peer else FusedSGDScheduleFree
        return kind(self.parameters(), **{**HPARAMS, "lr": self.lr})

    def training_step(self, batch, batch_idx):
        if not self.peer:
            return super().training_step(batch, batch_idx)
        inputs, targets = batch
        return F.cross_entropy(self.net(inputs), targets)

    def on_train_start(self) -> None:
        if self.peer:  # schedulefree's optimizer, switched by hand where its README says
            self.optimizers().optimizer.train()

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=self.batch_size)


def test_lightnings_lr_finder_steps_in_train_mode_and_leaves_the_optimizer_as_it_found_it(tmp_path):
    """Tuner.lr_find replaces the Trainer's callbacks for its trial fit: its steps still run in train mode,
    with schedulefree's losses for the same lrs, and the fit after it starts from the weights and mode the
    finder found."""
    from lightning.pytorch.tuner import Tuner

    results = {}
    for peer in (True, False):
        module = Tuned(peer=peer)
        trainer = _trainer(tmp_path / str(peer), epochs=2)
        finder = Tuner(trainer).lr_find(
            module, min_lr=1e-3, max_lr=1.0, num_training=6, early_stop_threshold=None
        )
        results[peer] = finder.results
        optimizer = trainer.optimizers[0]
        if not peer:
            assert not optimizer.training  # as the finder found it: a fresh optimizer is in eval mode
            assert _equal(
                [p.detach() for p in module.parameters()], [p.detach() for p in _net().parameters()]
            )
            trainer.fit(module)  # and the fit after it trains
            assert module.modes == [True] * (6 + 2 * 4)  # the finder's steps and the fit's
    assert results[False]["lr"] == results[True]["lr"] and len(results[False]["lr"]) == 6
    assert results[False]["loss"] == results[True]["loss"]


def test_lightnings_batch_size_finder_steps_in_train_mode(tmp_path):
    """Tuner.scale_batch_size's trials run in train mode: the size schedulefree's optimizer gets, and the
    weights and mode as the finder found them."""
    from lightning.pytorch.tuner import Tuner

    sizes = {}
    for peer in (True, False):
        module = Tuned(peer=peer)
        trainer = _trainer(tmp_path / str(peer), epochs=1, limit_train_batches=1)
        sizes[peer] = Tuner(trainer).scale_batch_size(module, mode="power", steps_per_trial=1, max_trials=3)
    assert sizes[False] == sizes[True] > 2  # grown from Lightning's first size, 2
    assert not trainer.optimizers[0].training
    assert _equal([p.detach() for p in module.parameters()], [p.detach() for p in _net().parameters()])
