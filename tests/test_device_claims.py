"""Values a device computes that are claimed equal to values computed on the host, in one table, each run on
every device present: the CPU kernels, the CUDA kernels under emulation and CUDA where a GPU is present.

A device's +, -, *, / and sqrt in double round as the host's do (IEEE; the libraries fuse no multiply-add
behind the code's back: -ffp-contract=off, nvcc --fmad=false), its cos, pow and exp do not (CUDA's libm is
not glibc's, which Python uses). A claim holds bit for bit where the device computes only the former, in the
host's order, or takes the host's values (the schedule's factors, computed into its row); where neither can
be, the claim states the tolerance CUDA is held to (docs/design.md, "Values computed on the device"). The
emulation runs the host's libm, so it cannot see a difference of that class: on it, as on the CPU, every
claim is bit for bit.

Oracles: WarmupSchedule.lr_at, and formulas written out here in Python floats (schedulefree's scalars, timm's
warmup of the average's decay, the LARS trust ratio, clip_grad_norm_'s coefficient, GradScaler's inverse
scale). Each readout is exact: float64 params at 0 (or 2) with gradient 1, lr 1 and no momentum step by minus
the coefficient the kernel computed, with no other rounding."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers import op_row, op_state
from torch import nn

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree, ops
from lightning_fusedsgd._abi import LARS_SUM_NAMES, SCHEDULE_FREE_SCALARS, StepRow, table
from lightning_fusedsgd.schedule import WarmupSchedule

# (device of the tensors, library kind): the CPU kernels, the CUDA kernels emulated on CPU tensors, CUDA.
DEVICES = [
    pytest.param(("cpu", "cpu"), id="cpu"),
    pytest.param(
        ("cpu", "cuda_emulated"), id="cuda_emulated", marks=[pytest.mark.cuda_emulated, pytest.mark.slow]
    ),
    pytest.param(
        ("cuda", "cuda"),
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
BACKENDS = {"cpu": "compiled", "cuda": "compiled", "cuda_emulated": "cuda_emulated"}


def _zeros_stepped(kind, device, groups, lr_on_device=False, **row):
    """The coefficient each group's tensor took: float64 params at 0, gradient 1, stepped once by the
    sgd_step op (a one-element tensor a group), negated; and the state (schedule-free's z)."""
    params = [torch.zeros(1, dtype=torch.float64, device=device) for _ in groups]
    grads = [torch.ones_like(p) for p in params]
    slots = {"z": [torch.zeros_like(p) for p in params]} if groups[0]["schedule_free"] else {}
    state, masks = op_state(len(params), **slots)
    hparams = table(groups, lr_on_device=lr_on_device)
    ops.load(kind).sgd_step(
        params, grads, state, masks, hparams, list(range(len(groups))), op_row(device, **row)
    )
    return [-p.item() for p in params], state


def _defaults(make=FusedSGD, **options):
    return make([nn.Parameter(torch.zeros(1))], **options).defaults


def schedule_lrs(kind, device):
    """WarmupLR's lrs on the device (schedule_lrs, the schedule's row) = WarmupSchedule.lr_at, every step of
    every decay, past the end too."""
    got, expected = [], []
    for config in (
        dict(decay="cosine", warmup_steps=3, start_factor=0.1, end_lr=1e-3),
        dict(decay="poly", warmup_steps=3, power=2.0, end_lr=1e-4),
        dict(decay="poly", power=0.7),
        dict(decay="linear", warmup_steps=1),
        dict(decay="multistep", warmup_steps=2, start_factor=0.5, milestones=(5, 9), gamma=0.3),
        dict(decay="constant", warmup_steps=4, start_factor=0.25),
    ):
        schedule = WarmupSchedule(total_steps=13, **config)
        on_device = dict(dtype=torch.float64, device=device)
        lrs, peaks = torch.zeros(2, **on_device), torch.tensor([0.4, 0.1], **on_device)
        row = torch.tensor(schedule.as_row(), **on_device)
        position = torch.zeros(2, dtype=torch.int64, device=device)
        for step in range(16):
            ops.load(kind).schedule_lrs(lrs, position, row, peaks, None, step > 0)
            got += lrs.tolist()
            expected += [schedule.lr_at(step, 0.4), schedule.lr_at(step, 0.1)]
    return got, expected


SCHEDULE_FREE_GROUPS = (
    dict(lr=0.5, warmup_steps=10, r=1.0, weight_lr_power=2.0),
    dict(lr=0.3, warmup_steps=0, r=0.5, weight_lr_power=1.5),
)


def _schedule_free_scalars(kind, device, names):
    """schedule_free_scalars on the device, 14 steps of two groups, against the arithmetic of
    schedulefree.SGDScheduleFree.step in Python floats (its lr_max starts at -1)."""
    groups = [_defaults(FusedSGDScheduleFree, **g) for g in SCHEDULE_FREE_GROUPS]
    scalars = torch.zeros(len(SCHEDULE_FREE_SCALARS), len(groups), dtype=torch.float64, device=device)
    scalars[SCHEDULE_FREE_SCALARS.index("lr_max")] = -1.0
    hparams = table(groups, lr_on_device=False)
    peer = [dict(k=0, lr_max=-1.0, weight_sum=0.0) for _ in groups]
    got, expected = [], []
    for _ in range(14):
        ops.load(kind).schedule_free_scalars(scalars, hparams, StepRow({}).on(torch.device(device)))
        got += [v for name in names for v in scalars[SCHEDULE_FREE_SCALARS.index(name)].tolist()]
        for g, options in zip(peer, SCHEDULE_FREE_GROUPS):
            k, warmup = g["k"], options["warmup_steps"]
            sched = (k + 1) / warmup if k < warmup else 1.0
            g["scheduled_lr"] = lr = options["lr"] * sched
            g["lr_max"] = lr_max = max(lr, g["lr_max"])
            weight = ((k + 1) ** options["r"]) * (lr_max ** options["weight_lr_power"])
            g["weight_sum"] = weight_sum = g["weight_sum"] + weight
            g["ckp1"] = weight / weight_sum if weight_sum else 0.0
            g["k"] = k + 1
        expected += [float(g[name]) for name in names for g in peer]
    return got, expected


def schedule_free_scalars_without_pow(kind, device):
    """Schedule-free's step count, largest lr and lr after warmup (+, /, max) = schedulefree's."""
    return _schedule_free_scalars(kind, device, ("k", "lr_max", "scheduled_lr"))


def schedule_free_scalars_of_pow(kind, device):
    """Schedule-free's sum of weights and ckp1, from (k + 1)^r lr_max^weight_lr_power (pow) = the peer's."""
    return _schedule_free_scalars(kind, device, ("weight_sum", "ckp1"))


def schedule_free_step(kind, device):
    """A schedule-free step's coefficients from the lrs and ckp1 on the device: y's gradient coefficient
    lr (beta (1 - ckp1) - 1) and z's lr = the peer's Python floats."""
    groups = [_defaults(FusedSGDScheduleFree, momentum=beta) for beta in (0.9, 0.75)]
    lrs, ckp1 = [0.37, 0.05], [0.3, 1 / 7]
    y, state = _zeros_stepped(kind, device, groups, lr_on_device=True, lrs=lrs, ckp1=ckp1)
    z = [-t.item() for t in state]
    expected = [-(lr * (g["momentum"] * (1 - c) - 1)) for lr, c, g in zip(lrs, ckp1, groups)]
    return y + z, expected + lrs


def schedule_free_switch(kind, device):
    """The weight of z that moves a schedule-free param to y (1 - beta) or to x (1 - 1 / beta) = the peer's
    Python floats: params at 0 with z at 1 (both weights below 0.5 in size: lerp's one multiply-add by 1)."""
    betas = (0.9, 0.75)
    groups = [_defaults(FusedSGDScheduleFree, momentum=beta) for beta in betas]
    got = []
    for train in (True, False):
        params = [torch.zeros(1, dtype=torch.float64, device=device) for _ in groups]
        state, masks = op_state(len(params), z=[torch.ones_like(p) for p in params])
        hparams = table(groups, lr_on_device=False)
        ops.load(kind).schedule_free_switch(params, state, masks, hparams, list(range(len(groups))), train)
        got += [p.item() for p in params]
    return got, [1 - beta for beta in betas] + [1 - 1 / beta for beta in betas]


def lrs_on_the_device(kind, device):
    """The lrs of the step row (capturable steps, tensor lrs) = the host's floats."""
    lrs = [0.1, 0.37, 1e-5]
    got, _ = _zeros_stepped(kind, device, [_defaults()] * 3, lr_on_device=True, lrs=lrs)
    return got, lrs


def average_warmup_decay(kind, device):
    """The average's decay with ema_warmup_gamma, min(ema_decay, 1 - (1 + n / gamma)^-power) (pow), and the
    update decay avg + (1 - decay) w = timm's get_decay and get_ema_avg_fn's roundings in Python floats:
    weights 1, 0, -1, ... (lr 1, gradient 1) after a copy of the first."""
    warmups = ((1.0, 0.75), (3.0, 2 / 3), (10.0, 1.0))
    params = [nn.Parameter(torch.full((1,), 2.0, dtype=torch.float64, device=device)) for _ in warmups]
    groups = [
        {"params": [p], "ema_warmup_gamma": gamma, "ema_warmup_power": power}
        for p, (gamma, power) in zip(params, warmups)
    ]
    optimizer = FusedSGD(groups, lr=1.0, ema_decay=0.9999, backend=BACKENDS[kind])
    got, expected = [], []
    averages = [None] * len(warmups)
    for step in range(6):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        got += [optimizer.state[p]["ema"].item() for p in params]
        weight = 1.0 - step
        for i, (gamma, power) in enumerate(warmups):
            if averages[i] is None:
                averages[i] = weight
            else:
                decay = min(0.9999, 1.0 - (1.0 + step / gamma) ** -power)
                averages[i] = averages[i] * decay + weight * (1.0 - decay)
        expected += averages
    return got, expected


def lars_trust_ratio(kind, device):
    """The LARS trust ratio from a tensor's sums (as a sharded step hands them reduced): eta ||w|| / (||g|| +
    lambda ||w|| + eps), LARC's min(r / lr, 1) = the formula in Python floats."""
    sums = [(2.0, 3.0), (0.7, 1e-3), (5.0, 0.3), (1e-8, 4e4)]
    hparams = dict(lars=True, weight_decay=5e-4, trust_coefficient=0.02, lars_eps=1e-3)
    groups = [_defaults(lr=1.0, **hparams, trust_clip=i % 2 == 1) for i in range(len(sums))]
    rows = torch.zeros(len(sums), len(LARS_SUM_NAMES), dtype=torch.float64, device=device)
    rows[:, LARS_SUM_NAMES.index("w_sq")] = torch.tensor([w for w, _ in sums], dtype=torch.float64)
    rows[:, LARS_SUM_NAMES.index("term_sq")] = torch.tensor([t for _, t in sums], dtype=torch.float64)
    got, _ = _zeros_stepped(kind, device, groups, lars_sq_sums=rows)
    expected = []
    for (w, t), group in zip(sums, groups):
        w_norm = math.sqrt(w)
        r = 0.02 * w_norm / (math.sqrt(t) + 5e-4 * w_norm + 1e-3)
        expected.append(min(r / 1.0, 1.0) if group["trust_clip"] else r)
    return got, expected


def _grad_scalers_inverse(scale: float) -> float:
    return torch.tensor(scale).double().reciprocal().float().item()  # as GradScaler.unscale_ takes it


def grad_scale_and_clip(kind, device):
    """GradScaler's inverse scale rounded to float, and clip_grad_norm_'s coefficient min(1, max_norm /
    (||g|| + 1e-6)) from the step's sum of squares (still scaled) = the formulas in Python floats."""
    got, expected = [], []
    for scale, grad_sq_sum, max_norm in ((1000.0, None, None), (3.0, 2.5e6, 0.75), (1000.0, 4e6, 3.0)):
        clip = {} if grad_sq_sum is None else dict(grad_sq_sum=grad_sq_sum, max_grad_norm=max_norm)
        coefficients, _ = _zeros_stepped(kind, device, [_defaults(lr=1.0)], grad_scale=scale, **clip)
        got += coefficients
        inverse = _grad_scalers_inverse(scale)
        coefficient = (
            1.0 if grad_sq_sum is None else min(1.0, max_norm / (math.sqrt(grad_sq_sum) * inverse + 1e-6))
        )
        expected.append(inverse * coefficient)
    return got, expected


@dataclass(frozen=True)
class Claim:
    run: Callable  # (library kind, device) -> (the device's values, the host's)
    cuda_rel: float | None = None  # the relative tolerance CUDA is held to; None: bit for bit
    of_largest: bool = False  # the tolerance is relative to the largest value, not each one's


# The claims. A CUDA tolerance is stated where CUDA's pow (within 2 ulps of the exact value, its documented
# bound; glibc's within 1) reaches the value. Schedule-free's weight: two pows, 3 ulps each from the host's,
# and a product; its sum and ckp1 a few ulps more: 4e-15 (18 ulps). The average's decay 1 - pow: within 3
# ulps of 1 (7e-16), which moves an update by that times |average - weight| (up to 6 here, over 5 updates):
# 5e-14 of the largest average.
CLAIMS = {
    "schedule-lrs": Claim(schedule_lrs),
    "schedule-free-scalars": Claim(schedule_free_scalars_without_pow),
    "schedule-free-weights-of-the-average": Claim(schedule_free_scalars_of_pow, cuda_rel=4e-15),
    "schedule-free-step-coefficients": Claim(schedule_free_step),
    "schedule-free-switch": Claim(schedule_free_switch),
    "lrs-on-the-device": Claim(lrs_on_the_device),
    "average-warmup-decay": Claim(average_warmup_decay, cuda_rel=5e-14, of_largest=True),
    "lars-trust-ratio": Claim(lars_trust_ratio),
    "grad-scale-and-clip-coefficient": Claim(grad_scale_and_clip),
}


@pytest.mark.parametrize("claim", list(CLAIMS))
@pytest.mark.parametrize("where", DEVICES)
def test_a_value_computed_on_the_device_is_the_hosts(claim, where):
    device, kind = where
    got, expected = CLAIMS[claim].run(kind, device)
    assert len(got) == len(expected) > 0
    rel = CLAIMS[claim].cuda_rel if kind == "cuda" else None
    if rel is None:
        assert got == expected
    else:
        largest = max(abs(e) for e in expected)
        bounds = [rel * (largest if CLAIMS[claim].of_largest else abs(e)) for e in expected]
        assert all(abs(g - e) <= b for g, e, b in zip(got, expected, bounds)), (got, expected)


@pytest.mark.parametrize("decay", ["cosine", "poly", "multistep"])
@pytest.mark.parametrize("where", DEVICES)
def test_the_device_schedule_takes_its_cos_and_pow_from_the_row(where, decay):
    """The device computes no cos or pow of its own (CUDA's are not the host's): with other factors in its row
    (powers of 2, no cos or pow of these steps), its lrs after warmup are end_lr + (peak - end_lr) factor, or
    peak factor (multistep), of the factor of the step (milestones reached)."""
    device, kind = where
    milestones = (4, 6) if decay == "multistep" else ()
    schedule = WarmupSchedule(total_steps=9, warmup_steps=2, decay=decay, milestones=milestones, end_lr=1e-3)
    row = schedule.as_row()
    start = len(row) - (
        len(milestones) + 1 if milestones else schedule.total_steps - schedule.warmup_steps + 1
    )
    row[start:] = factors = [2.0 ** -(i + 1) for i in range(len(row) - start)]
    on_device = dict(dtype=torch.float64, device=device)
    lrs, peak = torch.zeros(1, **on_device), 0.4
    position = torch.zeros(2, dtype=torch.int64, device=device)
    for step in range(12):
        ops.load(kind).schedule_lrs(
            lrs, position, torch.tensor(row, **on_device), torch.tensor([peak], **on_device), None, step > 0
        )
        t = min(step, schedule.total_steps)
        if step < schedule.warmup_steps:
            expected = schedule.lr_at(step, peak)
        elif milestones:
            expected = peak * factors[sum(m <= t for m in milestones)]
        else:
            expected = 1e-3 + (peak - 1e-3) * factors[t - schedule.warmup_steps]
        assert lrs.item() == expected, step
