"""Every boolean option refuses a string (a config's "false", which Python takes as true), wherever it enters:
the constructor, a group dict, add_param_group, a loaded state dict, the param-group builder, the Lightning
factory, a Hydra override, and the recipe runner's DataModules, models and the flags it reads. The options
are read off the signatures, so a new one is checked here too."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from lightning_helpers import TinyClassifier, compose_train, cpu_trainer, run_train_py
from torch import nn

from lightning_fusedsgd import FusedSGD, param_groups
from lightning_fusedsgd.lightning import ConfigError, configure_fused_sgd
from runner.data import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule, SyntheticDataModule
from runner.datamodule import SeededDataModule
from runner.model import ImageClassifier
from runner.run import train
from runner.simclr import SimCLR


def _boolean_arguments(function) -> list[str]:
    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.annotation in ("bool", "bool | None")
    ]


CONSTRUCTOR_FLAGS = _boolean_arguments(FusedSGD.__init__)
GROUP_FLAGS = [name for name in CONSTRUCTOR_FLAGS if name in FusedSGD([torch.zeros(1)]).defaults]


def test_the_signatures_have_the_flags_this_file_checks():
    assert {"master_weights", "nesterov", "capturable", "set_grad_none", "lars"} <= set(CONSTRUCTOR_FLAGS)
    assert "master_weights" in GROUP_FLAGS and "capturable" not in GROUP_FLAGS


def _momentum_for(key: str) -> dict[str, float]:
    return {"momentum": 0.9} if key == "nesterov" else {}


@pytest.mark.parametrize("key", CONSTRUCTOR_FLAGS)
def test_a_string_is_refused_at_construction(key):
    with pytest.raises(ValueError, match=f"Invalid {key}: 'false'"):
        FusedSGD([nn.Parameter(torch.randn(3))], **{key: "false"}, **_momentum_for(key))


@pytest.mark.parametrize("key", GROUP_FLAGS)
def test_a_string_in_a_group_dict_is_refused(key):
    group = {"params": [nn.Parameter(torch.randn(3))], key: "false"}
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: Invalid {key}: 'false'"):
        FusedSGD([group], **_momentum_for(key))


@pytest.mark.parametrize("key", GROUP_FLAGS)
def test_a_string_in_an_added_group_is_refused_and_nothing_added(key):
    optimizer = FusedSGD([nn.Parameter(torch.randn(3))], **_momentum_for(key))
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: Invalid {key}: 'false'"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.randn(2))], key: "false"})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("key", GROUP_FLAGS)
def test_a_string_in_a_loaded_state_dict_is_refused_and_nothing_changed(key):
    params = [nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0][key] = "false"
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=rf"saved param_groups\[0\]: Invalid {key}: 'false'"):
        optimizer.load_state_dict(saved)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_master_weights_false_as_a_string_used_to_keep_masters():
    """The defect: ``master_weights="false"`` kept fp32 masters. Now it is refused before anything exists."""
    param = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(
        ValueError, match="Invalid master_weights: 'false'. It must be True or False, got a str"
    ):
        FusedSGD([param], lr=0.1, master_weights="false")


@pytest.mark.parametrize("key", _boolean_arguments(param_groups))
def test_the_group_builder_refuses_a_string(key):
    with pytest.raises(ValueError, match=f"Invalid {key}: 'false'"):
        param_groups(nn.Linear(2, 2), 1e-4, **{key: "false"})


@pytest.mark.parametrize("key", _boolean_arguments(configure_fused_sgd))
def test_the_lightning_factory_refuses_a_string(key):
    with pytest.raises(ValueError, match=f"Invalid {key}: 'false'"):
        cpu_trainer(max_steps=1).fit(TinyClassifier(**{key: "false"}))


@pytest.mark.slow
def test_a_hydra_override_of_a_string_is_refused_in_one_line():
    result = run_train_py(["debug=tiny", "optim.master_weights='false'", "trainer.max_steps=1"])
    assert result.returncode == 2
    assert "error: Invalid master_weights: 'false'" in result.stderr
    assert "Traceback" not in result.stderr


# The runner's nodes: the DataModules' (their shared arguments' too) and the models'.
RUNNER_FLAGS = [
    pytest.param(build, node, key, id=f"{build.__name__}-{key}")
    for build, node, own in (
        (DigitsDataModule, "data", True),
        (CIFAR10DataModule, "data", True),
        (ImageFolderDataModule, "data", True),
        (SyntheticDataModule, "data", True),
        (ImageClassifier, "model", False),
        (SimCLR, "model", False),
    )
    for key in _boolean_arguments(build.__init__)
    + (_boolean_arguments(SeededDataModule.__init__) if own else [])
]


def test_the_runners_signatures_have_the_flags_this_file_checks():
    checked = {(values[1], values[2]) for values in (param.values for param in RUNNER_FLAGS)}
    assert {
        ("data", "drop_last"),
        ("data", "skip_unreadable"),
        ("data", "augment"),
        ("data", "download"),
    } <= checked
    assert {("model", "small_input"), ("model", "zero_init_residual"), ("model", "compile")} <= checked


@pytest.mark.parametrize(("build", "node", "key"), RUNNER_FLAGS)
def test_a_string_is_refused_by_the_runners_constructors(build, node, key):
    """``data.skip_unreadable=no`` turned skipping on: Hydra gives ``no`` as a string, which Python takes as
    true."""
    with pytest.raises(ConfigError, match=f"^{node}.{key}='no' is not a boolean: set {node}.{key}=true or"):
        build(**{key: "no"})


@pytest.mark.parametrize("override", ["init.trusted=no", "init.weights_only=no", "+optim.schedule_free=no",
                                      "trainer.enable_progress_bar=no", "+data.drop_last=no"])  # fmt: skip
def test_a_string_for_a_flag_the_runner_reads_is_refused_before_the_run(override, tmp_path):
    """``init.trusted=no`` would let a checkpoint's pickled objects load; the runner reads these flags itself,
    before any constructor that would check them."""
    key = override.split("=")[0].lstrip("+")
    with pytest.raises(ConfigError, match=f"^{key}='no' is not a boolean"):
        train(compose_train(["debug=tiny", override], tmp_path))
    assert not list(tmp_path.iterdir())
