"""``runner.train_metrics.TrainMetrics`` on a user's small module: the gradient norm where the step takes none
(``log_grad_norm``, off by default), under a GradScaler too, the norm a LARS step takes itself, and the
parameter counts of a partly frozen model. The run with every logger (tests/test_loggers.py) covers the norm a
clipping step takes."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning_helpers import TinyClassifier, UserModule, cpu_trainer

from lightning_fusedsgd import FusedLARS, FusedSGD, param_groups
from runner.train_metrics import TrainMetrics


class GradNorms(pl.Callback):
    """Each optimizer step's gradients' norm in float64 (torch's ``get_total_norm``), as the hook before the
    step holds them (scaled, for an optimizer that unscales them itself)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.double() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


class WithOptimizer(UserModule):
    def __init__(self, optimizer: type[torch.optim.Optimizer]) -> None:
        super().__init__()
        self.optimizer_class = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_class(self.parameters(), lr=0.1, momentum=0.9)


def _fit(module: pl.LightningModule, tmp_path, callbacks, **options) -> list[dict[str, str]]:
    """Three optimizer steps, each logged; the CSV log's rows."""
    logger = CSVLogger(tmp_path, name="", version="csv")
    trainer = cpu_trainer(max_steps=3, log_every_n_steps=1, logger=logger, callbacks=callbacks, **options)
    trainer.fit(module)
    return list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))


def _logged(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


@pytest.mark.slow
def test_log_grad_norm_takes_the_norm_where_the_step_takes_none_and_counts_the_trainable_params(tmp_path):
    torch.manual_seed(0)
    module = TinyClassifier(lr=0.1)  # configure_fused_sgd, no clipping: the step takes no norm
    module.net[0].requires_grad_(False)
    recorded = GradNorms()
    rows = _fit(module, tmp_path / "on", [TrainMetrics(log_grad_norm=True), recorded])
    assert _logged(rows, "train/grad_norm") == pytest.approx(recorded.norms, rel=1e-6)
    total = sum(p.numel() for p in module.parameters())
    frozen = sum(p.numel() for p in module.net[0].parameters())
    assert _logged(rows, "model/params_total") == [total]
    assert _logged(rows, "model/params_trainable") == [total - frozen]
    rows = _fit(TinyClassifier(lr=0.1), tmp_path / "off", [TrainMetrics()])
    assert "train/grad_norm" not in rows[0]  # off by default: never logged


@pytest.mark.slow
def test_under_a_grad_scaler_log_grad_norm_unscales_the_gradients_an_optimizer_unscales_itself(tmp_path):
    """fp16 under a GradScaler: Lightning unscales torch.optim.SGD's gradients before the hook, while
    FusedSGD's stay scaled until its step; both runs log the same norms (the same weights and data)."""
    logged = {}
    for optimizer in (torch.optim.SGD, FusedSGD):
        torch.manual_seed(0)
        precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        rows = _fit(
            WithOptimizer(optimizer),
            tmp_path / optimizer.__name__,
            [TrainMetrics(log_grad_norm=True)],
            plugins=[precision],
        )
        logged[optimizer] = _logged(rows, "train/grad_norm")
    assert len(logged[FusedSGD]) == 3
    assert logged[FusedSGD] == pytest.approx(logged[torch.optim.SGD], rel=1e-5)


class _Logged:
    """A LightningModule's ``log`` as the callback calls it: each metric by name."""

    def __init__(self) -> None:
        self.metrics: dict[str, torch.Tensor] = {}

    def log(self, name: str, value: torch.Tensor, **options) -> None:
        self.metrics[name] = value


def test_a_lars_step_logs_the_norm_its_norm_pass_took_without_log_grad_norm():
    """Called directly after a FusedLARS step (no training run): the logged norm is the float64 norm of every
    gradient, biases' included, taken by the step, not by an extra pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    optimizer = FusedLARS(param_groups(model, weight_decay=1e-4), lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 20)), torch.randint(0, 5, (8,))).backward()
    expected = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()])
    callback, module = TrainMetrics(), _Logged()
    trainer = SimpleNamespace(global_step=0, optimizers=[optimizer])
    callback.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.step()
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, module, None, None, 0)
    torch.testing.assert_close(module.metrics["train/grad_norm"], expected.float(), rtol=1e-6, atol=0)
