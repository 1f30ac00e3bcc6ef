"""Gradient clipping inside the step (``max_grad_norm`` / ``max_grad_value``), against
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` followed by ``torch.optim.SGD`` (or the float64
LARS formula), with and without a GradScaler: one table of optimizer settings crossed with clip settings."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import make_params
from oracles import assert_close_rel, lars_oracle_step
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD

SHAPES = [(300, 70), (70_000,), (17, 3, 3, 3), (50,)]
# The first threshold of each clips on every step of these gradients; the large one never does.
CLIPS = [("norm", 0.5), ("norm", 1e6), ("value", 0.005)]
SETTINGS = {
    "plain": dict(lr=0.1, momentum=0.9, weight_decay=1e-4),
    "nesterov-maximize": dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    "no-momentum": dict(lr=0.1),
}


def two_groups(params):
    return [
        {"params": params[:2], "weight_decay": 1e-3},
        {"params": params[2:], "lr": 0.05, "weight_decay": 0.0},
    ]


def torch_clip(params, algorithm, threshold):
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(params, threshold)
    else:
        torch.nn.utils.clip_grad_value_(params, threshold)


def clip_kwargs(algorithm, threshold):
    return {"max_grad_norm": threshold} if algorithm == "norm" else {"max_grad_value": threshold}


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}-{c[1]:g}")
def test_clipping_comes_before_lars(clip, backend, device):
    """LARS sees the clipped gradient: the float64 formula applied to torch's clipped gradients."""
    params = make_params(SHAPES, device=device)
    lars_mask = [True, True, True, False]
    groups = [{"params": params[:3]}, {"params": params[3:], "lars": False}]
    optimizer = FusedLARS(
        groups, lr=0.2, momentum=0.9, weight_decay=5e-4, backend=backend, **clip_kwargs(*clip)
    )
    weights = [p.detach().cpu().double() for p in params]
    buffers = [None] * len(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(s, generator=generator) * 0.01 for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.to(device, copy=True)
        optimizer.step()
        clipped = [nn.Parameter(torch.zeros_like(g, dtype=torch.float64)) for g in grads]
        for c, g in zip(clipped, grads):
            c.grad = g.double()
        torch_clip(clipped, *clip)
        lars_oracle_step(
            weights,
            buffers,
            [c.grad for c in clipped],
            lars_mask=lars_mask,
            lr=0.2,
            nesterov=False,
            trust_clip=False,
            decayed_grad=False,
            maximize=False,
        )
    assert_close_rel([p.cpu() for p in params], weights, 1e-5)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("clip", [("norm", 0.05), ("value", 0.002)], ids=["norm", "value"])
def test_clipping_under_grad_scaler_sees_unscaled_gradients_and_skips_overflow(clip, backend):
    """A real GradScaler: ours clips inside the step on unscaled gradients; torch's loop unscales, clips and
    steps. The overflowing step (an inf in the loss) is skipped by both and changes nothing of ours."""
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    ours = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, backend=backend, **clip_kwargs(*clip))
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2)]
    generator = torch.Generator().manual_seed(2)
    for step in range(6):
        x = torch.randn(32, 20, generator=generator)
        y = torch.randint(0, 5, (32,), generator=generator)
        overflow = step == 3
        for net, optimizer, scaler in ((model, ours, scalers[0]), (reference, torch_opt, scalers[1])):
            loss = nn.functional.cross_entropy(net(x), y) * (float("inf") if overflow else 1.0)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            if optimizer is torch_opt:
                scaler.unscale_(optimizer)
                torch_clip(list(net.parameters()), *clip)
            before = [p.detach().clone() for p in net.parameters()]
            scaler.step(optimizer)
            scaler.update()
            if overflow and optimizer is ours:
                assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
                assert not bool(ours.last_step_applied)
        assert_close_rel(list(model.parameters()), list(reference.parameters()), 1e-5)
    assert scalers[0].get_scale() == scalers[1].get_scale()


@pytest.mark.parametrize("make_threshold", [np.float32, np.float64, np.int64, int, float])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_any_real_number_is_a_threshold_as_in_torch(make_threshold, algorithm):
    """torch's clip functions take any real number: numpy scalars clip exactly as the float does."""
    runs = []
    for threshold in (make_threshold(1), 1.0):
        params = make_params(SHAPES)
        optimizer = FusedSGD(params, lr=0.1, momentum=0.9, **clip_kwargs(algorithm, threshold))
        for p in params:
            p.grad = torch.full_like(p, 3.0)
        optimizer.step()
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_max_grad_value_refuses_complex_params_as_torch_does_and_changes_nothing():
    params = [nn.Parameter(torch.randn(4, dtype=torch.complex64)), nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    probe = nn.Parameter(params[0].detach().clone())
    probe.grad = params[0].grad.clone()
    with pytest.raises(NotImplementedError):  # the oracle: torch refuses it too
        torch.nn.utils.clip_grad_value_([probe], 0.5)
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9, max_grad_value=0.5)
    before = [p.detach().clone() for p in params]
    with pytest.raises(
        ValueError, match="max_grad_value clips each gradient element.*complex.*max_grad_norm"
    ):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state
    FusedSGD(params, lr=0.1, momentum=0.9, max_grad_norm=0.5).step()  # the norm is defined for complex


def test_a_refused_step_does_not_report_a_skip():
    params = make_params(SHAPES)
    optimizer = FusedSGD(params, lr=0.1, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad = params[0].grad.to_sparse()  # refused by the plan, before any write
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="sparse gradient"):
        optimizer.step()
    assert optimizer.last_step_applied is True


def test_fsdp1_flattened_params_step_plain_sgd_as_they_are():
    """LARS and norm clipping are refused on FSDP1's flattened params (tests/cases.py); plain SGD is
    elementwise, so their shards step as they are. FSDP1 needs a GPU here: the param carries FSDP's own
    flattened marker, set by FSDP's helper."""
    from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

    params = make_params(SHAPES)
    _set_fsdp_flattened(params[0])
    for p in params:
        p.grad = torch.ones_like(p)
    before = params[0].detach().clone()
    FusedSGD(params, lr=0.1, momentum=0.9).step()
    assert torch.equal(params[0], before - 0.1)
