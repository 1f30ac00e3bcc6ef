"""``FusedSGD.last_grad_norm``: the gradient norm a step clipping by norm took, against the norm
``torch.nn.utils.clip_grad_norm_`` returns for the same gradients, with and without a GradScaler; the one a
LARS step's norm pass took, against the float64 norm of every gradient; None where the step took none."""

from __future__ import annotations

import pytest
import torch
from helpers import clone_params, make_params, two_groups
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD

SHAPES = [(300, 70), (70_000,), (17, 3, 3, 3), (50,)]


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("lars", [False, True], ids=["sgd", "lars"])
def test_a_step_clipping_by_norm_keeps_the_norm_clip_grad_norm_returns(backend, lars, device):
    """Steps 3 and 4 run the plan kept at step 2 (in C++ for the compiled kernel); each step's norm is its
    own gradients'."""
    params = make_params(SHAPES, device=device, channels_last=False)  # grads laid out as their params
    theirs = clone_params(params)
    optimizer = FusedSGD(
        two_groups(params), lr=0.1, momentum=0.9, lars=lars, max_grad_norm=0.5, backend=backend
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        for p, q in zip(params, theirs):
            p.grad = (torch.randn(p.shape, generator=generator) * 0.01).to(device)
            q.grad = p.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        optimizer.step()
        if backend == "compiled" and step >= 2:
            assert all(name.endswith("(kept plan)") for name in optimizer.last_backends.values())
        norm = optimizer.last_grad_norm
        assert norm.dtype == torch.float64 and norm.shape == () and norm.device == params[0].device
        torch.testing.assert_close(norm.float(), expected, rtol=1e-6, atol=0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_under_a_grad_scaler_the_norm_is_of_the_unscaled_gradients_and_a_skip_leaves_none():
    """A real GradScaler: torch's loop unscales and clips (clip_grad_norm_'s norm is the oracle); ours clips
    the scaled gradients in the step. The overflowing step, skipped on the host, leaves no norm (not the
    last one's)."""
    torch.manual_seed(0)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    ours = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.05)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2)]
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        x, y = torch.randn(32, 20, generator=generator), torch.randint(0, 5, (32,), generator=generator)
        overflow = step == 2
        for net, scaler in zip((model, reference), scalers):
            net.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y) * (float("inf") if overflow else 1.0)
            scaler.scale(loss).backward()
        scalers[1].unscale_(torch.optim.SGD(reference.parameters(), lr=0.0))
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        scalers[0].step(ours)
        scalers[0].update()
        scalers[1].update()
        if overflow:
            assert ours.last_grad_norm is None and not torch.isfinite(expected)
        else:
            torch.testing.assert_close(ours.last_grad_norm.float(), expected, rtol=1e-6, atol=0)
        with torch.no_grad():  # the reference takes our step's weights: only the norms are compared
            for p, q in zip(model.parameters(), reference.parameters()):
                q.copy_(p)


# LARS steps that clip by no norm: (optimizer, param dtype, options, GradScaler's scale).
LARS_STEPS = {
    "fp32": (FusedSGD, torch.float32, {"lars": True}, None),
    "fused-lars-grad-scaler": (FusedLARS, torch.float32, {}, 1024.0),
    "bf16-masters-grad-scaler": (FusedLARS, torch.bfloat16, {"master_weights": True}, 512.0),
    "decayed-grad-clip-value": (
        FusedLARS,
        torch.float32,
        {"lars_denominator": "decayed_grad", "max_grad_value": 0.015},
        None,
    ),
}


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("case", LARS_STEPS.values(), ids=LARS_STEPS)
def test_a_lars_step_keeps_the_norm_of_every_gradient_its_norm_pass_took(backend, case, device):
    """The LARS tensors' gradients and the others' (a group LARS leaves out, as biases and normalization
    params): the float64 norm of them all, unscaled and clipped by value as the step took them. Steps 3 and 4
    run the plan kept at step 2 (in C++ for the compiled kernel)."""
    optimizer_class, dtype, options, scale = case
    params = make_params(SHAPES, dtype=dtype, device=device, channels_last=False)
    groups = [{"params": params[:3]}, {"params": params[3:], "lars": False, "weight_decay": 0.0}]
    optimizer = optimizer_class(groups, lr=0.1, momentum=0.9, weight_decay=1e-4, backend=backend, **options)
    generator = torch.Generator().manual_seed(3)
    inverse = float(torch.tensor(1 / (scale or 1.0), dtype=torch.float32))  # as the kernel unscales
    bound = options.get("max_grad_value", float("inf"))
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 0.01 * (scale or 1.0)).to(device, dtype)
        if scale is not None:
            optimizer.grad_scale = torch.tensor([scale], device=device)
            optimizer.found_inf = torch.zeros(1, device=device)
        expected = torch.linalg.vector_norm(
            torch.cat([(p.grad.double() * inverse).clamp(-bound, bound).flatten() for p in params])
        )
        optimizer.step()
        if backend == "compiled" and step >= 2:
            assert all(name.endswith("(kept plan)") for name in optimizer.last_backends.values())
        norm = optimizer.last_grad_norm
        assert norm.dtype == torch.float64 and norm.shape == () and norm.device == params[0].device
        # The compiled kernel sums each chunk in fp32, as its LARS pass does, and AVX2's 8 lanes round those
        # sums otherwise than AVX-512's 16 (1.2e-6 apart here): the bound of tests/test_ops.py's report test.
        torch.testing.assert_close(norm, expected, rtol=1e-4 if backend == "compiled" else 1e-6, atol=0)


@pytest.mark.parametrize("clipping", [{}, {"max_grad_value": 0.01}], ids=["none", "by-value"])
def test_a_step_that_takes_no_norm_keeps_none(clipping):
    params = make_params(SHAPES)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = FusedSGD(params, lr=0.1, **clipping)
    optimizer.step()
    assert optimizer.last_grad_norm is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [{"max_grad_norm": 0.5}, {"lars": True}], ids=["clip-norm", "lars"])
def test_reading_the_norm_on_cuda_makes_no_host_sync(options):
    params = make_params(SHAPES, device="cuda")
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9, backend="compiled", **options)
    scale = torch.tensor(1024.0, device="cuda")
    expected = []
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 0.01
        expected.append(torch.nn.utils.get_total_norm([p.grad for p in params]))
        for p in params:
            p.grad.mul_(scale)
        optimizer.grad_scale, optimizer.found_inf = scale, torch.zeros((), device="cuda")
        if step > 0:  # the first step creates momentum buffers, which checks found_inf on the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            optimizer.step()
            norm = optimizer.last_grad_norm
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(norm.float(), expected[-1], rtol=1e-5, atol=0)
