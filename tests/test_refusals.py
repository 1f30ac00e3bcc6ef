"""Bad input gets a clear error that names the problem and the fix, and changes nothing: the refusal table
(tests/cases.py), on both backends where a step is refused."""

from __future__ import annotations

import pytest
import torch
from cases import (
    CONSTRUCTION_REFUSALS,
    REFUSALS,
    SCHEDULE_FREE_CONSTRUCTION_REFUSALS,
    SCHEDULE_FREE_REFUSALS,
)
from helpers import assert_unchanged, snapshot
from torch import nn

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree


@pytest.mark.parametrize(
    "refusal",
    [*REFUSALS, *(pytest.param(r, id=f"schedule-free-{r.id}") for r in SCHEDULE_FREE_REFUSALS)],
    ids=lambda r: r.id,
)
def test_refused_and_nothing_changed(refusal):
    scenario = refusal.scenario()
    before = snapshot(scenario.optimizer, scenario.params)
    last_step = scenario.optimizer.last_step_applied
    with pytest.raises(refusal.error, match=refusal.match):
        scenario.act()
    assert_unchanged(scenario.optimizer, scenario.params, before)
    assert scenario.optimizer.last_step_applied is last_step  # a refused step reports no skip either


@pytest.mark.parametrize("kwargs, message", CONSTRUCTION_REFUSALS, ids=lambda v: str(v)[:40])
def test_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedSGD([nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("kwargs, message", SCHEDULE_FREE_CONSTRUCTION_REFUSALS, ids=lambda v: str(v)[:40])
def test_schedule_free_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedSGDScheduleFree([nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(lr=-0.1), dict(weight_decay=-1.0), dict(momentum=0.0), dict(momentum=1.5)], ids=str
)
def test_refusals_schedulefrees_words_are_in_ours(kwargs):
    """Code that matches schedulefree.SGDScheduleFree's messages keeps working: its message (the oracle) is
    part of ours, which goes on to name the fix."""
    schedulefree = pytest.importorskip("schedulefree")
    with pytest.raises(ValueError) as theirs:
        schedulefree.SGDScheduleFree([nn.Parameter(torch.randn(3))], **kwargs)
    with pytest.raises(ValueError) as ours:
        FusedSGDScheduleFree([nn.Parameter(torch.randn(3))], **kwargs)
    assert str(theirs.value) in str(ours.value)
    assert len(str(ours.value)) > len(str(theirs.value))


def test_a_step_in_eval_mode_is_refused_in_schedulefrees_words():
    schedulefree = pytest.importorskip("schedulefree")
    messages = []
    for optimizer in (
        schedulefree.SGDScheduleFree([nn.Parameter(torch.randn(3))]),
        FusedSGDScheduleFree([nn.Parameter(torch.randn(3))]),
    ):
        with pytest.raises(Exception) as refused:
            optimizer.step()  # both start in eval mode
        messages.append(str(refused.value))
    assert messages[0] in messages[1]


def test_an_empty_parameter_list_is_refused_naming_frozen_params():
    with pytest.raises(ValueError, match="empty parameter list"):
        FusedSGD([], lr=0.1)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="not every parameter is frozen"):
        FusedSGD((p for p in frozen.parameters() if p.requires_grad), lr=0.1)


def test_a_refused_group_is_not_added():
    optimizer = FusedSGD([nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Nesterov"):
        optimizer.add_param_group(
            {"params": [nn.Parameter(torch.randn(2))], "nesterov": True, "dampening": 0.5}
        )
    with pytest.raises(ValueError, match="one device"):
        optimizer.add_param_group(
            {"params": [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3, device="meta"))]}
        )
    with pytest.raises(ValueError, match="the same parameter twice"):
        p = nn.Parameter(torch.randn(2))
        optimizer.add_param_group({"params": [p, p]})
    assert len(optimizer.param_groups) == 1


TORCH_REFUSALS = [
    (dict(lr=-0.1), ValueError),
    (dict(lr=torch.ones(2)), ValueError),
    (dict(momentum=-0.5), ValueError),
    (dict(weight_decay=-1.0), ValueError),
    (dict(nesterov=True), ValueError),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), ValueError),
]


@pytest.mark.parametrize("kwargs, error", TORCH_REFUSALS, ids=lambda v: str(v)[:40])
def test_refusals_torch_words_are_in_ours(kwargs, error):
    """Code and tests that match torch.optim.SGD's messages keep working: torch's own message (the oracle) is
    part of ours, which goes on to name the fix."""
    with pytest.raises(error) as theirs:
        torch.optim.SGD([nn.Parameter(torch.randn(3))], **kwargs)
    with pytest.raises(error) as ours:
        FusedSGD([nn.Parameter(torch.randn(3))], **kwargs)
    assert str(theirs.value) in str(ours.value)
    assert len(str(ours.value)) > len(str(theirs.value))


@pytest.mark.parametrize("params", [None, nn.Parameter(torch.randn(3))], ids=["none", "bare-tensor"])
def test_params_that_are_no_iterable_get_torchs_type_error(params):
    with pytest.raises(TypeError) as theirs:
        torch.optim.SGD(params)
    with pytest.raises(TypeError) as ours:
        FusedSGD(params)
    assert str(theirs.value) in str(ours.value)
