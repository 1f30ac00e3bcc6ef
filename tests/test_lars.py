"""LARS fused into the kernel, against an independent float64 plain-PyTorch reference of the formula."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_params
from oracles import lars_oracle_step
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD

# One tensor larger than a LARS wave (1M elements), several spanning kernel chunks, and small ones.
SHAPES = [(300, 1000), (64, 32, 3, 3), (70_000,), (1_050_000,), (10,), (5, 5)]
LR, MOMENTUM, WD = 0.2, 0.9, 5e-4


# Group 0 uses LARS; group 1 (like biases and norms) stays plain SGD.
LARS_MASK = [True, True, False, True, True, True]


def make_lars_params(seed=0, device="cpu"):
    params = make_params(SHAPES, seed=seed, device=device)
    with torch.no_grad():
        params[4].zero_()  # ||w|| = 0: trust ratio 1
    return params


def grads_for(step, generator):
    grads = [torch.randn(s, generator=generator) * 0.01 for s in SHAPES]
    grads[5].zero_()  # ||g|| = 0: trust ratio 1
    return grads


def mixed_groups(params):
    return [
        {"params": [p for p, m in zip(params, LARS_MASK) if m]},
        {"params": [p for p, m in zip(params, LARS_MASK) if not m], "lars": False},
    ]


def assert_matches_oracle(opt, params, lars_mask, seed, **oracle_kwargs):
    """Runs 30 steps of `opt` and of the float64 oracle (on the CPU) on the same gradients; compares weights
    and buffers."""
    weights = [p.detach().cpu().double() for p in params]
    buffers = [None] * len(params)
    generator = torch.Generator().manual_seed(seed)
    for step in range(30):
        grads = grads_for(step, generator)
        for p, g in zip(params, grads):
            p.grad = g.to(p.device, copy=True)
        opt.step()
        lars_oracle_step(
            weights, buffers, [g.double() for g in grads], lars_mask=lars_mask, lr=LR, **oracle_kwargs
        )
    for p, w in zip(params, weights):
        assert ((p.detach().cpu().double() - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() < 1e-5
    for p, b in zip(params, buffers):
        buffer = opt.state[p]["momentum_buffer"].cpu().double()
        assert ((buffer - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() < 1e-4


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_lars_coefficient_eps_and_dampening_reach_the_kernel(backend):
    params = make_lars_params()
    opt = FusedLARS(
        params,
        lr=LR,
        momentum=MOMENTUM,
        dampening=0.3,
        weight_decay=WD,
        trust_coefficient=0.02,
        lars_eps=0.05,
        backend=backend,
    )
    assert_matches_oracle(
        opt,
        params,
        [True] * len(params),
        seed=5,
        nesterov=False,
        trust_clip=False,
        decayed_grad=False,
        maximize=False,
        eta=0.02,
        eps=0.05,
        dampening=0.3,
    )


def test_lars_actually_rescales():
    """Guards the oracle test above: with LARS off the result must differ."""
    a, b = make_lars_params(), make_lars_params()
    opt_a = FusedSGD(a, lr=LR, momentum=MOMENTUM, weight_decay=WD, lars=True)
    opt_b = FusedSGD(b, lr=LR, momentum=MOMENTUM, weight_decay=WD, lars=False)
    generator = torch.Generator().manual_seed(1)
    grads = grads_for(0, generator)
    for p, q, g in zip(a, b, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt_a.step()
    opt_b.step()
    assert not torch.allclose(a[0], b[0])


def test_lars_uses_unscaled_gradient_under_grad_scaler():
    a, b = make_lars_params(), make_lars_params()
    opt_a = FusedLARS(a, lr=LR, momentum=MOMENTUM, weight_decay=WD, lars_eps=1e-3)
    opt_b = FusedLARS(b, lr=LR, momentum=MOMENTUM, weight_decay=WD, lars_eps=1e-3)
    generator = torch.Generator().manual_seed(2)
    for step in range(5):
        grads = grads_for(step, generator)
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g * 1024.0
        opt_b.grad_scale, opt_b.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    # An overflowing step changes nothing.
    before = copy.deepcopy(([q.detach() for q in b], opt_b.state_dict()))
    opt_b.found_inf = torch.tensor(1.0)
    opt_b.step()
    assert all(torch.equal(q, w) for q, w in zip(b, before[0]))
    for key, value in before[1]["state"].items():
        assert torch.equal(opt_b.state_dict()["state"][key]["momentum_buffer"], value["momentum_buffer"])


def test_lars_is_deterministic_across_thread_counts():
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            params = make_lars_params()
            opt = FusedLARS(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
            generator = torch.Generator().manual_seed(3)
            for step in range(3):
                for p, g in zip(params, grads_for(step, generator)):
                    p.grad = g
                opt.step()
            results.append([p.detach().clone() for p in params])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_lars_state_interoperates_with_torch_sgd():
    """FusedLARS -> torch.optim.SGD -> FusedLARS keeps buffers bit-identical; the run continues exactly."""
    generator = torch.Generator().manual_seed(4)
    grads = [grads_for(step, generator) for step in range(8)]
    kwargs = dict(lr=LR, momentum=MOMENTUM, weight_decay=WD)

    def run(opt, params, steps):
        for step in steps:
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()

    straight = make_lars_params()
    run(FusedLARS(straight, **kwargs), straight, range(8))

    resumed = make_lars_params()
    first = FusedLARS(resumed, **kwargs)
    run(first, resumed, range(4))
    via_torch = torch.optim.SGD(resumed, **kwargs)
    via_torch.load_state_dict(copy.deepcopy(first.state_dict()))
    for p in resumed:
        assert torch.equal(via_torch.state[p]["momentum_buffer"], first.state[p]["momentum_buffer"])
    second = FusedLARS(resumed, **kwargs)
    second.load_state_dict(copy.deepcopy(via_torch.state_dict()))
    run(second, resumed, range(4, 8))
    assert all(torch.equal(p, q) for p, q in zip(resumed, straight))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("scale", [1e-25, 1e20], ids=["tiny", "huge"])
@pytest.mark.parametrize("decayed_grad", [False, True])
def test_lars_norms_hold_over_the_whole_float_range(backend, scale, decayed_grad):
    """fp32 squares underflow at 1e-25 and overflow at 1e20; the trust ratio must still be the formula's."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(300, 1000), (1_050_000,), (64, 32, 3, 3)]
    params = [nn.Parameter(torch.randn(s, generator=generator) * scale) for s in shapes]
    opt = FusedSGD(
        params, lr=LR, momentum=MOMENTUM, weight_decay=WD, lars=True, backend=backend,
        lars_denominator="decayed_grad" if decayed_grad else "grad_plus_decay",
    )  # fmt: skip
    weights = [p.detach().double() for p in params]
    buffers = [None] * len(params)
    for _ in range(2):
        grads = [torch.randn(s, generator=generator) * (scale * 0.01) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        lars_oracle_step(
            weights, buffers, [g.double() for g in grads], lars_mask=[True] * 3, lr=LR,
            nesterov=False, trust_clip=False, decayed_grad=decayed_grad, maximize=False,
        )  # fmt: skip
    for p, w in zip(params, weights):
        assert p.isfinite().all()
        assert ((p.detach().double() - w).abs().max() / w.abs().max()).item() < 1e-5
