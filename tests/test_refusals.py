"""Bad input gets a clear error that names the problem and the fix, and changes nothing: the refusal table
(tests/cases.py), on both backends where a step is refused."""

from __future__ import annotations

import pytest
import torch
from cases import CONSTRUCTION_REFUSALS, REFUSALS
from helpers import assert_unchanged, snapshot
from torch import nn

from lightning_fusedsgd import FusedSGD


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.id)
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
