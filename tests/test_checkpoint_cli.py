"""Bringing checkpoints to ``train.py``: ``init.path`` starts from a foreign checkpoint; bad files fail first.

Oracles: what the foreign checkpoint holds (weights and torch.optim.SGD's momentum, read back from
the file), what a run starts from (recorded by a probe callback at train start), and the bytes of a
previous run's checkpoint, which a failing run must leave alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning_helpers import SMALL_RUN, STEPS_PER_EPOCH, compose_train, last_checkpoint, run_train_py
from zip_layout import storage_record, with_directory_attribute, with_zip64_disk_count

from lightning_fusedsgd.checkpoint import CheckpointError, CheckpointMismatchError
from lightning_fusedsgd.lightning import ConfigError
from lightning_fusedsgd.schedule import scaled_lr
from runner.model import build_resnet
from runner.run import train

pytestmark = [
    pytest.mark.slow,  # whole training runs: make test runs them, make test-fast not
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:The number of training batches:UserWarning"),
]

SHORT = [*SMALL_RUN, "+trainer.enable_model_summary=false"]
# The quickstart network as torchvision's reference script would build it for 1-channel digits.
ARCH = dict(arch="resnet18", in_channels=1)


def probe(path: Path) -> list[str]:
    """Overrides adding lightning_helpers.StartProbe, which saves what the run starts from to ``path``."""
    return ["+callbacks.probe._target_=lightning_helpers.StartProbe", f"+callbacks.probe.path={path}"]


def save_torchvision_checkpoint(path: Path, num_classes: int = 10) -> None:
    """Two steps of torch.optim.SGD as torchvision's reference script runs it, saved in its layout.

    Without --norm-weight-decay that script puts every parameter in one group, where FusedSGD's
    configure_fused_sgd makes a decay and a no-decay group: loading it is a remap by name.
    """
    torch.manual_seed(1)
    model = build_resnet(num_classes=num_classes, **ARCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)
    for _ in range(2):
        optimizer.zero_grad()
        images, targets = torch.randn(4, 1, 32, 32), torch.randint(0, num_classes, (4,))
        F.cross_entropy(model(images), targets).backward()
        optimizer.step()
    args = argparse.Namespace(
        norm_weight_decay=None, bias_weight_decay=None, transformer_embedding_decay=None
    )
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "epoch": 0,
        "args": args,
    }
    torch.save(checkpoint, path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A torchvision checkpoint of the quickstart network, one of a 5-class network, and a Lightning run."""
    root = tmp_path_factory.mktemp("files")
    save_torchvision_checkpoint(root / "torchvision.pth")
    save_torchvision_checkpoint(root / "torchvision_5_classes.pth", num_classes=5)
    train(compose_train([*SHORT, "trainer.max_epochs=1"], root / "run"))
    three_groups = ["optim=fused_lars", "optim.no_lars_bias=false", "trainer.max_epochs=1"]
    train(compose_train([*SHORT, *three_groups], root / "lars_run"))
    return {
        "lightning_three_groups": last_checkpoint(root / "lars_run"),
        "torchvision": root / "torchvision.pth",
        "other_model": root / "torchvision_5_classes.pth",
        "lightning": last_checkpoint(root / "run"),
    }


def test_torchvision_checkpoint_continues_in_a_cli_run_with_its_weights_and_momentum(
    files, tmp_path: Path
) -> None:
    saved = torch.load(files["torchvision"], weights_only=False)
    names = [name for name, _ in build_resnet(num_classes=10, **ARCH).named_parameters()]
    momentum = {
        f"net.{name}": saved["optimizer"]["state"][i]["momentum_buffer"] for i, name in enumerate(names)
    }

    # torchvision's epoch 0 is done: continue at epoch 1 of a 2-epoch run.
    overrides = [f"init.path={files['torchvision']}", "init.start_epoch=1", "trainer.max_epochs=2"]
    summary = train(compose_train([*SHORT, *overrides, *probe(tmp_path / "start.pt")], tmp_path / "run"))

    start = torch.load(tmp_path / "start.pt", weights_only=True)
    for name, tensor in saved["model"].items():
        assert torch.equal(start["weights"][f"net.{name}"], tensor), name
    assert {
        name: state["momentum_buffer"] for name, state in start["state"].items()
    }.keys() == momentum.keys()
    for name, buffer in momentum.items():
        assert torch.equal(start["state"][name]["momentum_buffer"], buffer), name
    # Epoch 0 counts as done: the epoch counter, the step and the schedule (warmup over) continue there.
    assert (start["epoch"], start["global_step"]) == (1, STEPS_PER_EPOCH)
    assert start["lr"] == [scaled_lr(0.2, 16)] * 2
    assert summary["global_step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("source", ["weights_file", "weights_only_option"])
def test_weights_only_start_warns_that_momentum_restarts(source: str, files, tmp_path: Path) -> None:
    if source == "weights_file":
        weights = torch.load(files["torchvision"], weights_only=False)["model"]
        torch.save(weights, tmp_path / "weights.pt")
        overrides = [f"init.path={tmp_path / 'weights.pt'}"]
    else:
        overrides = [f"init.path={files['torchvision']}", "init.weights_only=true"]
    cfg = compose_train([*SHORT, *overrides, "trainer.max_epochs=1", *probe(tmp_path / "start.pt")], tmp_path)
    warning = r"weights of .* only: momentum buffers restart from zero.*starts at epoch 0 \(step 0\)"
    with pytest.warns(UserWarning, match=warning):
        train(cfg)
    start = torch.load(tmp_path / "start.pt", weights_only=True)
    assert start["state"] == {}
    assert start["lr"] == [0.0, 0.0]  # warmup from 0, as a new run


def _drop_group_params(checkpoint: dict) -> None:
    del checkpoint["optimizer_states"][0]["param_groups"][0]["params"]


def _state_as_lists(checkpoint: dict) -> None:
    """The first parameter's buffer as a nested list (converting all 11M elements would take a minute)."""
    first = next(iter(checkpoint["optimizer_states"][0]["state"].values()))
    first["momentum_buffer"] = first["momentum_buffer"].tolist()


# Edits of a Lightning checkpoint that a resume must refuse, with the message fragments naming the fix.
EDITS = {
    "group_without_params": (_drop_group_params, "param_groups[0] has no 'params' list"),
    "state_holds_lists": (_state_as_lists, "momentum_buffer of 'net.conv1.weight' is a list, not a tensor"),
    "no_lr_schedulers": (
        lambda checkpoint: checkpoint.pop("lr_schedulers"),
        "holds no lr scheduler state",
        "init.path=",
    ),
    "empty_lr_schedulers": (
        lambda checkpoint: checkpoint.__setitem__("lr_schedulers", []),
        "would restart the lr schedule from step 0",
    ),
}


def bad_start(case: str, files: dict[str, Path], tmp_path: Path) -> tuple[list[str], type, list[str]]:
    """Overrides, expected error type and message fragments for each way a start is refused."""
    damaged = tmp_path / "damaged.ckpt"
    if case == "ckpt_path_truncated":
        data = files["lightning"].read_bytes()
        damaged.write_bytes(data[: len(data) // 3])
        return [f"ckpt_path={damaged}"], CheckpointError, [str(damaged), "truncated or corrupted"]
    if case == "init_path_flipped_byte":
        data = bytearray(files["torchvision"].read_bytes())
        data[data.index(b"data/0") + 500] ^= 0xFF  # inside tensor data: only the CRC check sees it
        damaged.write_bytes(bytes(data))
        return [f"init.path={damaged}"], CheckpointError, [str(damaged), "fails its CRC check"]
    if case == "ckpt_path_record_marked_as_directory":  # torch.load alone returns uninitialized memory
        data = files["lightning"].read_bytes()
        damaged.write_bytes(with_directory_attribute(data, storage_record(data)))
        fragments = [str(damaged), f"record '{storage_record(data)}' is marked as a directory"]
        return [f"ckpt_path={damaged}"], CheckpointError, fragments
    if case == "init_path_zip64_disk_count":  # Python's zipfile raised BadZipFile
        damaged.write_bytes(with_zip64_disk_count(files["torchvision"].read_bytes(), 2))
        return [f"init.path={damaged}"], CheckpointError, [str(damaged), "says the archive spans disks"]
    if case == "init_path_other_model":
        fragments = ["model weights do not match", "net.fc.weight (checkpoint [5, 512], model [10, 512])"]
        return [f"init.path={files['other_model']}"], CheckpointMismatchError, fragments
    if case == "ckpt_path_other_model":  # resnet34 has more blocks per stage than the run's resnet18
        fragments = ["missing from the checkpoint (96): net.layer1.2.bn1.bias"]
        return [f"ckpt_path={files['lightning']}", "model.arch=resnet34"], CheckpointMismatchError, fragments
    if case == "init_start_epoch_past_the_run":
        fragments = ["init.start_epoch=1 must be >= 0 and below trainer.max_epochs=1"]
        return [f"init.path={files['torchvision']}", "init.start_epoch=1"], ConfigError, fragments
    if case.startswith("ckpt_path_edited_"):
        checkpoint = torch.load(files["lightning"], weights_only=False)
        edit, *fragments = EDITS[case.removeprefix("ckpt_path_edited_")]
        edit(checkpoint)
        torch.save(checkpoint, damaged)
        return [f"ckpt_path={damaged}"], CheckpointError, [str(damaged), *fragments]
    assert case == "ckpt_path_torchvision"
    fragments = ["is a torchvision checkpoint", f"init.path={files['torchvision']}"]
    return [f"ckpt_path={files['torchvision']}"], CheckpointError, fragments


@pytest.mark.parametrize(
    "case",
    [
        "ckpt_path_truncated",
        "init_path_flipped_byte",
        "ckpt_path_record_marked_as_directory",
        "init_path_zip64_disk_count",
        "init_path_other_model",
        "ckpt_path_other_model",
        "ckpt_path_torchvision",
        "init_start_epoch_past_the_run",
        *(f"ckpt_path_edited_{edit}" for edit in EDITS),
    ],
)
def test_refused_start_fails_before_training_and_overwrites_nothing(case: str, files, tmp_path: Path) -> None:
    overrides, error, fragments = bad_start(case, files, tmp_path)
    run_dir = tmp_path / "run"  # a previous run in the same directory
    last_checkpoint(run_dir).parent.mkdir(parents=True)
    last_checkpoint(run_dir).write_bytes(b"previous run")
    with pytest.raises(error) as raised:
        train(compose_train([*SHORT, "trainer.max_epochs=1", *overrides], run_dir))
    for fragment in fragments:
        assert fragment in str(raised.value)
    assert last_checkpoint(run_dir).read_bytes() == b"previous run"
    assert [path.name for path in last_checkpoint(run_dir).parent.iterdir()] == ["last.ckpt"]
    assert not (run_dir / "csv").exists()  # no logger, no trainer: nothing was started


def test_cli_reports_a_checkpoint_of_another_model_without_a_traceback(files, tmp_path: Path) -> None:
    last_checkpoint(tmp_path).parent.mkdir()
    last_checkpoint(tmp_path).write_bytes(b"previous run")
    result = run_train_py([*SHORT, f"init.path={files['other_model']}", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {files['other_model']}: model weights do not match the model")
    assert "net.fc.weight (checkpoint [5, 512], model [10, 512])" in result.stderr
    assert last_checkpoint(tmp_path).read_bytes() == b"previous run"


def test_cli_reports_a_damaged_checkpoint_in_one_line(files, tmp_path: Path) -> None:
    """A checkpoint whose zip directory marks a storage record as a directory (one bit): torch.load would
    return that storage uninitialized; train.py prints one line naming the file and exits with status 2."""
    data = files["lightning"].read_bytes()
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(with_directory_attribute(data, storage_record(data)))
    result = run_train_py(
        [*SHORT, "trainer.max_epochs=2", f"ckpt_path={damaged}", f"hydra.run.dir={tmp_path}"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"error: checkpoint '{damaged}' is truncated or corrupted: record ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_resuming_with_another_grouping_is_an_error_without_a_traceback(files, tmp_path: Path) -> None:
    """A run saved with three groups (LARS on biases too) resumed with the default two: the lr schedule
    cannot be matched group by group, and the CLI says so and how to start from the file instead."""
    result = run_train_py(
        [
            *SHORT,
            "trainer.max_epochs=2",
            f"ckpt_path={files['lightning_three_groups']}",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "error: the lr scheduler checkpoint has 3 parameter groups, this optimizer has 2" in result.stderr
    assert "init.path=<checkpoint> instead of ckpt_path" in result.stderr
