"""A kind of optimizer state and a plan-deciding option are each one declaration (lightning_fusedsgd._abi):
this test declares a slot and a column of its own, and shows that planning, the kept plan, state dicts and
checkpoints follow with no other edit; and that an option's rules, declared beside it, are enforced with no
other edit either. The reference backend runs the steps (it reads the declarations; the
compiled kernels know the slots and columns they were built with, which the library compares when it loads),
and its math ignores the test's slot."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from lightning_fusedsgd import FusedSGD, _abi
from lightning_fusedsgd.checkpoint import remap_optimizer_state_dict, seed_state_from_weights
from lightning_fusedsgd.optim import _kept
from lightning_fusedsgd.optim._plan import plan_step

# A group switch that decides the plan, and the state it switches on: each param's weight when it started to
# keep one (fp32, seeded from the weight, dropped while its group does not keep it).
KEEP_START = _abi.Column(
    key="keep_start",
    encode=lambda value: float(bool(value)),
    check=lambda value: "It must be True or False." if isinstance(value, str) else None,
    plan=bool,
)
START_WEIGHT = _abi.Slot(
    key="start_weight",
    held=lambda group, dtype: bool(group["keep_start"]),
    dtype=lambda group, dtype: torch.float32,
    seed="weight",
    option="keep_start",
    stale_unheld=True,
)


@pytest.fixture(autouse=True)
def declared(monkeypatch):
    monkeypatch.setattr(_abi, "HPARAMS", (*_abi.HPARAMS, KEEP_START))
    monkeypatch.setattr(_abi, "SLOTS", (*_abi.SLOTS, START_WEIGHT))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).to(torch.bfloat16)


def _optimizer(model: nn.Module, keep: tuple[bool, bool] = (True, False)) -> FusedSGD:
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if n.startswith(f"{layer}.")], "keep_start": keep[layer]}
        for layer in (0, 1)
    ]
    return FusedSGD(groups, lr=0.1, momentum=0.9, master_weights=True, backend="reference")


def _step(model: nn.Module, optimizer: FusedSGD) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(p.dtype)
    optimizer.step()


def test_planning_seeds_the_slot_where_its_group_holds_it_and_drops_it_where_it_stops():
    model = _model()
    optimizer = _optimizer(model)
    started = {id(p): p.detach().float() for p in model.parameters()}
    _step(model, optimizer)
    first, second = optimizer.param_groups
    for p in first["params"]:
        kept = optimizer.state[p]["start_weight"]
        assert kept.dtype == torch.float32 and torch.equal(kept, started[id(p)])
    assert all("start_weight" not in optimizer.state[p] for p in second["params"])
    _step(model, optimizer)  # the slot rides along untouched (the reference's math ignores it)
    assert all(torch.equal(optimizer.state[p]["start_weight"], started[id(p)]) for p in first["params"])
    first["keep_start"] = False
    _step(model, optimizer)
    assert all("start_weight" not in optimizer.state[p] for p in first["params"])  # stale: dropped
    first["keep_start"] = True
    now = {id(p): optimizer.state[p]["master_param"].clone() for p in first["params"]}
    _step(model, optimizer)
    assert all(torch.equal(optimizer.state[p]["start_weight"], now[id(p)]) for p in first["params"])


def test_a_kept_plan_is_made_anew_when_the_column_or_the_slots_state_changes():
    model = _model()
    optimizer = _optimizer(model)
    _step(model, optimizer)
    groups, state = optimizer.param_groups, optimizer.state
    record = _kept._Record.of(groups, state, plan_step(groups, state))
    assert "start_weight" in record.tracked
    assert record.matches(groups, state)
    groups[1]["keep_start"] = True  # the column decides the plan
    assert not record.matches(groups, state)
    groups[1]["keep_start"] = False
    assert record.matches(groups, state)
    param = groups[0]["params"][0]
    state[param]["start_weight"] = state[param]["start_weight"].clone()  # the slot's state is tracked
    assert not record.matches(groups, state)


def test_a_state_dict_keeps_the_slot_in_its_dtype_and_a_regrouped_load_moves_it_by_name():
    model = _model()
    optimizer = _optimizer(model)
    _step(model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    loaded = _optimizer(model)
    loaded.load_state_dict(saved)
    for p, q in zip(model.parameters(), model.parameters()):
        if "start_weight" in optimizer.state[p]:
            assert loaded.state[q]["start_weight"].dtype == torch.float32  # torch's loader would cast to bf16
            assert torch.equal(loaded.state[q]["start_weight"], optimizer.state[p]["start_weight"])
    # The same state grouped as one group: remapped by name into the two groups.
    flat = {
        "state": saved["state"],
        "param_groups": [
            {
                **saved["param_groups"][0],
                "params": [i for g in saved["param_groups"] for i in g["params"]],
                "param_names": [n for g in saved["param_groups"] for n in g["param_names"]],
            }
        ],
    }
    remapped = remap_optimizer_state_dict(flat, loaded.param_groups)
    starts = [entry.get("start_weight") for entry in remapped["state"].values()]
    assert sum(start is not None for start in starts) == len(list(model[0].parameters()))


def test_a_checkpoint_seeds_the_slot_from_its_fp32_weights():
    """As master weights are: a bf16-true run started from a checkpoint's fp32 weights keeps its low bits."""
    model = _model()
    optimizer = _optimizer(model)
    weights = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    seed_state_from_weights(optimizer, model, weights)
    for name, p in model.named_parameters():
        held = name.startswith("0.")
        assert ("start_weight" in optimizer.state[p]) == held
        if held:
            assert torch.equal(optimizer.state[p]["start_weight"], weights[name])
            assert torch.equal(optimizer.state[p]["master_param"], weights[name])


def test_an_options_rules_are_declared_beside_it_and_refuse_before_anything_is_written(monkeypatch):
    # keep_start with a rule of each kind: only beside a momentum (the group's other keys), and for no float64
    # params. (FusedSGD takes no keep_start argument, so its defaults hold none.)
    ruled = dataclasses.replace(
        KEEP_START,
        rule=lambda group: (
            "keep_start needs a momentum" if group.get("keep_start") and group["momentum"] == 0 else None
        ),
        param_rule=lambda group, param, label: (
            f"keep_start keeps no {param.dtype} weights: {label()}"
            if group["keep_start"] and param.dtype == torch.float64
            else None
        ),
    )
    monkeypatch.setattr(_abi, "HPARAMS", (*_abi.HPARAMS[:-1], ruled))
    model = _model()
    with pytest.raises(ValueError, match="param_groups\\[0\\]: keep_start needs a momentum"):
        FusedSGD([{"params": list(model.parameters()), "keep_start": True}], lr=0.1, backend="reference")
    weight = nn.Parameter(torch.randn(3, dtype=torch.float64))
    optimizer = FusedSGD(
        [{"params": [weight], "keep_start": False}], lr=0.1, momentum=0.9, backend="reference"
    )
    weight.grad = torch.randn(3, dtype=torch.float64)
    optimizer.param_groups[0]["keep_start"] = True
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="keep_start keeps no torch.float64 weights: parameter 0 of group 0"):
        optimizer.step()
    assert torch.equal(weight, before) and not optimizer.state[weight]
