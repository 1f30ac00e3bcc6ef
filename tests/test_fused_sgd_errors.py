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
        (dict(lars_denominator="nope"), "Unknown lars_denominator"),
        (dict(trust_coefficient=0.0), "trust_coefficient > 0"),
        (dict(lars_eps=-1e-8), "lars_eps >= 0"),
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


def test_sparse_gradient_names_the_parameter_and_changes_nothing():
    model = nn.ModuleDict({"proj": nn.Linear(4, 4), "emb": nn.Embedding(10, 4, sparse=True)})
    opt = FusedSGD(model.named_parameters(), lr=0.1, momentum=0.9)
    model["proj"].weight.grad = torch.ones(4, 4)
    model["emb"](torch.tensor([1, 2])).sum().backward()
    params = list(model.parameters())
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=r"'emb.weight'.*SparseAdam"):
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


def test_torch_fused_backend_refuses_what_it_cannot_do():
    p = nn.Parameter(torch.randn(3).to(torch.bfloat16))
    opt = FusedSGD([p], lr=0.1, momentum=0.9, master_weights=True, backend="torch_fused")
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="torch_fused"):
        opt.step()
    assert not opt.state[p]
