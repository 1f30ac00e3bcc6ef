"""The CPU kernel steps 16-bit params on whole vectors, then element by element (the tail). Both give the bits
of the reference for every value a step meets (signed zeros, subnormals, the largest finite value, infinities,
NaN, with gradients of each kind), so a tensor whose elements are all alike stays alike, vectors and tail."""

from __future__ import annotations

import pytest
import torch
from helpers import VECTORS_AND_TAIL

from lightning_fusedsgd import FusedSGD

CASES = {  # name: (param dtype, FusedSGD options)
    "bf16": (torch.bfloat16, {}),
    "bf16-stochastic": (torch.bfloat16, {"update_rounding": "stochastic"}),
    "bf16-kahan": (torch.bfloat16, {"update_rounding": "kahan"}),
    "bf16-masters": (torch.bfloat16, {"master_weights": True}),
    "fp16": (torch.float16, {}),
    "fp16-masters": (torch.float16, {"master_weights": True}),
    "bf16-clip-value": (torch.bfloat16, {"max_grad_value": 1.0}),
    "fp16-masters-maximize": (
        torch.float16,
        {"master_weights": True, "maximize": True, "wd_after_momentum": True},
    ),
}
GRADS = [1e-3, -2.0, 0.0, float("inf"), float("nan")]


def _weights(dtype):
    info = torch.finfo(dtype)
    return [0.0, -0.0, 1.0, -3.3, info.smallest_normal / 4, info.max, -info.max, float("inf"), float("nan")]


def _run(backend, dtype, options):
    """Two steps of one param per (weight, gradient) pair, each VECTORS_AND_TAIL copies of its pair."""
    pairs = [(w, g) for w in _weights(dtype) for g in GRADS]
    params = [torch.nn.Parameter(torch.full((VECTORS_AND_TAIL,), w, dtype=dtype)) for w, _ in pairs]
    optimizer = FusedSGD(
        params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, backend=backend, **options
    )
    for _ in range(2):
        for p, (_, g) in zip(params, pairs):
            p.grad = torch.full_like(p, g)
        optimizer.step()
    state = [value for p in params for _, value in sorted(optimizer.state[p].items()) if value.dim() == 1]
    return [p.detach() for p in params] + state


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("name", list(CASES))
def test_vectors_and_tail_give_the_reference_bits(name):
    dtype, options = CASES[name]
    compiled, reference = _run("compiled", dtype, options), _run("reference", dtype, options)
    for actual, expected in zip(compiled, reference, strict=True):
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan)
        assert torch.equal(_bits(actual)[~nan], _bits(expected)[~nan])
        if actual.dtype == torch.bfloat16:  # the kernels' one bf16 NaN (kBf16NanBits in rounding.h)
            assert torch.all(_bits(actual)[nan] == -1)
        if "stochastic" not in name:  # each element draws its own bits
            # Alike, NaN bits too, except NaN payloads in fp32 state: those are the arithmetic's (which the
            # baseline build, whose loops the compiler vectorizes, does not keep alike in its remainder loop).
            alike = actual.isnan() if actual.dtype == torch.float32 and nan.any() else _bits(actual)
            assert torch.equal(alike, alike[:1].expand_as(alike))
