"""Capturable steps: FusedSGD(capturable=True) reads its lrs on the params' device and WarmupLR runs its
schedule there (a device step counter). Oracles: WarmupSchedule.lr_at in float64 (itself checked against
hand-computed values in test_schedules), torch.optim.SGD given those lrs on the host, and the host-schedule
run of the same loop. The CUDA graph cases run where a GPU is present."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD, WarmupLR
from lightning_fusedsgd.schedule import WarmupSchedule

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCHEDULES = {
    "cosine": dict(total_steps=12, warmup_steps=3, start_factor=0.1, decay="cosine", end_lr=1e-3),
    "poly": dict(total_steps=12, warmup_steps=3, start_factor=0.0, decay="poly", power=2.0, end_lr=1e-4),
    "linear": dict(total_steps=12, warmup_steps=0, decay="linear"),
    "multistep": dict(total_steps=12, warmup_steps=2, start_factor=0.5, decay="multistep", milestones=(5, 9)),
    "constant": dict(total_steps=12, warmup_steps=4, start_factor=0.25, decay="constant"),
}
PEAKS = (0.4, 0.1)


def _model(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(device)


def _groups(model: nn.Module) -> list[dict]:
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights, "lr": PEAKS[0]}, {"params": biases, "lr": PEAKS[1], "weight_decay": 0.0}]


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=generator).to(device), torch.randn(8, 3, generator=generator).to(
        device
    )


def _loss(model: nn.Module, step: int, device: torch.device) -> torch.Tensor:
    data, target = _batch(step, device)
    return nn.functional.mse_loss(model(data), target)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_device_schedule_gives_the_host_schedules_lrs(name, backend, device):
    """Every step's lrs, read from the device, are WarmupSchedule.lr_at's doubles bit for bit, on CUDA too
    (the row carries the host's cos and pow: CUDA's differ in the last bits). Past the end they hold f(T).
    The reference backend runs the same schedule (reading the position on the host)."""
    schedule = WarmupSchedule(**SCHEDULES[name])
    model = _model(device)
    optimizer = FusedSGD(_groups(model), momentum=0.9, capturable=True, backend=backend)
    scheduler = WarmupLR(optimizer, **SCHEDULES[name])
    for step in range(schedule.total_steps + 3):
        expected = torch.tensor([schedule.lr_at(step, peak) for peak in PEAKS], dtype=torch.float64)
        got = optimizer.lr_tensor().cpu()
        assert torch.equal(got, expected), (step, got.tolist(), expected.tolist())
        optimizer.zero_grad()
        _loss(model, step, device).backward()
        optimizer.step()
        scheduler.step()
    assert scheduler.last_epoch == schedule.total_steps + 3 and scheduler.skipped_steps == 0
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.parametrize("nesterov", [False, True])
def test_capturable_training_matches_torch_sgd_given_the_host_lrs(nesterov, device):
    """FusedSGD(capturable) with the device schedule against torch.optim.SGD whose group lrs are set on the
    host from WarmupSchedule.lr_at before each step: the same weights and buffers to rounding."""
    config = SCHEDULES["cosine"]
    schedule = WarmupSchedule(**config)
    ours, theirs = _model(device), _model(device)
    hparams = dict(momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    optimizer = FusedSGD(_groups(ours), capturable=True, **hparams)
    scheduler = WarmupLR(optimizer, **config)
    oracle = torch.optim.SGD(_groups(theirs), **hparams)
    for step in range(10):
        for group, peak in zip(oracle.param_groups, PEAKS):
            group["lr"] = schedule.lr_at(step, peak)
        for model, opt in ((ours, optimizer), (theirs, oracle)):
            opt.zero_grad()
            _loss(model, step, device).backward()
            opt.step()
        scheduler.step()
    assert optimizer.last_backends and set(optimizer.last_backends.values()) <= {
        "compiled",
        "compiled (kept plan)",
    }
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], oracle.state[q]["momentum_buffer"])


def _scaled_loop(device, capturable, steps, overflow, lars=False, state=None, stop=None):
    """An AMP loop (GradScaler, an inf loss at the ``overflow`` iterations): the lrs each iteration ran with,
    the weights, and (with ``stop``) the states saved after iteration ``stop``. With ``state``, resumes
    from it after iteration ``stop``."""
    model = _model(device)
    make = FusedLARS if lars else FusedSGD
    optimizer = make(_groups(model), momentum=0.9, weight_decay=1e-4, capturable=capturable)
    scheduler = WarmupLR(optimizer, **SCHEDULES["poly"])
    scaler = torch.amp.GradScaler(device.type, init_scale=256.0)
    first = 0
    if state is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), state[0]):
                p.copy_(saved)
        for target, saved in zip((optimizer, scheduler, scaler), state[1:]):
            target.load_state_dict(saved)
        first = stop + 1
    lrs, saved = [], None
    for step in range(first, steps):
        optimizer.zero_grad()
        loss = _loss(model, step, device) * (math.inf if step in overflow else 1.0)
        scaler.scale(loss).backward()
        lrs.append([float(group["lr"]) for group in optimizer.param_groups])
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step == stop:
            saved = [[p.detach().clone() for p in model.parameters()]] + [
                _round_trip(x.state_dict()) for x in (optimizer, scheduler, scaler)
            ]
    return lrs, [p.detach().clone() for p in model.parameters()], saved


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("lars", [False, True], ids=["sgd", "lars"])
def test_skipped_steps_hold_the_device_schedule_as_the_host_one_does(lars, device):
    """Steps a GradScaler skips do not advance the device counter: the lrs of every iteration, the weights
    and the counts equal the host-schedule run's (WarmupLR reading last_step_applied on the host), and the
    applied steps ran with f(0), f(1), ..."""
    overflow = {1, 4, 5}
    lrs, weights, saved = _scaled_loop(device, True, 10, overflow, lars=lars, stop=9)
    host_lrs, host_weights, host_saved = _scaled_loop(device, False, 10, overflow, lars=lars, stop=9)
    assert lrs == host_lrs
    for w, v in zip(weights, host_weights):
        assert torch.equal(w, v)
    assert (saved[2]["last_epoch"], saved[2]["skipped_steps"]) == (7, 3)
    assert (host_saved[2]["last_epoch"], host_saved[2]["skipped_steps"]) == (7, 3)
    applied = [lr[0] for step, lr in enumerate(lrs) if step not in overflow]
    schedule = WarmupSchedule(**SCHEDULES["poly"])
    assert applied == [schedule.lr_at(t, PEAKS[0]) for t in range(len(applied))]


@pytest.mark.parametrize(
    ("saved_capturable", "resumed_capturable"),
    [(True, True), (True, False), (False, True)],
    ids=["device-to-device", "device-to-host", "host-to-device"],
)
def test_resume_across_a_skip_continues_the_uninterrupted_run(saved_capturable, resumed_capturable, device):
    """A checkpoint taken mid-run (after a skipped step) restores the device counter and the lrs: the resumed
    run's lrs and weights equal the uninterrupted run's, in both directions between the device and host
    schedules (the checkpoint format is the same)."""
    overflow = {3, 4}
    lrs, weights, saved = _scaled_loop(device, saved_capturable, 10, overflow, stop=4)
    assert all(
        isinstance(group[key], float) for group in saved[1]["param_groups"] for key in ("lr", "initial_lr")
    )
    assert (saved[2]["last_epoch"], saved[2]["skipped_steps"]) == (3, 2)
    resumed_lrs, resumed_weights, _ = _scaled_loop(
        device, resumed_capturable, 10, overflow, state=saved, stop=4
    )
    assert resumed_lrs == lrs[5:]
    for w, v in zip(resumed_weights, weights):
        assert torch.equal(w, v)


def test_an_lr_assigned_as_a_number_is_taken_into_the_device_lrs():
    model = _model(torch.device("cpu"))
    optimizer = FusedSGD(_groups(model), capturable=True)
    storage = optimizer.lr_tensor()
    optimizer.param_groups[1]["lr"] = 0.025  # as a torch.optim user would
    optimizer.param_groups[0]["lr"].fill_(0.3)  # in place: no sync on CUDA
    oracle_model = _model(torch.device("cpu"))
    oracle = torch.optim.SGD(
        [{"params": g["params"], "lr": lr} for g, lr in zip(_groups(oracle_model), (0.3, 0.025))]
    )
    for model_, opt in ((model, optimizer), (oracle_model, oracle)):
        _loss(model_, 0, torch.device("cpu")).backward()
        opt.step()
    for p, q in zip(model.parameters(), oracle_model.parameters()):
        torch.testing.assert_close(p, q)
    assert optimizer.lr_tensor() is storage and storage.tolist() == [0.3, 0.025]
    assert optimizer.param_groups[1]["lr"].data_ptr() == storage[1].data_ptr()


def test_capturable_errors_name_the_fix():
    model = _model(torch.device("cpu"))
    on_meta = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        FusedSGD([{"params": list(model.parameters())}, {"params": [on_meta]}], capturable=True)
    with pytest.raises(RuntimeError, match="capturable=True"):
        FusedSGD(model.parameters()).lr_tensor()
    optimizer = FusedSGD(_groups(model), capturable=True)
    scheduler = WarmupLR(optimizer, total_steps=5)
    with pytest.raises(ValueError, match="without an epoch"):
        scheduler.step(3)
    lrs = optimizer.lr_tensor().tolist()
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.5})
    assert optimizer.lr_tensor().tolist() == [*lrs, 0.5]  # the lrs move to a larger tensor, kept
    with pytest.raises(ValueError, match="after adding every parameter group"):
        scheduler.step()
    assert scheduler.last_epoch == 0  # nothing advanced
    # A group on another device is refused before it is added: the optimizer still steps.
    groups, lrs = len(optimizer.param_groups), optimizer.lr_tensor().tolist()
    with pytest.raises(ValueError, match="one optimizer per device"):
        optimizer.add_param_group({"params": [on_meta]})
    assert len(optimizer.param_groups) == groups and optimizer.lr_tensor().tolist() == lrs
    _loss(model, 0, torch.device("cpu")).backward()
    optimizer.step()


def test_a_copied_capturable_optimizer_binds_its_own_lrs():
    import copy

    model = _model(torch.device("cpu"))
    optimizer = FusedSGD(_groups(model), momentum=0.9, capturable=True)
    clone = copy.deepcopy(optimizer)
    assert clone.capturable and clone.lr_tensor().tolist() == list(PEAKS)
    assert clone.lr_tensor().data_ptr() != optimizer.lr_tensor().data_ptr()
    clone.param_groups[0]["lr"].fill_(0.0)
    assert optimizer.lr_tensor().tolist() == list(PEAKS)


@needs_cuda
def test_cuda_eager_capturable_steps_do_not_synchronize():
    """After the first step, a capturable step and its scheduler step under a GradScaler read nothing back."""
    device = torch.device("cuda")
    model = _model(device)
    optimizer = FusedLARS(_groups(model), momentum=0.9, weight_decay=1e-4, capturable=True)
    scheduler = WarmupLR(optimizer, **SCHEDULES["cosine"])
    scaler = torch.amp.GradScaler("cuda")
    for step in range(4):
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(_loss(model, step, device)).backward()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            scaler.step(optimizer)
            scheduler.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        scaler.update()


def _resnet18_training(capture: bool, steps: int, warmup: int = 3) -> list[torch.Tensor]:
    """A ResNet-18 training step (channels_last, fp16 autocast, GradScaler, FusedLARS capturable, WarmupLR on
    the device): ``warmup`` eager steps, then ``steps`` more, eager or as replays of one captured step."""
    import torchvision

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torchvision.models.resnet18(num_classes=10).to(device, memory_format=torch.channels_last)
    optimizer = FusedLARS(model.parameters(), lr=1.0, momentum=0.9, weight_decay=5e-5, capturable=True)
    scheduler = WarmupLR(optimizer, total_steps=warmup + steps, warmup_steps=2, decay="poly", end_lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (
            torch.randn(16, 3, 32, 32, device=device, generator=generator),
            torch.randint(0, 10, (16,), device=device),
        )
        for _ in range(warmup + steps)
    ]
    images = torch.empty_like(batches[0][0]).to(memory_format=torch.channels_last)
    labels = torch.empty_like(batches[0][1])

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for data, target in batches[:warmup]:
            images.copy_(data)
            labels.copy_(target)
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    if not capture:
        for data, target in batches[warmup:]:
            images.copy_(data)
            labels.copy_(target)
            train_step()
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            train_step()
        for data, target in batches[warmup:]:
            images.copy_(data)
            labels.copy_(target)
            torch.cuda.set_sync_debug_mode("error")
            try:
                graph.replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert scheduler.last_epoch + scheduler.skipped_steps == warmup + steps
    return [p.detach().clone() for p in model.parameters()]


@needs_cuda
def test_cuda_graph_replays_of_a_resnet18_step_equal_eager_steps():
    """One captured training step replayed N times equals N eager steps (same data, deterministic kernels),
    with no sync during the replays."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    eager = _resnet18_training(capture=False, steps=6)
    replayed = _resnet18_training(capture=True, steps=6)
    for p, q in zip(replayed, eager):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_lightning_fit_and_resume_with_capturable_equal_the_host_schedule(tmp_path):
    """configure_fused_sgd(capturable=True) under Lightning's 16-mixed GradScaler: a fit equals the same fit
    with the host schedule (weights bit for bit, the schedule position); and resuming its checkpoint with
    the device schedule continues as resuming it with the host one does (Lightning's own resume is tested
    in test_resume)."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning_helpers import TinyClassifier, cpu_trainer

    from lightning_fusedsgd.lightning import Schedule

    def fit(capturable, max_steps, ckpt_path=None, save=None):
        torch.manual_seed(0)
        schedule = Schedule(decay="multistep", warmup=2, milestones=[6], unit="step")
        module = TinyClassifier(lr=0.5, schedule=schedule, capturable=capturable)
        trainer = cpu_trainer(max_steps=max_steps, plugins=[MixedPrecision("16-mixed", "cpu")])
        trainer.fit(module, ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        return [p.detach().clone() for p in module.parameters()], scheduler, trainer.optimizers[0]

    weights, scheduler, optimizer = fit(True, 5, save=tmp_path / "five.ckpt")
    host_weights, host_scheduler, _ = fit(False, 5)
    assert optimizer.capturable and scheduler.device_position is not None
    assert host_scheduler.device_position is None
    for w, v in zip(weights, host_weights):
        assert torch.equal(w, v)
    assert (scheduler.last_epoch, scheduler.skipped_steps) == (
        host_scheduler.last_epoch,
        host_scheduler.skipped_steps,
    )
    resumed, resumed_scheduler, _ = fit(True, 8, ckpt_path=tmp_path / "five.ckpt")
    host_resumed, host_resumed_scheduler, _ = fit(False, 8, ckpt_path=tmp_path / "five.ckpt")
    for w, v in zip(resumed, host_resumed):
        assert torch.equal(w, v)
    assert resumed_scheduler.last_epoch == host_resumed_scheduler.last_epoch == 8
