"""update_rounding="stochastic" and "kahan": bf16 params without master weights take their update unbiased, or
with what rounding dropped kept in a compensation, with the same bits from the compiled kernel and the
reference, on any thread count, and after a resume."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import VECTORS_AND_TAIL, make_params

from lightning_fusedsgd import FusedSGD

BACKENDS = ["compiled", "reference"]
ROUNDINGS = ["stochastic", "kahan"]  # the options beside "nearest"


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
    """The params, then each param's state tensors (momentum buffer, compensation), by key."""
    state = [sorted(optimizer.state[p].items()) for p in params if p in optimizer.state]
    return [p.detach().clone() for p in params] + [value.clone() for items in state for _, value in items]


def _assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        if x.element_size() == 2:  # 16-bit floats by their bits (a NaN too)
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y)


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
    """The stale-weight case: 1,000 updates of 1e-3 on weights of 1.0, against torch.optim.SGD stepping fp32
    weights (about 0). Rounded to nearest they never move. Rounded stochastically they reach the fp32 result
    within 0.01 on average, each within a random walk of 1,000 roundings (at most half a bf16 ulp of 1 each:
    rms < 0.07). With Kahan compensation param + compensation reaches it within 1,000 roundings of the
    compensation to bf16 (below half an ulp of the param, 2^-9, so each loses at most 2^-18)."""
    finals = {}
    for rounding in ("nearest", *ROUNDINGS):
        param = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = FusedSGD([param], lr=1e-3, update_rounding=rounding, backend=backend)
        for _ in range(1000):
            param.grad = torch.ones_like(param)
            optimizer.step()
        compensation = optimizer.state[param].get("kahan_compensation", torch.zeros_like(param))
        finals[rounding] = param.detach().double() + compensation.double()
    fp32 = torch.nn.Parameter(torch.ones(1))
    oracle = torch.optim.SGD([fp32], lr=1e-3)
    for _ in range(1000):
        fp32.grad = torch.ones_like(fp32)
        oracle.step()
    expected = float(fp32.detach())
    assert torch.all(finals["nearest"] == 1.0)
    assert abs(float(finals["stochastic"].mean()) - expected) < 0.01
    assert float((finals["stochastic"] - expected).pow(2).mean().sqrt()) < 0.07
    assert float((finals["kahan"] - expected).abs().max()) <= 1000 * 2.0**-18


@pytest.mark.parametrize("backend", BACKENDS)
def test_kahan_weights_follow_fp32_training(backend):
    """300 momentum steps of small noisy gradients against torch.optim.SGD stepping the same weights in
    fp32 (weights of about 1): param + compensation stays within 1e-3 of the fp32 weights, where rounded to
    nearest the weights drift further than that."""
    errors = {}
    for rounding in ("nearest", "kahan"):
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(10_000, generator=generator).to(torch.bfloat16))
        fp32 = torch.nn.Parameter(param.detach().float())
        optimizer = FusedSGD([param], lr=0.01, momentum=0.9, update_rounding=rounding, backend=backend)
        oracle = torch.optim.SGD([fp32], lr=0.01, momentum=0.9)
        for _ in range(300):
            grad = (0.01 * torch.randn(param.shape, generator=generator) + 1e-3).to(torch.bfloat16)
            param.grad, fp32.grad = grad, grad.float()
            optimizer.step()
            oracle.step()
        compensation = optimizer.state[param].get("kahan_compensation", torch.zeros_like(param))
        weight = param.detach().float() + compensation.float()
        errors[rounding] = (weight - fp32.detach()).abs()
    assert float(errors["kahan"].max()) < 1e-3 < float(errors["nearest"].max())


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_compiled_and_reference_give_the_same_bits(momentum, rounding):
    """Several tensors (a channels_last one), two groups with their own seeds (one above 2^32), and the
    momentum buffers (rounded too) and compensations."""
    results = []
    for backend in BACKENDS:
        params = make_params([(4, 3, 5, 5), (300,), (7, 11)], dtype=torch.bfloat16, seed=1)
        groups = [
            {"params": params[:2], "rounding_seed": 5},
            {"params": params[2:], "rounding_seed": 2**40 + 3},
        ]
        optimizer = _optimizer(groups, backend, momentum=momentum, update_rounding=rounding)
        _run(params, steps=4, optimizer=optimizer)
        assert set(optimizer.last_backends.values()) <= {backend, "compiled (kept plan)"}
        results.append(_bits(params, optimizer))
    _assert_same_bits(*results)


@pytest.mark.parametrize("option", ROUNDINGS)
def test_fp32_params_and_other_groups_round_as_before(option):
    """A group rounded to nearest, and fp32 params in a group with the option, step as without it."""
    runs = []
    for rounding in ("nearest", option):
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


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_the_same_bits_on_any_thread_count(rounding):
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            params = make_params([(3, 300_000), (17,)], dtype=torch.bfloat16)  # several chunks per tensor
            optimizer = _run(params, steps=3, update_rounding=rounding)
            results.append(_bits(params, optimizer))
    finally:
        torch.set_num_threads(threads)
    _assert_same_bits(*results)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_gives_the_same_bits(backend, rounding):
    """Four steps in one go, or two, a state dict (deep-copied as a checkpoint would be), a new optimizer
    loading it, and two more: the same params, buffers and compensations, bit for bit."""
    straight = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    optimizer = _run(straight, steps=4, seed=0, backend=backend, update_rounding=rounding)
    counts = [optimizer.state[p].get("rounding_step") for p in straight]
    assert counts == ([torch.tensor(4)] * 2 if rounding == "stochastic" else [None] * 2)

    resumed = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)  # the same gradients, across the two halves
    first = _run(resumed, steps=2, backend=backend, generator=generator, update_rounding=rounding)
    saved = copy.deepcopy(first.state_dict())
    second = _optimizer(resumed, backend, update_rounding=rounding)
    second.load_state_dict(saved)
    _run(resumed, steps=2, optimizer=second, generator=generator)
    _assert_same_bits(_bits(straight, optimizer), _bits(resumed, second))


def test_kahan_compensation_follows_the_groups_settings():
    """A group switched to "kahan" between steps starts its compensation at 0 (the weight is the param), one
    switched back drops it, and master weights take precedence over it."""
    param = make_params([(30,)], dtype=torch.bfloat16)[0]
    optimizer = _run([param], steps=1, update_rounding="nearest")
    before = param.detach().clone()
    optimizer.param_groups[0]["update_rounding"] = "kahan"
    optimizer.param_groups[0]["lr"] = 0.0  # the weight stays the param: the compensation stays 0
    _run([param], steps=1, optimizer=optimizer)
    assert optimizer.last_backends == {"cpu/bfloat16 + kahan_compensation": "compiled"}
    assert torch.equal(param, before)
    assert torch.equal(optimizer.state[param]["kahan_compensation"], torch.zeros_like(param))
    optimizer.param_groups[0]["update_rounding"] = "nearest"
    _run([param], steps=1, optimizer=optimizer)
    assert set(optimizer.state[param]) == {"momentum_buffer"}

    masters = make_params([(30,)], dtype=torch.bfloat16)[0]
    optimizer = _run([masters], steps=2, update_rounding="kahan", master_weights=True)
    assert set(optimizer.state[masters]) == {"momentum_buffer", "master_param"}


@pytest.mark.parametrize(
    "start, grad", [(3.0e38, -1.0e38), (3.3895e38, -1.0e36)], ids=["fp32-inf", "bf16-inf"]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kahan_weight_that_overflows_stays_inf(backend, start, grad):
    """A weight rounded to inf keeps a compensation of 0, where the fp32 weight overflows too and where only
    its rounding to bf16 does (bf16's largest value plus 1e36): inf - inf, or inf - a finite weight, would
    make the next weight NaN."""
    param = torch.nn.Parameter(torch.full((VECTORS_AND_TAIL,), start, dtype=torch.bfloat16))
    optimizer = FusedSGD([param], lr=1.0, update_rounding="kahan", backend=backend)
    if grad == -1.0e36:  # the fp32 weight is finite: only its rounding overflows
        assert torch.isfinite(param.detach().float() - grad).all()
    for step_grad in (grad, 0.0):
        param.grad = torch.full_like(param, step_grad)
        optimizer.step()
        assert torch.all(param == float("inf"))
        assert torch.all(optimizer.state[param]["kahan_compensation"] == 0)


def test_switching_between_masters_and_kahan_keeps_the_weight():
    """A group switched from master weights to "kahan" starts each compensation at what rounding the master
    to the param dropped, and one switched back starts each master at param + compensation: steps at lr 0
    show the weight kept across both switches, to the compensation's bf16 rounding."""
    param = make_params([(500,)], dtype=torch.bfloat16, seed=4)[0]
    optimizer = _run([param], steps=20, update_rounding="kahan", master_weights=True, lr=1e-3)
    group = optimizer.param_groups[0]
    master = optimizer.state[param]["master_param"].clone()
    assert not torch.equal(master, param.float())  # the master holds bits the param has not
    group.update({"master_weights": False, "lr": 0.0})
    _run([param], steps=1, optimizer=optimizer)
    compensation = optimizer.state[param]["kahan_compensation"]
    assert "master_param" not in optimizer.state[param]
    weight = param.float() + compensation.float()
    dropped = (master - param.float()).abs()
    assert torch.all((weight - master).abs() <= 2.0**-8 * dropped)  # one bf16 rounding of what was dropped

    group["master_weights"] = True
    _run([param], steps=1, optimizer=optimizer)
    assert torch.equal(optimizer.state[param]["master_param"], weight)
    assert "kahan_compensation" not in optimizer.state[param]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_regrouped_resume_continues_the_random_stream(backend):
    """Each param counts its stochastic steps in its state, so a state dict loaded into an optimizer grouped
    differently (remapped by name) draws the uninterrupted run's bits: four steps in one group equal two, then
    a load into two groups, then two more."""
    shapes = [(40, 9), (9,), (300,)]
    straight = make_params(shapes, dtype=torch.bfloat16)
    optimizer = _run(straight, steps=4, optimizer=_optimizer(list(zip("abc", straight)), backend))

    resumed = make_params(shapes, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    first = _run(
        resumed, steps=2, optimizer=_optimizer(list(zip("abc", resumed)), backend), generator=generator
    )
    saved = copy.deepcopy(first.state_dict())
    regrouped = _optimizer(
        [{"params": list(zip("ab", resumed[:2]))}, {"params": [("c", resumed[2])]}], backend
    )
    regrouped.load_state_dict(saved)
    assert [regrouped.state[p]["rounding_step"] for p in resumed] == [torch.tensor(2)] * 3
    _run(resumed, steps=2, optimizer=regrouped, generator=generator)
    _assert_same_bits(_bits(straight, optimizer), _bits(resumed, regrouped))


def test_a_checkpoint_counting_steps_per_group_resumes_the_stream():
    """A state dict of an earlier version counts stochastic steps per group (``group["rounding_step"]``);
    loaded, each param of the group continues from that count."""
    straight = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    optimizer = _run(straight, steps=4)
    resumed = make_params([(40, 9), (9,)], dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    saved = copy.deepcopy(_run(resumed, steps=2, generator=generator).state_dict())
    for entry in saved["state"].values():
        del entry["rounding_step"]
    saved["param_groups"][0]["rounding_step"] = 2  # the earlier format
    second = _optimizer(resumed)
    second.load_state_dict(saved)
    assert "rounding_step" not in second.param_groups[0]
    _run(resumed, steps=2, optimizer=second, generator=generator)
    _assert_same_bits(_bits(straight, optimizer), _bits(resumed, second))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_step_draws_nothing(backend):
    """A step a GradScaler skips (found_inf) leaves every count as it was: the run equals one without it."""
    params, reference = (
        make_params([(300,)], dtype=torch.bfloat16),
        make_params([(300,)], dtype=torch.bfloat16),
    )
    optimizer = _run(params, steps=1, backend=backend)
    expected = _run(reference, steps=2, backend=backend)
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    params[0].grad = torch.full_like(params[0], float("inf"))
    optimizer.step()
    assert optimizer.state[params[0]]["rounding_step"].item() == 1
    del optimizer.grad_scale, optimizer.found_inf
    generator = torch.Generator().manual_seed(0)
    torch.randn(params[0].shape, generator=generator)  # the first step's gradient
    _run(params, steps=1, optimizer=optimizer, generator=generator)
    _assert_same_bits(_bits(params, optimizer), _bits(reference, expected))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capturable_steps_round_stochastically_as_eager_ones(backend):
    """The counts live on the params' device and the kernel advances them, so a capturable optimizer draws the
    bits of a plain one."""
    plain, capturable = (make_params([(40, 9), (300,)], dtype=torch.bfloat16) for _ in range(2))
    expected = _run(plain, steps=3, backend=backend)
    actual = _run(capturable, steps=3, backend=backend, capturable=True)
    _assert_same_bits(_bits(plain, expected), _bits(capturable, actual))
