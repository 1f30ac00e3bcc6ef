"""The overrides a user types on train.py's command line: every optimizer option is a key, a typo is refused
naming the nearest key, an option the run would not use is refused, a bad value is one line."""

from __future__ import annotations

import inspect
import re

import pytest
from lightning_helpers import ROOT, TinyClassifier, compose_train, cpu_trainer, run_train_py
from omegaconf import OmegaConf

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree
from lightning_fusedsgd.lightning import ConfigError, configure_fused_sgd
from runner.overrides import SET_ELSEWHERE, check_typed_overrides, refused_key
from runner.run import instantiate as runner_instantiate
from runner.run import train

CONF = ROOT / "conf"
RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.yaml"))


def _arguments(function) -> set[str]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    parameters = list(inspect.signature(function).parameters.values())[1:]  # self, module
    return {p.name for p in parameters if p.kind not in variadic and p.name != "params"}


def _keys(cfg) -> set[str]:
    return {key for key in cfg.optim if not key.startswith("_")}


def test_every_option_of_the_optimizers_is_a_key_of_its_optim_config(tmp_path):
    """optim.trust_coefficient=... needs no +: each option of the optimizer an optim config builds, and of
    configure_fused_sgd, is a key of that config, or set by another node (said where it is typed); each key
    is an argument they take, with which the real optimizer is built."""
    factory = _arguments(configure_fused_sgd)
    sgd_only = {"lars", "no_lars_bias", "no_lars_norm"}  # schedule-free SGD steps without LARS
    expected = {
        "fused_sgd": (_arguments(FusedSGD.__init__) | factory) - {"schedule_free"},
        "fused_lars": (_arguments(FusedSGD.__init__) | factory) - {"schedule_free"},
        "schedule_free": (_arguments(FusedSGDScheduleFree.__init__) | factory) - sgd_only,
    }
    for choice, options in expected.items():
        cfg = compose_train([f"optim={choice}"], tmp_path)
        elsewhere = {key for key in options if f"optim.{key}" in SET_ELSEWHERE}
        assert options - elsewhere == _keys(cfg) - {"schedule_free"}, choice
        kwargs = {key: value for key, value in OmegaConf.to_object(cfg.optim).items() if key[0] != "_"}
        trainer = cpu_trainer(max_steps=1)
        trainer.fit(TinyClassifier(**kwargs))
        assert type(trainer.optimizers[0]) is (
            FusedSGDScheduleFree if choice == "schedule_free" else FusedSGD
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lrr=0.1"], "optim.lrr=0.1: optim=fused_sgd has no key lrr; did you mean optim.lr?"),
        (["optim.trust_coeficient=0.01"], "did you mean optim.trust_coefficient?"),
        (
            ["optim=schedule_free", "optim.nesterov=true"],
            "optim.nesterov=true: optim=schedule_free has no key nesterov; it is a key of optim=fused_lars, "
            "optim=fused_sgd",
        ),
        (["optim.ema_decay=0.99"], "optim=fused_sgd has no key ema_decay; it is ema.decay (the average"),
        (["schedule=cosine", "schedule.milestones=[5]"], "it is a key of schedule=multistep"),
        (["trainer.max_epoch=3"], "trainer=default has no key max_epoch; did you mean trainer.max_epochs?"),
        (
            ["trainer.benchmark=true"],
            "Trainer takes benchmark: +trainer.benchmark=true adds it to the config",
        ),
        (["seeed=1"], "seeed=1: the config has no key seeed; did you mean seed?"),
        (
            ["-m", "optim.lrr=0.1,0.2"],
            "optim.lrr=0.1,0.2: optim=fused_sgd has no key lrr; did you mean optim.lr?",
        ),
        # Under -m, each choice of a swept group; here optim=schedule_free has no nesterov.
        (
            ["-m", "optim=fused_sgd,schedule_free", "optim.nesterov=true", "optim.lr=0.1,0.2"],
            "it is a key of",
        ),
        (["recipe=resnet50_lars", "optim.lars_eps=1e-8", "optim.trust_coefficient=0.02"], None),
        (["-m", "optim.lr=0.1,0.2", "schedule=cosine,poly", "optim=fused_sgd,fused_lars"], None),
        (["--help", "optim.lrr=1"], None),  # Hydra's own
    ],
)
def test_a_key_the_config_lacks_is_refused_naming_the_nearest(args, message, tmp_path):
    """Hydra's own answer, "To append to your config use +optim.lrr=0.1", adds a key the optimizer then
    refuses with a traceback."""
    compose_train([], tmp_path)  # registers the recipes, as importing train.py does
    refused = refused_key(args, CONF, "train", "1.3")
    if message is None:
        assert refused is None
    else:
        assert message in refused and "+optim" not in refused


@pytest.mark.slow
def test_train_py_says_a_typo_in_one_line():
    """Where Hydra printed "Could not override 'seeed'. To append to your config use +seeed=1" and three more
    lines, exit status 1."""
    result = run_train_py(["seeed=1"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "error: seeed=1: the config has no key seeed; did you mean seed?"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(trust_coefficient=0.01), "trust_coefficient=0.01 is an option of LARS, and lars=False"),
        (dict(no_lars_norm=False), "no_lars_norm=False is an option of LARS"),
        (dict(lars_denominator="decayed_grad"), "lars_denominator='decayed_grad' is an option of LARS"),
        (
            dict(schedule_free=True, nesterov=True),
            "FusedSGDScheduleFree takes no option 'nesterov': it is FusedSGD",
        ),
        (dict(schedule_free=True, warmup_steps=5), "warmup_steps is the schedule's warmup"),
        (dict(lrr=0.1), "FusedSGD takes no option 'lrr'; did you mean 'lr'?"),
        (dict(lr="abc"), "Invalid learning rate: 'abc'. It must be a number"),
        (dict(base_lr="abc"), "base_lr must be a finite number >= 0, got 'abc'"),
        (dict(lars=True, trust_coefficient=0.01, lars_eps=1e-8), None),  # with LARS: used
        (dict(trust_coefficient=0.001, no_lars_norm=True), None),  # FusedSGD's defaults: nothing changed
    ],
)
def test_an_option_the_optimizer_would_not_use_is_refused(kwargs, message):
    """Not passed on to be dropped (a LARS option without LARS) or to fail in a traceback (an option the
    optimizer does not take, an lr that is no number): one ConfigError, as the optimizer's own refusals."""
    trainer = cpu_trainer(max_steps=1)
    if message is None:
        trainer.fit(TinyClassifier(**kwargs))
        assert trainer.global_step == 1
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            trainer.fit(TinyClassifier(**kwargs))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim=schedule_free", "optim.base_lr=0.5"],
            "optim.base_lr=0.5 is not used: optim.lr=1.0 is the peak",
        ),
        (["optim.lr=0.3", "optim.reference_batch_size=64"], "optim.reference_batch_size=64 is not used"),
        (
            ["recipe=resnet50", "schedule=cosine", "schedule.milestones=[10]"],
            "schedule.milestones=[10] is not used",
        ),
        (
            ["recipe=resnet50_lars", "schedule=multistep", "schedule.power=3"],
            "decay='multistep' does not read it",
        ),
        (["optim=schedule_free", "optim.lr=null", "optim.base_lr=0.5"], None),
    ],
)
def test_an_override_the_run_would_not_use_is_refused(overrides, message, tmp_path):
    """Refused by the run before anything is built (an override the run would use passes the check)."""
    cfg = compose_train(overrides, tmp_path)
    if message is None:
        check_typed_overrides(cfg)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            train(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("schedule.warmup=abc", "schedule.warmup must be a number, got 'abc'"),
        ("schedule.milestones=[6,x]", "schedule.milestones[1] must be a number, got 'x'"),
        ("schedule.start_lr=fast", "schedule.start_lr must be a number, got 'fast'"),
    ],
)
def test_a_schedule_value_that_is_no_number_is_a_config_error(override, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        runner_instantiate(compose_train([override], tmp_path).schedule)


@pytest.mark.slow
def test_a_bad_value_is_the_runners_one_line_error(tmp_path):
    """optim.lr=abc ended in float()'s traceback: train.py prints a ConfigError as `error: ...`."""
    with pytest.raises(ConfigError, match=re.escape("Invalid learning rate: 'abc'")):
        train(compose_train(["debug=tiny", "optim.lr=abc"], tmp_path))
