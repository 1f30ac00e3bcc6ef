"""The state a state dict brings, checked before anything is replaced: every slot by its declaration
(``_abi.SLOTS``: a count one number, the rest the param's shape) and schedule-free's group state by its kind,
on every optimizer class and every way in (``load_state_dict``, the checkpoint package's by-name remap, a
``torch.optim.SGD`` checkpoint); a refused load changes nothing and the next step is the one without it."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from helpers import assert_unchanged, snapshot
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD, FusedSGDScheduleFree, _abi
from lightning_fusedsgd.checkpoint import load_optimizer_state

# Optimizers whose states hold, between them, every slot: (class, param dtype, arguments).
HOLDERS = {
    "sgd-masters-average": (FusedSGD, torch.bfloat16, dict(momentum=0.9, master_weights=True, ema_decay=0.9)),
    "sgd-stochastic": (
        FusedSGD,
        torch.bfloat16,
        dict(momentum=0.9, master_weights=False, update_rounding="stochastic"),
    ),
    "lars-kahan-average": (
        FusedLARS,
        torch.bfloat16,
        dict(momentum=0.9, master_weights=False, update_rounding="kahan", ema_decay=0.5),
    ),
    "schedule-free-masters": (FusedSGDScheduleFree, torch.bfloat16, dict(master_weights=True)),
    "lars-fp32": (FusedLARS, torch.float32, dict(momentum=0.9)),
}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(dtype)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    cls, _, arguments = HOLDERS[name]
    optimizer = cls(params, lr=0.05, **arguments)
    if isinstance(optimizer, FusedSGDScheduleFree):
        optimizer.train()
    return optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    optimizer.step()


def _stepped(name: str, named: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(HOLDERS[name][1])
    optimizer = _optimizer(name, model.named_parameters() if named else model.parameters())
    for seed in range(2):
        _step(model, optimizer, seed)
    return model, optimizer


def _misshapen(key: str, value: torch.Tensor) -> list[torch.Tensor]:
    """Values of a slot in shapes its declaration refuses: a count of 3 or of 1 elements, a per-element slot
    one number, or flat with one element more than its param."""
    if _abi.slot(key).count:
        return [value.new_zeros(3), value.new_zeros(1)]
    return [value.new_zeros(()), value.new_zeros(value.numel() + 1)]


def _expected_message(
    key: str, label: str, found: torch.Tensor, param_shape: tuple[int, ...], by_name: bool = False
) -> str:
    """The refusal: the slot, the param, the shape found, the one expected, and the fix. Matched by name (the
    checkpoint package), a state tensor of another shape is refused as the checkpoint of another model."""
    shape = re.escape(str(tuple(found.shape)))
    if _abi.slot(key).count:
        return rf"the {key} of {label} has shape {shape}, but it is a count, one number \(shape \(\)\).*drop"
    if by_name and found.dim() > 0:
        name = label.strip("'")
        return (
            rf"(?s){name} \(checkpoint {key} {re.escape(str(list(found.shape)))}, model "
            rf"{re.escape(str(list(param_shape)))}\).*Nothing was loaded or changed. Use a checkpoint"
        )
    expected = re.escape(str(param_shape))
    return rf"The {key} of {label} has shape {shape} but the parameter has shape {expected}.*drop"


def _refused_and_unchanged(model, optimizer, load, message: str) -> None:
    """``load`` is refused with ``message``, the optimizer and params are as before it, and the next step is
    that of a twin that never saw it (a copy made before)."""
    before = snapshot(optimizer, list(model.parameters()))
    twin_model, twin = copy.deepcopy((model, optimizer))
    with pytest.raises(ValueError, match=message):
        load()
    assert_unchanged(optimizer, list(model.parameters()), before)
    _step(model, optimizer, seed=7)
    _step(twin_model, twin, seed=7)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


def test_the_holders_hold_every_slot():
    held = {key for name in HOLDERS for state in _stepped(name)[1].state.values() for key in state}
    assert held == set(_abi.slot_keys())


@pytest.mark.parametrize("name", HOLDERS)
def test_a_slot_of_a_shape_its_declaration_refuses_is_refused_naming_it_and_changes_nothing(name):
    model, optimizer = _stepped(name)
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
    saved = optimizer.state_dict()
    names = [n for group in saved["param_groups"] for n in group["param_names"]]
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            for bad in _misshapen(key, value):
                broken = copy.deepcopy(saved)
                broken["state"][index][key] = bad
                message = _expected_message(key, f"'{names[index]}'", bad, shapes[names[index]])
                _refused_and_unchanged(
                    model, optimizer, lambda broken=broken: optimizer.load_state_dict(broken), message
                )


@pytest.mark.parametrize("name", HOLDERS)
def test_a_misshapen_slot_of_an_unnamed_state_is_refused_naming_the_param_by_index(name):
    model, optimizer = _stepped(name, named=False)
    saved = optimizer.state_dict()
    for key, value in saved["state"][1].items():  # the first layer's bias, shape (4,)
        bad = _misshapen(key, value)[0]
        broken = copy.deepcopy(saved)
        broken["state"][1][key] = bad
        label = "parameter 1" if _abi.slot(key).count else r"parameter 1 of group 0 \(shape \(4,\)\)"
        with pytest.raises(ValueError, match=_expected_message(key, label, bad, (4,))):
            optimizer.load_state_dict(broken)


@pytest.mark.parametrize("name", HOLDERS)
def test_a_misshapen_slot_remapped_by_name_is_refused_and_changes_nothing(name):
    """A state saved under one grouping, loaded by the checkpoint package into another (by name)."""
    source, saving = _stepped(name)
    saved = saving.state_dict()
    model = copy.deepcopy(source)
    named = list(model.named_parameters())
    optimizer = _optimizer(
        name,
        [{"params": [p for p in named if p[1].dim() == 1]}, {"params": [p for p in named if p[1].dim() > 1]}],
    )
    load_optimizer_state(optimizer, copy.deepcopy(saved))
    _step(model, optimizer, seed=3)
    names = saved["param_groups"][0]["param_names"]
    for key, value in saved["state"][0].items():  # '0.weight', shape (4, 3)
        for bad in _misshapen(key, value):
            broken = copy.deepcopy(saved)
            broken["state"][0][key] = bad
            message = _expected_message(key, f"'{names[0]}'", bad, (4, 3), by_name=True)
            _refused_and_unchanged(
                model, optimizer, lambda broken=broken: load_optimizer_state(optimizer, broken), message
            )


def test_a_torch_sgd_checkpoint_with_a_misshapen_buffer_is_refused_by_every_way_in():
    model = _model(torch.float32)
    sgd = torch.optim.SGD(model.named_parameters(), lr=0.05, momentum=0.9)
    _step(model, sgd, seed=0)
    broken = copy.deepcopy(sgd.state_dict())
    broken["state"][2]["momentum_buffer"] = torch.zeros(())  # '2.weight', shape (2, 4)
    optimizer = _optimizer("lars-fp32", model.named_parameters())
    _step(model, optimizer, seed=1)
    message = _expected_message(
        "momentum_buffer", "'2.weight'", broken["state"][2]["momentum_buffer"], (2, 4)
    )
    for load in (
        lambda: optimizer.load_state_dict(copy.deepcopy(broken)),
        lambda: load_optimizer_state(optimizer, copy.deepcopy(broken)),
    ):
        _refused_and_unchanged(model, optimizer, load, message)


@pytest.mark.parametrize("key", [slot.key for slot in _abi.SLOTS if slot.count])
def test_a_count_set_to_a_misshapen_tensor_is_refused_by_the_step_naming_it(key):
    """The step checks the state it finds by the same declaration, before it writes anything."""
    name = "sgd-stochastic" if key == "rounding_step" else "sgd-masters-average"
    model, optimizer = _stepped(name)
    weight = model[0].weight
    optimizer.state[weight][key] = torch.zeros(3, dtype=torch.int64)
    before = snapshot(optimizer, list(model.parameters()))
    with pytest.raises(ValueError, match=rf"The {key} of '0.weight' has shape \(3,\) but it is a count"):
        _step(model, optimizer, seed=5)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), before[0]))


@pytest.mark.parametrize("key", [slot.key for slot in _abi.SLOTS if slot.count])
@pytest.mark.parametrize(
    "value, problem",
    [
        (torch.tensor(-3), "is -3, but it is a count, a whole number >= 0"),
        (torch.tensor(2.7), "is 2.7[0-9]*, but it is a count, a whole number >= 0"),
        (torch.tensor(float("nan")), "is nan, but it is a count, a whole number >= 0"),
        (torch.tensor(True), "is a torch.bool tensor, but it is a count, a whole number >= 0"),
    ],
)
def test_a_count_of_a_value_no_count_has_is_refused_naming_it_and_changes_nothing(key, value, problem):
    """A count is one whole number >= 0: a negative one left the average where it was at every later step,
    a fraction was cut to an int, a bool taken as 0 or 1, each without a word."""
    name = "sgd-stochastic" if key == "rounding_step" else "sgd-masters-average"
    model, optimizer = _stepped(name)
    broken = copy.deepcopy(optimizer.state_dict())
    broken["state"][0][key] = value
    message = rf"the {key} of '0.weight' {problem}: the state is damaged.*drop the optimizer state"
    _refused_and_unchanged(model, optimizer, lambda: optimizer.load_state_dict(broken), message)


def test_another_optimizers_state_is_refused_naming_its_keys_and_changes_nothing():
    """Adam's ``exp_avg`` and ``exp_avg_sq`` are no state of FusedSGD: torch's loader would keep them beside
    FusedSGD's own without a word."""
    model, optimizer = _stepped("lars-fp32")
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, adam, seed=3)
    message = r"per-parameter state 'exp_avg', 'exp_avg_sq', which is no state of FusedSGD.*weights only"
    _refused_and_unchanged(model, optimizer, lambda: optimizer.load_state_dict(adam.state_dict()), message)


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("k", torch.tensor([1, 2, 3]), r"a tensor of shape \(3,\), but it is one real number"),
        ("k", 2.5, "2.5, but it is a count, an int >= 0"),
        ("k", -1, "-1, but it is a count, an int >= 0"),
        ("weight_sum", torch.zeros(2), r"a tensor of shape \(2,\), but it is one real number"),
        ("lr_max", "0.1", "'0.1', but it is a finite number"),
        ("scheduled_lr", float("nan"), "nan, but it is a finite number"),
        ("train_mode", "True", "'True', but it is a mode, True or False"),
    ],
)
def test_schedule_free_group_state_of_another_kind_is_refused_and_changes_nothing(key, value, problem):
    model, optimizer = _stepped("schedule-free-masters")
    broken = copy.deepcopy(optimizer.state_dict())
    broken["param_groups"][0][key] = value
    message = rf"saved param_groups\[0\]: its {key} is {problem}.*Load the state the run saved"
    _refused_and_unchanged(model, optimizer, lambda: optimizer.load_state_dict(broken), message)


def _our_warnings(caught, optimizer) -> list[str]:
    start = f"{type(optimizer).__name__}.load_state_dict: the loaded state has"
    return [str(w.message) for w in caught if str(w.message).startswith(start)]


@pytest.mark.parametrize("name", HOLDERS)
def test_a_state_without_a_slot_its_groups_hold_says_so_once_naming_it_and_how_many(name):
    """Each slot but the momentum buffer carries history a restart loses: a loaded state without it warns once
    for the load, naming the slot, its option and how many params start it anew; the step then runs."""
    model, optimizer = _stepped(name)
    saved = optimizer.state_dict()
    keys = {key for entry in saved["state"].values() for key in entry} - {"momentum_buffer"}
    for key in sorted(keys):
        lacking = copy.deepcopy(saved)
        count = sum(lacking_entry.pop(key, None) is not None for lacking_entry in lacking["state"].values())
        option = _abi.slot(key).option
        with pytest.warns(UserWarning) as caught:
            optimizer.load_state_dict(lacking)
        said = _our_warnings(caught, optimizer)
        assert len(said) == 1, said
        assert re.search(rf"has no {key} for {count} params whose groups keep one \({option}\)", said[0])
        _step(model, optimizer, seed=4)
        assert key in optimizer.state[model[0].weight]


@pytest.mark.parametrize("name", HOLDERS)
def test_a_complete_state_loads_without_a_word(name):
    model, optimizer = _stepped(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def test_every_missing_slot_is_said_in_one_warning_and_an_emptied_entry_counts():
    """A state without masters and the average's counts: one warning names each with its count; an entry
    emptied of all its state is a loaded param that lacks them too. A missing momentum buffer is not said: it
    starts from the next gradient, as torch.optim.SGD's does."""
    model, optimizer = _stepped("sgd-masters-average")
    lacking = copy.deepcopy(optimizer.state_dict())
    for entry in lacking["state"].values():
        for key in ("master_param", "ema_step", "ema_updates", "momentum_buffer"):
            del entry[key]
    lacking["state"][3].clear()  # '2.bias': no ema either
    with pytest.warns(UserWarning) as caught:
        optimizer.load_state_dict(lacking)
    (said,) = _our_warnings(caught, optimizer)
    assert re.search(
        r"has no master_param for 4 params whose groups keep one \(master_weights\), no ema for 1 params "
        r"whose groups keep one \(ema_decay\), no ema_step for 4 params .*, no ema_updates for 4 params .*: "
        r"each starts anew",
        said,
    ), said
    assert "momentum_buffer" not in said


def test_an_earlier_versions_group_count_of_0_is_no_missing_count():
    """A state dict of an earlier version keeps the stochastic steps' count per group; at 0 its params start
    at 0, as the checkpoint says: nothing is missing."""
    model, optimizer = _stepped("sgd-stochastic")
    earlier = copy.deepcopy(optimizer.state_dict())
    for entry in earlier["state"].values():
        del entry["rounding_step"]
    earlier["param_groups"][0]["rounding_step"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.load_state_dict(earlier)
    assert all(optimizer.state[p]["rounding_step"].item() == 0 for p in model.parameters())


def test_schedule_free_groups_without_their_state_say_so_once():
    """A group that lacks schedule-free SGD's scalars (a torch.optim.SGD checkpoint) keeps the optimizer's
    own: said once for the load, naming each and in how many of the loaded groups."""
    model, optimizer = _stepped("schedule-free-masters")
    lacking = copy.deepcopy(optimizer.state_dict())
    for key in ("k", "weight_sum"):
        del lacking["param_groups"][0][key]
    k = optimizer.param_groups[0]["k"].item()
    with pytest.warns(UserWarning) as caught:
        optimizer.load_state_dict(lacking)
    said = [str(w.message) for w in caught if "lack schedule-free SGD's state of a group" in str(w.message)]
    assert len(said) == 1 and "k in 1 of 1, weight_sum in 1 of 1" in said[0], said
    assert optimizer.param_groups[0]["k"] == k  # the optimizer's own
