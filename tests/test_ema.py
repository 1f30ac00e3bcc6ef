"""The average of the weights kept in the step (``ema_decay``): against ``torch.optim.swa_utils``'
``get_ema_avg_fn`` and ``AveragedModel`` (the formula Lightning's EMAWeightAveraging applies) on the same
weights, under Lightning's schedule (``update_starting_at_step``, ``update_every_n_steps``), timm's warmup of
the decay, skipped steps, the swap into the params and back, and state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_params
from oracles import assert_close_rel
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from lightning_fusedsgd import FusedLARS, FusedSGD

SHAPES = [(8, 3, 3, 3), (8,), (33, 17), (70_000,)]


def _grads(params, generator):
    """Gradients laid out as their params (channels_last ones too), so that plans are kept."""
    for p in params:
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))


def _lightning_schedule(step: int, start: int, every: int) -> bool:
    """Whether Lightning's EMAWeightAveraging updates after the optimizer step of this 0-based index."""
    return step >= start and step % every == 0


def _oracle_run(optimizer, params, weights_of, decay, start, every, steps=9, seed=0):
    """Steps ``optimizer`` and keeps get_ema_avg_fn's average of ``weights_of(p)`` after each step Lightning's
    schedule updates (the first update copies), from the weights before the first step."""
    generator = torch.Generator().manual_seed(seed)
    average = [weights_of(p).detach().clone() for p in params]
    update, updates = get_ema_avg_fn(decay), 0
    for step in range(steps):
        _grads(params, generator)
        optimizer.step()
        if _lightning_schedule(step, start, every):
            for a, p in zip(average, params):
                a.copy_(
                    weights_of(p).detach() if updates == 0 else update(a, weights_of(p).detach(), updates)
                )
            updates += 1
    return average


OPTIONS = {
    "momentum": dict(momentum=0.9, weight_decay=1e-4),
    "nesterov-clip-norm": dict(momentum=0.9, nesterov=True, max_grad_norm=1.0),
    "lars": dict(momentum=0.9, weight_decay=1e-3, lars=True, trust_coefficient=0.02),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("options", list(OPTIONS), ids=str)
@pytest.mark.parametrize("start, every", [(0, 1), (3, 2)], ids=["every-step", "from-3-every-2"])
def test_the_average_is_get_ema_avg_fns_under_lightnings_schedule(dtype, backend, options, start, every):
    """Bit for bit: the kernel's average of each new weight equals get_ema_avg_fn's of the weights the step
    left, at the steps Lightning's schedule names, the first of which copies; a second group keeps none."""
    params = make_params(SHAPES, dtype=dtype)
    averaged, plain = params[:3], params[3:]
    optimizer = FusedSGD(
        [{"params": averaged, "ema_decay": 0.9, "ema_start": start, "ema_every": every}, {"params": plain}],
        lr=0.05,
        backend=backend,
        **OPTIONS[options],
    )
    expected = _oracle_run(optimizer, averaged, lambda p: p, 0.9, start, every)
    for p, e in zip(averaged, expected):
        assert optimizer.state[p]["ema"].dtype == dtype
        assert torch.equal(optimizer.state[p]["ema"], e)
        assert int(optimizer.state[p]["ema_step"]) == 9
    assert all("ema" not in optimizer.state[p] for p in plain)
    if backend == "compiled":
        assert set(optimizer.last_backends.values()) == {"compiled (kept plan)"}


def test_the_average_equals_averaged_models():
    """torch.optim.swa_utils.AveragedModel with get_ema_avg_fn (Lightning's EMAWeightAveraging), updated after
    every step of a model trained by FusedSGD, holds the optimizer's averages bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    averaged_model = AveragedModel(model, avg_fn=get_ema_avg_fn(0.95), use_buffers=False)
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, ema_decay=0.95)
    for _ in range(7):
        nn.functional.cross_entropy(model(torch.randn(32, 6)), torch.randint(0, 3, (32,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged_model.update_parameters(model)
    for p, a in zip(model.parameters(), averaged_model.module.parameters()):
        assert torch.equal(optimizer.state[p]["ema"], a.detach())


@pytest.mark.parametrize("rounding", ["master_weights", "nearest", "stochastic", "kahan"])
def test_16_bit_params_average_their_fp32_weight(rounding):
    """bf16 params keep an fp32 average of the step's fp32 result: with masters exactly get_ema_avg_fn's of
    the masters; otherwise the compiled kernel gives the reference's bits, within a bf16 rounding of the
    average of the params themselves."""
    options = dict(master_weights=True) if rounding == "master_weights" else dict(update_rounding=rounding)
    runs = {}
    for backend in ("compiled", "reference"):
        params = make_params(SHAPES, dtype=torch.bfloat16)
        optimizer = FusedSGD(params, lr=0.05, momentum=0.9, ema_decay=0.7, backend=backend, **options)
        state = optimizer.state
        expected = _oracle_run(
            optimizer, params, lambda p, s=state: s[p].get("master_param", p).float(), 0.7, 0, 1
        )
        runs[backend] = [optimizer.state[p]["ema"] for p in params]
        assert all(e.dtype == torch.float32 for e in runs[backend])
        if "master" in rounding:
            assert all(torch.equal(e, x) for e, x in zip(runs[backend], expected))
        else:
            assert_close_rel(runs[backend], expected, 2**-7)
    assert all(torch.equal(c, r) for c, r in zip(runs["compiled"], runs["reference"]))


def test_timms_warmup_of_the_decay():
    """With ema_warmup_gamma, the update after n updates uses timm's ModelEmaV3.get_decay(step) for the same
    update (its update_after_step 0, its step counting from 1): min(decay, 1 - (1 + n / gamma) ** -power)."""
    timm = pytest.importorskip("timm.utils.model_ema")
    params = make_params(SHAPES[:3])
    optimizer = FusedSGD(
        params, lr=0.05, momentum=0.9, ema_decay=0.99, ema_warmup_gamma=1.0, ema_warmup_power=0.75
    )
    timm_ema = timm.ModelEmaV3(
        nn.Linear(1, 1), decay=0.99, use_warmup=True, warmup_gamma=1.0, warmup_power=0.75
    )
    generator = torch.Generator().manual_seed(0)
    average = [p.detach().clone() for p in params]
    for step in range(1, 30):
        _grads(params, generator)
        optimizer.step()
        decay = timm_ema.get_decay(step)
        for a, p in zip(average, params):
            a.copy_(get_ema_avg_fn(decay)(a, p.detach(), step) if decay else p.detach())
    assert all(torch.equal(optimizer.state[p]["ema"], a) for p, a in zip(params, average))


def test_timms_lerp_differs_from_ours_by_rounding_only():
    """timm's ModelEmaV3 updates by lerp (``ema + (1 - decay) (w - ema)``), ours by get_ema_avg_fn's
    ``decay ema + (1 - decay) w``: the same average to within the float32 roundings of each update, which add
    up over the updates (measured: 3.9e-7 on weights of up to 0.11 after 199 updates, about 30 ulps)."""
    timm = pytest.importorskip("timm.utils.model_ema")
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    timm_ema = timm.ModelEmaV3(model, decay=0.999, foreach=True)
    optimizer = FusedSGD(model.parameters(), lr=0.05, momentum=0.9, ema_decay=0.999)
    for step in range(1, 200):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        timm_ema.update(model, step=step)
    for p, t in zip(model.parameters(), timm_ema.module.parameters()):
        ours = optimizer.state[p]["ema"]
        assert not torch.equal(ours, t)  # the formulas round differently
        assert (ours - t).abs().max() <= step * torch.finfo(torch.float32).eps * t.abs().max()


def test_a_skipped_step_leaves_the_average_and_its_counts_untouched():
    params = make_params(SHAPES)
    optimizer = FusedSGD(params, lr=0.05, momentum=0.9, ema_decay=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        _grads(params, generator)
        optimizer.step()
    before = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    optimizer.grad_scale, optimizer.found_inf = torch.tensor([8.0]), torch.tensor([1.0])
    _grads(params, generator)
    optimizer.step()
    assert not bool(optimizer.last_step_applied)
    for p in params:
        for key in ("ema", "ema_step", "ema_updates"):
            assert torch.equal(optimizer.state[p][key], before[p][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_averaged_weights_swaps_in_and_back_bit_for_bit(dtype):
    """Inside the context the params hold their averages (rounded to a bf16 param's dtype); after it the
    params and averages are bit for bit as before, and the next steps equal those of a run without it."""
    runs = []
    for swap in (False, True):
        params = make_params(SHAPES, dtype=dtype)
        optimizer = FusedLARS(params, lr=0.05, momentum=0.9, weight_decay=1e-3, ema_decay=0.8)
        generator = torch.Generator().manual_seed(0)
        for step in range(6):
            _grads(params, generator)
            optimizer.step()
            if swap and step == 3:
                state = {p: optimizer.state[p]["ema"].clone() for p in params}
                weights = [p.detach().clone() for p in params]
                with optimizer.averaged_weights():
                    for p in params:
                        assert torch.equal(p.detach(), state[p].to(dtype))
                assert all(
                    torch.equal(
                        p.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                        w.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                    )
                    for p, w in zip(params, weights)
                )
                assert all(torch.equal(optimizer.state[p]["ema"], state[p]) for p in params)
        runs.append([p.detach().clone() for p in params] + [optimizer.state[p]["ema"] for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_averaged_weights_entered_inside_itself_keeps_the_averages_in(dtype):
    """An evaluation helper that enters the context inside a block of it: the params hold their averages for
    the whole inner block and after it, ``averaged_state_dict`` is the averages everywhere, and the outer
    block's end gives every param and average back bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(dtype)
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, ema_decay=0.5)
    for _ in range(3):
        model(torch.randn(16, 4, dtype=dtype)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = dict(model.named_parameters())
    averages = {name: optimizer.state[p]["ema"].to(dtype, copy=True) for name, p in params.items()}
    weights = {name: p.detach().clone() for name, p in params.items()}
    state = {name: optimizer.state[p]["ema"].clone() for name, p in params.items()}
    assert any(not torch.equal(averages[name], weights[name]) for name in params)

    def assert_bits(tensors, expected):
        for name, tensor in tensors.items():
            assert torch.equal(tensor.detach(), expected[name]), name

    assert_bits(optimizer.averaged_state_dict(model), averages)
    with optimizer.averaged_weights():
        with optimizer.averaged_weights():
            assert_bits(params, averages)
            assert_bits(optimizer.averaged_state_dict(model), averages)
        assert_bits(params, averages)
        assert_bits(optimizer.averaged_state_dict(model), averages)
    assert_bits(params, weights)
    assert_bits({name: optimizer.state[p]["ema"] for name, p in params.items()}, state)


def test_averaged_state_dict_is_the_averaged_model_other_code_loads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, ema_decay=0.5)
    for _ in range(3):
        model(torch.randn(16, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.averaged_state_dict(model)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(state)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(q.detach(), optimizer.state[p]["ema"]), name
    assert torch.equal(state["1.running_mean"], model[1].running_mean)  # buffers: the module's


def test_a_state_dict_keeps_the_average_in_fp32_and_a_state_without_one_says_so():
    params = make_params(SHAPES, dtype=torch.bfloat16)
    optimizer = FusedSGD(params, lr=0.05, momentum=0.9, master_weights=True, ema_decay=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        _grads(params, generator)
        optimizer.step()
    loaded = FusedSGD(params, lr=0.05, momentum=0.9, master_weights=True, ema_decay=0.9)
    loaded.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p in params:
        assert loaded.state[p]["ema"].dtype == torch.float32  # torch's loader would cast it to bf16
        assert torch.equal(loaded.state[p]["ema"], optimizer.state[p]["ema"])
    older = copy.deepcopy(optimizer.state_dict())  # a checkpoint from before the average was kept
    for entry in older["state"].values():
        for key in ("ema", "ema_step", "ema_updates"):
            del entry[key]
    with pytest.warns(UserWarning, match="has no ema for 4 params whose groups keep one"):
        loaded.load_state_dict(older)
    _grads(params, generator)
    loaded.step()  # the average starts anew: its first update copies the weight
    assert all(torch.equal(loaded.state[p]["ema"], loaded.state[p]["master_param"]) for p in params)


def test_the_average_is_off_by_default_and_costs_no_state():
    params = make_params(SHAPES)
    optimizer = FusedSGD(params, lr=0.05, momentum=0.9)
    _grads(params, torch.Generator().manual_seed(0))
    optimizer.step()
    assert all(set(optimizer.state[p]) == {"momentum_buffer"} for p in params)


@pytest.mark.parametrize(
    "make", [lambda: torch.randn(3, dtype=torch.complex64), lambda: torch.randn(3).to_sparse()]
)
def test_an_average_of_a_complex_or_sparse_param_is_refused_at_construction(make):
    param = nn.Parameter(make())
    with pytest.raises(
        ValueError, match="ema_decay=0.9: an average of the weights is kept of dense real params"
    ):
        FusedSGD([param], lr=0.1, ema_decay=0.9)
    optimizer = FusedSGD([nn.Parameter(torch.randn(2))], lr=0.1, ema_decay=0.9)
    with pytest.raises(ValueError, match="put it in a group with ema_decay=None"):
        optimizer.add_param_group({"params": [param]})
    assert len(optimizer.param_groups) == 1
