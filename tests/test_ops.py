"""The kernels as PyTorch custom ops: schemas and fake kernels (opcheck), and torch.compile tracing a
FusedSGD step into one graph with no break, with eager's result."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import op_row, op_state
from oracles import assert_close_rel
from torch import nn
from torch._dynamo.utils import counters

from lightning_fusedsgd import FusedLARS, FusedSGD, _abi
from lightning_fusedsgd._abi import LARS_DENOMINATORS, UPDATE_ROUNDINGS, hparam_names
from lightning_fusedsgd.ops import load as load_ops
from lightning_fusedsgd.ops import reference

OPS = load_ops("cpu")


def table(**hparams):
    """One group's row; max_grad_value is inf (no clamp) unless given: 0 would clamp every gradient to 0;
    update_rounding is a name of _abi.UPDATE_ROUNDINGS."""
    defaults = {
        "lr": 0.1,
        "trust_coefficient": 1e-3,
        "max_grad_value": math.inf,
        "update_rounding": "nearest",
        "ema_decay": math.nan,  # no average
        "ema_every": 1,
    }
    row = {name: 0.0 for name in hparam_names()} | defaults | hparams
    row["update_rounding"] = UPDATE_ROUNDINGS.index(row["update_rounding"])
    if isinstance(row["lars_denominator"], str):
        row["lars_denominator"] = LARS_DENOMINATORS.index(row["lars_denominator"])
    return torch.tensor([[float(row[name]) for name in hparam_names()]], dtype=torch.float64)


def bucket(dtype=torch.float32, master=False, momentum=True):
    """A bucket's params, grads, momentum buffers and companions; ``master``: True for fp32 masters, "kahan"
    for bf16 compensations."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(33, 17), (70_000,), (5,)]
    params = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    buffer_dtype = torch.float32 if master is True else dtype
    buffers = [torch.randn(s, generator=generator).to(buffer_dtype) for s in shapes] if momentum else []
    masters = {
        True: [p.float() for p in params],
        "kahan": [(1e-3 * torch.randn(s, generator=generator)).to(dtype) for s in shapes],
    }.get(master, [])
    return params, grads, buffers, masters


def state_of(buffers, companions=(), master=False, steps=(), first_step=(False, True, False)):
    """The op's ``state`` and ``state_slots`` for a bucket's buffers (the second seeded this step) and
    companions (fp32 masters, or Kahan compensations)."""
    kind = {True: "master_param", "kahan": "kahan_compensation"}.get(master, "master_param")
    return op_state(3, first_step, momentum_buffer=buffers, rounding_step=steps, **{kind: companions})


# sgd_step's cases; "reports": the step adds its gradients' sum of squares to an unscaled_grad_sq_sum.
SGD_STEP_CASES = {
    "nesterov": dict(hparams=dict(momentum=0.9, nesterov=1.0, weight_decay=1e-4)),
    "no-momentum": dict(hparams=dict(), momentum=False),
    "lars": dict(hparams=dict(momentum=0.9, lars=1.0, weight_decay=1e-4), reports=True),
    "lars-decayed-grad": dict(
        hparams=dict(momentum=0.9, lars=1.0, weight_decay=0.05, lars_denominator="decayed_grad"), reports=True
    ),
    "bf16-master": dict(hparams=dict(momentum=0.9), dtype=torch.bfloat16, master=True),
    "bf16-master-lars-grad-scaler": dict(
        hparams=dict(momentum=0.9, lars=1.0, weight_decay=1e-4),
        dtype=torch.bfloat16,
        master=True,
        scaler=True,
        reports=True,
    ),
    "bf16-kahan-lars": dict(
        hparams=dict(momentum=0.9, lars=1.0, update_rounding="kahan"),
        dtype=torch.bfloat16,
        master="kahan",
        reports=True,
    ),
    "bf16-stochastic": dict(
        hparams=dict(momentum=0.9, update_rounding="stochastic"), dtype=torch.bfloat16, steps=True
    ),
    "grad-scaler": dict(hparams=dict(momentum=0.9), scaler=True),
    "clip-norm": dict(hparams=dict(momentum=0.9, lars=1.0), scaler=True, clip=0.5, reports=True),
    "clip-value": dict(hparams=dict(momentum=0.9, max_grad_value=0.1), reports=True),
}


def sgd_step_args(case, reported=None):
    """The op's arguments for a case (fresh tensors), ``reported`` its unscaled_grad_sq_sum."""
    master = case.get("master", False)
    params, grads, buffers, companions = bucket(
        case.get("dtype", torch.float32), master, case.get("momentum", True)
    )
    scaler = (
        dict(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor([0.0])) if case.get("scaler") else {}
    )
    clip = dict(grad_sq_sum=OPS.grad_sq_sum(grads), max_grad_norm=case["clip"]) if case.get("clip") else {}
    steps = [torch.tensor(7) for _ in params] if case.get("steps") else ()
    return (
        params,
        grads,
        *state_of(buffers, companions, master, steps),
        table(**case["hparams"]),
        [0, 0, 0],
        op_row(**scaler, **clip),
        reported,
    )


@pytest.mark.parametrize("case", SGD_STEP_CASES.values(), ids=SGD_STEP_CASES)
def test_sgd_step_passes_opcheck(case):
    reported = torch.zeros((), dtype=torch.float64) if case.get("reports") else None
    torch.library.opcheck(OPS.sgd_step.default, sgd_step_args(case, reported))


@pytest.mark.parametrize("ops", [OPS, reference], ids=["compiled", "reference"])
@pytest.mark.parametrize(
    "case", [c for c in SGD_STEP_CASES.values() if c.get("reports")], ids=lambda c: str(c["hparams"])
)
def test_sgd_step_reports_its_gradients_norm_and_steps_the_same_bits(ops, case):
    """The sum added to unscaled_grad_sq_sum is the float64 sum of squares of every gradient (LARS tensors'
    and not), unscaled and clipped by value as the step takes them, before the norm clip; reporting it changes
    no bit of the step."""
    reported = torch.full((), 0.25, dtype=torch.float64)  # added to
    args, silent = sgd_step_args(case, reported), sgd_step_args(case)
    ops.sgd_step(*args)
    ops.sgd_step(*silent)
    for written, same in zip([*args[0], *args[2]], [*silent[0], *silent[2]], strict=True):
        assert torch.equal(written.view(torch.uint8), same.view(torch.uint8))
    inverse = float(torch.tensor(1 / 1024.0 if case.get("scaler") else 1.0, dtype=torch.float32))
    bound = case["hparams"].get("max_grad_value", math.inf)
    grads = [(g.double() * inverse).clamp(-bound, bound) for g in args[1]]
    expected = 0.25 + sum((g * g).sum() for g in grads)
    # The CPU kernel sums a chunk in fp32 (as its LARS norm pass does, cpu_sums.h): clamped gradients, each
    # square the same, round all one way.
    assert reported.item() == pytest.approx(expected.item(), rel=1e-6 if ops is reference else 1e-4)


@pytest.mark.parametrize(
    "dtype, slot, companion, message",
    [
        (
            torch.float32,
            "master_param",
            lambda p: p.clone(),
            "holds a master_param, but Float params of its group hold none",
        ),
        (
            torch.float16,
            "kahan_compensation",
            lambda p: p.to(torch.bfloat16),
            "holds a kahan_compensation, but Half params of its group hold none",
        ),
        (torch.bfloat16, "master_param", lambda p: p.to(torch.float16), "a master_param of .* must be Float"),
    ],
    ids=["fp32-masters-of-fp32", "bf16-compensations-of-fp16", "fp16-masters"],
)
def test_sgd_step_refuses_companions_it_cannot_use(dtype, slot, companion, message):
    """The op checks what a bucket's weight slots hold before writing anything."""
    params, grads, _, _ = bucket(dtype)
    before = [p.clone() for p in params]
    state = op_state(3, **{slot: [companion(p) for p in params]})
    with pytest.raises(RuntimeError, match=message):
        OPS.sgd_step(params, grads, *state, table(), [0, 0, 0], op_row())
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_sgd_step_refuses_state_its_groups_do_not_hold():
    """The state a tensor holds is what its group and dtype say (_abi.SLOTS' held): a buffer of a group
    without momentum, or none where there is momentum, is refused before anything is written."""
    params, grads, buffers, _ = bucket()
    before = [p.clone() for p in params]
    for hparams, state in (({}, op_state(3, momentum_buffer=buffers)), (dict(momentum=0.9), op_state(3))):
        with pytest.raises(RuntimeError, match="momentum_buffer, but Float params of its group hold"):
            OPS.sgd_step(params, grads, *state, table(**hparams), [0, 0, 0], op_row())
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.parametrize(
    "seeded, hparams",
    [("master_param", dict(momentum=0.9)), ("momentum_buffer", dict())],
    ids=["a-slot-seeded-from-the-weight", "a-buffer-not-held"],
)
def test_sgd_step_seeds_only_held_slots_declared_seeded_from_the_gradient(seeded, hparams):
    """The kernel seeds a slot on a tensor's first step only where the tensor holds it and _abi.SLOTS declares
    it seeded from the gradient (the momentum buffer): a state_slots entry asking more is refused before
    anything is written."""
    params, grads, buffers, masters = bucket(torch.bfloat16, master=True)
    state, masks = op_state(3, momentum_buffer=buffers if hparams else [], master_param=masters)
    bit = len(_abi.SLOTS) + _abi.slot_keys().index(seeded)
    masks[1] |= 1 << bit
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match="the kernel seeds only held slots seeded from the gradient"):
        OPS.sgd_step(params, grads, state, masks, table(**hparams), [0, 0, 0], op_row())
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    masks[1] &= ~(1 << bit)
    OPS.sgd_step(params, grads, state, masks, table(**hparams), [0, 0, 0], op_row())  # the same, unseeded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_grad_sq_sum_passes_opcheck_and_sums_squares(dtype):
    grads = bucket(dtype)[1]
    torch.library.opcheck(OPS.grad_sq_sum.default, (grads,))
    expected = sum(float(g.double().square().sum()) for g in grads)
    assert OPS.grad_sq_sum(grads).dtype == torch.float64
    # fp32 sums of 16K-element chunks (double for fp64): about sqrt(16K) float32 roundings
    assert OPS.grad_sq_sum(grads).item() == pytest.approx(
        expected, rel=1e-5 if dtype != torch.float64 else 1e-12
    )


@pytest.mark.parametrize(
    "dtype, master", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, "kahan")]
)
def test_lars_sq_sums_passes_opcheck(dtype, master, device):
    load_ops(device.type)
    params, grads, _, companions = ([t.to(device) for t in tensors] for tensors in bucket(dtype, master))
    rounding = "kahan" if master == "kahan" else "nearest"
    hparams = table(lars=1.0, weight_decay=1e-4, lars_denominator="decayed_grad", update_rounding=rounding)
    state = state_of([], companions, master)
    args = (params, grads, *state, hparams, [0, 0, 0], op_row(device, grad_scale=torch.tensor([4.0])))
    torch.library.opcheck(OPS.lars_sq_sums.default, args)
    # A float64 oracle: the weight is the param, the master, or param + compensation; the decayed_grad term is
    # g / grad_scale + wd w, the gradient's sum of squares that of g / grad_scale.
    weights = {
        False: params,
        True: companions,
        "kahan": [p.double() + c.double() for p, c in zip(params, companions)] if master == "kahan" else [],
    }[master]
    expected = []
    for w, g in zip(weights, grads):
        w, unscaled = w.double(), g.double() / 4.0
        term = unscaled + 1e-4 * w
        expected.append(
            torch.stack([(w * w).sum(), (term * term).sum(), (w * term).sum(), (unscaled * unscaled).sum()])
        )
    for ops in (OPS, reference):
        assert_close_rel([ops.lars_sq_sums(*args).cpu()], [torch.stack(expected).cpu()], 1e-5)


@pytest.mark.parametrize("ops", [OPS, reference], ids=["compiled", "reference"])
@pytest.mark.parametrize("lars", [0.0, 1.0], ids=["plain", "lars-trust-clip"])
def test_sgd_step_reads_the_lrs_on_the_device(ops, lars, device):
    """Given ``lrs``, each group's lr comes from there (the table's lr is NaN, so any use of it would show):
    the same update as the table's lr, for two groups, with LARS's trust clip (r / lr) too."""
    load_ops(device.type)
    hparams = dict(momentum=0.9, weight_decay=1e-4, lars=lars, trust_clip=lars)
    rows = [torch.cat([table(**hparams, lr=lr) for lr in lrs]) for lrs in ((0.1, 0.02), (math.nan, math.nan))]
    runs = []
    for hparam_table, lrs in zip(rows, (None, torch.tensor([0.1, 0.02], dtype=torch.float64, device=device))):
        params, grads, buffers, _ = ([t.to(device) for t in tensors] for tensors in bucket())
        args = (params, grads, *state_of(buffers), hparam_table, [0, 1, 1])
        if lrs is not None and ops is OPS and device.type == "cpu":
            torch.library.opcheck(OPS.sgd_step.default, (*copy.deepcopy(args), op_row(device, lrs=lrs)))
        ops.sgd_step(*args, op_row(device, lrs=lrs))
        runs.append(params + buffers)
    for got, want in zip(*runs):
        assert torch.equal(got, want)
    assert all(torch.isfinite(t).all() for t in runs[1])


def test_schedule_lrs_passes_opcheck():
    from lightning_fusedsgd.schedule import WarmupSchedule

    cosine = WarmupSchedule(total_steps=10, warmup_steps=2, start_factor=0.1, decay="cosine", end_lr=0.001)
    schedule = torch.tensor(cosine.as_row(), dtype=torch.float64)
    args = (
        torch.zeros(2, dtype=torch.float64),
        torch.tensor([3, 1]),
        schedule,
        torch.tensor([0.1, 0.05], dtype=torch.float64),
        torch.tensor(True),
        True,
    )
    torch.library.opcheck(OPS.schedule_lrs.default, args)


@pytest.mark.parametrize("ops", [OPS, reference], ids=["compiled", "reference"])
def test_schedule_lrs_counts_applied_and_skipped_steps(ops, device):
    """An applied step advances the position and sets f(applied steps); a skipped one only counts the skip;
    advance=False only sets the lrs. Oracle: WarmupSchedule.lr_at."""
    from lightning_fusedsgd.schedule import WarmupSchedule

    load_ops(device.type)
    schedule = WarmupSchedule(total_steps=10, warmup_steps=2, start_factor=0.1, decay="poly", end_lr=1e-3)
    on_device = dict(device=device, dtype=torch.float64)
    lrs, peaks = torch.zeros(2, **on_device), torch.tensor([0.1, 0.05], **on_device)
    row = torch.tensor(schedule.as_row(), **on_device)
    position = torch.tensor([4, 0], device=device)
    ops.schedule_lrs(lrs, position, row, peaks, None, False)
    assert position.tolist() == [4, 0]
    assert lrs.tolist() == [schedule.lr_at(4, 0.1), schedule.lr_at(4, 0.05)]
    for applied, expected_position in ((True, [5, 0]), (False, [5, 1]), (None, [6, 1])):
        flag = None if applied is None else torch.tensor(applied, device=device)
        ops.schedule_lrs(lrs, position, row, peaks, flag, True)
        assert position.tolist() == expected_position
        step = expected_position[0]
        assert lrs.tolist() == [schedule.lr_at(step, 0.1), schedule.lr_at(step, 0.05)]


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("denominator", ["grad_plus_decay", "decayed_grad"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["no-clip", "clip-norm"])
@pytest.mark.parametrize("weight_scale", [1.0, 1e-25], ids=["normal", "tiny-weights"])
def test_given_lars_sq_sums_replace_the_norm_pass(backend, denominator, max_grad_norm, weight_scale, device):
    """sgd_step given lars_sq_sums (what a sharded step passes after its all-reduce) equals sgd_step's own
    norm pass, under a GradScaler's scale and norm clipping: clipped_term_sq_sum's algebra, on one process.
    Tiny weights: their fp32 squares underflow, so the CPU sums must fall back to double."""
    ops = load_ops(device.type) if backend == "compiled" else reference
    params, grads, buffers, _ = ([t.to(device) for t in tensors] for tensors in bucket())
    params = [p * weight_scale for p in params]
    scale = torch.tensor([8.0], device=device)
    grads = [g * scale for g in grads]
    hparams = table(
        momentum=0.9,
        weight_decay=0.05,
        lars=1.0,
        trust_coefficient=0.5,
        lars_denominator=denominator,
    )
    groups = [0, 0, 0]
    grad_sq_sum = ops.grad_sq_sum(grads) if max_grad_norm else None
    clip = dict(grad_sq_sum=grad_sq_sum, max_grad_norm=max_grad_norm) if max_grad_norm else {}
    if max_grad_norm:  # the clip is active, so its coefficient enters the norms
        assert grad_sq_sum.sqrt() / scale > 4 * max_grad_norm
    row = op_row(device, grad_scale=scale, **clip)
    expected, expected_buffers = [p.clone() for p in params], [b.clone() for b in buffers]
    ops.sgd_step(expected, grads, *state_of(expected_buffers), hparams, groups, row)
    actual, actual_buffers = [p.clone() for p in params], [b.clone() for b in buffers]
    sums = ops.lars_sq_sums(actual, grads, *state_of(actual_buffers), hparams, groups, row)
    row_with_sums = op_row(device, grad_scale=scale, lars_sq_sums=sums, **clip)
    ops.sgd_step(actual, grads, *state_of(actual_buffers), hparams, groups, row_with_sums)
    assert_close_rel(actual + actual_buffers, expected + expected_buffers, 1e-6)
    plain_hparams = table(momentum=0.9, weight_decay=0.05)
    plain, plain_buffers = [p.clone() for p in params], [b.clone() for b in buffers]
    ops.sgd_step(plain, grads, *state_of(plain_buffers), plain_hparams, groups, row)
    update, plain_update = actual[1] - params[1], plain[1] - params[1]  # a first step: no old buffer
    assert not torch.allclose(update, plain_update, rtol=0.1), "the trust ratio must matter here"


def test_sgd_step_schema_declares_what_it_writes():
    schema = OPS.sgd_step.default._schema
    written = [
        argument.name for argument in schema.arguments if argument.alias_info and argument.alias_info.is_write
    ]
    assert written == ["params", "state", "unscaled_grad_sq_sum"]


def compiled_and_eager_runs(make_optimizer, dtype=torch.float32, scaler=False, steps=4):
    """The same steps run eagerly and through torch.compile; returns both param lists, both optimizers and
    dynamo's graph-break reasons for the compiled run."""
    runs = []
    for compiled in (False, True):
        generator = torch.Generator().manual_seed(0)
        params = [
            nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in [(33, 17), (70_000,), (8,)]
        ]
        optimizer = make_optimizer(params)
        step = optimizer.step
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(optimizer.step, backend="aot_eager")
        for i in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(dtype)
            if scaler:  # what GradScaler hands an optimizer that unscales itself
                optimizer.grad_scale = torch.tensor([256.0])
                optimizer.found_inf = torch.tensor([1.0 if i == 2 else 0.0])
                for p in params:
                    p.grad.mul_(256.0)
            step()
        runs.append((params, optimizer))
    return runs, dict(counters["graph_break"])


@pytest.mark.parametrize(
    "make_optimizer, dtype, scaler",
    [
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4), torch.float32, False),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True), torch.float32, False),
        (
            lambda p: FusedLARS(p, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_clip=True),
            torch.float32,
            False,
        ),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, master_weights=True), torch.bfloat16, False),
        (
            lambda p: FusedSGD(p, lr=0.1, momentum=0.9, update_rounding="kahan", capturable=True),
            torch.bfloat16,
            False,
        ),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, update_rounding="stochastic"), torch.bfloat16, False),
        (
            lambda p: FusedSGD(p, lr=0.1, momentum=0.9, update_rounding="stochastic", capturable=True),
            torch.bfloat16,
            True,
        ),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), torch.float32, True),
        (lambda p: FusedLARS(p, lr=0.1, momentum=0.9, max_grad_norm=1.0), torch.float32, True),
        (lambda p: FusedSGD(p, lr=torch.tensor(0.1), momentum=0.9), torch.float32, False),
        (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, capturable=True), torch.float32, False),
        (lambda p: FusedLARS(p, lr=0.1, momentum=0.9, trust_clip=True, capturable=True), torch.float32, True),
        (
            lambda p: FusedSGD(p, lr=0.1, momentum=0.9, ema_decay=0.9, ema_every=2, capturable=True),
            torch.float32,
            True,
        ),
        (
            lambda p: FusedSGD(
                p, lr=0.1, momentum=0.9, master_weights=True, ema_decay=0.9, ema_warmup_gamma=1.0
            ),
            torch.bfloat16,
            False,
        ),
    ],
    ids=[
        "plain",
        "nesterov",
        "lars",
        "bf16-master",
        "bf16-kahan-capturable",
        "bf16-stochastic",
        "bf16-stochastic-capturable-grad-scaler",
        "grad-scaler",
        "clip-norm-lars-grad-scaler",
        "tensor-lr",
        "capturable",
        "capturable-lars-grad-scaler",
        "ema-capturable-grad-scaler",
        "bf16-master-ema-warmup",
    ],
)
def test_compiled_step_traces_without_graph_breaks_and_matches_eager(make_optimizer, dtype, scaler):
    ((eager, eager_opt), (compiled, compiled_opt)), breaks = compiled_and_eager_runs(
        make_optimizer, dtype, scaler
    )
    assert breaks == {}, breaks
    assert set(compiled_opt.last_backends.values()) == {"compiled"}  # the traced graph, not the kept plan
    if eager_opt.last_grad_norm is not None:  # clipping by norm: the traced step keeps its norm too
        assert torch.equal(compiled_opt.last_grad_norm, eager_opt.last_grad_norm)
    for p, q in zip(compiled, eager):
        assert torch.equal(p, q)
        for key, value in eager_opt.state[q].items():
            assert torch.equal(compiled_opt.state[p][key], value), key


def test_compiled_step_calls_our_op():
    graphs = []

    def record(graph_module, inputs):
        graphs.append(graph_module)
        return graph_module.forward

    params = [nn.Parameter(torch.randn(70_000))]
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9)
    torch._dynamo.reset()
    step = torch.compile(lambda: optimizer.step(), backend=record)
    for _ in range(2):
        params[0].grad = torch.ones_like(params[0])
        step()
    targets = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert (
        targets.count(torch.ops.lightning_fusedsgd.sgd_step) == len(graphs) == 2
    )  # first step, then later ones
