"""Gradient clipping inside the step (``max_grad_norm`` / ``max_grad_value``), against
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` followed by ``torch.optim.SGD`` (or the float64
LARS formula), with and without a GradScaler: one table of optimizer settings crossed with clip settings."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
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


def make_params(device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in SHAPES]


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


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}-{c[1]:g}")
@pytest.mark.parametrize("setting", [*SETTINGS, "two-groups"])
def test_clipping_matches_torch_clip_then_sgd(setting, clip, backend, device):
    params = make_params(device)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    hparams = SETTINGS.get(setting, dict(lr=0.1, momentum=0.9))
    if setting == "two-groups":
        ours = FusedSGD(two_groups(params), **hparams, backend=backend, **clip_kwargs(*clip))
        torch_opt = torch.optim.SGD(two_groups(reference), **hparams)
    else:
        ours = FusedSGD(params, **hparams, backend=backend, **clip_kwargs(*clip))
        torch_opt = torch.optim.SGD(reference, **hparams)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(s, generator=generator).to(device) * 0.01 for s in SHAPES]
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        torch_clip(reference, *clip)
        torch_opt.step()
    assert_close_rel(params, reference, 2e-6)
    if "momentum" in hparams:
        assert_close_rel(
            [ours.state[p]["momentum_buffer"] for p in params],
            [torch_opt.state[q]["momentum_buffer"] for q in reference],
            2e-6,
        )


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}-{c[1]:g}")
def test_clipping_comes_before_lars(clip, backend, device):
    """LARS sees the clipped gradient: the float64 formula applied to torch's clipped gradients."""
    params = make_params(device)
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


@pytest.mark.parametrize("backend", ["compiled", "torch"])
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
        params = make_params("cpu")
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
    with pytest.raises(ValueError, match="max_grad_value clips each gradient element.*complex.*max_grad_norm"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state
    FusedSGD(params, lr=0.1, momentum=0.9, max_grad_norm=0.5).step()  # the norm is defined for complex


def test_clipping_options_are_checked_before_anything_changes():
    params = make_params("cpu")
    with pytest.raises(ValueError, match="max_grad_norm and max_grad_value are alternatives"):
        FusedSGD(params, max_grad_norm=1.0, max_grad_value=0.1)
    with pytest.raises(ValueError, match="Invalid max_grad_norm: -1"):
        FusedSGD(params, max_grad_norm=-1)
    optimizer = FusedSGD(two_groups(params), lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.param_groups[1]["max_grad_norm"] = 1.0
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="max_grad_norm differs between parameter groups"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state


def test_a_refused_step_does_not_report_a_skip():
    params = make_params("cpu")
    optimizer = FusedSGD(params, lr=0.1, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad = params[0].grad.to_sparse()  # refused by the plan, before any write
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="sparse gradient"):
        optimizer.step()
    assert optimizer.last_step_applied is True


@pytest.mark.parametrize("options", [dict(lars=True), dict(max_grad_norm=1.0)], ids=["lars", "max_grad_norm"])
def test_fsdp1_flattened_params_refuse_norms_and_change_nothing(options):
    """FSDP1 needs a GPU here, so the param carries FSDP's own flattened marker (set by FSDP's helper)."""
    from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

    params = make_params("cpu")
    _set_fsdp_flattened(params[0])
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="FSDP1 .* Use FSDP2"):
        FusedSGD(params, lr=0.1, momentum=0.9, **options).step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    FusedSGD(params, lr=0.1, momentum=0.9).step()  # plain SGD is elementwise: FSDP1 shards step as they are
    assert not torch.equal(params[0], before[0])
