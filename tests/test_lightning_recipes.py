"""Every recipe composes and instantiates from the real config; fast_dev_run of two of them."""

from __future__ import annotations

import csv
import functools
import importlib.metadata
import itertools
import json
import re
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from lightning.fabric.utilities import registry
from lightning_helpers import ROOT, compose_train
from omegaconf import OmegaConf

import runner.throughput
from lightning_fusedsgd.checkpoint import read_checkpoint_file
from lightning_fusedsgd.lightning import (
    AttachDeepSpeed,
    ClipInTheStep,
    ConfigError,
    Schedule,
    ScheduleFreeModes,
)
from runner.data import DigitsDataModule
from runner.jpeg_folder import make_jpeg_folder
from runner.loggers import build_loggers
from runner.model import ImageClassifier
from runner.resume import ResumeInCutEpoch
from runner.run import train
from runner.simclr import SimCLR

RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.yaml"))

# The published hyperparameters each recipe must carry (sources in the recipe files and docs/design.md).
PUBLISHED = {
    "quickstart": {
        "data._target_": "DigitsDataModule",
        "model.arch": "resnet18",
        "model.in_channels": 1,
        "model.num_classes": 10,
        "model.zero_init_residual": True,
        "optim.base_lr": 0.2,
        "schedule.milestones": [6, 8],
        "trainer.max_epochs": 10,
    },
    "resnet50": {
        "data._target_": "ImageFolderDataModule",
        "model.arch": "resnet50",
        "model.zero_init_residual": True,
        "data.batch_size": 32,
        "optim.base_lr": 0.1,
        "optim.reference_batch_size": 256,
        "optim.momentum": 0.9,
        "optim.weight_decay": 1e-4,
        "optim.no_decay_norm": True,
        "optim.lars": False,
        "schedule.decay": "multistep",
        "schedule.warmup": 5,
        "schedule.start_lr": 0.1,
        "schedule.milestones": [30, 60, 80],
        "trainer.max_epochs": 90,
    },
    "resnet50_lars": {
        "data._target_": "ImageFolderDataModule",
        "model.arch": "resnet50",
        "data.batch_size": 408,
        "optim.base_lr": 10.5,
        "optim.reference_batch_size": 3264,
        "optim.lars": True,
        "optim.trust_coefficient": 0.001,
        "optim.lars_eps": 0.0,
        "optim.weight_decay": 5e-5,
        "optim.momentum": 0.9,
        "optim.no_lars_norm": True,
        "model.label_smoothing": 0.1,
        "schedule.decay": "poly",
        "schedule.power": 2.0,
        "schedule.end_lr": 1e-4,
        "schedule.warmup": 2,
        "trainer.max_epochs": 37,
    },
    "resnet50_torchvision_v1": {
        "data._target_": "ImageFolderDataModule",
        "model.arch": "resnet50",
        "model.zero_init_residual": False,
        "data.batch_size": 32,
        "optim.base_lr": 0.1,
        "optim.reference_batch_size": 256,
        "optim.weight_decay": 1e-4,
        "optim.no_decay_norm": False,
        "optim.no_decay_bias": False,
        "schedule.decay": "multistep",
        "schedule.warmup": 0,
        "schedule.milestones": [30, 60],
        "trainer.max_epochs": 90,
    },
    "resnet18_cifar10": {
        "data._target_": "CIFAR10DataModule",
        "model.arch": "resnet18",
        "model.small_input": True,
        "data.batch_size": 128,
        "optim.base_lr": 0.1,
        "optim.reference_batch_size": 128,
        "optim.weight_decay": 5e-4,
        "optim.no_decay_norm": False,
        "schedule.decay": "cosine",
        "trainer.max_epochs": 200,
    },
    "simclr": {
        "data._target_": "DigitsDataModule",
        "data.views._target_": "SimCLRTransform",
        "data.drop_last": True,
        "model._target_": "SimCLR",
        "model.arch": "resnet18",
        "model.temperature": 0.5,
        "model.projection_dim": 128,
        "optim.lars": True,
        "optim.lars_denominator": "decayed_grad",
        "optim.base_lr": 0.3,
        "optim.weight_decay": 1e-6,
        "optim.momentum": 0.9,
        "schedule.decay": "cosine",
    },
    "simclr_imagenet": {
        "data._target_": "ImageFolderDataModule",
        "data.views._target_": "SimCLRTransform",
        "data.batch_size": 512,
        "data.drop_last": True,
        "model._target_": "SimCLR",
        "model.arch": "resnet50",
        "model.temperature": 0.1,
        "optim.lars": True,
        "optim.trust_coefficient": 0.001,
        "optim.lars_denominator": "decayed_grad",
        "optim.base_lr": 0.3,
        "optim.reference_batch_size": 256,
        "optim.weight_decay": 1e-6,
        "optim.momentum": 0.9,
        "schedule.decay": "cosine",
        "schedule.warmup": 10,
        "trainer.max_epochs": 1000,
    },
}

FACTORIES = "lightning.pytorch.callbacks_factory"  # the entry point group Lightning reads
OFFLINE = {"quickstart", "simclr"}  # digits ship with scikit-learn: the tiny runs use the real data


def test_every_recipe_is_checked():
    assert set(RECIPES) == set(PUBLISHED)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_states_source_result_and_command(recipe):
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text()
    assert text.startswith("# ")
    assert re.search(r"^# Source: \S", text, re.M)
    assert re.search(r"^# Published[^:]*: .*\d%", text, re.M)
    assert re.search(
        rf"^# Run: python train.py{'' if recipe == 'quickstart' else f' recipe={recipe}'}", text, re.M
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_instantiates(recipe, tmp_path):
    cfg = compose_train([f"recipe={recipe}"], tmp_path)
    assert cfg.name == recipe
    for key, value in PUBLISHED[recipe].items():
        actual = OmegaConf.select(cfg, key)
        if key.endswith("_target_"):
            assert actual.endswith(value), key
        else:
            assert (OmegaConf.to_object(actual) if OmegaConf.is_config(actual) else actual) == value, key

    datamodule = instantiate(cfg.data)  # no data needed until setup()
    assert isinstance(datamodule, pl.LightningDataModule) and datamodule.batch_size == cfg.data.batch_size
    factory = instantiate(cfg.optim)
    assert isinstance(factory, functools.partial)
    schedule = instantiate(cfg.schedule)
    assert isinstance(schedule, Schedule)
    model = instantiate(cfg.model, optimizer=functools.partial(factory, schedule=schedule))
    assert isinstance(model, SimCLR if cfg.data.get("views") else ImageClassifier)
    if cfg.model.get("zero_init_residual"):
        last_bn = model.net.layer1[0].bn3 if cfg.model.arch == "resnet50" else model.net.layer1[0].bn2
        assert torch.count_nonzero(last_bn.weight) == 0
    callbacks = [instantiate(node) for node in cfg.callbacks.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=build_loggers(cfg.logger))
    assert trainer.max_epochs == cfg.trainer.max_epochs
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "checkpoints")


def test_fast_dev_run_default_recipe(tmp_path):
    summary = train(compose_train(["trainer.fast_dev_run=true", "trainer.accelerator=cpu"], tmp_path))
    assert summary["global_step"] == 1
    assert 0.0 <= summary["val/acc"] <= 1.0
    assert json.loads((tmp_path / "metrics.json").read_text())["name"] == "quickstart"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_runs_tiny_on_synthetic_data(recipe, tmp_path):
    """debug=tiny bounds what makes a run long (epochs, steps, image size, validation, workers): each recipe,
    ImageNet's ResNet-50s included, trains 2 epochs of 3 steps on 32x32 synthetic images, each step logged."""
    overrides = [f"recipe={recipe}", "debug=tiny", *([] if recipe in OFFLINE else ["data=synthetic"])]
    cfg = compose_train(overrides, tmp_path)
    assert cfg.data.image_size == 32 and cfg.trainer.max_epochs == 2 and cfg.data.num_workers == 0
    summary = train(cfg)
    assert summary["name"] == recipe and summary["global_step"] == 6 and summary["epochs"] == 2
    assert 0.0 <= summary["val/acc"] <= 1.0
    # Every step logged (Lightning's default, every 10 steps, logged none of these 3-step epochs).
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == list(range(6))
    assert len([row for row in rows if any(row[key] for key in row if key.startswith("lr-"))]) == 6
    if cfg.data.get("views"):  # self-supervised: the kNN accuracy beside a random backbone's
        assert 0.0 <= summary["metrics"]["val/acc_random_init"] <= 1.0


def test_the_summary_says_when_no_validation_ran(tmp_path, capsys):
    summary = train(compose_train(["debug=tiny", "trainer.max_steps=2"], tmp_path))
    assert summary["global_step"] == 2 and summary["val/acc"] is None
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        last_line.startswith("summary: name=quickstart validation=none epochs=") and " steps=2 " in last_line
    )
    assert "nan" not in last_line
    assert json.loads((tmp_path / "metrics.json").read_text())["best_val/acc"] is None


def test_the_summary_records_each_validation_as_the_log_has_it(tmp_path):
    """The curves of the summary (its checkpointed record, curves.png, best_val/acc) hold each pass's val/acc
    and, with an average of the weights, val/acc_raw, at its step: the values the CSV log has."""
    summary = train(compose_train(["debug=tiny", "trainer.max_epochs=3", "ema.decay=0.5"], tmp_path))
    record = read_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")["callbacks"]["RunSummary"]
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    for key, series in (("val/acc", record["val_acc"]), ("val/acc_raw", record["val_acc_raw"])):
        logged = [float(row[key]) for row in rows if row.get(key)]
        assert series == list(zip((3, 6, 9), logged)), key
    assert summary["best_val/acc"] == max(float(row["val/acc"]) for row in rows if row.get("val/acc"))


def test_resume_from_last_checkpoint_continues_the_run(tmp_path):
    short = [
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "data.batch_size=8",
        "trainer.accelerator=cpu",
    ]
    first = train(compose_train([*short, "trainer.max_epochs=1"], tmp_path / "first"))
    assert first["global_step"] == 2
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = train(compose_train([*short, "trainer.max_epochs=2", f"ckpt_path={last}"], tmp_path / "second"))
    assert resumed["global_step"] == 4 and resumed["epochs"] == 2


def test_a_cut_epoch_whose_loop_state_is_not_lightnings_layout_is_said_at_the_resume():
    """Where the loop counters are not laid out as this Lightning writes them, the runner cannot resume in
    the cut epoch: it says which batches go untrained rather than skipping them silently."""
    trainer = SimpleNamespace(datamodule=DigitsDataModule())
    checkpoint = {"DigitsDataModule": {"epoch": 3, "batches": 2}, "loops": {"fit_loop": {}}}
    with pytest.warns(UserWarning, match="epoch 3 ended after 2 of its batches .* rest of epoch 3 is not"):
        ResumeInCutEpoch().on_load_checkpoint(trainer, None, checkpoint)
    assert checkpoint["loops"] == {"fit_loop": {}}  # left as it was


@pytest.mark.parametrize(
    ("overrides", "classes", "channels"),
    [
        ([], 10, 1),
        (["recipe=resnet50"], 1000, 3),
        (["data=synthetic", "data.num_classes=7", "data.in_channels=2"], 7, 2),
    ],
)
def test_the_model_takes_classes_and_channels_from_the_data_config(overrides, classes, channels, tmp_path):
    cfg = compose_train(overrides, tmp_path)
    assert (cfg.model.num_classes, cfg.model.in_channels) == (classes, channels)
    assert (cfg.data.num_classes, cfg.data.in_channels) == (classes, channels)


def test_recipes_are_a_config_group_of_files_and_debug_shrinks_a_run(tmp_path):
    recipe_dir = ROOT / "recipes"
    assert recipe_dir.is_dir() and not recipe_dir.is_symlink()
    cfg = compose_train(["recipe=resnet50", "debug=tiny"], tmp_path)
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.limit_train_batches == 3
    assert cfg.data.batch_size == 16 and cfg.model.arch == "resnet50"  # the recipe, shrunk


@pytest.mark.slow
def test_checkpoint_paths_under_the_home_folder_are_read_there(tmp_path, monkeypatch):
    """ckpt_path and init.path given as '~/...' were looked up as written ("is not a file")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    train(compose_train(["debug=tiny", "trainer.max_epochs=1"], tmp_path / "first"))
    resumed = ["debug=tiny", "trainer.max_epochs=1", "ckpt_path='~/first/checkpoints/last.ckpt'"]
    with pytest.raises(
        ConfigError, match=f"ckpt_path={tmp_path}/first/checkpoints/last.ckpt is of a finished"
    ):
        train(compose_train(resumed, tmp_path / "resumed"))
    started = ["init.path='~/first/checkpoints/last.ckpt'", "init.weights_only=true", "trainer.max_steps=1"]
    with pytest.warns(UserWarning, match="momentum"):
        assert train(compose_train(["debug=tiny", *started], tmp_path / "started"))["global_step"] == 1


@pytest.mark.slow
def test_an_averaged_run_validates_both_weights_and_ends_with_the_average(tmp_path):
    """ema.decay: validation runs on the average (val/acc) and on the training weights (val/acc_raw), both in
    the summary and the plot; the run ends with the average in the model, whose last.ckpt carries Lightning's
    keys and the optimizer's averages."""
    cfg = compose_train(["debug=tiny", "ema.decay=0.5"], tmp_path)
    summary = train(cfg)
    assert 0.0 <= summary["val/acc"] <= 1.0 and 0.0 <= summary["metrics"]["val/acc_raw"] <= 1.0
    assert (tmp_path / "curves.png").is_file()
    checkpoint = read_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt", trusted=True)
    assert {"current_model_state", "averaging_state"} <= checkpoint.keys()
    averaged, current = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert any(not torch.equal(averaged[name], current[name]) for name in averaged)
    optimizer_state = checkpoint["optimizer_states"][0]["state"]
    assert all("ema" in entry for entry in optimizer_state.values())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["quickstart", "resnet50"])
def test_schedule_free_is_an_optim_choice_of_the_recipes(recipe, tmp_path):
    """optim=schedule_free: FusedSGDScheduleFree with the recipe's warmup and no lr scheduler, and a run
    resumed from its last.ckpt (which holds no scheduler state) continues it."""
    overrides = [f"recipe={recipe}", "optim=schedule_free", "debug=tiny"]
    overrides += [] if recipe in OFFLINE else ["data=synthetic"]
    first = train(compose_train([*overrides, "trainer.max_epochs=1"], tmp_path / "first"))
    assert first["global_step"] == 3
    checkpoint = torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["lr_schedulers"] == []
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert {(g["schedule_free"], g["train_mode"], g["k"]) for g in groups} == {(True, False, 3)}
    assert {g["warmup_steps"] for g in groups} == {3 * (5 if recipe == "resnet50" else 1)}  # epochs x 3 steps
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = train(
        compose_train([*overrides, "trainer.max_epochs=2", f"ckpt_path={last}"], tmp_path / "next")
    )
    assert resumed["global_step"] == 6


def test_schedule_free_with_a_second_average_is_refused_before_the_run(tmp_path):
    overrides = ["recipe=resnet50", "optim=schedule_free", "debug=tiny", "data=synthetic", "ema.decay=0.9"]
    cfg = compose_train(overrides, tmp_path)
    refused = r"optim=schedule_free with ema.decay=0.9: .*add ema.decay=null"
    with pytest.raises(ConfigError, match=refused):
        train(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.image_size=0", "data.image_size=0 must be >= 1"),
        ("model.channels_last=yes", "model.channels_last='yes': choose true, false or auto"),
    ],
)
def test_a_value_a_constructor_refuses_is_a_config_error_not_hydras_wrapper(override, message, tmp_path):
    """Hydra wraps whatever a target raises; train.py prints a ConfigError in one line, so the runner unwraps
    the user's mistake."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(compose_train(["debug=tiny", override], tmp_path))


def test_enable_progress_bar_false_turns_the_configs_progress_bar_off(tmp_path):
    """A user's first override to quiet a log: the config's TQDMProgressBar would make Lightning refuse it."""
    overrides = ["trainer.fast_dev_run=true", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    assert train(compose_train(overrides, tmp_path))["global_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("installed", [True, False])
def test_the_runner_adds_the_package_callbacks_once_installed_or_not(installed, tmp_path, monkeypatch):
    """A checkout that was not pip-installed registers no entry point: the runner adds the package's callbacks
    itself (schedule-free SGD fails without its modes), and where the entry point adds them too, each runs
    once."""
    entry_point = importlib.metadata.EntryPoint(
        name="lightning_fusedsgd", value="lightning_fusedsgd.lightning.clipping:callbacks", group=FACTORIES
    )
    found = {FACTORIES: [entry_point] if installed else []}
    for module in (registry, importlib.metadata):
        monkeypatch.setattr(module, "entry_points", lambda group: found.get(group, []))
    seen: list[list[pl.Callback]] = []
    fit = pl.Trainer.fit
    monkeypatch.setattr(
        pl.Trainer, "fit", lambda self, *a, **k: (seen.append(self.callbacks), fit(self, *a, **k))
    )
    summary = train(compose_train(["optim=schedule_free", "debug=tiny", "trainer.max_epochs=1"], tmp_path))
    assert summary["global_step"] == 3
    kinds = [type(callback) for callback in seen[0]]
    assert [kinds.count(kind) for kind in (ClipInTheStep, AttachDeepSpeed, ScheduleFreeModes)] == [1, 1, 1]


@pytest.mark.slow
def test_resnet50_trains_tiny_on_a_generated_jpeg_folder(tmp_path):
    """The image-folder pipeline under a whole run: bytes in the loader, decoded and augmented, normalized in
    on_after_batch_transfer (decode=auto: the CPU here)."""
    root = make_jpeg_folder(tmp_path / "data", classes=3, train=8, val=2)
    overrides = ["recipe=resnet50", "debug=tiny", f"data.root={root}", "data.num_classes=3"]
    summary = train(compose_train(overrides, tmp_path / "run"))
    assert summary["global_step"] == 4 and 0.0 <= summary["val/acc"] <= 1.0  # 24 images: 2 batches of 16


@pytest.mark.slow
def test_images_per_second_are_logged_and_summarized_through_lightnings_throughput(
    tmp_path, capsys, monkeypatch
):
    """A clock that advances 0.25 s per reading: 16 images a step is 64 images/s over the window, in the CSV
    log and the summary line; the time spent validating between the epochs is left out of the rate."""
    clock = itertools.count(step=0.25)
    monkeypatch.setattr(runner.throughput, "perf_counter", lambda: next(clock))
    summary = train(compose_train(["debug=tiny", "trainer.log_every_n_steps=1"], tmp_path))
    assert summary["metrics"]["train/images_per_sec"] == 64.0
    assert " steps=6 images_per_sec=64.0 " in capsys.readouterr().out.strip().splitlines()[-1]
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    logged = [float(row["train/images_per_sec"]) for row in rows if row.get("train/images_per_sec")]
    # Steps 2, 3 (a window of 2 steps within epoch 1), 4 (its window spans validation: 0.25 s of the 0.5 s
    # gap is the hook before validation), 5, 6.
    assert logged == [64.0, 64.0, 32.0, 64.0, 64.0]


def _set_up_on(accelerator: str, **options) -> ImageClassifier:
    model = ImageClassifier(arch="resnet18", num_classes=3, **options)
    model.trainer = pl.Trainer(accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False)
    model.setup("fit")
    return model


@pytest.mark.parametrize(("setting", "channels_last"), [("auto", False), (True, True), (False, False)])
def test_channels_last_auto_keeps_the_cpus_contiguous_format(setting, channels_last):
    model = _set_up_on("cpu", channels_last=setting)
    weight = model.net.conv1.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert model.memory_format == (torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu_check.sh runs it")
def test_channels_last_auto_is_channels_last_on_cuda():
    assert _set_up_on("cuda", channels_last="auto").memory_format == torch.channels_last


def test_a_model_channels_last_not_a_choice_is_refused():
    with pytest.raises(ConfigError, match="model.channels_last='yes': choose true, false or auto"):
        ImageClassifier(channels_last="yes")


def test_model_compile_compiles_the_network_in_place_keeping_the_state_dicts_names():
    model = _set_up_on("cpu", compile=True)
    assert model.net._compiled_call_impl is not None  # compiled lazily: nothing is built until a forward
    assert "net.conv1.weight" in model.state_dict() and not any(
        "_orig_mod" in name for name in model.state_dict()
    )
    assert _set_up_on("cpu").net._compiled_call_impl is None  # model.compile=false, the default


@pytest.mark.heavy  # inductor compiles ResNet-18's forward and backward on the CPU: a minute or more
def test_model_compile_trains_a_compiled_network_with_the_state_dicts_names(tmp_path, monkeypatch):
    compiled = []
    compile_in_place = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module,
        "compile",
        lambda module, **k: compiled.append(module) or compile_in_place(module, **k),
    )
    summary = train(compose_train(["debug=tiny", "model.compile=true", "trainer.max_epochs=1"], tmp_path))
    assert summary["global_step"] == 3
    assert [type(module).__name__ for module in compiled] == ["ResNet"]
    names = read_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt", trusted=True)["state_dict"]
    assert "net.conv1.weight" in names and not any("_orig_mod" in name for name in names)
