"""FusedSGDScheduleFree against schedulefree.SGDScheduleFree, the peer it replaces: the same trajectories
bit for bit (fp32 and float64, 16-bit params on their fp32 masters against the peer in fp32), the same
train/eval switches, state dicts that cross both ways, and what the peer has not (GradScaler skips, clipping
in the step), against the peer fed what those give it."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from helpers import clone_params, make_params, set_grads
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedSGDScheduleFree, ops
from lightning_fusedsgd._abi import SCHEDULE_FREE_SCALARS, StepRow, table
from lightning_fusedsgd.ops import reference

schedulefree = pytest.importorskip("schedulefree")

STEPS = 120
# Two groups with their own lr and decay, warmup, r > 0: every scalar of the peer's step matters.
HPARAMS = dict(lr=0.5, weight_decay=1e-3, warmup_steps=10, r=1.0, weight_lr_power=2.0)
# float64 on CUDA against the peer there: within this much of each tensor's largest value, not bit for bit
# (measured on an H200: up to 47 ulps of an element). docs/design.md, "Values computed on the device".
CUDA_FLOAT64_REL = 1e-14


def _groups(params, second=None):
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.2, "weight_decay": 5e-3, **(second or {})}]


def _pair(params, momentum, backend="auto", **options):
    """Ours over ``params`` and the peer over copies of them, both in train mode."""
    copies = clone_params(params)
    ours = FusedSGDScheduleFree(_groups(params), momentum=momentum, backend=backend, **HPARAMS, **options)
    peer = schedulefree.SGDScheduleFree(_groups(copies), momentum=momentum, **HPARAMS)
    ours.train()
    peer.train()
    return ours, peer, copies


def _assert_same(ours, peer, params, copies, weights=None, rel=0.0):
    """y (or x) and z bit for bit, or within ``rel`` of each tensor's largest value; ``weights``: where ours
    keeps its weights (its fp32 masters)."""

    def same(a, b):
        return torch.equal(a, b) if rel == 0.0 else bool((a - b).abs().max() <= rel * b.abs().max())

    for p, q in zip(params, copies):
        weight = p.detach() if weights is None else ours.state[p][weights]
        assert same(weight, q.detach())
        if "z" in peer.state[q]:
            assert same(ours.state[p]["z"], peer.state[q]["z"])
        else:
            assert "z" not in ours.state[p]


@pytest.mark.parametrize("momentum", [0.9, 0.5])  # 1 - 1/beta inside and outside lerp's |w| < 0.5 branch
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_steps_and_switches_are_schedulefrees_bit_for_bit(backend, dtype, momentum, device):
    """120 steps, params without grads on some steps (and one step without any), an eval/train round trip
    every 40 steps as a validation makes: y, z, x and every group scalar equal the peer's (on CUDA: float64
    weights within CUDA_FLOAT64_REL, weight_sum within 4e-15, test_device_claims' tolerance of CUDA's pow)."""
    rel = CUDA_FLOAT64_REL if device.type == "cuda" and dtype == torch.float64 else 0.0
    params = make_params(dtype=dtype, device=device)
    ours, peer, copies = _pair(params, momentum, backend)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads([params, copies], step, generator)
        if step == 50:
            for p in (*params, *copies):
                p.grad = None  # the peer advances its scalars all the same
        ours.step()
        peer.step()
        if step % 40 == 39:
            ours.eval()
            peer.eval()
            _assert_same(ours, peer, params, copies, rel=rel)  # x
            ours.train()
            peer.train()
    _assert_same(ours, peer, params, copies, rel=rel)
    saved = ours.state_dict()["param_groups"]
    for group, theirs in zip(saved, peer.param_groups):
        for key in ("k", "lr_max", "weight_sum", "scheduled_lr", "train_mode"):
            assert type(group[key]) is type(theirs[key]), key
            if device.type == "cuda" and key == "weight_sum":
                assert group[key] == pytest.approx(theirs[key], rel=4e-15, abs=0.0)
            else:
                assert group[key] == theirs[key], key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_params_step_on_fp32_masters_as_schedulefree_in_fp32(dtype):
    """The masters and z are the peer's fp32 params and z (its grads: ours, widened); the params hold their
    rounding; a plan kept across steps gives the same."""
    params = make_params(dtype=dtype)
    ours = FusedSGDScheduleFree(_groups(params), master_weights=True, **HPARAMS)
    copies = [nn.Parameter(p.detach().float()) for p in params]
    peer = schedulefree.SGDScheduleFree(_groups(copies), **HPARAMS)
    ours.train()
    peer.train()
    generator = torch.Generator().manual_seed(2)
    for _ in range(30):
        for p, q in zip(params, copies):
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))  # a kept layout
            q.grad = p.grad.float()
        ours.step()
        peer.step()
    assert ours.last_backends == {f"cpu/{str(dtype)[6:]} + master_param": "compiled (kept plan)"}
    _assert_same(ours, peer, params, copies, weights="master_param")
    assert all(torch.equal(p, q.to(dtype)) for p, q in zip(params, copies))
    ours.eval()
    peer.eval()
    _assert_same(ours, peer, params, copies, weights="master_param")
    assert all(torch.equal(p, q.to(dtype)) for p, q in zip(params, copies))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_bf16_without_masters_backends_agree(rounding):
    """Where the peer has no counterpart (bf16 params rounded once per step, not per foreach op): the kernel
    against the reference, bit for bit, z stored as SGD's momentum buffer is (stochastic: with the low 16
    random bits; Kahan: to nearest)."""
    params = make_params(dtype=torch.bfloat16)
    copies = clone_params(params)
    options = dict(update_rounding=rounding, rounding_seed=7, **HPARAMS)
    compiled = FusedSGDScheduleFree(_groups(params), **options)
    reference = FusedSGDScheduleFree(_groups(copies), backend="reference", **options)
    for optimizer in (compiled, reference):
        optimizer.train()
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        set_grads([params, copies], step, generator)
        compiled.step()
        reference.step()
    compiled.eval()
    reference.eval()
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        assert compiled.state[p].keys() == reference.state[q].keys()
        for key, value in compiled.state[p].items():
            assert torch.equal(value, reference.state[q][key]), key


def _trained(params, kind):
    """Ten steps of ours or of the peer over ``params``, in train mode."""
    cls = FusedSGDScheduleFree if kind == "ours" else schedulefree.SGDScheduleFree
    optimizer = cls(_groups(params), **HPARAMS)
    optimizer.train()
    generator = torch.Generator().manual_seed(4)
    for _ in range(10):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("saved_by", ["peer", "ours"])
def test_state_dicts_cross_with_schedulefree(saved_by):
    """A state dict saved by either loads into both, which continue bit for bit (z, the scalars as numbers of
    the peer's types, the mode)."""
    params = make_params()
    saved = _trained(params, saved_by).state_dict()
    assert type(saved["param_groups"][0]["k"]) is int and type(saved["param_groups"][0]["lr_max"]) is float
    ours_params, peer_params = clone_params(params), clone_params(params)
    ours = FusedSGDScheduleFree(_groups(ours_params), **HPARAMS)
    peer = schedulefree.SGDScheduleFree(_groups(peer_params), **HPARAMS)
    ours.load_state_dict(copy.deepcopy(saved))  # torch's loader keeps the tensors it is given
    peer.load_state_dict(copy.deepcopy(saved))
    generator = torch.Generator().manual_seed(5)
    for _ in range(10):
        for p, q in zip(ours_params, peer_params):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        ours.step()
        peer.step()
    _assert_same(ours, peer, ours_params, peer_params)


def test_a_skipped_step_changes_nothing_and_an_applied_one_unscales():
    """Under a GradScaler: a step with found_inf leaves y, z and every scalar as they were (the peer never
    sees it); an applied one unscales in the kernel (scale 2^10: exact), as the peer stepping the unscaled
    grads."""
    params = make_params()
    ours, peer, copies = _pair(params, 0.9)
    generator = torch.Generator().manual_seed(6)
    for step in range(6):
        set_grads([params, copies], step, generator)
        skipped = step in (0, 3)
        ours.grad_scale = torch.tensor(1024.0)
        ours.found_inf = torch.tensor(1.0 if skipped else 0.0)
        for p in params:
            if p.grad is not None:
                p.grad *= 1024.0
        before = [p.detach().clone() for p in params], copy.deepcopy(ours.state_dict())
        ours.step()
        assert bool(ours.last_step_applied) is not skipped
        if skipped:
            assert all(torch.equal(p, w) for p, w in zip(params, before[0]))
            assert ours.state_dict()["param_groups"] == before[1]["param_groups"]
            assert [sorted(s) for s in ours.state_dict()["state"].values()] == [
                sorted(s) for s in before[1]["state"].values()
            ]
            continue
        peer.step()
    _assert_same(ours, peer, params, copies)


@pytest.mark.parametrize("clip", [dict(max_grad_value=0.5), dict(max_grad_norm=2.0)], ids=["value", "norm"])
def test_clipping_in_the_step_is_torchs_clip_then_schedulefree(clip):
    """By value: bit for bit (a clamp rounds nothing). By norm: to fp32 rounding, the global norm summed in
    another order than clip_grad_norm_'s."""
    params = make_params()
    ours, peer, copies = _pair(params, 0.9, **clip)
    generator = torch.Generator().manual_seed(7)
    for step in range(20):
        set_grads([params, copies], step, generator)
        ours.step()
        with_grads = [q for q in copies if q.grad is not None]
        if "max_grad_value" in clip:
            torch.nn.utils.clip_grad_value_(with_grads, clip["max_grad_value"])
        else:
            torch.nn.utils.clip_grad_norm_(with_grads, clip["max_grad_norm"])
        peer.step()
    if "max_grad_value" in clip:
        _assert_same(ours, peer, params, copies)
    else:
        assert_close_rel(params, copies, 2e-6)
        assert_close_rel([ours.state[p]["z"] for p in params], [peer.state[q]["z"] for q in copies], 2e-6)


def test_capturable_steps_read_the_lrs_and_the_scalars_on_the_device():
    """capturable=True: the lrs a view of one device tensor, the scalars always one; the same bits as a plain
    step, an lr set on the group (a scheduler) taking effect at the next step."""
    params = make_params()
    ours, peer, copies = _pair(params, 0.9, capturable=True)
    generator = torch.Generator().manual_seed(8)
    for step in range(20):
        set_grads([params, copies], step, generator)
        if step == 10:
            ours.param_groups[1]["lr"] = peer.param_groups[1]["lr"] = 0.3
        ours.step()
        peer.step()
    _assert_same(ours, peer, params, copies)
    scalars = ours._scalars.tensor
    assert scalars.shape == (len(SCHEDULE_FREE_SCALARS), 2) and scalars.dtype == torch.float64
    for g, group in enumerate(ours.param_groups):
        assert group["k"].data_ptr() == scalars[0, g].data_ptr()  # a view, which the op advances in place
        assert group["lr"].data_ptr() == ours.lr_tensor()[g].data_ptr()


def test_a_group_added_mid_run_follows_the_peer():
    """Its scalars start at the peer's initial values and join the device tensor; it switches to train with
    its own train()."""
    params = make_params()
    copies = clone_params(params)
    ours = FusedSGDScheduleFree(_groups(params[:4]), **HPARAMS)
    peer = schedulefree.SGDScheduleFree(_groups(copies[:4]), **HPARAMS)
    generator = torch.Generator().manual_seed(9)
    for step in range(12):
        if step == 5:
            ours.add_param_group({"params": params[4:], "lr": 0.05})
            peer.add_param_group({"params": copies[4:], "lr": 0.05})
        ours.train()
        peer.train()
        set_grads([params, copies], step, generator)
        ours.step()
        peer.step()
    _assert_same(ours, peer, params, copies)


def test_every_argument_of_the_peer_has_its_default():
    """A drop-in: the peer's arguments, each with the peer's default (so a group dict, and a state dict's
    param_groups, hold what the peer's would)."""
    ours = inspect.signature(FusedSGDScheduleFree).parameters
    for name, parameter in inspect.signature(schedulefree.SGDScheduleFree).parameters.items():
        assert name in ours and ours[name].default == parameter.default, name


def _scalars_op_run(library):
    """Ten calls of a library's schedule_free_scalars on two groups (lrs from the table, then from the row; a
    skipped step at 4): each call's scalars."""
    groups = [
        FusedSGDScheduleFree([nn.Parameter(torch.zeros(1))], **HPARAMS).defaults,
        FusedSGDScheduleFree([nn.Parameter(torch.zeros(1))], lr=0.3, r=0.5).defaults,
    ]
    hparams = table(groups, lr_on_device=False)
    scalars = torch.zeros(len(SCHEDULE_FREE_SCALARS), 2, dtype=torch.float64)
    scalars[SCHEDULE_FREE_SCALARS.index("lr_max")] = -1.0
    history = []
    for step in range(10):
        values = {"found_inf": torch.tensor(float(step == 4))}
        if step >= 6:
            values["lrs"] = torch.tensor([0.1, 0.2], dtype=torch.float64)
        library.schedule_free_scalars(scalars, hparams, StepRow(values).on(torch.device("cpu")))
        history.append(scalars.clone())
    return history


def test_the_scalars_op_of_the_kernel_is_the_references_and_skips():
    compiled, expected = _scalars_op_run(ops.load("cpu")), _scalars_op_run(reference)
    assert all(torch.equal(a, e) for a, e in zip(compiled, expected))
    assert torch.equal(expected[4], expected[3])  # skipped
    k, scheduled = SCHEDULE_FREE_SCALARS.index("k"), SCHEDULE_FREE_SCALARS.index("scheduled_lr")
    assert expected[-1][k].tolist() == [9.0, 9.0]
    assert expected[-1][scheduled].tolist() == [0.1 * (9 / 10), 0.2]  # the first group's warmup: 10 steps


def _named_run(groups_of, steps, saved=None):
    """Ours over named params grouped by ``groups_of(named)``, ``saved`` loaded first (weights and optimizer
    state, saved in eval mode as checkpoints are), then the ``steps`` (a range) of one sequence of grads; an
    eval/train round trip after step 4, as a checkpoint written there makes."""
    named = list(zip("abcde", make_params()))
    optimizer = FusedSGDScheduleFree(groups_of(named), **HPARAMS)
    if saved is not None:
        optimizer.load_state_dict(copy.deepcopy(saved))
        for name, p in named:
            p.data.copy_(saved["weights"][name])
    optimizer.train()
    generator = torch.Generator().manual_seed(10)
    grads = [[torch.randn(p.shape, generator=generator) for _, p in named] for _ in range(8)]
    for step in steps:
        for (_, p), grad in zip(named, grads[step]):
            p.grad = grad.clone()
        optimizer.step()
        if step == 3:
            optimizer.eval()
            optimizer.train()
    optimizer.eval()
    return optimizer, [p for _, p in named]


def _two_groups(named):
    return [{"params": named[:3]}, {"params": named[3:], "lr": 0.2}]


def test_a_load_regrouped_by_name_carries_z_and_each_groups_scalars():
    """The same groups in the other order: a regrouped load (remapped by name) whose z follow their params and
    whose scalars follow their groups, continuing bit for bit as the run it was saved from."""
    straight, expected = _named_run(_two_groups, range(8))
    first, params = _named_run(_two_groups, range(4))
    saved = {**first.state_dict(), "weights": dict(zip("abcde", (p.detach().clone() for p in params)))}
    resumed, actual = _named_run(lambda named: _two_groups(named)[::-1], range(4, 8), saved)
    _assert_same(resumed, straight, actual, expected)
    assert [g["k"] for g in resumed.state_dict()["param_groups"]] == [8, 8]


def test_a_load_regrouped_across_groups_of_different_scalars_is_refused():
    from lightning_fusedsgd.checkpoint import CheckpointMismatchError

    first, _ = _named_run(_two_groups, range(4))
    target, _ = _named_run(lambda named: [{"params": named}], range(0))
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(
        CheckpointMismatchError, match=r"different weight_sum .*group them as the checkpoint did"
    ):
        target.load_state_dict(first.state_dict())
    assert target.state_dict() == before


def test_a_start_from_an_fp32_run_keeps_its_z_and_seeds_the_masters_from_its_weights(tmp_path):
    """A bf16 run with fp32 masters started from an fp32 schedule-free checkpoint (InitFromCheckpoint's path):
    z as saved, the masters the checkpoint's fp32 weights (not the bf16 params' values)."""
    from lightning_fusedsgd.checkpoint import (
        load_optimizer_state,
        read_start_checkpoint,
        seed_state_from_weights,
    )

    fp32 = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    optimizer = FusedSGDScheduleFree(fp32.named_parameters(), **HPARAMS)
    optimizer.train()
    for _ in range(3):
        for p in fp32.parameters():
            p.grad = torch.randn(p.shape)
        optimizer.step()
    optimizer.eval()
    saved = {
        "pytorch-lightning_version": "2.6",
        "state_dict": fp32.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }
    torch.save(saved, tmp_path / "run.ckpt")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    started = FusedSGDScheduleFree(bf16.named_parameters(), master_weights=True, **HPARAMS)
    state = read_start_checkpoint(tmp_path / "run.ckpt", bf16)
    load_optimizer_state(started, state.optimizer_state, module=bf16, source=state.path)
    bf16.load_state_dict(state.model_state)
    seed_state_from_weights(started, bf16, state.model_state)
    for (name, p), q in zip(bf16.named_parameters(), fp32.parameters()):
        assert started.state[p]["z"].dtype == torch.float32
        assert torch.equal(started.state[p]["z"], optimizer.state[q]["z"]), name
        assert torch.equal(started.state[p]["master_param"], q.detach()), name
    assert started.state_dict()["param_groups"][0]["k"] == 3


def test_a_switch_keeps_its_plan_while_params_and_state_are_the_same(monkeypatch):
    """Switches plan once while nothing changed; a z replaced (a loaded state) is planned anew and switched
    with: the compiled kernel's weights equal the reference backend's."""
    from lightning_fusedsgd.optim import _step

    plans = []
    planned = _step.plan_switch
    monkeypatch.setattr(_step, "plan_switch", lambda *args: plans.append(1) or planned(*args))
    runs = []
    for backend in ("compiled", "reference"):
        params = make_params()
        optimizer = FusedSGDScheduleFree(_groups(params), backend=backend, **HPARAMS)
        optimizer.train()
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        optimizer.step()
        plans.clear()
        for _ in range(3):
            optimizer.eval()
            optimizer.train()
        assert len(plans) == 1
        optimizer.state[params[1]]["z"] = optimizer.state[params[1]]["z"] * 2
        optimizer.eval()
        assert len(plans) == 2
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))
