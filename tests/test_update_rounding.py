"""update_rounding="stochastic": bf16 params without master weights take their update unbiased, with the same
bits from the compiled kernel and the reference, on any thread count, and after a resume."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_params

from lightning_fusedsgd import FusedSGD

BACKENDS = ["compiled", "torch"]


def _optimizer(params, backend="compiled", **hparams):
    defaults = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2, "update_rounding": "stochastic"}
    return FusedSGD(params, backend=backend, **{**defaults, **hparams})


def _run(params, steps, seed=0, backend="compiled", optimizer=None, generator=None, **hparams):
    """Steps ``params`` with pseudo-random gradients from ``generator`` (default: seeded with ``seed``);
    returns the optimizer (``_optimizer``'s unless one is given)."""
    if optimizer is None:
        optimizer = _optimizer(params, backend, **hparams)
    generator = torch.Generator().manual_seed(seed) if generator is None else generator
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()
    return optimizer


def _bits(params, optimizer):
    return [p.detach().clone() for p in params] + [
        optimizer.state[p]["momentum_buffer"].clone() for p in params if p in optimizer.state
    ]


def _assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounding_is_unbiased_and_between_the_neighbours(backend):
    """Each element is 1 - u for one u: the mean of 65,536 roundings is within 4 standard errors of the fp32
    result (a float64 oracle), and every rounding is one of the two bf16 values around it."""
    u = 3.0e-3  # 1 - u lies between two bf16 values, 0.8 of an ulp above the lower one
    param = torch.nn.Parameter(torch.ones(1 << 16, dtype=torch.bfloat16))
    optimizer = FusedSGD([param], lr=1.0, update_rounding="stochastic", backend=backend)
    param.grad = torch.full_like(param, u)
    optimizer.step()
    exact = 1.0 - float(torch.tensor(u, dtype=torch.bfloat16).double())
    below = float(torch.tensor(exact).to(torch.bfloat16).double())
    ulp = 2.0**-8  # of bf16 in [0.5, 1)
    below = below if below <= exact else below - ulp
    values = param.detach().double()
    assert set(values.unique().tolist()) == {below, below + ulp}
    p_up = (exact - below) / ulp
    standard_error = ulp * (p_up * (1 - p_up) / values.numel()) ** 0.5
    assert abs(float(values.mean()) - exact) < 4 * standard_error


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_updates_are_not_lost(backend):
    """The stale-weight case: 1,000 updates of 1e-3 on weights of 1.0. Rounded to nearest they never move;
    rounded stochastically they reach the fp32 result, 1 - 1000 x 1e-3 = 0, within 0.01 on average, and
    each weight within a random walk of 1,000 roundings (at most half a bf16 ulp of 1 each: rms < 0.07)."""
    finals = {}
    for rounding in ("nearest", "stochastic"):
        param = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = FusedSGD([param], lr=1e-3, update_rounding=rounding, backend=backend)
        for _ in range(1000):
            param.grad = torch.ones_like(param)
            optimizer.step()
        finals[rounding] = param.detach().double()
    assert torch.all(finals["nearest"] == 1.0)
    assert abs(float(finals["stochastic"].mean())) < 0.01
    assert float(finals["stochastic"].pow(2).mean().sqrt()) < 0.07


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_compiled_and_reference_give_the_same_bits(momentum):
    """Several tensors (a channels_last one), two groups with their own seeds (one above 2^32), and the
    momentum buffers rounded too."""
    results = []
    for backend in BACKENDS:
        params = make_params([(4, 3, 5, 5), (300,), (7, 11)], dtype=torch.bfloat16, seed=1)
        groups = [
            {"params": params[:2], "rounding_seed": 5},
            {"params": params[2:], "rounding_seed": 2**40 + 3},
        ]
        optimizer = _optimizer(groups, backend, momentum=momentum)
        _run(params, steps=4, optimizer=optimizer)
        assert set(optimizer.last_backends.values()) <= {backend, "compiled (kept plan)"}
        results.append(_bits(params, optimizer))
    _assert_same_bits(*results)


def test_fp32_params_and_other_groups_round_as_before():
    """A group rounded to nearest, and fp32 params in a stochastic group, step as without the option."""
    runs = []
    for rounding in ("nearest", "stochastic"):
        bf16 = make_params([(50,)], dtype=torch.bfloat16, seed=2)
        fp32 = make_params([(50,)], seed=3)
        optimizer = FusedSGD(
            [{"params": bf16, "update_rounding": "nearest"}, {"params": fp32}],
            lr=0.05,
            momentum=0.9,
            update_rounding=rounding,
        )
        _run(bf16 + fp32, steps=3, optimizer=optimizer)
        runs.append([p.detach().clone() for p in bf16 + fp32])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_the_bits_depend_on_the_seed_and_the_step_only():
    first = make_params([(1000,)], dtype=torch.bfloat16)
    same = make_params([(1000,)], dtype=torch.bfloat16)
    other = make_params([(1000,)], dtype=torch.bfloat16)
    _run(first, steps=2, rounding_seed=7)
    _run(same, steps=2, rounding_seed=7)
    _run(other, steps=2, rounding_seed=8)
    assert torch.equal(first[0], same[0])
    assert not torch.equal(first[0], other[0])


def test_the_same_bits_on_any_thread_count():
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            params = make_params([(3, 300_000), (17,)], dtype=torch.bfloat16)  # several chunks per tensor
            optimizer = _run(params, steps=3)
            results.append(_bits(params, optimizer))
    finally:
        torch.set_num_threads(threads)
    _assert_same_bits(*results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_draws_the_same_bits(backend):
    """Four steps in one go, or two, a state dict (deep-copied as a checkpoint would be), a new optimizer
    loading it, and two more: the same params and buffers, bit for bit."""
    straight = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    optimizer = _run(straight, steps=4, seed=0, backend=backend)
    assert optimizer.param_groups[0]["rounding_step"] == 4

    resumed = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)  # the same gradients, across the two halves
    first = _run(resumed, steps=2, backend=backend, generator=generator)
    saved = copy.deepcopy(first.state_dict())
    second = _optimizer(resumed, backend)
    second.load_state_dict(saved)
    _run(resumed, steps=2, optimizer=second, generator=generator)
    _assert_same_bits(_bits(straight, optimizer), _bits(resumed, second))
