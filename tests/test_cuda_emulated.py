"""The CUDA kernels and their host code, run on the CPU: ``fused_sgd_cuda.cu`` built by the host compiler with
an emulation of CUDA's execution model (``ops/csrc/emulation/``), its ops registered as
``torch.ops.lightning_fusedsgd_cuda_emulated``. Every op and launch path (tables copied, tables written by
kernels as under graph capture, a plan kept in C++) runs under several scheduling seeds (blocks, and threads
between barriers, in order, reversed, shuffled), so a result that depends on the order of threads fails. The
emulated build's blocks are small (``CHUNK``), so that the shapes below cross every loop boundary of the
kernels; what a GPU faults on (a shared array or device allocation overrun, host code touching device memory)
fails a call; ``make mutants`` checks that these tests catch bugs injected into the kernels.

Oracles: the compiled CPU kernel, bit for bit, wherever the two take the same norms (LARS tensors are handed
the same sums, as a sharded step hands them, where the two would sum in different orders); float64 sums for
the norm passes; the CPU kernel to rounding where the CUDA kernels take their own LARS norms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import make_params, op_row
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedSGD, FusedSGDScheduleFree, ops
from lightning_fusedsgd._abi import (
    DECAYS,
    LARS_DENOMINATORS,
    UPDATE_ROUNDINGS,
    hparam_names,
    slot_keys,
    state_slots,
)
from lightning_fusedsgd.schedule import WarmupSchedule

HPARAM_NAMES, SLOT_KEYS = hparam_names(), slot_keys()

pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]  # slow: it builds a library (once, cached)

SEEDS = [0, 1, 2, 3]  # in order, reversed, two shuffles
# The emulated build's threads per block, loads in flight per thread and elements per block (a chunk):
# emulation/fused_sgd_cuda_emulated.cpp.
THREADS, UNROLL, CHUNK = 512, 4, 2560
# Tensors whose last chunk ends at, short of and past the update loop's unrolled pass (THREADS * UNROLL
# elements) and its steps (THREADS): one pass, a chunk less one, a chunk, one more, a chunk and a step and 3,
# two chunks less one.
BOUNDARY_SHAPES = (
    (THREADS * UNROLL,),
    (CHUNK - 1,),
    (CHUNK,),
    (CHUNK + 1,),
    (CHUNK + THREADS + 3,),
    (2 * CHUNK - 1,),
)
# More chunks than a block has threads: the LARS rows' loop (a block per tensor, a thread per chunk) steps on.
MANY_CHUNKS = ((THREADS + 1) * CHUNK + 3,)
ROUNDING_STEP_THREADS = 256  # advance_rounding_steps_kernel's threads per block, a thread per tensor


@pytest.fixture(scope="module")
def emulated():
    return ops.load("cuda_emulated")


@pytest.fixture(scope="module")
def cpu():
    return ops.load("cpu")


@pytest.fixture(autouse=True)
def poisoned_memory():
    """New tensors hold garbage, as fresh device memory does (torch's deterministic mode fills uninitialized
    memory with NaN or the largest integer): a table byte or a partial sum never written shows."""
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled)


@pytest.fixture(params=SEEDS, ids=lambda seed: f"seed{seed}")
def seed(request, emulated):
    emulated.set_schedule(request.param)
    yield request.param
    emulated.set_schedule(0)


@pytest.fixture(params=[False, True], ids=["copied-tables", "captured-tables"])
def capturing(request, emulated):
    emulated.set_capturing(request.param)
    yield request.param
    emulated.set_capturing(False)


def table(groups: list[dict[str, Any]]) -> torch.Tensor:
    """The hyperparameter table of these groups (defaults: FusedSGD's, lr 0.05)."""
    rows = []
    for hparams in groups:
        row = {name: 0.0 for name in HPARAM_NAMES}
        row |= {
            "lr": 0.05,
            "trust_coefficient": 1e-3,
            "max_grad_value": math.inf,
            "always_adapt": 1.0,
            "update_rounding": "nearest",
            "ema_decay": math.nan,  # no average
            "ema_every": 1,
        }
        row |= hparams
        row["update_rounding"] = UPDATE_ROUNDINGS.index(row["update_rounding"])
        row["lars_denominator"] = LARS_DENOMINATORS.index(row.get("lars_denominator") or "grad_plus_decay")
        rows.append([float(row[name]) for name in HPARAM_NAMES])
    return torch.tensor(rows, dtype=torch.float64)


# Shapes: ragged sizes, an empty tensor, several CUDA chunks of one tensor (its LARS sums reduced across
# blocks).
SHAPES = [(33, 17), (0,), (2 * CHUNK + 1001,), (5,), (3, 5, 4, 4)]


@dataclass(frozen=True)
class Case:
    """One bucket: its param dtype, how its weights are stored, two groups' hyperparameters (the second group
    takes every other tensor), GradScaler and clipping."""

    id: str
    dtype: torch.dtype = torch.float32
    masters: str = ""  # "", "fp32", "kahan"
    groups: tuple[dict[str, Any], ...] = (dict(momentum=0.9, weight_decay=1e-3), dict(momentum=0.9))
    scale: float | None = None  # GradScaler's scale
    found_inf: bool = False
    max_grad_norm: float | None = None
    shapes: tuple[tuple[int, ...], ...] = tuple(SHAPES)
    first_step: tuple[bool, ...] = field(default=())

    @property
    def lars(self) -> bool:
        return any(group.get("lars") for group in self.groups)


def _lars(**options: Any) -> tuple[dict[str, Any], ...]:
    return (
        dict(momentum=0.9, weight_decay=5e-3, lars=1.0, **options),
        dict(momentum=0.9, lars=1.0, **options),
    )


CASES = [
    Case("fp32-momentum"),
    Case("fp32-nesterov", groups=(dict(momentum=0.9, nesterov=1.0, weight_decay=1e-3), dict(momentum=0.8))),
    Case("fp32-dampening-maximize", groups=(dict(momentum=0.9, dampening=0.3, maximize=1.0), dict())),
    Case("fp32-decay-after-momentum", groups=(dict(momentum=0.9, weight_decay=1e-2, wd_after_momentum=1.0),)),
    Case("fp32-first-step", first_step=(True, False, True, True, False)),
    Case("fp64", dtype=torch.float64),
    Case("fp16-nearest", dtype=torch.float16),
    Case("fp16-fp32-masters", dtype=torch.float16, masters="fp32"),
    Case("bf16-nearest", dtype=torch.bfloat16),
    Case("bf16-fp32-masters", dtype=torch.bfloat16, masters="fp32"),
    Case(
        "bf16-kahan",
        dtype=torch.bfloat16,
        masters="kahan",
        groups=(dict(momentum=0.9, weight_decay=1e-3, update_rounding="kahan"),),
    ),
    Case(
        "bf16-stochastic",
        dtype=torch.bfloat16,
        groups=(
            dict(momentum=0.9, weight_decay=1e-3, update_rounding="stochastic", rounding_seed=7),
            dict(momentum=0.9, update_rounding="nearest"),
        ),
    ),
    Case(
        "ema-every-other-step",
        groups=(dict(momentum=0.9, ema_decay=0.99, ema_every=2, ema_start=4), dict(momentum=0.9)),
    ),
    Case(
        "fp64-ema-nesterov",
        dtype=torch.float64,
        groups=(dict(momentum=0.9, nesterov=1.0, ema_decay=0.999),),
    ),
    Case(
        "bf16-masters-ema-warmup",
        dtype=torch.bfloat16,
        masters="fp32",
        groups=(dict(momentum=0.9, ema_decay=0.9999, ema_warmup_gamma=2.0, ema_warmup_power=0.75),),
    ),
    Case(
        "bf16-stochastic-ema",
        dtype=torch.bfloat16,
        groups=(dict(momentum=0.9, update_rounding="stochastic", ema_decay=0.9),),
    ),
    Case(
        "fp16-ema-found-inf",
        dtype=torch.float16,
        groups=(dict(momentum=0.9, ema_decay=0.5),),
        scale=64.0,
        found_inf=True,
    ),
    Case("lars", groups=_lars()),
    Case("lars-nesterov-trust-clip", groups=_lars(nesterov=1.0, trust_clip=1.0, lars_eps=1e-8)),
    Case("lars-decayed-grad-maximize", groups=_lars(lars_denominator="decayed_grad", maximize=1.0)),
    Case(
        "lars-not-always-adapt-zero-norm-plain-grad",
        groups=(
            dict(momentum=0.9, weight_decay=5e-3, lars=1.0, lars_zero_norm=1.0),
            dict(momentum=0.9, lars=1.0, always_adapt=0.0),
        ),
    ),
    Case("lars-bf16-kahan", dtype=torch.bfloat16, masters="kahan", groups=_lars(update_rounding="kahan")),
    Case(
        "lars-fp16-masters-clip-norm-scaler",
        dtype=torch.float16,
        masters="fp32",
        groups=_lars(),
        scale=1024.0,
        max_grad_norm=0.5,
    ),
    Case("clip-norm", max_grad_norm=0.5),
    Case("clip-value", groups=(dict(momentum=0.9, max_grad_value=0.01), dict(max_grad_value=0.02))),
    Case("lars-decayed-grad-clip-norm", groups=_lars(lars_denominator="decayed_grad"), max_grad_norm=0.5),
    Case("grad-scaler", scale=512.0),
    Case("grad-scaler-found-inf", scale=512.0, found_inf=True),
    Case(
        "bf16-stochastic-found-inf",
        dtype=torch.bfloat16,
        groups=(dict(momentum=0.9, update_rounding="stochastic"),),
        scale=64.0,
        found_inf=True,
    ),
    Case(
        "many-tensors", shapes=tuple((7 + i % 5,) for i in range(130))
    ),  # tables of several kernel parameters
    Case("many-tensors-lars", shapes=tuple((9 + i % 3, 2) for i in range(70)), groups=_lars()),
    Case("chunk-boundaries", shapes=BOUNDARY_SHAPES),
    Case("lars-chunk-boundaries", shapes=BOUNDARY_SHAPES, groups=_lars(lars_denominator="decayed_grad")),
    Case(
        "bf16-stochastic-past-a-grid-stride",  # more tensors than a block of the rounding steps' kernel
        dtype=torch.bfloat16,
        groups=(dict(momentum=0.9, update_rounding="stochastic", rounding_seed=3),),
        shapes=tuple((3 + i % 4,) for i in range(ROUNDING_STEP_THREADS + 44)),
    ),
]


def bucket(case: Case) -> dict[str, Any]:
    """The case's op arguments (fresh tensors), by name; its state by slot key, a list with None where a
    tensor holds no such state."""
    generator = torch.Generator().manual_seed(0)
    groups = len(case.groups)
    tensor_group = [i % groups for i in range(len(case.shapes))]
    params, grads = [], []
    slots: dict[str, list[torch.Tensor | None]] = {key: [None] * len(case.shapes) for key in SLOT_KEYS}
    scale = case.scale or 1.0
    for i, shape in enumerate(case.shapes):
        weight = torch.randn(shape, generator=generator)
        if i == 3 and case.lars:
            weight.zero_()  # a LARS tensor whose norm is 0
        params.append(weight.to(case.dtype))
        grads.append((torch.randn(shape, generator=generator) * scale).to(case.dtype))
        hparams = case.groups[tensor_group[i]]
        if hparams.get("momentum", 0.0) != 0.0:
            buffer_dtype = torch.float32 if case.masters == "fp32" else case.dtype
            slots["momentum_buffer"][i] = torch.randn(shape, generator=generator).to(buffer_dtype)
        if case.masters == "fp32":
            slots["master_param"][i] = params[-1].float()
        elif case.masters == "kahan":
            slots["kahan_compensation"][i] = (1e-3 * torch.randn(shape, generator=generator)).to(
                torch.bfloat16
            )
        elif case.dtype == torch.bfloat16 and hparams.get("update_rounding") == "stochastic":
            slots["rounding_step"][i] = torch.tensor(5 + i)
        if hparams.get("ema_decay") is not None:  # steps and updates so that some copy, blend or wait
            opmath = torch.float64 if case.dtype == torch.float64 else torch.float32
            slots["ema"][i] = torch.randn(shape, generator=generator).to(opmath)
            slots["ema_step"][i] = torch.tensor(3 + i)
            slots["ema_updates"][i] = torch.tensor(i % 3)
    return dict(
        params=params,
        grads=grads,
        slots=slots,
        group_hparams=table(list(case.groups)),
        tensor_group=tensor_group,
        first_step=list(case.first_step) or [False] * len(case.shapes),
        grad_scale=None if case.scale is None else torch.tensor([case.scale]),
        found_inf=None if case.scale is None else torch.tensor([float(case.found_inf)]),
    )


def _state(a: dict[str, Any]) -> tuple[list[torch.Tensor], list[int]]:
    """The op's ``state`` and ``state_slots`` of a bucket."""
    state, masks = [], []
    for t in range(len(a["params"])):
        held = [a["slots"][key][t] is not None for key in SLOT_KEYS]
        fresh = [h and key == "momentum_buffer" and a["first_step"][t] for key, h in zip(SLOT_KEYS, held)]
        state += [a["slots"][key][t] for key, h in zip(SLOT_KEYS, held) if h]
        masks.append(state_slots(held, fresh))
    return state, masks


def _row(a: dict[str, Any], **values: Any) -> list[torch.Tensor | None]:
    return op_row(grad_scale=a["grad_scale"], found_inf=a["found_inf"], **values)


def _companions(a: dict[str, Any]) -> list[torch.Tensor]:
    """The bucket's fp32 masters or Kahan compensations, one per tensor."""
    return [m for key in ("master_param", "kahan_compensation") for m in a["slots"][key] if m is not None]


def _written(a: dict[str, Any]) -> list[torch.Tensor]:
    return [*a["params"], *(t for key in SLOT_KEYS for t in a["slots"][key] if t is not None)]


def _lars_sq_sums(op_library, a: dict[str, Any]) -> torch.Tensor:
    return op_library.lars_sq_sums(
        a["params"], a["grads"], *_state(a), a["group_hparams"], a["tensor_group"], _row(a)
    )


def _step(op_library, a, grad_sq_sum=None, max_grad_norm=None, lars_sq_sums=None, reported=None):
    clip = dict(grad_sq_sum=grad_sq_sum, max_grad_norm=max_grad_norm) if max_grad_norm else {}
    op_library.sgd_step(
        a["params"],
        a["grads"],
        *_state(a),
        a["group_hparams"],
        a["tensor_group"],
        _row(a, lars_sq_sums=lars_sq_sums, **clip),
        reported,
    )


def _assert_same_bits(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if a.element_size() == 2:
            a, e = a.view(torch.int16), e.view(torch.int16)
        assert torch.equal(a, e)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_sgd_step_gives_the_cpu_kernels_bits(case, seed, capturing, emulated, cpu):
    """Each bucket through the CUDA kernels equals the compiled CPU kernel bit for bit: params, buffers,
    masters and compensations, rounding steps. LARS tensors get the same sums (the CPU kernel's, as a sharded
    step hands them reduced), so the two take the same trust ratios."""
    expected, actual, initial = bucket(case), bucket(case), bucket(case)
    clip = (cpu.grad_sq_sum(expected["grads"]), case.max_grad_norm) if case.max_grad_norm else (None, None)
    sums = _lars_sq_sums(cpu, expected) if case.lars else None
    launches = emulated.stats()[0]
    _step(cpu, expected, *clip, sums)
    _step(emulated, actual, *clip, sums)
    _assert_same_bits(_written(actual), _written(expected))
    if case.found_inf:
        _assert_same_bits(_written(actual), _written(initial))
    else:
        assert any(not torch.equal(p, q) for p, q in zip(actual["params"], initial["params"]) if p.numel())
    # The launches: the update, the rounding steps' advance, and under capture the kernels writing the tables
    # (several where they fill more than one kernel parameter).
    counts = [t for key in ("rounding_step", "ema_step") for t in actual["slots"][key] if t is not None]
    pieces = emulated.stats()[0] - launches - 1 - bool(counts)
    if not capturing:
        assert pieces == 0
    else:
        assert pieces >= (3 if len(case.shapes) > 100 else 1)


@pytest.mark.parametrize("case", [case for case in CASES if case.lars], ids=lambda case: case.id)
def test_lars_norms_of_the_cuda_kernels(case, seed, capturing, emulated, cpu):
    """Given no sums, the CUDA kernels reduce each LARS tensor's sums once (lars_sq_sums's two kernels) and
    the update reads them: within rounding of the CPU kernel, whose norms are summed in another order."""
    expected, actual = bucket(case), bucket(case)
    clip = (cpu.grad_sq_sum(expected["grads"]), case.max_grad_norm) if case.max_grad_norm else (None, None)
    _step(cpu, expected, *clip)
    _step(emulated, actual, *clip)
    # 16-bit values one rounding apart at most, where the trust ratios differ by rounding; a Kahan
    # compensation (what rounding the weight dropped) through the weight, param + compensation.
    compensations = _companions(actual) + _companions(expected) if case.masters == "kahan" else []
    for a, e in zip(_written(actual), _written(expected), strict=True):
        if e.numel() and not any(e is c for c in compensations):
            assert_close_rel([a], [e], {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(e.dtype, 1e-6))
    if compensations:
        weights = [
            [p.float() + m.float() for p, m in zip(b["params"], _companions(b)) if p.numel()]
            for b in (actual, expected)
        ]
        assert_close_rel(*weights, 1e-6)


@pytest.mark.parametrize(
    "case",
    [case for case in CASES if case.lars or case.id in ("clip-value", "grad-scaler-found-inf")],
    ids=lambda case: case.id,
)
def test_a_step_reports_its_gradients_float64_norm_and_steps_the_same_bits(case, seed, emulated):
    """The sum sgd_step adds to its unscaled_grad_sq_sum: every gradient's (LARS tensors' and not), unscaled
    and clipped by value, summed in float64 (rows, then one block over them); nothing where the step is
    skipped. A step that reports it writes the bits of one that does not."""
    reporting, silent = bucket(case), bucket(case)
    reported = torch.full((), 0.25, dtype=torch.float64)  # added to
    _step(emulated, reporting, reported=reported)
    _step(emulated, silent)
    _assert_same_bits(_written(reporting), _written(silent))
    inverse = float(torch.tensor(1.0 / (case.scale or 1.0), dtype=torch.float32))
    expected = 0.25
    for i, grad in enumerate(reporting["grads"]):
        bound = case.groups[reporting["tensor_group"][i]].get("max_grad_value", math.inf)
        expected += float(((grad.double() * inverse).clamp(-bound, bound) ** 2).sum())
    assert reported.item() == (0.25 if case.found_inf else pytest.approx(expected, rel=1e-6))


@pytest.mark.parametrize(
    "case",
    [case for case in CASES if case.lars or "masters" in case.id or "kahan" in case.id],
    ids=lambda case: case.id,
)
def test_lars_sq_sums_within_the_float64_oracles_bound(case, seed, capturing, emulated):
    """Each row is the float64 sum of w^2, t^2, w t and g^2 (t the LARS norm term, g the unscaled gradient,
    before the clip), within the
    rounding of a double sum (n eps relative to the sum of magnitudes); zeros for tensors without LARS."""
    a = bucket(case)
    rows = _lars_sq_sums(emulated, a)
    inv_scale = 1.0 if case.scale is None else 1.0 / case.scale
    for i, (param, grad) in enumerate(zip(a["params"], a["grads"])):
        hparams = case.groups[a["tensor_group"][i]]
        adapts = hparams.get("lars") and (
            hparams.get("always_adapt", 1.0) or hparams.get("weight_decay", 0.0)
        )
        if not adapts:
            assert torch.equal(rows[i], torch.zeros(4, dtype=torch.float64))
            continue
        w = param.double()
        if case.masters == "fp32":
            w = _companions(a)[i].double()
        elif case.masters == "kahan":
            w = (param.float() + _companions(a)[i].float()).double()
        g = grad.double() * float(torch.tensor(inv_scale, dtype=torch.float32))
        g = -g if hparams.get("maximize") else g
        decay = hparams.get("weight_decay", 0.0)
        t = g + decay * w if hparams.get("lars_denominator") == "decayed_grad" else g
        expected = torch.stack([(w * w).sum(), (t * t).sum(), (w * t).sum(), (g * g).sum()])
        bound = torch.stack([(w * w).sum(), (t * t).sum(), (w * t).abs().sum(), (g * g).sum()])
        bound = bound * (w.numel() + 1) * 2**-23
        assert ((rows[i] - expected).abs() <= bound + 1e-300).all(), (i, rows[i], expected)


def _exact(shape, generator, dtype, scale=1.0):
    """Integers of up to 12 bits in ``dtype`` (times ``scale``, a power of two): their squares and products,
    and every sum of them below, are exact in float64 in any order; in float32 a thread's first few squares
    already pass 2^24, where integers stop being exact."""
    return (torch.randint(-4096, 4097, shape, generator=generator).double() * scale).to(dtype)


EXACT_SHAPES = (MANY_CHUNKS, *BOUNDARY_SHAPES, (0,), (7,), (33, 17))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lars_sq_sums_of_exact_terms_are_their_float64_sums(dtype, seed, emulated):
    """The CUDA kernels sum in float64: each row is the float64 sums bit for bit where those are exact
    (unscaled, sign-corrected and decayed terms included), across every chunk and loop boundary, a tensor of
    more chunks than a block has threads included. A sum in float32 anywhere loses bits."""
    generator = torch.Generator().manual_seed(5)
    scale = 1024.0
    params = [_exact(shape, generator, dtype) for shape in EXACT_SHAPES]
    grads = [_exact(shape, generator, dtype, scale) for shape in EXACT_SHAPES]
    groups = [
        dict(lars=1.0, weight_decay=0.5, lars_denominator="decayed_grad"),
        dict(lars=1.0, weight_decay=0.5, maximize=1.0),
    ]
    tensor_group = [i % 2 for i in range(len(params))]
    no_state = [0] * len(params)
    step = op_row(grad_scale=torch.tensor([scale]))
    rows = emulated.lars_sq_sums(params, grads, [], no_state, table(groups), tensor_group, step)
    for i, (param, grad) in enumerate(zip(params, grads)):
        w, g = param.double(), grad.double() / scale
        t = g + 0.5 * w if tensor_group[i] == 0 else -g
        expected = torch.stack([(w * w).sum(), (t * t).sum(), (w * t).sum(), (g * g).sum()])
        assert torch.equal(rows[i], expected), (i, rows[i] - expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_grad_sq_sum_of_exact_squares_is_their_float64_sum(dtype, seed, capturing, emulated):
    """Bit for bit where the float64 sum is exact, across every chunk and loop boundary."""
    generator = torch.Generator().manual_seed(3)
    shapes = [*EXACT_SHAPES[1:], (2 * CHUNK + 7,), (31, 3), *[(5,)] * 90]
    grads = [_exact(shape, generator, dtype) for shape in shapes]
    total = emulated.grad_sq_sum(grads)
    assert total.dtype == torch.float64
    assert torch.equal(total, sum(g.double().square().sum() for g in grads))


@pytest.mark.parametrize("decay", DECAYS)
def test_schedule_lrs_gives_the_cpu_kernels_lrs(decay, seed, emulated, cpu):
    """Every step of every decay, the device schedule gives the CPU op's doubles bit for bit (the same host
    libm), a skipped step counting a skip, and WarmupSchedule.lr_at's values."""
    milestones = (5, 9) if decay == "multistep" else ()
    schedule = WarmupSchedule(
        total_steps=12, warmup_steps=3, start_factor=0.1, decay=decay, milestones=milestones
    )
    row = torch.tensor(schedule.as_row(), dtype=torch.float64)
    peaks = torch.tensor([0.4, 0.1], dtype=torch.float64)
    states = [(torch.zeros(2, dtype=torch.float64), torch.tensor([0, 0])) for _ in range(2)]
    for step in range(15):
        applied = None if step % 4 else torch.tensor(step != 8)
        for library, (lrs, position) in zip((cpu, emulated), states):
            library.schedule_lrs(lrs, position, row, peaks, applied, step > 0)
        assert torch.equal(states[1][0], states[0][0]) and torch.equal(states[1][1], states[0][1])
    lrs, position = states[1]
    assert position.tolist() == [13, 1]
    assert lrs.tolist() == [schedule.lr_at(13, 0.4), schedule.lr_at(13, 0.1)]


@pytest.mark.parametrize(
    "hparams, dtype",
    [
        (dict(momentum=0.9, nesterov=True, weight_decay=1e-4), torch.float32),
        (dict(momentum=0.9, master_weights=True), torch.bfloat16),
        (dict(momentum=0.9, update_rounding="stochastic"), torch.bfloat16),
        (dict(momentum=0.9, max_grad_value=0.01, capturable=True), torch.float32),
    ],
    ids=["nesterov", "bf16-masters", "bf16-stochastic", "value-clip-capturable"],
)
def test_a_plan_kept_in_cpp_runs_the_cuda_kernels(hparams, dtype, seed, capturing):
    """FusedSGD(backend="cuda_emulated"): the whole step path, its later steps through a plan kept in C++
    (KeptPlan calling the emulated ops), equal to the compiled CPU kernel's steps bit for bit."""
    runs = []
    for backend in ("compiled", "cuda_emulated"):
        params = make_params([(2 * CHUNK + 7,), (33, 17), (8,), (3, 5, 4, 4)], dtype=dtype)
        optimizer = FusedSGD(params, lr=0.05, backend=backend, **hparams)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))
            optimizer.step()
        runs.append([*params, *(value for p in params for _, value in sorted(optimizer.state[p].items()))])
    assert set(optimizer.last_backends.values()) == {"cuda_emulated (kept plan)"}
    _assert_same_bits(runs[1], runs[0])


def test_lars_training_through_the_cuda_kernels_equals_the_cpu_kernels(seed):
    """A LARS step path with norm clipping: the CUDA kernels' own norms, to rounding of the CPU kernel's."""
    runs = []
    for backend in ("compiled", "cuda_emulated"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 10))
        optimizer = FusedSGD(
            model.parameters(),
            lr=0.5,
            momentum=0.9,
            weight_decay=1e-3,
            lars=True,
            max_grad_norm=1.0,
            backend=backend,
        )
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            data, target = (
                torch.randn(64, 300, generator=generator),
                torch.randint(0, 10, (64,), generator=generator),
            )
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
        runs.append(list(model.parameters()))
    assert_close_rel(runs[1], runs[0], 1e-5)


@pytest.mark.parametrize("lars", [False, True], ids=["sgd", "lars"])
@pytest.mark.parametrize("backend", ["compiled", "cuda_emulated"])
def test_a_grad_scale_that_is_no_power_of_two_unscales_as_torchs_grad_scaler(backend, lars):
    """GradScaler(init_scale=1000.0) handing its scale to the step gives the bits of the same step on the
    grads GradScaler.unscale_ unscaled: the kernels multiply by 1 / 1000 rounded to float as it does, in the
    update and in the LARS sums (float64 params, whose math runs in double, where a double 1 / 1000 would
    differ; a power-of-two scale cannot tell them apart). Oracles: torch.optim.SGD after unscale_ (the plain
    path's bits), and for LARS the same optimizer stepping the unscaled grads."""
    runs = []
    for in_the_step in (True, False):
        params = make_params([(70_000,), (33, 17), (8,)], dtype=torch.float64)
        hparams = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
        if lars or in_the_step:
            optimizer = FusedSGD(params, lars=lars, backend=backend, **hparams)
        else:
            optimizer = torch.optim.SGD(params, **hparams)
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=100)
        generator = torch.Generator().manual_seed(4)
        for _ in range(3):
            scaler.scale(torch.ones(()))  # a loss scaled, which the scaler's step asks for
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64) * 1000.0
            if not in_the_step:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        assert scaler.get_scale() == 1000.0
        runs.append([*params, *(optimizer.state[p]["momentum_buffer"] for p in params)])
    _assert_same_bits(runs[0], runs[1])


def test_the_shapes_are_written_for_the_emulated_builds_geometry(emulated):
    """BOUNDARY_SHAPES and MANY_CHUNKS cross the loop boundaries of this geometry: a chunk takes a full and
    a partial unrolled pass, and MANY_CHUNKS more chunks than a block has threads."""
    assert emulated.launch_geometry() == [THREADS, UNROLL, CHUNK]
    assert THREADS * UNROLL < CHUNK < 2 * THREADS * UNROLL
    assert math.ceil(MANY_CHUNKS[0] / CHUNK) > THREADS


def test_params_in_one_storage_step_as_the_cpu_kernels_do(seed, emulated, cpu):
    """Views of one buffer (a flat parameter buffer) share one device copy: each view's update lands."""
    runs = []
    for library in (cpu, emulated):
        generator = torch.Generator().manual_seed(4)
        flat, flat_grad = (torch.randn(2 * CHUNK + 50, generator=generator) for _ in range(2))
        sizes = [CHUNK + 7, CHUNK + 43]
        params, grads = list(flat.split(sizes)), list(flat_grad.split(sizes))
        library.sgd_step(params, grads, [], [0, 0], table([dict()]), [0, 0], op_row())
        runs.append(flat)
    _assert_same_bits(runs[1:], runs[:1])


@pytest.mark.parametrize(
    "kind, error",
    [
        (
            "shared_past_end",
            r"thread 8 of block 0 accessed address 0x\w+, 0 bytes past the end of a __shared__ "
            r"array of 64 bytes",
        ),
        (
            "device_past_end",
            r"thread 0 of block 0 accessed address 0x\w+, 0 bytes past the end of a device "
            r"allocation of 20 bytes",
        ),
        ("wild_pointer", r"accessed address 0x44, which is no device memory"),
        (
            "host_read",
            r"the host code of lightning_fusedsgd_cuda_emulated::faulty_access touched device memory "
            r"outside a kernel, at address 0x\w+, 0 bytes into a device allocation of 20 bytes",
        ),
        ("host_item", r"read a device value on the host, through aten::_local_scalar_dense"),
        (
            "past_launch_bounds",
            r"a launch of 128 threads per block of a kernel declared with __launch_bounds__\(64\)",
        ),
    ],
)
def test_the_emulation_fails_what_a_gpu_faults_on(kind, error, emulated):
    """Kernels past the end of a __shared__ array or a device allocation or at a wild pointer, host code
    reading device memory or a device value, and a launch of more threads per block than the kernel's
    __launch_bounds__ (faulty_access, a test op of the emulated library), fail the call, with the address and
    what it is; the emulation goes on, and an access in bounds or a launch at the bound is no fault."""
    data = torch.arange(5.0)
    with pytest.raises(RuntimeError, match=error):
        emulated.faulty_access(kind, data)
    assert torch.equal(data, torch.arange(5.0))
    emulated.faulty_access("device_in_bounds", data)  # data[0] = data[4]; data[1] = 64 threads, at the bound
    assert data.tolist() == [4.0, 64.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "options, dtype",
    [
        (dict(weight_decay=1e-3, momentum=0.5), torch.float32),
        (dict(master_weights=True, max_grad_value=0.5), torch.bfloat16),
        (dict(update_rounding="stochastic", capturable=True), torch.bfloat16),
    ],
    ids=["fp32", "bf16-masters-value-clip", "bf16-stochastic-capturable"],
)
def test_schedule_free_steps_and_switches_through_the_cuda_kernels(options, dtype, seed, capturing):
    """FusedSGDScheduleFree(backend="cuda_emulated"): its scalars advanced on the device (a skipped step
    leaving them), its updates (kept plans among them) and its train/eval switches equal the compiled CPU
    kernel's bit for bit."""
    runs = []
    for backend in ("compiled", "cuda_emulated"):
        params = make_params([(70_000,), (33, 17), (8,), (3, 5, 4, 4)], dtype=dtype)
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.2, "momentum": 0.8, "r": 1.0}]
        optimizer = FusedSGDScheduleFree(groups, lr=0.5, warmup_steps=2, r=0.5, backend=backend, **options)
        optimizer.train()
        generator = torch.Generator().manual_seed(1)
        for step in range(5):
            for p in params:
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))
            optimizer.found_inf = torch.tensor(float(step == 3))
            optimizer.step()
            if step == 1:
                optimizer.eval()
                optimizer.train()
        optimizer.eval()
        state = [value for p in params for _, value in sorted(optimizer.state[p].items())]
        runs.append([*params, *state, optimizer._scalars.tensor])
    assert set(optimizer.last_backends.values()) == {"cuda_emulated (kept plan)"}
    assert runs[1][-1][0].tolist() == [4.0, 4.0]  # k: the skipped step did not count
    _assert_same_bits(runs[1], runs[0])


def test_schedule_free_scalars_give_the_cpu_kernels_values(seed, capturing, emulated, cpu):
    """The scalars op on the device (the step row's found_inf read there: a skipped step changes nothing)
    gives the CPU op's doubles bit for bit (the same host libm)."""
    from test_schedule_free import _scalars_op_run

    assert all(torch.equal(a, e) for a, e in zip(_scalars_op_run(emulated), _scalars_op_run(cpu)))
