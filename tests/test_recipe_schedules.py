"""The recipes under a schedule a user chooses: each keeps its warmup (a recipe's keys of its own decay left
out under another decay, saying so)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning_helpers import ROOT, compose_train

import runner.run
from lightning_fusedsgd import FusedSGD
from lightning_fusedsgd.lightning import ConfigError, Schedule
from lightning_fusedsgd.schedule import DECAYS, WarmupSchedule
from runner.overrides import DECAY_KEYS, applied_schedule
from runner.run import instantiate as runner_instantiate
from runner.run import train

CONF = ROOT / "conf"
RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.yaml"))


def test_the_decay_keys_are_those_each_decay_reads():
    """runner.overrides.DECAY_KEYS against the schedule itself: changing a key changes some step's lr exactly
    for the decays that read it (milestones are refused by the others)."""
    changed = {"gamma": 0.5, "power": 3.0, "end_lr": 0.05}
    for decay in DECAYS:
        base = dict(
            total_steps=40, warmup_steps=4, decay=decay, milestones=(20,) if decay == "multistep" else ()
        )
        lrs = [WarmupSchedule(**base).lr_at(step, 1.0) for step in range(41)]
        for key, value in changed.items():
            other = [WarmupSchedule(**base, **{key: value}).lr_at(step, 1.0) for step in range(41)]
            assert (other != lrs) == (decay in DECAY_KEYS[key]), (decay, key)
        if decay != "multistep":
            with pytest.raises(ValueError, match="milestones only apply"):
                WarmupSchedule(**{**base, "milestones": (20,)})
    assert DECAY_KEYS["milestones"] == ("multistep",)


def test_each_recipes_warmup_survives_a_schedule_switch():
    """The warmup is the recipe's: python train.py schedule=cosine kept the quickstart's decay and lost its
    1-epoch warmup (the multistep group's), and recipe=resnet50 schedule=cosine was refused for the recipe's
    milestones; each recipe keeps its warmup under another schedule, and the schedule builds, but where the
    multistep group's milestones (the quickstart's epochs 6 and 8) fall in the recipe's warmup: refused."""
    compose_train([], ROOT)  # registers the recipes
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for recipe in RECIPES:
            own = compose("train", [f"recipe={recipe}"]).schedule
            for name in ["multistep" if own.decay == "cosine" else "cosine"]:  # to another decay
                switched = compose("train", [f"recipe={recipe}", f"schedule={name}"]).schedule
                assert (switched.warmup, switched.get("start_lr")) == (own.warmup, own.get("start_lr"))
                schedule = runner_instantiate(applied_schedule(switched))
                assert schedule.decay == name and schedule.warmup == own.warmup
                build = functools.partial(
                    schedule.build, FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0), peak_lr=1.0
                )
                if name == "multistep" and min(schedule.milestones) <= own.warmup:
                    with pytest.raises(ConfigError, match=r"milestones \[60, 80\] are outside warmup_steps"):
                        build(total_steps=900, steps_per_epoch=10)
                else:
                    assert build(total_steps=900, steps_per_epoch=10).schedule.decay == name


class _Built(Exception):
    """Raised by the spy once the run has built its schedule."""


def test_a_schedule_switch_leaves_out_the_recipes_keys_of_its_decay(tmp_path, caplog, monkeypatch):
    """recipe=resnet50 schedule=cosine was refused for the recipe's milestones (multistep's): the run leaves
    them out of the schedule it builds, saying so (the run stops there)."""
    built: list[Schedule] = []

    def spy(node, **kwargs):
        made = runner_instantiate(node, **kwargs)
        if isinstance(made, Schedule):
            built.append(made)
            raise _Built
        return made

    monkeypatch.setattr(runner.run, "instantiate", spy)
    cfg = compose_train(["recipe=resnet50", "schedule=cosine", "debug=tiny", "data=synthetic"], tmp_path)
    with caplog.at_level(logging.INFO, logger="runner.overrides"), pytest.raises(_Built):
        train(cfg)
    assert "decay='cosine' does not read the recipe's milestones=[30, 60, 80]: left out" in caplog.text
    assert built[0].milestones == () and built[0].warmup == 5 and built[0].decay == "cosine"
