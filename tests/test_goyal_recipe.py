"""The Goyal et al. recipe (recipe=resnet50) as the paper ran it: no average of the weights unless asked, and
a log line whose warmup is the lr the run takes."""

from __future__ import annotations

import functools
import logging
import re

import lightning.pytorch as pl
import pytest
from hydra.utils import instantiate
from lightning_helpers import ROOT, TinyClassifier, compose_train, cpu_trainer
from lightning_utilities.core import rank_zero as lightning_utilities_rank_zero

from lightning_fusedsgd.lightning import EMAWeightAveraging


def test_the_goyal_recipe_keeps_no_average_unless_asked(tmp_path):
    """Goyal et al. trained without an average of the weights; torchvision's is an opt-in the recipe names."""
    assert compose_train(["recipe=resnet50"], tmp_path).ema.decay is None
    header = (ROOT / "recipes" / "resnet50.yaml").read_text().split("defaults:")[0]
    opt_in = re.search(r"(ema\.decay=\S+) (ema\.update_every_n_steps=\d+)", header).groups()
    cfg = compose_train(["recipe=resnet50", *opt_in], tmp_path)
    assert isinstance(EMAWeightAveraging(**cfg.ema), EMAWeightAveraging) and cfg.ema.decay == 0.94175


@pytest.fixture
def factory_log():
    """configure_fused_sgd's log lines (see test_lightning_factory.py)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    lightning_utilities_rank_zero.log.addHandler(handler)
    yield records
    lightning_utilities_rank_zero.log.removeHandler(handler)


class _LrsUntil(pl.Callback):
    """The lr of each step until ``steps`` steps, then stops the fit."""

    def __init__(self, steps: int) -> None:
        self.steps, self.lrs = steps, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        trainer.should_stop = len(self.lrs) >= self.steps


@pytest.mark.parametrize("batch", [16, 512])
def test_the_warmup_line_says_the_lr_the_goyal_recipe_uses(batch, factory_log, tmp_path):
    """recipe=resnet50 warms up from the base lr (start_lr 0.1): at a global batch of 512 from 0.1 to 0.2 over
    5 epochs; at 16 the peak, 0.00625, is below it, so there is no ramp. The line said "warmup 5 of 90 steps"
    either way: it now says where the warmup starts, which is the first step's lr, and the step after it
    trains at the peak it names."""
    cfg = compose_train(["recipe=resnet50"], tmp_path)
    factory = functools.partial(instantiate(cfg.optim), schedule=instantiate(cfg.schedule))
    module = TinyClassifier(samples=batch, batch_size=batch)  # one step an epoch: 90 steps, warmup 5
    module.configure_optimizers = lambda: factory(module)
    lrs = _LrsUntil(7)
    cpu_trainer(max_epochs=cfg.trainer.max_epochs, callbacks=[lrs]).fit(module)
    [line] = [r.getMessage() for r in factory_log if r.getMessage().startswith("configure_fused_sgd:")]
    peak = float(re.search(r"peak lr (\S+) =", line).group(1))
    warmup, total, start = re.search(
        r"warmup (\d+) of (\d+) steps(?: from lr (\S+)| at the peak lr)", line
    ).groups()
    assert (int(warmup), int(total), peak) == (5, 90, pytest.approx(0.1 * batch / 256, rel=1e-5))
    assert lrs.lrs[0] == pytest.approx(peak if start is None else float(start), rel=1e-5)
    assert (start is None) == (batch <= 256)
    assert lrs.lrs[5] == lrs.lrs[6] == pytest.approx(peak, rel=1e-5)
    if start is not None:
        assert lrs.lrs[0] == pytest.approx(0.1) and lrs.lrs[4] < peak
