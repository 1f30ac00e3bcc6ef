"""FusedSGD against its oracles: the table of option combinations (tests/cases.py) crossed with the backends,
dtypes and devices. The plain path gives ``torch.optim.SGD``'s default path bit for bit (its single-tensor
path on the CPU, foreach on CUDA), every step, the first (buffer seeding) and those after a resume included;
LARS follows its float64 formula and clipping torch's clip functions to rounding."""

from __future__ import annotations

import pytest
import torch
from cases import CLIP_CASES, LARS_CASES, TORCH_CASES
from helpers import clone_params, make_params, set_grads, two_groups
from oracles import assert_close_rel, lars_oracle_step
from torch import nn

from lightning_fusedsgd import FusedSGD

BACKENDS = ["compiled", "reference"]


def _buffers(optimizer, params):
    return [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]


def _assert_equal(ours, theirs, step):
    for p, q in zip(ours, theirs):
        assert (p is None) == (q is None), step
        assert p is None or torch.equal(p, q), step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda case: case.id)
def test_gives_torch_sgds_bits(case, dtype, backend, device):
    """20 steps over two groups, with params that have no grad on some steps, grads laid out unlike their
    param, an lr change, and at step 10 a resume into a new FusedSGD from the state dict."""
    hparams = case.hparams
    ours = make_params(dtype=dtype, device=device)
    theirs = clone_params(ours)

    def fused():
        return FusedSGD(two_groups(ours, hparams["weight_decay"]), lr=0.05, backend=backend, **hparams)

    optimizer = fused()
    oracle = torch.optim.SGD(two_groups(theirs, hparams["weight_decay"]), lr=0.05, **hparams)
    generator = torch.Generator().manual_seed(1)
    for step in range(20):
        if step == 10:
            saved = optimizer.state_dict()
            optimizer = fused()
            optimizer.load_state_dict(saved)
        if step == 15:  # as a scheduler does
            for group in optimizer.param_groups + oracle.param_groups:
                group["lr"] *= 0.5
        set_grads([ours, theirs], step, generator)
        optimizer.step()
        oracle.step()
        _assert_equal(ours, theirs, step)
        _assert_equal(_buffers(optimizer, ours), _buffers(oracle, theirs), step)
    assert ours[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_lr_and_a_closure_give_torch_sgds_bits(backend):
    ours = make_params()
    theirs = clone_params(ours)
    optimizer = FusedSGD(ours, lr=torch.tensor(0.05), momentum=0.9, backend=backend)
    oracle = torch.optim.SGD(theirs, lr=torch.tensor(0.05), momentum=0.9)
    x = torch.randn(70_000)

    def closure(params):
        def loss():
            for p in params:
                p.grad = None
            value = sum((p**2).sum() for p in params[:3]) + (params[3] * x).sum()
            value.backward()
            return value

        return loss

    for _ in range(5):
        assert torch.equal(optimizer.step(closure(ours)), oracle.step(closure(theirs)))
    _assert_equal(ours, theirs, "end")


LARS_SHAPES = [(300, 1000), (64, 32, 3, 3), (70_000,), (1_050_000,), (10,), (5, 5)]
LARS_MASK = [True, True, False, True, True, True]  # the third tensor is in a group without LARS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LARS_CASES, ids=lambda case: case.id)
def test_lars_follows_its_float64_formula(case, backend, device):
    """30 steps over a LARS group and a plain one, a zero weight (||w|| = 0) and a zero gradient (||g|| = 0)
    among them; tensors past the 1M-element wave."""
    params = make_params(LARS_SHAPES, device=device)
    with torch.no_grad():
        params[4].zero_()
    groups = [
        {"params": [p for p, lars in zip(params, LARS_MASK) if lars]},
        {"params": [p for p, lars in zip(params, LARS_MASK) if not lars], "lars": False},
    ]
    hparams = case.hparams
    optimizer = FusedSGD(groups, lr=0.1, backend=backend, **hparams)
    weights = [p.detach().cpu().double() for p in params]
    buffers = [None] * len(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        grads = [torch.randn(s, generator=generator) * 0.01 for s in LARS_SHAPES]
        grads[5].zero_()
        for p, g in zip(params, grads):
            p.grad = g.to(p.device, copy=True)
        optimizer.step()
        lars_oracle_step(
            weights,
            buffers,
            [g.double() for g in grads],
            lars_mask=LARS_MASK,
            lr=0.1,
            nesterov=hparams["nesterov"],
            trust_clip=hparams["trust_clip"],
            decayed_grad=hparams["lars_denominator"] == "decayed_grad",
            maximize=hparams["maximize"],
            weight_decay=hparams["weight_decay"],
            momentum=hparams["momentum"],
        )
    assert_close_rel([p.cpu() for p in params], weights, 1e-5)
    assert_close_rel([optimizer.state[p]["momentum_buffer"].cpu() for p in params], buffers, 1e-4)


CLIP_SHAPES = [(300, 70), (70_000,), (17, 3, 3, 3), (50,)]


def _torch_clip(params, hparams):
    if hparams.get("max_grad_norm") is not None:
        torch.nn.utils.clip_grad_norm_(params, hparams["max_grad_norm"])
    else:
        torch.nn.utils.clip_grad_value_(params, hparams["max_grad_value"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", ["one", "two"])
@pytest.mark.parametrize("case", CLIP_CASES, ids=lambda case: case.id)
def test_clipping_follows_torchs_clip_then_sgd(case, groups, backend, device):
    params = make_params(CLIP_SHAPES, device=device)
    reference = clone_params(params)
    clip = {k: v for k, v in case.hparams.items() if k.startswith("max_grad_")}
    hparams = {k: v for k, v in case.hparams.items() if k not in clip}

    def grouped(ps):
        if groups == "one":
            return ps
        return [{"params": ps[:2], "weight_decay": 1e-3}, {"params": ps[2:], "lr": 0.05, "weight_decay": 0.0}]

    optimizer = FusedSGD(grouped(params), lr=0.1, backend=backend, **case.hparams)
    oracle = torch.optim.SGD(grouped(reference), lr=0.1, **hparams)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(s, generator=generator).to(device) * 0.01 for s in CLIP_SHAPES]
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        _torch_clip(reference, case.hparams)
        oracle.step()
    assert_close_rel(params, reference, 2e-6)
    if hparams.get("momentum"):
        assert_close_rel(_buffers(optimizer, params), _buffers(oracle, reference), 2e-6)


@pytest.mark.parametrize(
    "dtype, options",
    [
        (torch.bfloat16, {}),
        (torch.float16, {}),
        (torch.bfloat16, dict(master_weights=True)),
        (torch.float16, dict(master_weights=True)),
        (torch.bfloat16, dict(update_rounding="kahan", lars=True)),
    ],
    ids=["bf16", "fp16", "bf16-master", "fp16-master", "bf16-kahan-lars"],
)
def test_backends_agree_in_low_precision(dtype, options):
    """The compiled kernel against the reference where torch has no counterpart: one fp32 rounding chain, one
    rounding to the param's dtype (a 1-ulp difference in an intermediate, such as LARS's fp32 norm sums, may
    flip it)."""
    a = make_params(dtype=dtype)
    b = clone_params(a)
    hparams = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, **options)
    compiled, reference = (
        FusedSGD(a, backend="compiled", **hparams),
        FusedSGD(b, backend="reference", **hparams),
    )
    generator = torch.Generator().manual_seed(2)
    for step in range(20):
        set_grads([a, b], step, generator)
        compiled.step()
        reference.step()
    for p, q in zip(a, b):
        assert (p.float() - q.float()).abs().max() <= 2 * torch.finfo(dtype).eps * q.float().abs().max()
        if "kahan_compensation" in reference.state[q]:  # the weights, param + compensation, agree to fp32
            weights = [
                x.float() + opt.state[x]["kahan_compensation"].float()
                for x, opt in ((p, compiled), (q, reference))
            ]
            assert_close_rel(weights[:1], weights[1:], 1e-5)
        for key, value in reference.state[q].items():
            assert (
                compiled.state[p][key].dtype == value.dtype and compiled.state[p][key].stride() == p.stride()
            )


def test_low_precision_without_masters_stays_within_rounding_of_torch():
    """torch rounds to bf16 after every op, the kernel once per step: a few bf16 ulps of the weights apart."""
    ours = make_params(dtype=torch.bfloat16)
    theirs = clone_params(ours)
    hparams = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    optimizer, oracle = FusedSGD(ours, **hparams), torch.optim.SGD(theirs, foreach=False, **hparams)
    generator = torch.Generator().manual_seed(4)
    for step in range(20):
        set_grads([ours, theirs], step, generator)
        optimizer.step()
        oracle.step()
    for p, q in zip(ours, theirs):
        assert (p.float() - q.float()).abs().max() <= 4 * 2**-8 * q.float().abs().max()


def test_complex_params_step_as_their_real_views_close_to_torch():
    """torch steps complex params in complex arithmetic (alpha * b as a complex product); the kernel steps
    their real views: equal to rounding, not bit for bit."""
    ours = [
        nn.Parameter(torch.randn(50, dtype=torch.complex64)),
        nn.Parameter(torch.randn(3, 4, dtype=torch.complex64)),
    ]
    theirs = clone_params(ours)
    hparams = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    optimizer, oracle = FusedSGD(ours, **hparams), torch.optim.SGD(theirs, **hparams)
    for _ in range(10):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        optimizer.step()
        oracle.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert optimizer.state[p]["momentum_buffer"].dtype == torch.complex64


@pytest.mark.parametrize(
    "switches",
    [dict(), dict(foreach=False), dict(foreach=True), dict(fused=None), dict(fused=False), dict(fused=True)]
    + [dict(differentiable=False)],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults",
)
def test_takes_torch_sgds_arguments_and_defaults(switches):
    """What code and configs pass to torch.optim.SGD, its implementation switches and its default lr
    included, gives torch's bits; the groups carry the same keys as torch's, with the same values."""
    ours, theirs = make_params(), make_params()
    optimizer = FusedSGD(ours, momentum=0.9, **switches)
    oracle = torch.optim.SGD(theirs, momentum=0.9, **{"foreach": False, **switches, "fused": None})
    assert optimizer.defaults["lr"] == oracle.defaults["lr"] == 1e-3
    torch_keys = set(oracle.param_groups[0]) - {"params"}
    assert {k: optimizer.param_groups[0][k] for k in torch_keys - {"foreach", "fused"}} == {
        k: oracle.param_groups[0][k] for k in torch_keys - {"foreach", "fused"}
    }
    assert {k: optimizer.param_groups[0][k] for k in ("foreach", "fused")} == {
        "foreach": switches.get("foreach"),
        "fused": switches.get("fused"),
    }
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        set_grads([ours, theirs], step, generator)
        optimizer.step()
        oracle.step()
        _assert_equal(ours, theirs, step)
