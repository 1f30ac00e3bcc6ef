"""The runner's loggers (conf/logger/, runner/loggers.py) and what every run logs (runner/train_metrics.py).

One tiny run with every logger at once (``logger=many``) serves the read-backs: TensorBoard's event files
through its EventAccumulator, MLflow's store through its client and wandb's offline run file through its own
records hold the CSV log's scalars and the resolved config; the metrics are checked against independent
oracles (the schedule by hand, ``get_total_norm`` of the step's gradients, the clock, torchvision's parameter
count)."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchvision
import yaml
from hydra.utils import get_class
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning_helpers import compose_train
from omegaconf import OmegaConf

import runner.train_metrics
from lightning_fusedsgd.lightning import ConfigError
from runner.run import train

WANDB_VARIABLES = ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_MODE")
PEAK_LR = 0.2 * 16 / 256  # the quickstart's base_lr, scaled to debug=tiny's batch of 16
EPOCH_SECONDS = (10.0, 20.0)  # what the probe's clock says each epoch lasts
EXTERNAL = {"wandb": WandbLogger, "mlflow": MLFlowLogger}  # logger=many adds them to csv and tensorboard


class Probe(pl.Callback):
    """The oracles' measurements, taken after the runner's callbacks in each hook: each optimizer step's
    gradient norm (torch's ``get_total_norm`` of the gradients the step takes, in float64) and a clock that
    advances by ``EPOCH_SECONDS[epoch]`` once the epoch has started."""

    now = 0.0
    norms: list[float] = []

    @classmethod
    def clock(cls) -> float:
        return cls.now

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Probe.now += EPOCH_SECONDS[trainer.current_epoch]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.double() for p in pl_module.parameters() if p.grad is not None]
        Probe.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def _processes_under(pid: int) -> list[str]:
    """The command names of every process descended from ``pid`` (Linux's /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while read
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        parents[int(stat.parent.name)] = (int(fields[1]), name)
    found, frontier = [], {pid}
    while frontier:
        children = {child for child, (parent, _) in parents.items() if parent in frontier}
        found += [parents[child][1] for child in children]
        frontier = children
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``python train.py debug=tiny data=synthetic logger=many``, clipping by norm at a threshold it never
    reaches (so the step takes the norm), every step logged, in process: its run dir, config, CSV rows and
    what it left behind."""
    root = tmp_path_factory.mktemp("loggers")
    run_dir, cwd = root / "run", root / "cwd"
    cwd.mkdir()
    Probe.now, Probe.norms = 0.0, []
    overrides = [
        "debug=tiny",
        "data=synthetic",
        "logger=many",
        "trainer.log_every_n_steps=1",
        "trainer.gradient_clip_val=1000",
        "+callbacks.probe._target_=test_loggers.Probe",
    ]
    environment = {variable: os.environ.get(variable) for variable in WANDB_VARIABLES}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(runner.train_metrics, "perf_counter", Probe.clock)
        cfg = compose_train(overrides, run_dir)
        config = OmegaConf.to_container(cfg, resolve=True)
        summary = train(cfg)
        processes = _processes_under(os.getpid())
        environment_after = {variable: os.environ.get(variable) for variable in WANDB_VARIABLES}
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    scalars = {(key, int(row["step"])): float(value) for row in rows for key, value in row.items() if value}
    return SimpleNamespace(
        dir=run_dir,
        cwd=cwd,
        config=config,
        summary=summary,
        scalars={key: value for key, value in scalars.items() if key[0] != "step"},
        processes=processes,
        environment=(environment, environment_after),
        norms=list(Probe.norms),
    )


def _series(scalars: dict[tuple[str, int], float], key: str) -> list[float]:
    return [value for (name, _), value in sorted(scalars.items(), key=lambda item: item[0][1]) if name == key]


def _flat(config: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """The config's leaves by their path joined with "/", as Lightning's loggers flatten hyperparameters: a
    list of dicts by index, other lists whole."""
    flat = {}
    for key, value in config.items():
        path = f"{parent}/{key}" if parent else key
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            value = {str(index): item for index, item in enumerate(value)}
        flat.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return flat


def _tensorboard(run_dir: Path) -> tuple[dict, dict]:
    """The scalars and the hyperparameters of the run's TensorBoard event files, read by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    values = {key: getattr(value, value.WhichOneof("kind")) for key, value in hparams.items()}
    return scalars, values


def _mlflow(run_dir: Path, experiment: str) -> tuple[dict, dict, str]:
    """The scalars, params and status of the run's MLflow run, read through MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    scalars = {
        (key, metric.step): metric.value
        for key in mlflow_run.data.metrics
        for metric in client.get_metric_history(mlflow_run.info.run_id, key)
    }
    return scalars, mlflow_run.data.params, mlflow_run.info.status


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file, decoded by wandb's own protobuf schema. wandb 0.31 ships no reader of
    the file (its Go service writes it); the framing is LevelDB's log: after a 7-byte header, blocks of
    32 KiB, each record a chunk (4-byte checksum, 2-byte length, 1-byte type: 1 whole, 2 first, 3 middle,
    4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B\xe1\xbe\x00", "not a .wandb file of the version read here"
    records, chunks, position = [], [], 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def _wandb(run_dir: Path) -> tuple[dict, dict]:
    """The scalars (by trainer/global_step) and the config of the run's offline wandb run."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    scalars, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            step = row.pop("trainer/global_step")
            scalars.update({(key, step): value for key, value in row.items() if not key.startswith("_")})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    config.pop("_wandb", None)
    return scalars, config


def _assert_same_scalars(theirs: dict, csv_scalars: dict) -> None:
    assert theirs.keys() == csv_scalars.keys()
    for key, value in csv_scalars.items():
        assert math.isclose(theirs[key], value, rel_tol=1e-6), key  # TensorBoard keeps float32


@pytest.mark.slow
def test_tensorboard_holds_the_csv_scalars_and_the_config(run):
    scalars, hparams = _tensorboard(run.dir)
    assert scalars.pop(("hp_metric", 0)) == -1  # Lightning's placeholder: the HPARAMS tab lists the config
    _assert_same_scalars(scalars, run.scalars)
    # Lightning hands TensorBoard numbers, bools and strings; other values (None, lists) as their str.
    expected = {
        key: value if isinstance(value, (bool, int, float, str)) else str(value)
        for key, value in _flat(run.config).items()
    }
    assert hparams == expected


@pytest.mark.slow
def test_mlflow_holds_the_csv_scalars_and_the_config_in_its_sqlite_store(run):
    scalars, params, status = _mlflow(run.dir, experiment=run.config["name"])
    _assert_same_scalars(scalars, run.scalars)
    # Lightning hands MLflow each value as its str, cut at 250 characters.
    assert params == {key: str(value)[:250] for key, value in _flat(run.config).items()}
    assert status == "FINISHED"


@pytest.mark.slow
def test_wandb_holds_the_csv_scalars_and_the_config_offline_in_the_run_dir(run):
    scalars, config = _wandb(run.dir)
    _assert_same_scalars(scalars, run.scalars)
    assert config == run.config
    # wandb's own logs went to the run dir; its service processes ended; the environment is as it was.
    assert list(run.dir.glob("wandb/cache/**/core-debug-*.log"))
    assert not [name for name in run.processes if name.startswith("wandb")]
    assert run.environment[0] == run.environment[1]
    assert not list(run.cwd.iterdir())  # nothing written in the working directory (no ./mlruns, ./wandb)


@pytest.mark.slow
def test_the_csv_holds_the_config_and_every_metric(run):
    assert yaml.safe_load((run.dir / "csv" / "hparams.yaml").read_text()) == run.config
    names = {name for name, _ in run.scalars}
    for group in ("decay", "no_decay"):
        assert {f"lr-FusedSGD/{group}{kind}" for kind in ("", "-momentum", "-weight_decay")} < names
    assert {"train/grad_norm", "train/epoch_time_s", "train/images_per_sec", "model/params_total"} < names


@pytest.mark.slow
def test_lr_momentum_and_weight_decay_per_group_follow_the_schedule_and_config(run):
    """The tiny quickstart: 6 steps, a warmup from 0 over the first epoch (3 steps), its milestones past the
    end; each step's lr logged before it is taken. Biases and norms take no weight decay."""
    lrs = [PEAK_LR * step / 3 for step in range(3)] + [PEAK_LR] * 3
    for group, weight_decay in (("decay", 1e-4), ("no_decay", 0.0)):
        assert _series(run.scalars, f"lr-FusedSGD/{group}") == pytest.approx(lrs, rel=1e-12)
        assert _series(run.scalars, f"lr-FusedSGD/{group}-momentum") == [0.9] * 6
        assert _series(run.scalars, f"lr-FusedSGD/{group}-weight_decay") == [weight_decay] * 6


@pytest.mark.slow
def test_the_grad_norm_is_the_norm_the_clipping_step_took(run):
    assert len(run.norms) == 6
    assert _series(run.scalars, "train/grad_norm") == pytest.approx(run.norms, rel=1e-6)


@pytest.mark.slow
def test_epoch_times_and_parameter_counts(run):
    assert _series(run.scalars, "train/epoch_time_s") == list(EPOCH_SECONDS)
    net = torchvision.models.resnet18(num_classes=1000)  # data=synthetic: ImageNet-shaped, 3 channels
    count = sum(p.numel() for p in net.parameters())
    assert run.scalars[("model/params_total", 0)] == run.scalars[("model/params_trainable", 0)] == count


@pytest.mark.parametrize(
    ("choice", "kinds"),
    [
        ("logger=csv", {"csv": CSVLogger}),
        ("logger=[csv,tensorboard]", {"csv": CSVLogger, "tensorboard": TensorBoardLogger}),
        ("logger=many", {"csv": CSVLogger, "tensorboard": TensorBoardLogger} | EXTERNAL),
        ("logger=none", {}),
        ("~logger", {}),
    ],
)
def test_the_logger_group_composes_one_several_or_none(choice, kinds, tmp_path):
    """Each chosen logger under its name (the run with every logger builds them)."""
    node = compose_train([choice], tmp_path).get("logger") or {}
    assert {name: get_class(logger._target_) for name, logger in node.items()} == kinds


@pytest.mark.parametrize(
    ("choice", "blocked", "named"),
    [
        ("logger=tensorboard", ["tensorboard", "tensorboardX"], "tensorboard or tensorboardX"),
        ("logger=wandb", ["wandb"], "wandb"),
        ("logger=[csv,mlflow]", ["sqlalchemy"], "sqlalchemy"),
    ],
)
def test_a_missing_logger_package_is_named_with_the_extra_before_anything_is_built(
    choice, blocked, named, tmp_path, monkeypatch
):
    for package in blocked:  # not importable, as where it is not installed
        monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=rf"needs the {named} package, .*pip install -e \"\.\[loggers\]\""):
        train(compose_train(["debug=tiny", choice], tmp_path / "run"))
    assert not (tmp_path / "run").exists()
