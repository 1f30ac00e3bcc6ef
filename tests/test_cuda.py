"""What only the CUDA kernel has to show: no host sync under a GradScaler, determinism, the real GradScaler
under autocast, its options and dtypes against the reference backend, and bf16 update rounding against the
compiled CPU kernel. Its parity with torch.optim.SGD
and with the float64 LARS formula is checked by test_parity.py, which runs on every
device (conftest.py). Skipped where no GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD
from lightning_fusedsgd.ops import cpu_capability

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"
# A tensor spanning several 64K-element CUDA chunks with a ragged tail, channels_last, and small ones.
PLAIN_SHAPES = [(8, 3, 3, 3), (8,), (33, 17), (200_001,), (3, 5, 4, 4)]


def cuda_params(shapes, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=generator).to(device=CUDA, dtype=dtype)
        if p.dim() == 4:
            p = p.contiguous(memory_format=torch.channels_last)
        params.append(nn.Parameter(p))
    return params


def clone(params):
    return [nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in params]


def set_grads(params_sets, generator, scale=1.0, step=None):
    """Same gradients on every copy, laid out like their params (channels_last too, so steps after the
    first reuse the kept plan). With `step`, some params get no grad on some steps."""
    for i, p in enumerate(params_sets[0]):
        grad = None
        if step is None or (step + i) % 7 != 3:
            grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator) * scale)
        for params in params_sets:
            params[i].grad = None if grad is None else grad.clone(memory_format=torch.preserve_format)


def test_auto_runs_our_cuda_kernel():
    p = nn.Parameter(torch.randn(10, device=CUDA))
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.last_backends == {"cuda:0/float32": "compiled"}


@pytest.mark.parametrize(
    "hparams",
    [
        dict(wd_after_momentum=True),
        dict(wd_after_momentum=True, nesterov=True, maximize=True),
        dict(lars=True, momentum=0.0),
        dict(lars=True, dampening=0.3),
        dict(lars=True, nesterov=True, trust_clip=True),
        dict(lars=True, lars_denominator="decayed_grad", maximize=True, wd_after_momentum=True),
    ],
    ids=lambda h: "-".join(f"{k}={v}" for k, v in h.items()),
)
def test_options_match_the_reference_backend(hparams):
    """Options torch.optim.SGD lacks: against our reference backend (itself tested against independent
    oracles in test_fused_sgd.py and test_lars.py)."""
    ours = cuda_params(PLAIN_SHAPES)
    theirs = clone(ours)
    settings = dict(lr=0.05, momentum=0.9, weight_decay=1e-3) | hparams
    opt = FusedSGD(ours, backend="compiled", **settings)
    ref = FusedSGD(theirs, backend="reference", **settings)
    generator = torch.Generator().manual_seed(6)
    for step in range(20):
        set_grads([ours, theirs], generator, step=step)
        opt.step()
        ref.step()
    assert_close_rel(ours, theirs, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("lars", [False, True])
def test_dtypes_match_the_reference_backend(dtype, master_weights, lars):
    ours = cuda_params(PLAIN_SHAPES, dtype=dtype)
    theirs = clone(ours)
    hparams = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, master_weights=master_weights, lars=lars)
    opt = FusedSGD(ours, backend="compiled", **hparams)
    ref = FusedSGD(theirs, backend="reference", **hparams)
    generator = torch.Generator().manual_seed(2)
    for _ in range(10):
        set_grads([ours, theirs], generator, scale=0.1)
        opt.step()
        ref.step()
    # Same fp32 (fp64) math; a rounding step apart at most where the low-precision param is rounded.
    rel = 1e-12 if dtype == torch.float64 else 1e-2
    assert_close_rel(ours, theirs, rel)
    if master_weights and dtype != torch.float64:
        masters = [opt.state[p]["master_param"] for p in ours]
        assert_close_rel(masters, [ref.state[q]["master_param"] for q in theirs], 1e-5)
        assert all(m.dtype == torch.float32 for m in masters)


@pytest.mark.parametrize("lars", [False, True])
def test_grad_scaler_contract_without_host_syncs(lars):
    """Unscaling and the found_inf skip happen on the device: a step never synchronizes with the host."""
    scaled = cuda_params(PLAIN_SHAPES)
    plain = clone(scaled)
    hparams = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, lars=lars, backend="compiled")
    opt, ref = FusedSGD(scaled, **hparams), FusedSGD(plain, **hparams)
    generator = torch.Generator().manual_seed(3)
    scale = torch.tensor(1024.0, device=CUDA)
    for step in range(6):
        set_grads([scaled, plain], generator)
        for p in scaled:
            p.grad.mul_(scale)
        opt.grad_scale = scale
        opt.found_inf = torch.tensor(float(step == 4), device=CUDA)
        before = [p.detach().clone() for p in scaled]
        if step > 0:  # the first step creates momentum buffers, which checks found_inf on the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if step >= 2:  # from here on every step runs the plan kept at step 1, in C++
            assert opt.last_backends == {"cuda:0/float32": "compiled (kept plan)"}
        if step == 4:
            assert all(torch.equal(p, b) for p, b in zip(scaled, before))
        else:
            ref.step()
    assert_close_rel(scaled, plain, 1e-6)


def test_lars_is_deterministic():
    results = []
    for _ in range(2):
        params = cuda_params(PLAIN_SHAPES, seed=4)
        opt = FusedLARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4, backend="compiled")
        generator = torch.Generator().manual_seed(5)
        for _ in range(5):
            set_grads([params], generator)
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_real_grad_scaler_under_autocast():
    """torch.amp.GradScaler drives both optimizers; an overflow on the first step skips it and creates no
    state, as torch's SGD under the same scaler does."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )
    models = [model.to(CUDA), copy.deepcopy(model).to(CUDA)]
    opts = [
        FusedSGD(models[0].parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, backend="compiled"),
        torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False),
    ]
    scalers = [torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")]
    generator = torch.Generator().manual_seed(8)
    for step in range(8):
        x = torch.randn(16, 3, 8, 8, generator=generator).to(CUDA)
        y = torch.randint(0, 4, (16,), generator=generator).to(CUDA)
        for m, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            if step == 0:
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            if step == 0:
                assert not any(opt.state[p] for p in m.parameters())
    # fp16 activations amplify rounding differences between the two updates; a scaler contract broken
    # (a missed unscale, a step not skipped) would be off by orders of magnitude.
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert_close_rel([p], [q], 1e-3)
    assert scalers[0].get_scale() == scalers[1].get_scale() < 65536.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits in its own dtype's width (a float as the integer of its size; integers as they are), so
    that NaNs and signed zeros compare too, and a 0-d int64 count beside bf16 params compares at all."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.skipif(
    cpu_capability() == "default",
    reason="the CPU kernel fuses multiply-adds only where it has FMA (AVX2, AVX512), as CUDA always does",
)
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_update_rounding_gives_the_cpu_kernels_bits(rounding, devices=("cpu", CUDA)):
    """Stochastic rounding and Kahan compensation on CUDA (several chunks, channels_last) give the compiled
    CPU kernel's bits: params, buffers and compensations, over a few steps."""
    results = []
    for device in devices:
        generator = torch.Generator().manual_seed(3)
        params = []
        for shape in PLAIN_SHAPES:
            p = torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)
            params.append(
                nn.Parameter(p.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p)
            )
        optimizer = FusedSGD(
            params, lr=0.05, momentum=0.9, weight_decay=1e-2, update_rounding=rounding, backend="compiled"
        )
        for _ in range(3):
            for p in params:
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))
            optimizer.step()
        state = [value for p in params for _, value in sorted(optimizer.state[p].items())]
        results.append([t.detach().cpu() for t in params + state])
    for cpu, cuda in zip(*results, strict=True):
        assert cpu.dtype == cuda.dtype and torch.equal(_bits(cpu), _bits(cuda))
