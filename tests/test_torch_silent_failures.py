"""Silent failures torch's fused and foreach CPU steps have had, which ours must never share: 16-bit params of
a vector or more left unchanged, a GradScaler that skips the very first step leaving momentum uninitialized
(NaN on the next), a channels_last param with a contiguous gradient, and a param list that mixes DTensors with
plain tensors. Each against torch.optim.SGD's single-tensor step, or the reference where torch rounds 16-bit
steps otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import VECTORS_AND_TAIL, clone_params, make_params

from lightning_fusedsgd import FusedSGD

HPARAMS = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}


def _bits(t):
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t


@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_of_any_length_are_updated(dtype, master_weights):
    """Every length from 1 to past two vectors of the widest build: the reference's bits, and changed."""
    shapes = [(n,) for n in range(1, VECTORS_AND_TAIL + 1)]
    runs = {}
    for backend in ("compiled", "reference"):
        params = make_params(shapes, dtype=dtype)
        optimizer = FusedSGD(params, backend=backend, master_weights=master_weights, **HPARAMS)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        runs[backend] = params
    before = make_params(shapes, dtype=dtype)
    for compiled, reference, initial in zip(runs["compiled"], runs["reference"], before, strict=True):
        assert torch.equal(_bits(compiled), _bits(reference))
        assert not torch.equal(compiled.detach(), initial.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grad_scaler_skipping_the_first_step_leaves_no_uninitialized_momentum(dtype):
    """The first step overflows and is skipped; the second then seeds the buffers as a first step does (with
    the gradient, not dampened as later steps add it): what torch.optim.SGD gives for the second step's
    gradients alone (fp32 masters of bf16 params: bf16 through the reference)."""
    params = make_params(dtype=dtype)
    expected = clone_params(params)
    master_weights = dtype != torch.float32
    hparams = {**HPARAMS, "nesterov": False, "dampening": 0.5}
    optimizer = FusedSGD(params, master_weights=master_weights, **hparams)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator).to(dtype) for p in params]

    # d loss / d p: the scale (a power of two: unscaling is exact) times the step's gradient.
    def step(step_grads):
        optimizer.zero_grad()
        scaler.scale(sum((p * g).sum() for p, g in zip(params, step_grads))).backward()
        scaler.step(optimizer)
        scaler.update()

    step([torch.full_like(p, float("inf")) for p in params])
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    step(grads)
    if dtype == torch.float32:
        oracle = torch.optim.SGD(expected, foreach=False, **hparams)
    else:
        oracle = FusedSGD(expected, backend="reference", master_weights=True, **hparams)
    for e, g in zip(expected, grads):
        e.grad = g.clone()
    oracle.step()
    for p, e in zip(params, expected):
        assert torch.equal(_bits(p), _bits(e))
        buffer = optimizer.state[p]["momentum_buffer"]
        assert torch.isfinite(buffer).all()
        assert torch.equal(buffer, oracle.state[e]["momentum_buffer"])


def test_a_channels_last_param_with_a_contiguous_grad():
    """The gradient's elements are read at the param's, not in the gradient's memory order."""
    params = make_params([(8, 3, 5, 5), (4, 6, 3, 3)])
    assert all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous() for p in params)
    expected = clone_params(params)
    optimizer = FusedSGD(params, **HPARAMS)
    oracle = torch.optim.SGD(expected, foreach=False, **HPARAMS)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, e in zip(params, expected):
            grad = torch.randn(p.shape, generator=generator)
            assert grad.is_contiguous()
            p.grad, e.grad = grad, grad.clone()
        optimizer.step()
        oracle.step()
    for p, e in zip(params, expected):
        assert torch.equal(p, e)
        assert p.is_contiguous(memory_format=torch.channels_last)


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo group and its mesh, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize(
    "hparams", [HPARAMS, {**HPARAMS, "lars": True, "max_grad_norm": 0.5}], ids=["sgd", "lars"]
)
def test_a_param_list_mixing_dtensors_and_plain_tensors(one_rank_mesh, hparams):
    """Sharded and plain params in one group step as the same params all plain (torch.optim.SGD where it has
    the options; else FusedSGD over plain tensors, the one-process run)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    plain = make_params()
    mixed = [
        torch.nn.Parameter(distribute_tensor(p.detach().clone(), one_rank_mesh, [Shard(0)])) if i % 2 else p
        for i, p in enumerate(clone_params(plain))
    ]
    assert any(isinstance(p, DTensor) for p in mixed) and not all(isinstance(p, DTensor) for p in mixed)
    optimizer = FusedSGD(mixed, **hparams)
    if "lars" in hparams:
        oracle = FusedSGD(plain, **hparams)
    else:
        oracle = torch.optim.SGD(plain, foreach=False, **hparams)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for m, p in zip(mixed, plain):
            grad = torch.randn(p.shape, generator=generator)
            p.grad = grad
            m.grad = (
                distribute_tensor(grad.clone(), one_rank_mesh, [Shard(0)])
                if isinstance(m, DTensor)
                else grad.clone()
            )
        optimizer.step()
        oracle.step()
    for m, p in zip(mixed, plain):
        full = m.full_tensor() if isinstance(m, DTensor) else m
        assert torch.equal(full.detach(), p.detach())
