"""Checkpoint remapping, starting from foreign checkpoints, validation and atomic writes.

Oracles are independent of the code under test: ``torch.optim.SGD`` continuing a run, the same
FusedSGD loaded the plain way, parameter groups written out by hand, and bytes on disk.
"""

from __future__ import annotations

import argparse
import copy
import io
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_helpers import cpu_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fusedsgd.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_optimizer_state,
    read_checkpoint_file,
    read_start_checkpoint,
    remap_optimizer_state_dict,
    same_param_layout,
    save_checkpoint_file,
)
from lightning_fusedsgd.lightning.checkpointing import AtomicCheckpointIO, InitFromCheckpoint
from lightning_fusedsgd.optim import FusedSGD
from lightning_fusedsgd.schedule import WarmupLR

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")

LR, MOMENTUM, WD = 0.05, 0.9, 1e-4
BATCH, STEPS_PER_EPOCH = 8, 4


class Net(nn.Module):
    """Conv + BatchNorm + Linear: weights, biases and norm parameters, like a ResNet in miniature."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def batches(seed: int, count: int = STEPS_PER_EPOCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
        for _ in range(count)
    ]


def loader(data: list[tuple[torch.Tensor, torch.Tensor]]) -> DataLoader:
    """The same batches, in the same order, as a DataLoader for Lightning."""
    return DataLoader(
        TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])), batch_size=BATCH
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def torchvision_groups(model: Net) -> list[dict]:
    """What torchvision's reference script builds with --norm-weight-decay 0.0, written out by hand."""
    other = [model.conv.weight, model.conv.bias, model.fc.weight, model.fc.bias]
    return [
        {"params": other, "weight_decay": WD},
        {"params": [model.bn.weight, model.bn.bias], "weight_decay": 0.0},
    ]


def buffers_by_name(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in module.named_parameters()}
    return {names[id(p)]: s["momentum_buffer"] for p, s in optimizer.state.items() if "momentum_buffer" in s}


def assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], exact: bool
) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if exact:
            assert torch.equal(actual[name], expected[name]), name
        else:  # FusedSGD and torch.optim.SGD round differently in the last bit
            torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


class LitNet(pl.LightningModule):
    """A LightningModule using FusedSGD with a grouping unlike torch's: no-decay group first, named."""

    def __init__(
        self,
        classes: int = 3,
        master_weights: bool = False,
        total_steps: int | None = None,
        update_rounding: str = "nearest",
    ) -> None:
        super().__init__()
        self.model = Net(classes)
        self.master_weights = master_weights
        self.total_steps = total_steps
        self.update_rounding = update_rounding

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        named = list(self.named_parameters())
        norm = [(n, p) for n, p in named if ".bn." in n]
        other = [(n, p) for n, p in named if ".bn." not in n]
        optimizer = FusedSGD(
            [{"params": norm, "weight_decay": 0.0}, {"params": other, "weight_decay": WD}],
            lr=LR,
            momentum=MOMENTUM,
            master_weights=self.master_weights,
            update_rounding=self.update_rounding,
        )
        if self.total_steps is None:
            return optimizer
        scheduler = WarmupLR(optimizer, total_steps=self.total_steps, warmup_steps=self.total_steps // 2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_trainer(root: Path, **kwargs) -> pl.Trainer:
    return cpu_trainer(**({"default_root_dir": root, "max_epochs": 1} | kwargs))


def save_torchvision_checkpoint(
    path: Path, *, ddp_prefix: bool = False, classes: int = 3
) -> tuple[Net, torch.optim.SGD]:
    """Train a Net one epoch as torchvision's reference script would and save its checkpoint layout."""
    torch.manual_seed(0)
    model = Net(classes)
    optimizer = torch.optim.SGD(torchvision_groups(model), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)
    train(model, optimizer, batches(seed=1))
    scheduler.step()
    weights = {("module." if ddp_prefix else "") + k: v for k, v in model.state_dict().items()}
    args = argparse.Namespace(norm_weight_decay=0.0, bias_weight_decay=None, transformer_embedding_decay=None)
    checkpoint = {
        "model": weights,
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
    }
    torch.save(checkpoint | {"epoch": 0, "args": args}, path)
    return model, optimizer


# ---------------------------------------------------------------------------------------------------
# remap_optimizer_state_dict / load_optimizer_state
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("named", [True, False], ids=["param_names", "saved_names"])
def test_one_group_sgd_state_continues_in_grouped_fusedsgd(named: bool) -> None:
    torch.manual_seed(0)
    source = Net()
    params = source.named_parameters() if named else source.parameters()
    sgd = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    train(source, sgd, batches(seed=1))
    saved, weights = copy.deepcopy(sgd.state_dict()), copy.deepcopy(source.state_dict())
    saved_buffers = {name: b.clone() for name, b in buffers_by_name(sgd, source).items()}

    # Oracle 1: torch.optim.SGD simply keeps going.
    train(source, sgd, batches(seed=2))

    # Oracle 2: FusedSGD with torch's own layout, loaded the plain way.
    plain = Net()
    plain.load_state_dict(weights)
    plain_opt = FusedSGD(plain.named_parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    plain_opt.load_state_dict(copy.deepcopy(saved))

    # Under test: two groups, in another order, matched by name.
    target = Net()
    target.load_state_dict(weights)
    named_params = list(target.named_parameters())
    vectors = [(n, p) for n, p in named_params if p.ndim <= 1]
    matrices = [(n, p) for n, p in named_params if p.ndim > 1]
    grouped = FusedSGD(
        [{"params": vectors}, {"params": matrices}],
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WD,
    )
    saved_names = None if named else [name for name, _ in source.named_parameters()]
    load_optimizer_state(grouped, saved, saved_names=saved_names)
    assert_same_tensors(buffers_by_name(grouped, target), saved_buffers, exact=True)

    train(plain, plain_opt, batches(seed=2))
    train(target, grouped, batches(seed=2))
    assert_same_tensors(dict(target.named_parameters()), dict(plain.named_parameters()), exact=True)
    assert_same_tensors(buffers_by_name(grouped, target), buffers_by_name(plain_opt, plain), exact=True)
    assert_same_tensors(dict(target.named_parameters()), dict(source.named_parameters()), exact=False)
    assert_same_tensors(buffers_by_name(grouped, target), buffers_by_name(sgd, source), exact=False)


def test_remap_keeps_target_hyperparameters_and_swaps_prefixes() -> None:
    ddp = nn.Module()
    ddp.module = Net()  # names "module.conv.weight", as saved from a DDP-wrapped model
    sgd = torch.optim.SGD(ddp.named_parameters(), lr=0.5, momentum=MOMENTUM, weight_decay=WD)
    for p in ddp.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    saved = sgd.state_dict()

    lit = nn.Module()
    lit.model = Net()  # names "model.conv.weight", as in a LightningModule holding self.model
    names, params = zip(*lit.named_parameters())
    target_groups = [
        {"params": params[2:], "param_names": names[2:], "lr": 0.1, "weight_decay": 0.0, "lars": False},
        {"params": params[:2], "param_names": names[:2], "lr": 0.2, "weight_decay": WD, "lars": True},
    ]
    remapped = remap_optimizer_state_dict(saved, target_groups)

    groups = remapped["param_groups"]
    assert [g["param_names"] for g in groups] == [list(names[2:]), list(names[:2])]
    assert [(g["lr"], g["weight_decay"], g["lars"]) for g in groups] == [(0.1, 0.0, False), (0.2, WD, True)]
    assert [g["params"] for g in remapped["param_groups"]] == [[0, 1, 2, 3], [4, 5]]
    saved_by_name = dict(zip(saved["param_groups"][0]["param_names"], saved["state"].values()))
    for group in remapped["param_groups"]:
        for index, name in zip(group["params"], group["param_names"]):
            # The very same tensor moved: bit-identical by construction, no copy made.
            assert remapped["state"][index] is saved_by_name[name.replace("model.", "module.", 1)]


def test_remap_error_names_missing_extra_and_reshaped_parameters_and_changes_nothing() -> None:
    source = Net(classes=3)
    sgd = torch.optim.SGD(source.named_parameters(), lr=LR, momentum=MOMENTUM)
    train(source, sgd, batches(seed=1, count=1))
    saved = sgd.state_dict()
    saved["param_groups"][0]["param_names"] = [
        "bn.beta" if n == "bn.bias" else n for n in saved["param_groups"][0]["param_names"]
    ]

    target = Net(classes=5)
    optimizer = FusedSGD(target.named_parameters(), lr=LR, momentum=MOMENTUM)
    train(target, optimizer, batches(seed=3, count=1))
    before = copy.deepcopy(optimizer.state_dict())

    with pytest.raises(CheckpointMismatchError) as error:
        load_optimizer_state(optimizer, saved, source="old.ckpt")
    message = str(error.value)
    assert "old.ckpt" in message
    assert "missing from the checkpoint (1): bn.bias" in message
    assert "in the checkpoint but not in the model (1): bn.beta" in message
    assert "fc.weight (checkpoint momentum_buffer [3, 4], model [5, 4])" in message
    assert "fc.bias (checkpoint momentum_buffer [3], model [5])" in message
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, state in before["state"].items():
        assert torch.equal(after["state"][index]["momentum_buffer"], state["momentum_buffer"])


def test_unnamed_state_without_names_is_refused_with_the_fix() -> None:
    model = Net()
    saved = torch.optim.SGD(model.parameters(), lr=LR).state_dict()
    target = FusedSGD(list(model.named_parameters())[:2], lr=LR)
    target.add_param_group({"params": list(model.named_parameters())[2:]})
    with pytest.raises(CheckpointMismatchError, match="no param_names.*Pass saved_names"):
        remap_optimizer_state_dict(saved, target.param_groups)
    with pytest.raises(CheckpointMismatchError, match="5 saved names given for 6 saved parameters"):
        remap_optimizer_state_dict(saved, target.param_groups, saved_names=["a", "b", "c", "d", "e"])


def test_same_param_layout() -> None:
    model = Net()
    named = list(model.named_parameters())
    one_group = torch.optim.SGD(named, lr=LR)
    assert same_param_layout(one_group.state_dict(), one_group.param_groups)
    reordered = torch.optim.SGD(named[::-1], lr=LR)  # same sizes, names in another order
    assert not same_param_layout(one_group.state_dict(), reordered.param_groups)
    unnamed = torch.optim.SGD(model.parameters(), lr=LR)
    assert same_param_layout(unnamed.state_dict(), reordered.param_groups)  # sizes are all torch can see
    two_groups = torch.optim.SGD([{"params": named[:2]}, {"params": named[2:]}], lr=LR)
    assert not same_param_layout(one_group.state_dict(), two_groups.param_groups)


# ---------------------------------------------------------------------------------------------------
# Starting a Lightning run from a checkpoint made elsewhere
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ddp_prefix", [False, True], ids=["plain", "ddp_module_prefix"])
def test_torchvision_checkpoint_starts_a_fit_with_its_momentum(tmp_path: Path, ddp_prefix: bool) -> None:
    path = tmp_path / "checkpoint.pth"
    reference, sgd = save_torchvision_checkpoint(path, ddp_prefix=ddp_prefix)
    saved_buffers = {f"model.{n}": b.clone() for n, b in buffers_by_name(sgd, reference).items()}
    train(reference, sgd, batches(seed=2))  # oracle: torchvision's run continues one more epoch

    start = read_start_checkpoint(path, LitNet())
    assert (start.kind, start.epoch) == ("torchvision", 0)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.buffers = {
                n: b.clone() for n, b in buffers_by_name(trainer.optimizers[0], pl_module).items()
            }

    probe = Probe()
    lit = LitNet()
    make_trainer(tmp_path, callbacks=[InitFromCheckpoint(path), probe]).fit(lit, loader(batches(seed=2)))

    assert_same_tensors(probe.buffers, saved_buffers, exact=True)
    expected = {f"model.{n}": p for n, p in reference.named_parameters()}
    assert_same_tensors(dict(lit.named_parameters()), expected, exact=False)


def test_weights_only_start_warns_and_continues_the_run_at_start_epoch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weights = Net().state_dict()
    torch.save(weights, tmp_path / "weights.pt")

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.lr = trainer.optimizers[0].param_groups[0]["lr"]
                self.state = dict(trainer.optimizers[0].state)
                self.weights = {n: t.clone() for n, t in pl_module.model.state_dict().items()}
                self.position = (trainer.current_epoch, trainer.global_step)

    probe = Probe()
    lit = LitNet(total_steps=20)
    start = InitFromCheckpoint(tmp_path / "weights.pt", start_epoch=2)
    trainer = make_trainer(tmp_path, max_epochs=3, callbacks=[start, probe])
    warning = (
        r"weights of .*weights\.pt only: momentum buffers restart from zero.*starts at epoch 2 \(step 8\)"
    )
    with pytest.warns(UserWarning, match=warning):
        trainer.fit(lit, loader(batches(seed=2)))

    assert probe.state == {}
    assert_same_tensors(probe.weights, weights, exact=True)
    # Two epochs of 4 steps counted as done: max_epochs=3 leaves one epoch to train.
    assert probe.position == (2, 2 * STEPS_PER_EPOCH)
    assert (trainer.current_epoch, trainer.global_step) == (3, 3 * STEPS_PER_EPOCH)
    schedule = trainer.lr_scheduler_configs[0].scheduler.schedule
    assert probe.lr == schedule.lr_at(8, LR)  # warmup is 10 steps: 8 in, the lr is 0.8 x the peak
    assert probe.lr == pytest.approx(0.8 * LR)


def test_bf16_true_start_keeps_fp32_weights_as_master_and_fp32_momentum(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pth"
    reference, sgd = save_torchvision_checkpoint(path)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            names = {id(p): n for n, p in pl_module.named_parameters()}
            state = trainer.optimizers[0].state
            self.masters = {names[id(p)]: s["master_param"].clone() for p, s in state.items()}
            self.buffers = {names[id(p)]: s["momentum_buffer"].clone() for p, s in state.items()}

    probe = Probe()
    lit = LitNet(master_weights=True)
    make_trainer(
        tmp_path, precision="bf16-true", max_steps=1, callbacks=[InitFromCheckpoint(path), probe]
    ).fit(lit, loader(batches(seed=2)))
    assert next(lit.parameters()).dtype == torch.bfloat16
    assert_same_tensors(probe.masters, {f"model.{n}": p for n, p in reference.named_parameters()}, exact=True)
    expected_buffers = {f"model.{n}": b for n, b in buffers_by_name(sgd, reference).items()}
    assert_same_tensors(probe.buffers, expected_buffers, exact=True)


def test_bf16_true_start_with_kahan_keeps_the_fp32_weights_low_bits(tmp_path: Path) -> None:
    """Without masters, update_rounding="kahan" starts each compensation at what rounding the checkpoint's
    fp32 weight to the bf16 param dropped: param + compensation is closer to the fp32 weight than the
    param."""
    path = tmp_path / "checkpoint.pth"
    reference, _ = save_torchvision_checkpoint(path)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            state = trainer.optimizers[0].state
            self.weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.compensations = {
                n: state[p]["kahan_compensation"].clone() for n, p in pl_module.named_parameters()
            }

    probe = Probe()
    make_trainer(
        tmp_path, precision="bf16-true", max_steps=1, callbacks=[InitFromCheckpoint(path), probe]
    ).fit(LitNet(update_rounding="kahan"), loader(batches(seed=2)))
    gained = 0
    for name, fp32 in reference.named_parameters():
        param, compensation = probe.weights[f"model.{name}"], probe.compensations[f"model.{name}"]
        fp32 = fp32.detach()
        assert torch.equal(param, fp32.to(torch.bfloat16))
        assert torch.equal(compensation, (fp32 - param.float()).to(torch.bfloat16))
        error, kept = (param.float() - fp32).abs(), (param.float() + compensation.float() - fp32).abs()
        assert torch.all(kept <= error)
        gained += int((kept < error).sum())
    assert gained > 0


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_checkpoint_of_another_model_fails_before_training_and_overwrites_nothing(tmp_path: Path) -> None:
    path = tmp_path / "other.pth"
    save_torchvision_checkpoint(path, classes=5)
    with pytest.raises(CheckpointMismatchError) as error:
        read_start_checkpoint(path, LitNet())
    assert "model weights do not match" in str(error.value)
    assert "model.fc.weight (checkpoint [5, 4], model [3, 4])" in str(error.value)
    assert "model.fc.bias (checkpoint [5], model [3])" in str(error.value)

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"previous run")
    lit = LitNet()
    before = {n: t.clone() for n, t in lit.state_dict().items()}
    trainer = make_trainer(
        tmp_path,
        enable_checkpointing=True,
        callbacks=[InitFromCheckpoint(path), ModelCheckpoint(dirpath=checkpoints, save_last=True)],
        plugins=[AtomicCheckpointIO()],
    )
    with pytest.raises(CheckpointMismatchError, match=r"other\.pth"):
        trainer.fit(lit, loader(batches(seed=2)))
    assert trainer.global_step == 0
    assert (checkpoints / "last.ckpt").read_bytes() == b"previous run"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert_same_tensors(lit.state_dict(), before, exact=True)


@pytest.mark.parametrize(
    "args, groups",
    [
        (
            argparse.Namespace(
                norm_weight_decay=0.0, bias_weight_decay=0.0, transformer_embedding_decay=None
            ),
            # torchvision checks custom keys before norm classes, so bn.bias joins "bias", not "norm".
            [["conv.weight", "fc.weight"], ["bn.weight"], ["conv.bias", "bn.bias", "fc.bias"]],
        ),
        (
            argparse.Namespace(
                norm_weight_decay=None, bias_weight_decay=None, transformer_embedding_decay=None
            ),
            [["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]],
        ),
        (
            None,
            [["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]],
        ),  # pre-0.12 script
    ],
    ids=["norm_and_bias_decay", "defaults", "no_args"],
)
def test_torchvision_unnamed_groups_are_rebuilt_from_its_args(tmp_path: Path, args, groups) -> None:
    model = Net()
    params = dict(model.named_parameters())
    sgd = torch.optim.SGD(
        [{"params": [params[n] for n in names]} for names in groups], lr=LR, momentum=MOMENTUM
    )
    train(model, sgd, batches(seed=1, count=1))
    checkpoint = {"model": model.state_dict(), "optimizer": sgd.state_dict(), "epoch": 3, "args": args}
    torch.save(checkpoint, tmp_path / "tv.pth")

    start = read_start_checkpoint(tmp_path / "tv.pth", LitNet())
    saved_groups = start.optimizer_state["param_groups"]
    assert [g["param_names"] for g in saved_groups] == [[f"model.{n}" for n in names] for names in groups]
    lit = LitNet()
    optimizer = lit.configure_optimizers()
    load_optimizer_state(optimizer, start.optimizer_state)
    expected = {f"model.{n}": b for n, b in buffers_by_name(sgd, model).items()}
    assert_same_tensors(buffers_by_name(optimizer, lit), expected, exact=True)


def test_lightning_checkpoint_of_unnamed_sgd_matches_by_parameter_order(tmp_path: Path) -> None:
    source = LitNet()
    sgd = torch.optim.SGD(source.parameters(), lr=LR, momentum=MOMENTUM)
    train(source.model, sgd, batches(seed=1, count=1))
    checkpoint = {
        "pytorch-lightning_version": pl.__version__,
        "state_dict": source.state_dict(),
        "optimizer_states": [sgd.state_dict()],
        "epoch": 0,
        "global_step": 1,
    }
    torch.save(checkpoint, tmp_path / "sgd.ckpt")
    start = read_start_checkpoint(tmp_path / "sgd.ckpt", LitNet())
    assert (start.kind, start.global_step) == ("lightning", 1)
    assert start.optimizer_state["param_groups"][0]["param_names"] == [
        n for n, _ in source.named_parameters()
    ]

    two_groups = [{"params": source.model.conv.parameters()}, {"params": source.model.fc.parameters()}]
    checkpoint["optimizer_states"] = [torch.optim.SGD(two_groups, lr=LR).state_dict()]
    torch.save(checkpoint, tmp_path / "two_groups.ckpt")
    refusal = r"two_groups\.ckpt.*no param_names, 2 group\(s\) and 4 parameters.*weights_only=True"
    with pytest.raises(CheckpointMismatchError, match=refusal):
        read_start_checkpoint(tmp_path / "two_groups.ckpt", LitNet())
    assert (
        read_start_checkpoint(tmp_path / "two_groups.ckpt", LitNet(), weights_only=True).optimizer_state
        is None
    )


def test_extra_and_missing_weights_are_named(tmp_path: Path) -> None:
    weights = Net().state_dict()
    weights["head.weight"] = weights.pop("fc.weight")
    torch.save(weights, tmp_path / "w.pt")
    with pytest.raises(CheckpointMismatchError) as error:
        read_start_checkpoint(tmp_path / "w.pt", LitNet())
    assert "missing from the checkpoint (1): model.fc.weight" in str(error.value)
    assert "in the checkpoint but not in the model (1): head.weight" in str(error.value)


# ---------------------------------------------------------------------------------------------------
# Damaged files
# ---------------------------------------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped_byte":  # inside the tensor data, which torch.load alone would not notice
        offset = data.index(b"data/0") + 200
        path.write_bytes(data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :])
    elif how == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped_byte", "garbage", "empty", "missing"])
def test_damaged_file_fails_naming_the_file(tmp_path: Path, how: str) -> None:
    path = tmp_path / "run" / "last.ckpt"
    path.parent.mkdir()
    torch.save({"state_dict": {"w": torch.arange(1000.0)}}, path)
    _damage(path, how)
    with pytest.raises(CheckpointError, match=str(path)):
        read_checkpoint_file(path)


def test_resume_from_truncated_checkpoint_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    trainer = make_trainer(tmp_path, max_steps=1, plugins=[AtomicCheckpointIO()])
    trainer.fit(LitNet(), loader(batches(seed=2)))
    trainer.save_checkpoint(path)
    _damage(path, "truncated")
    with pytest.raises(CheckpointError, match=rf"{path}.*truncated or corrupted"):
        make_trainer(tmp_path, max_steps=2, plugins=[AtomicCheckpointIO()]).fit(
            LitNet(), loader(batches(seed=2)), ckpt_path=path
        )


# ---------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.filterwarnings("error:Starting from the weights")
def test_atomic_io_checkpoints_resume_bit_identically(tmp_path: Path) -> None:
    def fit(max_epochs: int, dirpath: Path, ckpt_path: Path | None = None) -> tuple[LitNet, pl.Trainer]:
        torch.manual_seed(0)
        lit = LitNet(total_steps=4 * STEPS_PER_EPOCH)
        # On a resume, Lightning's ckpt_path wins over a start checkpoint (which would warn if applied).
        start = [InitFromCheckpoint(tmp_path / "weights.pt")] if ckpt_path else []
        trainer = make_trainer(
            tmp_path,
            max_epochs=max_epochs,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True), *start],
            plugins=[AtomicCheckpointIO()],
        )
        trainer.fit(lit, loader(batches(seed=2)), ckpt_path=ckpt_path)
        return lit, trainer

    straight, straight_trainer = fit(4, tmp_path / "straight")
    fit(2, tmp_path / "split")
    torch.save(Net().state_dict(), tmp_path / "weights.pt")
    checkpoint = read_checkpoint_file(tmp_path / "split" / "last.ckpt", trusted=True)
    assert checkpoint["global_step"] == 2 * STEPS_PER_EPOCH
    resumed, resumed_trainer = fit(4, tmp_path / "split", ckpt_path=tmp_path / "split" / "last.ckpt")

    assert_same_tensors(dict(resumed.named_parameters()), dict(straight.named_parameters()), exact=True)
    assert_same_tensors(
        buffers_by_name(resumed_trainer.optimizers[0], resumed),
        buffers_by_name(straight_trainer.optimizers[0], straight),
        exact=True,
    )
    for directory in ("straight", "split"):
        assert not list((tmp_path / directory).glob(".*")), "temporary files left behind"


def test_failed_write_keeps_the_previous_checkpoint_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "last.ckpt"
    save_checkpoint_file({"step": 1, "w": torch.ones(1000)}, path)
    previous = path.read_bytes()

    real_save = torch.save

    def save_half_then_fail(obj, file, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint_file({"step": 2, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()

    assert path.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert read_checkpoint_file(path)["step"] == 1


def test_next_save_removes_temp_file_of_a_killed_writer(tmp_path: Path) -> None:
    script = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    stale = tmp_path / f".last.ckpt.{int(dead.stdout)}.0badf00d.tmp"
    stale.write_bytes(b"half a checkpoint")
    save_checkpoint_file({"step": 3}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert read_checkpoint_file(tmp_path / "last.ckpt") == {"step": 3}


def test_optimizer_state_written_before_the_custom_ops_refactor_still_loads():
    """tests/fixtures/fusedsgd_state_f79bf57.pt: FusedSGD's state dict as main wrote it at f79bf57 (LARS
    and excluded groups, bf16 params with fp32 masters). It loads bit for bit, and the steps that follow
    match torch.optim.SGD on the fp32 params outside LARS (the independent oracle there)."""
    from lightning_fusedsgd import FusedSGD, param_groups

    saved = torch.load(Path(__file__).parent / "fixtures" / "fusedsgd_state_f79bf57.pt", weights_only=True)
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model[2].to(torch.bfloat16)
    model.load_state_dict(saved["model"])
    opt = FusedSGD(
        param_groups(model, 1e-4), lr=0.1, momentum=0.9, nesterov=True, master_weights=True, lars=True
    )
    opt.load_state_dict(saved["optimizer"])
    params = [p for group in opt.param_groups for p in group["params"]]
    for index, p in enumerate(params):
        for key, tensor in saved["optimizer"]["state"][index].items():
            assert opt.state[p][key].dtype == torch.float32 and torch.equal(opt.state[p][key], tensor)

    plain = [p for p in opt.param_groups[1]["params"] if p.dtype == torch.float32]
    oracle_params = [nn.Parameter(p.detach().clone()) for p in plain]
    oracle = torch.optim.SGD(oracle_params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0)
    for p, q in zip(plain, oracle_params):
        oracle.state[q]["momentum_buffer"] = opt.state[p]["momentum_buffer"].clone()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        for p, q in zip(plain, oracle_params):
            q.grad = p.grad.clone()
        opt.step()
        oracle.step()
    for p, q in zip(plain, oracle_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
    for p in params:
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), opt.state[p]["master_param"].bfloat16())


def _stepped_state(dtype: torch.dtype) -> tuple[list[nn.Parameter], dict]:
    """Params of ``dtype`` and the state dict of two FusedSGD steps on them (fp32 masters for low
    precision)."""
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in [(5, 3), (4,)]]
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9, master_weights=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(dtype)
        optimizer.step()
    return params, copy.deepcopy(optimizer.state_dict())


def _double_the_buffers(optimizer, state_dict):
    for state in state_dict["state"].values():
        state["momentum_buffer"] = state["momentum_buffer"] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_hooks_decide_what_is_loaded_for_every_dtype(dtype: torch.dtype) -> None:
    params, saved = _stepped_state(dtype)
    target = FusedSGD(
        [nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9, master_weights=True
    )
    seen_dtypes = []
    target.register_load_state_dict_pre_hook(_double_the_buffers)
    target.register_load_state_dict_post_hook(
        lambda optimizer: seen_dtypes.extend(s["momentum_buffer"].dtype for s in optimizer.state.values())
    )
    expected = [saved["state"][i]["momentum_buffer"] * 2 for i in range(2)]
    target.load_state_dict(copy.deepcopy(saved))  # the hook edits the dict it is given, as torch's do
    buffers = [target.state[p]["momentum_buffer"] for p in target.param_groups[0]["params"]]
    # The pre-hook's edit is what was loaded, in fp32 (the masters' dtype) for bf16 params too ...
    assert all(b.dtype == torch.float32 and torch.equal(b, e) for b, e in zip(buffers, expected))
    # ... and the post-hook saw the state as it stays.
    assert seen_dtypes == [torch.float32, torch.float32]
    if dtype == torch.float32:  # torch.optim.SGD loads the same hook's edit: the same buffers
        oracle = torch.optim.SGD([nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9)
        oracle.register_load_state_dict_pre_hook(_double_the_buffers)
        oracle.load_state_dict(copy.deepcopy(saved))
        for b, p in zip(buffers, oracle.param_groups[0]["params"]):
            assert torch.equal(b, oracle.state[p]["momentum_buffer"])
