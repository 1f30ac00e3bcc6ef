"""WarmupLR / WarmupSchedule / scaled_lr against hand-computed learning rates."""

from __future__ import annotations

import dataclasses
import io
import math
import tracemalloc

import pytest
import torch

from lightning_fusedsgd import FusedSGD
from lightning_fusedsgd.schedule import DEVICE_ROW_STEPS, WarmupLR, WarmupSchedule, scaled_lr

# One schedule shape for the table below: peak 0.8, 10 steps, 2 of warmup from 0.25 * peak.
PEAK = 0.8
BASE = dict(total_steps=10, warmup_steps=2, start_factor=0.25)
END = 0.1
# After warmup, progress p = (t - 2) / 8.
COS_P25 = 0.5 * (1 + math.sqrt(2) / 2)  # (1 + cos(pi/4)) / 2, p = 0.25 at t = 4

DECAY_CASES = {
    "cosine": dict(decay="cosine", end_lr=END),
    "poly": dict(decay="poly", power=2.0, end_lr=END),
    "linear": dict(decay="linear", end_lr=END),
    "multistep": dict(decay="multistep", milestones=(5, 8), gamma=0.5),
    "constant": dict(decay="constant"),
}

# (decay, step, expected lr); the warmup rows hold for every decay.
WARMUP_ROWS = [(0, 0.25 * 0.8), (1, 0.8 * (0.25 + 0.75 * 0.5)), (2, 0.8)]
EXPECTED = [(decay, step, lr) for decay in DECAY_CASES for step, lr in WARMUP_ROWS] + [
    ("cosine", 4, 0.1 + 0.7 * COS_P25),
    ("cosine", 6, 0.1 + 0.7 * 0.5),
    ("cosine", 10, 0.1),
    ("cosine", 15, 0.1),
    ("poly", 4, 0.1 + 0.7 * 0.75**2),
    ("poly", 6, 0.1 + 0.7 * 0.25),
    ("poly", 9, 0.1 + 0.7 * 0.125**2),
    ("poly", 10, 0.1),
    ("poly", 15, 0.1),
    ("linear", 4, 0.1 + 0.7 * 0.75),
    ("linear", 6, 0.45),
    ("linear", 10, 0.1),
    ("multistep", 4, 0.8),
    ("multistep", 5, 0.4),
    ("multistep", 7, 0.4),
    ("multistep", 8, 0.2),
    ("multistep", 10, 0.2),
    ("multistep", 15, 0.2),
    ("constant", 6, 0.8),
    ("constant", 10, 0.8),
    ("constant", 15, 0.8),
]


def _optimizer(*lrs: float | torch.Tensor) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(params, lr=1.0, momentum=0.9)


def _run(optimizer: torch.optim.Optimizer, scheduler: WarmupLR, num_steps: int) -> list[list[float]]:
    """Take num_steps optimizer steps, recording the lrs each one used."""
    used = []
    for _ in range(num_steps):
        used.append([float(group["lr"]) for group in optimizer.param_groups])
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize(("decay", "step", "expected"), EXPECTED)
def test_lr_at_matches_hand_computed(decay: str, step: int, expected: float) -> None:
    schedule = WarmupSchedule(**BASE, **DECAY_CASES[decay])
    assert schedule.lr_at(step, PEAK) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("decay", list(DECAY_CASES))
def test_scheduler_sets_the_same_lrs_on_the_optimizer(decay: str) -> None:
    optimizer = _optimizer(PEAK)
    scheduler = WarmupLR(optimizer, **BASE, **DECAY_CASES[decay])
    used = [lrs[0] for lrs in _run(optimizer, scheduler, 16)]
    for row_decay, step, expected in EXPECTED:
        if row_decay == decay:
            assert used[step] == pytest.approx(expected, rel=1e-12), f"step {step}"
    assert scheduler.get_last_lr() == [pytest.approx(used[-1])]


def test_per_group_peaks_scale_together_and_share_end_lr() -> None:
    optimizer = _optimizer(0.8, 0.2)
    scheduler = WarmupLR(optimizer, **BASE, decay="cosine", end_lr=END)
    used = _run(optimizer, scheduler, 11)
    assert used[0] == pytest.approx([0.2, 0.05])
    assert used[1] == pytest.approx([0.5, 0.125])
    assert used[2] == pytest.approx([0.8, 0.2])
    assert used[6] == pytest.approx([0.45, 0.1 + 0.1 * 0.5])
    assert used[10] == pytest.approx([0.1, 0.1])
    assert [group["initial_lr"] for group in optimizer.param_groups] == [0.8, 0.2]


def test_no_warmup_starts_at_peak() -> None:
    schedule = WarmupSchedule(total_steps=4, decay="linear")
    assert schedule.curve(1.0, 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_mlperf_poly_schedule() -> None:
    # NVIDIA MLPerf v2.0 ResNet-50 LARS: peak 10.5 (batch 3264), warmup 2 of 35 "epochs", poly 2 to 1e-4.
    schedule = WarmupSchedule(total_steps=35, warmup_steps=2, decay="poly", power=2.0, end_lr=1e-4)
    assert schedule.lr_at(1, 10.5) == pytest.approx(5.25)
    assert schedule.lr_at(2, 10.5) == pytest.approx(10.5)
    assert schedule.lr_at(13, 10.5) == pytest.approx((10.5 - 1e-4) * (22 / 33) ** 2 + 1e-4)
    assert schedule.lr_at(35, 10.5) == pytest.approx(1e-4)


def test_tensor_lr_is_filled_in_place() -> None:
    lr = torch.tensor(PEAK)
    optimizer = _optimizer(lr)
    scheduler = WarmupLR(optimizer, **BASE, decay="poly", end_lr=END)
    _run(optimizer, scheduler, 6)
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.1 + 0.7 * 0.5**2, rel=1e-6)  # t = 6, p = 0.5


def _roundtrip(state: dict) -> dict:
    """Save and load like a checkpoint, with the restricted unpickler Lightning may use."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


SCHEDULE_FOR_RESUME = dict(total_steps=12, warmup_steps=3, start_factor=0.1)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("decay", ["cosine", "multistep", "poly"])
@pytest.mark.parametrize("resume_at", [0, 1, 3, 4, 7, 11, 12, 14])
@pytest.mark.parametrize("optimizer_first", [True, False])
def test_resume_continues_the_uninterrupted_sequence(
    decay: str, resume_at: int, optimizer_first: bool
) -> None:
    extra = dict(milestones=(6, 9)) if decay == "multistep" else dict(end_lr=0.01)
    total_run = 16

    optimizer = _optimizer(0.5, 0.05)
    uninterrupted = _run(
        optimizer, WarmupLR(optimizer, decay=decay, **SCHEDULE_FOR_RESUME, **extra), total_run
    )

    optimizer = _optimizer(0.5, 0.05)
    scheduler = WarmupLR(optimizer, decay=decay, **SCHEDULE_FOR_RESUME, **extra)
    before = _run(optimizer, scheduler, resume_at)
    saved = _roundtrip({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})

    optimizer = _optimizer(0.5, 0.05)
    scheduler = WarmupLR(optimizer, decay=decay, **SCHEDULE_FOR_RESUME, **extra)
    if optimizer_first:  # Lightning's order
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    else:
        scheduler.load_state_dict(saved["scheduler"])
        optimizer.load_state_dict(saved["optimizer"])
    after = _run(optimizer, scheduler, total_run - resume_at)

    assert before + after == uninterrupted


def test_scheduler_only_resume_sets_the_group_lr() -> None:
    # Even without the optimizer state, the next step must use f(t), not the f(0) set at construction.
    optimizer = _optimizer(PEAK)
    scheduler = WarmupLR(optimizer, **BASE, decay="constant")
    _run(optimizer, scheduler, 5)
    state = scheduler.state_dict()

    optimizer = _optimizer(PEAK)
    scheduler = WarmupLR(optimizer, **BASE, decay="constant")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    scheduler.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.8)
    assert scheduler.get_last_lr() == [pytest.approx(0.8)]


def test_resume_with_a_longer_run_that_changes_taken_steps_warns_and_uses_the_new_schedule() -> None:
    optimizer = _optimizer(1.0)
    scheduler = WarmupLR(optimizer, total_steps=10, decay="linear")
    _run(optimizer, scheduler, 5)
    state = scheduler.state_dict()

    optimizer = _optimizer(1.0)
    scheduler = WarmupLR(optimizer, total_steps=20, decay="linear")
    with pytest.warns(UserWarning, match=r"5 steps already taken followed another .*total_steps: 10 -> 20"):
        scheduler.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.75)  # 1 - 5/20


@pytest.mark.filterwarnings("error")
def test_resume_with_a_longer_multistep_run_is_silent_and_exactly_the_longer_run() -> None:
    # max_epochs=2 then max_epochs=4 with milestones ahead: the factory even turned the short run's
    # milestone-less multistep into "constant"; every step taken is unchanged, so no warning.
    longer = dict(total_steps=16, warmup_steps=2, decay="multistep", milestones=(9, 12))
    optimizer = _optimizer(1.0)
    uninterrupted = _run(optimizer, WarmupLR(optimizer, **longer), 16)

    optimizer = _optimizer(1.0)
    scheduler = WarmupLR(optimizer, total_steps=8, warmup_steps=2, decay="constant")
    before = _run(optimizer, scheduler, 8)
    state = _roundtrip(scheduler.state_dict())
    optimizer = _optimizer(1.0)
    scheduler = WarmupLR(optimizer, **longer)
    scheduler.load_state_dict(state)
    assert before + _run(optimizer, scheduler, 8) == uninterrupted


SCHEDULE_VARIANTS = [
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="cosine", end_lr=0.01),
    dict(total_steps=24, warmup_steps=3, start_factor=0.1, decay="cosine", end_lr=0.01),
    dict(total_steps=24, warmup_steps=3, start_factor=0.1, decay="cosine", end_lr=0.02),
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="poly", power=1.0, end_lr=0.01),
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="linear", end_lr=0.01),
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="poly", power=2.0, end_lr=0.01),
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="multistep", milestones=(6, 9)),
    dict(total_steps=24, warmup_steps=3, start_factor=0.1, decay="multistep", milestones=(6, 20)),
    dict(total_steps=24, warmup_steps=3, start_factor=0.1, decay="multistep", milestones=(7, 9)),
    dict(total_steps=24, warmup_steps=3, start_factor=0.1, decay="multistep", milestones=(6, 9), gamma=0.5),
    dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="constant"),
    dict(total_steps=12, warmup_steps=3, start_factor=0.2, decay="constant"),
    dict(total_steps=12, warmup_steps=4, start_factor=0.1, decay="constant"),
    dict(total_steps=12, warmup_steps=0, decay="constant"),
    dict(total_steps=12, warmup_steps=0, decay="cosine"),
]


@pytest.mark.parametrize("num_steps", [0, 1, 3, 4, 5, 7, 8, 13])
def test_changes_within_reports_every_change_of_a_taken_lr(num_steps: int) -> None:
    # Oracle: the lrs themselves, compared bit for bit. Nothing reported must mean identical lrs.
    schedules = [WarmupSchedule(**kwargs) for kwargs in SCHEDULE_VARIANTS]
    silent = 0
    for a in schedules:
        for b in schedules:
            if not a.changes_within(b, num_steps):
                silent += 1
                assert a.curve(PEAK, num_steps) == b.curve(PEAK, num_steps), (a, b)
    assert silent > len(schedules)  # not vacuous: some different schedules agree on these steps


def test_changes_within_ignores_what_only_matters_later() -> None:
    short = WarmupSchedule(total_steps=12, warmup_steps=3, decay="constant")
    longer = WarmupSchedule(total_steps=40, warmup_steps=3, decay="multistep", milestones=(20, 30))
    assert short.changes_within(longer, 12) == {}
    assert longer.changes_within(short, 21) == {
        "decay": ("multistep", "constant"),
        "milestones": ((20, 30), ()),
    }
    cosine = WarmupSchedule(total_steps=12, warmup_steps=6, decay="cosine")
    assert cosine.changes_within(dataclasses.replace(cosine, total_steps=24), 6) == {}  # still warming up
    assert cosine.changes_within(dataclasses.replace(cosine, total_steps=24), 8) == {"total_steps": (12, 24)}


def test_resume_with_a_changed_peak_warns_and_uses_the_new_peak() -> None:
    optimizer = _optimizer(1.0)
    scheduler = WarmupLR(optimizer, total_steps=10, decay="linear")
    _run(optimizer, scheduler, 5)
    state = scheduler.state_dict()

    optimizer = _optimizer(2.0)
    scheduler = WarmupLR(optimizer, total_steps=10, decay="linear")
    with pytest.warns(UserWarning, match=r"peak lrs \[2.0\], the checkpoint has \[1.0\]"):
        scheduler.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0)  # 2.0 * (1 - 5/10)


def test_resume_with_a_different_group_count_fails() -> None:
    optimizer = _optimizer(1.0, 1.0)
    state = WarmupLR(optimizer, total_steps=10).state_dict()
    with pytest.raises(ValueError, match="2 parameter groups, this optimizer has 1"):
        WarmupLR(_optimizer(1.0), total_steps=10).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(total_steps=10, warmup_steps=10), r"warmup_steps=10 is not shorter than the run"),
        (dict(total_steps=10, warmup_steps=25), r"shorten the warmup"),
        (dict(total_steps=0), r"total_steps must be an integer >= 1"),
        (dict(total_steps=-5), r"total_steps must be an integer >= 1"),
        (dict(total_steps=10.0), r"total_steps must be an integer"),
        (dict(total_steps=10, warmup_steps=-1), r"warmup_steps must be an integer >= 0"),
        (dict(total_steps=10, decay="step"), r"valid decays: cosine, multistep, poly, linear, constant"),
        (dict(total_steps=10, decay="multistep"), r"needs milestones"),
        (dict(total_steps=10, decay="multistep", milestones=(8, 5)), r"strictly increasing"),
        (dict(total_steps=10, decay="multistep", milestones=(5, 5)), r"strictly increasing"),
        (dict(total_steps=10, warmup_steps=2, decay="multistep", milestones=(2,)), r"\[2\] are outside"),
        (dict(total_steps=10, decay="multistep", milestones=(3, 30)), r"\[30\] are outside.*not epochs"),
        (dict(total_steps=10, decay="multistep", milestones=(2.5,)), r"integer step indices"),
        (dict(total_steps=10, decay="cosine", milestones=(5,)), r"only apply to decay='multistep'"),
        (dict(total_steps=10, start_factor=1.5), r"start_factor must be in \[0, 1\]"),
        (dict(total_steps=10, decay="multistep", milestones=(5,), gamma=0.0), r"gamma must be in \(0, 1\]"),
        (dict(total_steps=10, decay="multistep", milestones=(5,), gamma=10), r"gamma must be in \(0, 1\]"),
        (dict(total_steps=10, decay="poly", power=0), r"power must be"),
        (dict(total_steps=10, end_lr=-1e-4), r"end_lr must be"),
        (dict(total_steps=10, end_lr=float("nan")), r"end_lr must be"),
    ],
)
def test_invalid_schedules_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WarmupSchedule(**kwargs)
    with pytest.raises(ValueError, match=message):
        WarmupLR(_optimizer(0.1), **kwargs)


def test_invalid_steps_and_peaks_are_rejected() -> None:
    schedule = WarmupSchedule(total_steps=10, end_lr=0.01)
    with pytest.raises(ValueError, match="step must be >= 0"):
        schedule.lr_at(-1, 0.1)
    with pytest.raises(ValueError, match="peak lr must be"):
        schedule.lr_at(3, -0.1)
    with pytest.raises(ValueError, match=r"below end_lr=0.01 \(an absolute lr\)"):
        WarmupLR(_optimizer(0.1, 0.001), total_steps=10, end_lr=0.01)
    # end_lr does not constrain decays that ignore it.
    WarmupLR(_optimizer(0.001), total_steps=10, decay="constant", end_lr=0.01)


@pytest.mark.parametrize(
    ("base_lr", "batch", "reference", "expected"),
    [(0.1, 256, 256, 0.1), (0.1, 8192, 256, 3.2), (0.1, 32 * 8, 256, 0.1), (2.0, 3264, 1024, 6.375)],
)
def test_scaled_lr(base_lr: float, batch: int, reference: int, expected: float) -> None:
    assert scaled_lr(base_lr, batch, reference) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.1, 0), "global_batch_size must be a positive integer"),
        ((0.1, -256), "global_batch_size must be a positive integer"),
        ((0.1, 256.0), "global_batch_size must be a positive integer"),
        ((0.1, 256, 0), "reference_batch_size must be a positive integer"),
        ((-0.1, 256), "base_lr must be"),
        ((float("inf"), 256), "base_lr must be"),
    ],
)
def test_scaled_lr_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaled_lr(*args)


def _scaled_loop(steps, overflow, state=None, stop=None):
    """A plain AMP loop with FusedSGD: ``scaler.step(opt); scaler.update(); scheduler.step()`` every
    iteration, an inf loss at the ``overflow`` iterations. Returns the lr each iteration ran with, the
    weights, and (with ``stop``) the states saved after iteration ``stop``."""
    from lightning_fusedsgd import FusedSGD

    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, generator=generator))
    optimizer = FusedSGD([weight], lr=PEAK, momentum=0.9)
    scheduler = WarmupLR(optimizer, **BASE, decay="cosine", end_lr=END)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    first = 0
    if state is not None:
        for target, saved in zip((weight.data, optimizer, scheduler, scaler), state):
            target.copy_(saved) if isinstance(saved, torch.Tensor) else target.load_state_dict(saved)
        first = stop + 1
    lrs, saved = [], None
    for step in range(first, steps):
        data = torch.randn(64, generator=torch.Generator().manual_seed(step))
        loss = (weight * data).sum() ** 2 * (math.inf if step in overflow else 1.0)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step == stop:
            saved = [copy_state(x) for x in (weight.detach(), optimizer, scheduler, scaler)]
    return lrs, weight.detach().clone(), saved


def copy_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    buffer = io.BytesIO()
    torch.save(obj.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_skipped_steps_do_not_advance_the_schedule_in_a_plain_loop() -> None:
    overflow = {1, 4, 5}
    lrs, _, _ = _scaled_loop(12, overflow)
    schedule = WarmupSchedule(**BASE, decay="cosine", end_lr=END)
    applied = [lr for step, lr in enumerate(lrs) if step not in overflow]
    assert applied == pytest.approx(schedule.curve(PEAK, len(applied)))  # f(0), f(1), ... nothing lost
    assert lrs[1] == lrs[2] and lrs[4] == lrs[5] == lrs[6]  # a skipped step's lr is used by the next one


def test_resume_across_a_skipped_step_continues_the_uninterrupted_run() -> None:
    overflow = {3, 4}
    lrs, weight, saved = _scaled_loop(10, overflow, stop=4)
    resumed_lrs, resumed_weight, _ = _scaled_loop(10, overflow, state=saved, stop=4)
    assert resumed_lrs == lrs[5:]
    assert torch.equal(resumed_weight, weight)
    assert saved[2]["skipped_steps"] == 2 and saved[2]["last_epoch"] == 3


@pytest.mark.parametrize(
    "config, factor",
    [
        (dict(decay="cosine", warmup_steps=7), lambda p, s: 0.5 * (1.0 + math.cos(math.pi * p))),
        (dict(decay="poly", warmup_steps=3, power=2.0), lambda p, s: (1.0 - p) ** 2.0),
        (dict(decay="poly", power=0.7), lambda p, s: (1.0 - p) ** 0.7),
        (dict(decay="linear", warmup_steps=1), lambda p, s: (1.0 - p) ** 1.0),
    ],
    ids=["cosine", "poly-2", "poly-0.7", "linear"],
)
def test_the_device_row_holds_each_steps_factor_of_the_formula_bit_for_bit(config, factor) -> None:
    """The row's factors, one a step from warmup_steps to total_steps, are the class docstring's shape of
    p = (t - w) / (T - w), computed here in plain Python (the host's cos and pow), bit for bit; lr_at reads
    them too."""
    schedule = WarmupSchedule(total_steps=100_003, end_lr=1e-4, **config)
    w, total = schedule.warmup_steps, schedule.total_steps
    row = schedule.row()
    assert row.dtype == torch.float64 and row.device.type == "cpu"
    factors = row[len(row) - (total - w + 1) :].tolist()
    assert factors == [factor((t - w) / (total - w), t) for t in range(w, total + 1)]
    for t in (w, w + 1, total // 2, total):
        assert schedule.lr_at(t, 0.4) == 1e-4 + (0.4 - 1e-4) * factors[t - w]


def test_a_device_row_is_built_without_a_python_list_of_its_steps() -> None:
    """A capturable optimizer's WarmupLR builds its row of 8 bytes a step: its peak Python allocations for
    10^6 steps stay under 12 bytes a step (a list of floats takes 32)."""
    steps = 1_000_000
    optimizer = FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, capturable=True)
    tracemalloc.start()
    try:
        WarmupLR(optimizer, total_steps=steps, warmup_steps=10, decay="cosine")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * steps, peak
    assert optimizer.lr_tensor().item() == 0.0  # f(0) of a warmup from 0


def test_a_device_row_longer_than_its_bound_is_refused_naming_the_ways_out() -> None:
    long = dict(total_steps=DEVICE_ROW_STEPS + 5, warmup_steps=5)
    optimizer = FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, capturable=True)
    lrs = optimizer.lr_tensor().clone()
    for decay in ("cosine", "poly", "linear"):
        with pytest.raises(
            ValueError,
            match=rf"decay='{decay}'.*each of its {DEVICE_ROW_STEPS + 1} steps.*"
            r"capturable=False.*'multistep' or 'constant'.*shorter total_steps",
        ):
            WarmupLR(optimizer, decay=decay, **long)
        assert torch.equal(optimizer.lr_tensor(), lrs) and "initial_lr" not in optimizer.param_groups[0]
    # The host schedule of the same run, and a device schedule whose row holds no step's factor, are made.
    host = FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert WarmupLR(host, **long).get_last_lr() == [0.0]
    WarmupLR(optimizer, decay="multistep", milestones=(DEVICE_ROW_STEPS,), **long)
    assert optimizer.lr_tensor().item() == 0.0


# A key left out of a scheduler state.
_ABSENT = object()


@pytest.mark.parametrize("capturable", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("last_epoch", _ABSENT, " has no last_epoch, the steps taken"),
        (
            "last_epoch",
            torch.tensor([1, 2]),
            r"'s last_epoch is tensor\(\[1, 2\]\), but it is a count of steps",
        ),
        ("last_epoch", -5, "'s last_epoch is -5, but it is a count of steps, an int >= 0"),
        ("last_epoch", 2.5, "'s last_epoch is 2.5, but it is a count of steps"),
        ("skipped_steps", -2, "'s skipped_steps is -2, but it is a count of steps"),
        ("skipped_steps", "1", "'s skipped_steps is '1', but it is a count of steps"),
        (
            "base_lrs",
            [float("nan")],
            r"'s base_lrs is \[nan\], but it is each group's peak lr, a number >= 0",
        ),
        (
            "schedule",
            {"total_steps": 0},
            r"'s schedule is no WarmupSchedule \(total_steps must be an integer >= 1",
        ),
    ],
)
def test_a_scheduler_state_of_another_kind_is_refused_and_changes_nothing(capturable, key, value, problem):
    """Refused before anything changes (a negative count set a negative lr, a count of two steps failed
    naming nothing, a state without its steps started the schedule again); the run goes on as f(step) says.
    Oracle: lr_at."""
    schedule = dict(total_steps=20, warmup_steps=5, start_factor=0.1)
    optimizer = FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.4, capturable=capturable)
    scheduler = WarmupLR(optimizer, **schedule)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    broken = {k: v for k, v in {**saved, key: value}.items() if v is not _ABSENT}
    with pytest.raises(ValueError, match=rf"the lr scheduler checkpoint{problem}.*scheduler.state_dict\(\)"):
        scheduler.load_state_dict(broken)
    assert scheduler.state_dict() == saved
    for step in (3, 4):
        assert float(optimizer.param_groups[0]["lr"]) == WarmupSchedule(**schedule).lr_at(step, 0.4)
        optimizer.step()
        scheduler.step()
