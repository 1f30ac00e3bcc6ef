"""What the README tells a user, as they would use it: its code blocks run as written, and the callbacks that
installing the package adds to every Lightning Trainer leave a fit of another optimizer alone and turn off."""

from __future__ import annotations

import importlib.metadata
import re
import runpy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities import registry
from lightning_helpers import ROOT, UserModule, cpu_trainer

from lightning_fusedsgd.lightning import AttachDeepSpeed, ClipInTheStep, ConfigError, ScheduleFreeModes
from lightning_fusedsgd.lightning.clipping import callbacks

README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, re.M | re.S)
OURS = (ClipInTheStep, AttachDeepSpeed, ScheduleFreeModes)
SWITCH = "LIGHTNING_FUSEDSGD_CALLBACKS"  # as the README names it


def test_the_readme_has_its_python_blocks():
    assert len(PYTHON_BLOCKS) == 2  # a PyTorch loop, a LightningModule


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=["pytorch_loop", "lightning_module"])
def test_a_readme_python_block_runs_as_written(block, tmp_path, monkeypatch):
    """Each block is a whole script: its imports, a model and data of its own (`model`, `loader` and
    `import torch` were missing), run in a fresh namespace in an empty directory."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "snippet.py"
    script.write_text(block)
    names = runpy.run_path(str(script), run_name="__main__")
    if "optimizer" in names:  # the loop stepped the optimizer: momentum buffers
        assert names["optimizer"].state
    else:  # the Trainer fitted: its checkpoint
        assert list(tmp_path.rglob("*.ckpt"))


class PlainOptimizerModule(UserModule):
    """A user's module with torch's own optimizer and lr scheduler."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "SGD":
            optimizer = torch.optim.SGD(
                self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4
            )
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}


def _installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This package's entry point as pip installs it, whatever this environment holds."""
    entry_point = importlib.metadata.EntryPoint(
        name="lightning_fusedsgd",
        value="lightning_fusedsgd.lightning.clipping:callbacks",
        group="lightning.pytorch.callbacks_factory",
    )
    monkeypatch.setattr(registry, "entry_points", lambda group: [entry_point] if "pytorch" in group else [])


def _fit(name: str) -> tuple[pl.Trainer, PlainOptimizerModule]:
    pl.seed_everything(0)
    module = PlainOptimizerModule(name)
    trainer = cpu_trainer(max_epochs=2, gradient_clip_val=0.5)
    trainer.fit(module)
    return trainer, module


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_the_package_callbacks_leave_a_fit_of_another_optimizer_as_it_is_and_turn_off(name, monkeypatch):
    """With torch.optim.SGD or Adam (clipped by Lightning, stepped by torch's StepLR), a Trainer that has the
    package's three callbacks trains bit for bit as one that LIGHTNING_FUSEDSGD_CALLBACKS=0 left without."""
    assert f"`{SWITCH}=0`" in README
    _installed(monkeypatch)
    with_ours, module = _fit(name)
    assert [sum(isinstance(cb, kind) for cb in with_ours.callbacks) for kind in OURS] == [1, 1, 1]
    assert "configure_gradient_clipping" not in vars(module)  # Lightning's own clipping ran
    monkeypatch.setenv(SWITCH, "0")
    without, other = _fit(name)
    assert not any(isinstance(cb, OURS) for cb in without.callbacks)
    assert with_ours.global_step == without.global_step == 10
    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, other.state_dict()[key]), key
    first, second = (trainer.optimizers[0].state_dict() for trainer in (with_ours, without))
    assert first["param_groups"] == second["param_groups"]
    for index, state in first["state"].items():
        for key, value in state.items():
            assert torch.equal(value, second["state"][index][key]), (index, key)


@pytest.mark.parametrize(("setting", "added"), [("1", 3), ("off", 0), ("False", 0), (" yes ", 3)])
def test_the_callbacks_switch_reads_the_usual_words(setting, added, monkeypatch):
    monkeypatch.setenv(SWITCH, setting)
    assert len(callbacks()) == added


def test_a_callbacks_switch_it_cannot_read_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(SWITCH, "maybe")
    with pytest.raises(ConfigError, match=f"{SWITCH}='maybe': set it to 0 .* or 1"):
        callbacks()
