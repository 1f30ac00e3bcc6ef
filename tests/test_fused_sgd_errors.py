"""Bad input raises a clear error and changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fusedsgd import FusedSGD


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt, params, before):
    weights, state = before
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    assert after["state"].keys() == state["state"].keys()
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(after["state"][key][name], tensor)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-0.1), "Invalid lr"),
        (dict(lr=torch.tensor(-0.1)), "Invalid lr"),
        (dict(momentum=-0.9), "Invalid momentum"),
        (dict(weight_decay=-1e-4), "Invalid weight_decay"),
        (dict(nesterov=True), "Nesterov momentum requires momentum > 0"),
        (dict(nesterov=True, momentum=0.9, dampening=0.1), "dampening = 0"),
        (
            dict(lars_denominator="nope"),
            r"Invalid lars_denominator: 'nope'. Choose one of \('grad_plus_decay'",
        ),
        (dict(trust_coefficient=0.0), r"Invalid trust_coefficient: 0.0. It must be > 0"),
        (dict(lars_eps=-1e-8), r"Invalid lars_eps: -1e-08. It must be >= 0"),
        (dict(backend="cuda_magic"), "Unknown backend"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedSGD([nn.Parameter(torch.randn(3))], **kwargs)


def test_empty_parameter_list():
    with pytest.raises(ValueError, match="empty parameter list"):
        FusedSGD([], lr=0.1)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="empty parameter list"):
        FusedSGD((p for p in frozen.parameters() if p.requires_grad), lr=0.1)


def test_invalid_group_is_not_added():
    opt = FusedSGD([nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Nesterov"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "nesterov": True, "dampening": 0.5})
    assert len(opt.param_groups) == 1


def test_group_on_two_devices():
    with pytest.raises(ValueError, match="one device"):
        FusedSGD([nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3, device="meta"))], lr=0.1)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(lars=True), "without lars"),
        (dict(max_grad_value=1.0), "without max_grad_value"),
        (dict(weight_decay=1e-4), "neither adds weight decay"),
    ],
)
def test_sparse_gradient_with_a_fused_only_option_names_the_parameter_and_changes_nothing(options, named):
    model = nn.ModuleDict({"proj": nn.Linear(4, 4), "emb": nn.Embedding(10, 4, sparse=True)})
    opt = FusedSGD(model.named_parameters(), lr=0.1, momentum=0.9, **options)
    model["proj"].weight.grad = torch.ones(4, 4)
    model["emb"](torch.tensor([1, 2])).sum().backward()
    params = list(model.parameters())
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=rf"'emb.weight' has a sparse gradient.*{named}"):
        opt.step()
    assert_unchanged(opt, params, before)


def test_wrong_momentum_shape_in_loaded_state_names_the_parameter():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = FusedSGD(model.named_parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    params = list(model.parameters())
    before = snapshot(opt, params)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][2]["momentum_buffer"] = torch.zeros(7, 3)
    with pytest.raises(ValueError, match=r"momentum_buffer of '1.weight' has shape \(7, 3\)"):
        opt.load_state_dict(bad)
    assert_unchanged(opt, params, before)


def test_wrong_momentum_shape_put_in_state_is_caught_before_any_update():
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(4, 3))]
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.state[params[1]]["momentum_buffer"] = torch.zeros(5, 3)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 \(shape \(4, 3\)\)"):
        opt.step()
    assert_unchanged(opt, params, before)


def stepped_pair(*params, **hparams):
    """An optimizer over `params` that has taken three steps (the cached step is in use)."""
    opt = FusedSGD(list(params), **{"lr": 0.1, "momentum": 0.9, **hparams})
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt


@pytest.mark.parametrize("backend", ["compiled", "torch"])
def test_overlapping_param_views_are_refused_before_any_update(backend):
    base = torch.randn(10)
    first, second = nn.Parameter(base[:6]), nn.Parameter(base[4:])
    other = nn.Parameter(torch.randn(70_000))
    groups = [{"params": [("other", other)]}, {"params": [("a", first), ("b", second)]}]
    opt = FusedSGD(groups, lr=0.1, momentum=0.9, backend=backend)
    params = [other, first, second]
    for p in params:
        p.grad = torch.ones_like(p)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match="'a' and 'b' are overlapping views"):
        opt.step()
    assert_unchanged(opt, params, before)


def test_unsupported_dtype_is_refused_before_any_update():
    good = nn.Parameter(torch.randn(5))
    odd = nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn), requires_grad=False)
    opt = stepped_pair(good)
    opt.add_param_group({"params": [odd]})
    good.grad = torch.ones(5)
    odd.grad = torch.zeros(3, dtype=torch.float8_e4m3fn)
    before = snapshot(opt, [good])
    with pytest.raises(TypeError, match=r"parameter 0 of group 1 .*float8_e4m3fn.*convert it"):
        opt.step()
    assert_unchanged(opt, [good], before)


def test_expanded_param_is_refused_before_any_update():
    good = nn.Parameter(torch.randn(70_000))
    expanded = nn.Parameter(torch.randn(1, 3).expand(4, 3))
    opt = FusedSGD([good, expanded], lr=0.1, momentum=0.9)
    good.grad, expanded.grad = torch.ones_like(good), torch.ones(4, 3)
    before = snapshot(opt, [good])
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 .*expand\(\)ed view"):
        opt.step()
    assert_unchanged(opt, [good], before)


def test_unknown_lars_denominator_set_after_construction_is_refused_at_step():
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))]
    opt = stepped_pair(*params)
    opt.param_groups[0]["lars_denominator"] = "decayed"
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: Invalid lars_denominator: 'decayed'"):
        opt.step()
    assert_unchanged(opt, params, before)
    opt.param_groups[0]["lars_denominator"] = "decayed_grad"
    opt.step()  # fixed: steps again


def _bad_state_dicts(opt):
    good = opt.state_dict()

    def edited(edit):
        state = copy.deepcopy(good)
        edit(state)
        return state

    def set_buffer(value):
        return lambda s: s["state"][1].__setitem__("momentum_buffer", value)

    def set_denominator(s):
        s["param_groups"][0]["lars_denominator"] = "decayed"

    return [
        pytest.param(edited(set_buffer(torch.empty(3, device="meta"))), "meta device", id="meta-buffer"),
        pytest.param(edited(set_buffer(3)), "momentum_buffer of 'b' is a int, not a tensor", id="int-buffer"),
        pytest.param(edited(set_buffer([1.0, 2.0])), "is a list, not a tensor", id="list-buffer"),
        pytest.param({"param_groups": good["param_groups"]}, "no 'state' entry", id="no-state"),
        pytest.param(
            edited(set_denominator), r"saved param_groups\[0\]: Invalid lars_denominator", id="bad-group"
        ),
        pytest.param([1, 2], "is a list, not a dict", id="not-a-dict"),
    ]


def _named_stepped():
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))]
    opt = FusedSGD(zip(["a", "b"], params), lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


@pytest.mark.parametrize("index", range(6))
def test_bad_state_dict_is_refused_with_a_clear_error_and_changes_nothing(index):
    opt, params = _named_stepped()
    case = _bad_state_dicts(opt)[index]
    state_dict, message = case.values
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state_dict)
    assert_unchanged(opt, params, before)
