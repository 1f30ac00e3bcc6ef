"""FusedSGD's behaviour around the update: GradScaler, sparse gradients, master weights, state dicts and their
interop with torch.optim.SGD, kept plans, layouts. The update itself is checked against its oracles in
test_parity.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import clone_params, make_params, set_grads
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedLARS, FusedSGD, FusedSGDScheduleFree, ops

BACKENDS = ["compiled", "reference"]


def test_wd_after_momentum_keeps_decay_out_of_the_buffer():
    """Hand-written TransformerEngine rule: b = mu b + g; w -= lr (b + wd w); the buffer never sees wd."""
    p = nn.Parameter(torch.randn(1000))
    w = p.detach().clone()
    b = None
    opt = FusedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.05, wd_after_momentum=True)
    for _step in range(10):
        g = torch.randn(1000)
        p.grad = g.clone()
        opt.step()
        b = g.clone() if b is None else 0.9 * b + g
        w = w - 0.1 * (b + 0.05 * w)
    torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_bf16_master_weights_track_fp32(backend):
    fp32, bf16 = make_params(dtype=torch.float32), make_params(dtype=torch.float32)
    bf16 = [nn.Parameter(p.detach().to(torch.bfloat16)) for p in bf16]
    kwargs = dict(lr=0.01, momentum=0.9, weight_decay=1e-4, backend=backend)
    opt32 = FusedSGD(fp32, **kwargs)
    opt16 = FusedSGD(bf16, master_weights=True, **kwargs)
    generator = torch.Generator().manual_seed(3)
    for _step in range(100):
        grads = [torch.randn(p.shape, generator=generator) for p in fp32]
        for p, q, g in zip(fp32, bf16, grads):
            p.grad, q.grad = g, g.to(torch.bfloat16)
        opt32.step()
        opt16.step()
    for p, q in zip(fp32, bf16):
        master = opt16.state[q]["master_param"]
        assert master.dtype == torch.float32 and opt16.state[q]["momentum_buffer"].dtype == torch.float32
        torch.testing.assert_close(
            q, master.to(torch.bfloat16), rtol=0, atol=0
        )  # param is the rounded master
        # Only the bf16 rounding of each gradient separates the runs.
        assert (master - p.detach()).abs().max() <= 0.01 * p.detach().abs().max()


def test_grad_scaler_unscales_in_kernel_and_skips_overflow():
    scaler_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=512.0)  # ours halves to 512 on the overflow
    ours, theirs = make_params(), make_params()
    opt = FusedSGD(ours, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False)
    x = torch.randn(70_000)

    def backward(params, scaler, overflow):
        loss = sum((p**2).sum() for p in params[:3]) + (params[3] * x).sum()
        if overflow:
            loss = loss * float("inf")
        scaler.scale(loss).backward()

    # First step overflows: nothing may change and no buffer may be created.
    backward(ours, scaler_ours, overflow=True)
    before = [p.detach().clone() for p in ours]
    scaler_ours.step(opt)
    scaler_ours.update()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))
    assert not any(opt.state[p] for p in ours)
    assert scaler_ours.get_scale() == 512.0
    for _step in range(5):
        opt.zero_grad()
        ref.zero_grad()
        backward(ours, scaler_ours, overflow=False)
        backward(theirs, scaler_ref, overflow=False)
        scaler_ours.step(opt)
        scaler_ref.step(ref)
        scaler_ours.update()
        scaler_ref.update()
    assert_close_rel(ours, theirs, 1e-5)
    # A later overflow leaves weights and buffers bit-identical.
    opt.zero_grad()
    backward(ours, scaler_ours, overflow=True)
    snapshot = copy.deepcopy((list(ours), opt.state_dict()))
    scaler_ours.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(ours, snapshot[0]))
    after = opt.state_dict()["state"]
    assert after.keys() == snapshot[1]["state"].keys()
    for key, value in snapshot[1]["state"].items():
        assert value.keys() == after[key].keys()
        for name, tensor in value.items():
            assert torch.equal(after[key][name], tensor)


def test_grad_scaler_steps_an_optimizer_whose_params_have_no_grad_as_torch_fused_does():
    """A second optimizer whose params got no grad this iteration (a frozen phase, multi-optimizer loops):
    GradScaler hands it found_inf as the int 0; torch's fused SGD steps it as a no-op, so does ours."""
    used, frozen = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4))
    scaler = torch.amp.GradScaler("cpu")
    for optimizer in (
        torch.optim.SGD([frozen], lr=0.1, fused=True),
        FusedSGD([frozen], lr=0.1, momentum=0.9),
    ):
        before = frozen.detach().clone()
        used.grad = None
        scaler.scale((used * 2).sum()).backward()
        scaler.step(optimizer)
        assert torch.equal(frozen, before) and not optimizer.state
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


@pytest.mark.parametrize(
    "hparams",
    [
        dict(momentum=0.9),
        dict(momentum=0.9, nesterov=True, maximize=True),
        dict(momentum=0.9, dampening=0.3),
        dict(),
    ],
    ids=["momentum", "nesterov-maximize", "dampening", "plain"],
)
@pytest.mark.parametrize("scaler", [False, True], ids=["", "grad-scaler"])
def test_sparse_gradients_step_as_torch_sgd_steps_them(hparams, scaler):
    """nn.Embedding(sparse=True) beside dense layers: the sparse param through torch's own path, the rest
    fused, against torch.optim.SGD on the same model (under a GradScaler too)."""
    torch.manual_seed(0)
    models = [nn.ModuleDict({"emb": nn.Embedding(20, 4, sparse=True), "proj": nn.Linear(4, 3)}) for _ in "ab"]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        FusedSGD(models[0].parameters(), lr=0.1, **hparams),
        torch.optim.SGD(models[1].parameters(), lr=0.1, **hparams),
    ]
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0, enabled=scaler) for _ in "ab"]
    sign = -1.0 if hparams.get("maximize") else 1.0  # a bounded objective either way
    for step in range(6):
        indices = torch.tensor([step, step + 3, 7, 7])
        for model, optimizer, grad_scaler in zip(models, optimizers, scalers):
            optimizer.zero_grad()
            grad_scaler.scale(sign * model["proj"](model["emb"](indices)).pow(2).sum()).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
    assert optimizers[0].state or not hparams.get("momentum")
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)  # the sparse param through torch's own path, the rest with its bits


def test_a_sparse_momentum_buffer_continues_dense_when_the_gradient_turns_dense():
    """torch.optim.SGD raises adding a dense gradient to the sparse buffer its sparse path made; FusedSGD
    continues with the buffer made dense, which the oracle is given by hand."""
    torch.manual_seed(0)
    embeddings = [nn.Embedding(10, 3, sparse=True) for _ in "ab"]
    embeddings[1].load_state_dict(embeddings[0].state_dict())
    ours = FusedSGD(embeddings[0].parameters(), lr=0.1, momentum=0.9)
    oracle = torch.optim.SGD(embeddings[1].parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        for embedding, optimizer in zip(embeddings, (ours, oracle)):
            embedding.sparse = step < 2
            if step == 2 and optimizer is oracle:
                state = oracle.state[embedding.weight]
                state["momentum_buffer"] = state["momentum_buffer"].to_dense()
            optimizer.zero_grad()
            embedding(torch.tensor([1, 2, 2])).sum().backward()
            optimizer.step()
    assert not ours.state[embeddings[0].weight]["momentum_buffer"].is_sparse
    assert torch.equal(embeddings[0].weight, embeddings[1].weight)


def test_grad_scaler_with_master_weights_overflow_creates_nothing():
    params = [nn.Parameter(torch.randn(100).to(torch.bfloat16))]
    opt = FusedSGD(params, lr=0.1, momentum=0.9, master_weights=True)
    params[0].grad = torch.full((100,), float("inf"), dtype=torch.bfloat16)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(1.0)
    before = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[0], before) and not opt.state[params[0]]


def test_state_dict_round_trip_and_interop_both_ways():
    def run(opt, params, steps, seed):
        generator = torch.Generator().manual_seed(seed)
        for step in range(steps):
            set_grads([params], step, generator)
            opt.step()

    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    # N + M steps of torch.optim.SGD: the oracle.
    oracle = make_params()
    oracle_opt = torch.optim.SGD(oracle, foreach=False, **kwargs)
    run(oracle_opt, oracle, 10, seed=5)
    run(oracle_opt, oracle, 10, seed=6)
    for first, second in [(torch.optim.SGD, FusedSGD), (FusedSGD, torch.optim.SGD), (FusedSGD, FusedSGD)]:
        params = make_params()
        opt_a = first(params, **kwargs) if first is FusedSGD else first(params, foreach=False, **kwargs)
        run(opt_a, params, 10, seed=5)
        saved = copy.deepcopy(opt_a.state_dict())
        params_b = clone_params(params)
        opt_b = (
            second(params_b, **kwargs) if second is FusedSGD else second(params_b, foreach=False, **kwargs)
        )
        opt_b.load_state_dict(saved)
        run(opt_b, params_b, 10, seed=6)
        assert_close_rel(params_b, oracle, 1e-5)


def test_master_weights_survive_state_dict_round_trip_in_fp32():
    params = [nn.Parameter(torch.randn(64).to(torch.bfloat16))]
    opt = FusedSGD(params, lr=1e-3, momentum=0.9, master_weights=True)
    for _ in range(3):
        params[0].grad = torch.randn(64).to(torch.bfloat16)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    restored = [nn.Parameter(params[0].detach().clone())]
    opt2 = FusedSGD(restored, lr=1e-3, momentum=0.9, master_weights=True)
    opt2.load_state_dict(saved)
    for key in ("master_param", "momentum_buffer"):
        assert opt2.state[restored[0]][key].dtype == torch.float32
        assert torch.equal(opt2.state[restored[0]][key], opt.state[params[0]][key])


@pytest.mark.parametrize(
    ("saved_with", "loaded_into"),
    [
        (dict(master_weights=True), dict()),
        (dict(master_weights=True), dict(update_rounding="kahan")),
        (dict(), dict(master_weights=True)),
        (dict(update_rounding="kahan"), dict(master_weights=True)),
    ],
    ids=["masters-into-default", "masters-into-kahan", "plain-into-masters", "kahan-into-masters"],
)
def test_loaded_state_keeps_the_precision_of_the_loaded_groups(saved_with, loaded_into):
    """A checkpoint's groups decide what its state is, whatever the loading optimizer was built with: the
    resumed run gives the uninterrupted run's bits (params, fp32 masters and buffers, compensations)."""
    hparams = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    uninterrupted = make_params([(70_000,), (33, 17)], dtype=torch.bfloat16)
    resumed = clone_params(uninterrupted)
    optimizer = FusedSGD(uninterrupted, **hparams, **saved_with)
    generator = torch.Generator().manual_seed(4)

    def step(param_sets, optimizers):
        grads = [torch.randn(p.shape, generator=generator).to(torch.bfloat16) for p in param_sets[0]]
        for params, opt in zip(param_sets, optimizers):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()

    for _ in range(2):
        step([uninterrupted], [optimizer])
    for p, q in zip(resumed, uninterrupted):
        p.data.copy_(q)
    saved = copy.deepcopy(optimizer.state_dict())
    loader = FusedSGD(resumed, **hparams, **loaded_into)
    loader.load_state_dict(saved)
    for _ in range(2):
        step([uninterrupted, resumed], [optimizer, loader])
    for p, q in zip(resumed, uninterrupted):
        assert torch.equal(p, q)
        mine, theirs = loader.state[p], optimizer.state[q]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype, key
            assert torch.equal(mine[key], value), key


def test_named_parameters_are_accepted():
    model = nn.Linear(4, 3)
    opt = FusedSGD(model.named_parameters(), lr=0.1, momentum=0.9)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


def test_non_dense_params_are_updated_through_a_copy():
    base = torch.randn(6, 5)
    p = nn.Parameter(base.t())  # non-contiguous, not channels_last
    q = nn.Parameter(base.t().contiguous())
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9, foreach=False)
    for _ in range(3):
        g = torch.randn(5, 6)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert p.stride() == (1, 5)


def test_zero_grad_follows_set_grad_none():
    p = nn.Parameter(torch.randn(3))
    for set_grad_none in (True, False):
        p.grad = torch.ones(3)
        FusedSGD([p], set_grad_none=set_grad_none).zero_grad()
        assert (p.grad is None) == set_grad_none


def test_compiled_kernel_is_what_runs_on_cpu():
    """CI sets LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1: a build failure fails here instead of falling back."""
    assert hasattr(ops.load(), "sgd_step")
    p = nn.Parameter(torch.randn(10))
    opt = FusedSGD([p])
    expected = ["compiled", "compiled (kept plan)", "compiled (kept plan)"]  # later steps reuse the plan
    for backend in expected:
        p.grad = torch.ones(10)
        opt.step()
        assert opt.last_backends == {"cpu/float32": backend}


@pytest.mark.parametrize("replaced", ["buffer", "state dict"])
def test_state_replaced_between_steps_is_used(replaced):
    """Later steps reuse a validated plan; state replaced by hand must still take effect: a buffer, or the
    whole per-param dict (as Lightning's optimizer-to-device does)."""
    ours, theirs = make_params(), make_params()
    opt = FusedSGD(ours, lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    generator = torch.Generator().manual_seed(7)
    for step in range(6):
        if step == 3:
            for optimizer, param in [(opt, p) for p in ours] + [(ref, q) for q in theirs]:
                buffer = torch.full_like(param, 0.5)
                if replaced == "buffer":
                    optimizer.state[param]["momentum_buffer"] = buffer
                else:
                    optimizer.state[param] = {"momentum_buffer": buffer}
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, generator=generator)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert_close_rel(ours, theirs, 1e-5)


def test_torch_sgd_state_with_one_group_loads_into_two_groups_by_name():
    from lightning_fusedsgd import param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    ref = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    ref.step()
    saved = copy.deepcopy(ref.state_dict())
    opt = FusedSGD(param_groups(model, 1e-4), lr=0.1, momentum=0.9)
    assert len(opt.param_groups) == 2
    opt.load_state_dict(saved)
    by_name = dict(zip(saved["param_groups"][0]["param_names"], saved["state"].values()))
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            assert torch.equal(opt.state[p]["momentum_buffer"], by_name[name]["momentum_buffer"])
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]  # our grouping's hyperparameters kept


def test_deepcopy_and_pickle_keep_settings_and_state():
    import pickle

    params = make_params()
    opt = FusedSGD(params, lr=0.05, momentum=0.9, set_grad_none=False, backend="reference")
    set_grads([params], 0, torch.Generator().manual_seed(8))
    opt.step()
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.backend == "reference" and copied.set_grad_none is False
        copied_params = [p for g in copied.param_groups for p in g["params"]]
        for p, q in zip(copied_params, params):
            assert copied.state[p].keys() == opt.state[q].keys()
            assert all(torch.equal(copied.state[p][key], value) for key, value in opt.state[q].items())
            p.grad = torch.ones_like(p)
        copied.step()  # steps with the copied state and settings
        copied.zero_grad()
        assert all(p.grad is not None for p in copied_params)  # set_grad_none=False survived


def test_groups_given_as_generators_keep_their_params():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    opt = FusedSGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]


def test_layout_change_after_a_kept_plan_is_handled_like_torch():
    """A param re-laid out in place (p.data = ...) must not reach the kernel with its old buffer."""
    ours = [nn.Parameter(torch.randn(4, 3, 5, 5)), nn.Parameter(torch.randn(70_000, dtype=torch.float64))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedSGD(ours, lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    generator = torch.Generator().manual_seed(9)
    for step in range(4):
        if step == 2:
            ours[0].data = ours[0].data.contiguous(memory_format=torch.channels_last)
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.grad = (
                g.clone(memory_format=torch.preserve_format) if p is ours[1] else torch.empty_like(p).copy_(g)
            )
            q.grad = g.clone()
        opt.step()
        ref.step()
    assert ours[0].is_contiguous(memory_format=torch.channels_last)
    assert_close_rel(ours, theirs, 1e-6)


def test_a_kept_plan_does_not_keep_gradients_alive():
    import weakref

    params = make_params()
    opt = FusedSGD(params, lr=0.05, momentum=0.9)
    for _ in range(3):  # the second step onwards reuses the kept plan
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    refs = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)


def test_a_parameter_listed_twice_is_refused():
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="same parameter twice"):
        FusedSGD([p, p], lr=0.1)


def _outside_write(kind, param, model_state=None):
    """Writes 7.0 into the first row of `param` from outside the optimizer, in one of the ways users do."""
    with torch.no_grad():
        if kind == "fill_":
            param.fill_(7.0)
        elif kind == "data":  # bumps no version counter
            param.data.fill_(7.0)
        elif kind == "partial":
            param[0] = 7.0
        else:  # load_state_dict after the optimizer was built
            param.copy_(torch.full_like(param, 7.0))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("kind", ["fill_", "data", "partial", "load_state_dict"])
def test_master_weights_follow_writes_from_outside_the_optimizer(backend, kind):
    """A write to a master-weighted param (EMA swap, load_state_dict, p.data) is what the next step starts
    from, as it is for torch.optim.SGD on fp32 params: the master is re-synced, not reverted to."""
    fp32 = [nn.Parameter(torch.randn(33, 17)), nn.Parameter(torch.randn(70_000))]
    bf16 = [nn.Parameter(p.detach().to(torch.bfloat16)) for p in fp32]
    fp32 = [nn.Parameter(p.detach().float()) for p in bf16]  # the same starting values
    ours = FusedSGD(bf16, lr=0.1, momentum=0.9, master_weights=True, backend=backend)
    ref = torch.optim.SGD(fp32, lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:  # after the kept plan took over
            if kind == "load_state_dict":
                model = nn.ParameterList(bf16)
                model.load_state_dict({str(i): torch.full_like(p, 7.0) for i, p in enumerate(bf16)})
                for p in fp32:
                    _outside_write("fill_", p)
            else:
                for p in bf16 + fp32:
                    _outside_write(kind, p)
        zero = step >= 3  # zero grads after the write: the update is momentum alone
        for p, q in zip(bf16, fp32):
            g = torch.zeros(p.shape) if zero else torch.randn(p.shape, generator=generator).bfloat16().float()
            p.grad, q.grad = g.bfloat16(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(bf16, fp32):
        torch.testing.assert_close(ours.state[p]["master_param"], q.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), ours.state[p]["master_param"].bfloat16())


def test_master_weights_turned_off_and_on_again_start_from_the_param():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(1000).bfloat16())
    opt = FusedSGD([p], lr=0.1, master_weights=True)
    p.grad = torch.randn(1000).bfloat16()
    opt.step()
    opt.param_groups[0]["master_weights"] = False
    opt.step()  # steps the bf16 param directly: a kept master would now be stale
    assert "master_param" not in opt.state[p]
    opt.param_groups[0]["master_weights"] = True
    expected = p.detach().float() - 0.1 * p.grad.float()  # momentum 0: one update from the param as it is
    opt.step()
    torch.testing.assert_close(opt.state[p]["master_param"], expected, rtol=1e-6, atol=1e-6)


def test_buffer_dtype_changed_behind_the_kept_plan_steps_like_torch():
    """A buffer whose dtype changed through .data keeps its identity, so only the recorded layouts show
    it: the kept plan must fall back to a full plan (which converts it) before any bucket runs."""
    ours = [nn.Parameter(torch.randn(70_000)), nn.Parameter(torch.randn(33, 17, dtype=torch.float64))]
    theirs = clone_params(ours)
    opt = FusedSGD(ours, lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 3:
            for optimizer, params in ((opt, ours), (ref, theirs)):
                buffer = optimizer.state[params[1]]["momentum_buffer"]
                buffer.data = buffer.float()
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert_close_rel(ours, theirs, 1e-6)


def test_interleaved_views_of_one_tensor_are_not_overlapping_params():
    """Columns of one matrix share its memory range but no element: they step like torch.optim.SGD."""
    base = torch.randn(6, 4)
    ours = [nn.Parameter(base[:, 0]), nn.Parameter(base[:, 1]), nn.Parameter(base[:, 2:])]
    theirs_base = base.clone()
    theirs = [
        nn.Parameter(theirs_base[:, 0]),
        nn.Parameter(theirs_base[:, 1]),
        nn.Parameter(theirs_base[:, 2:]),
    ]
    opt = FusedSGD(ours, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.ones_like(p)
            q.grad = torch.ones_like(q)
        opt.step()
        ref.step()
    assert_close_rel(ours, theirs, 1e-6)


def test_momentum_zero_keeps_no_state_like_torch():
    params = make_params()
    opt = FusedSGD(params, lr=0.1)
    for _ in range(3):  # the kept plan too
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    ref = torch.optim.SGD(clone_params(params), lr=0.1)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    ref.step()
    assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}


@pytest.mark.parametrize("kind", [FusedSGD, FusedLARS, FusedSGDScheduleFree], ids=lambda kind: kind.__name__)
def test_the_earlier_backend_name_torch_warns_and_runs_the_reference(kind):
    """``backend="torch"`` (renamed ``"reference"``) still runs, for one minor version: a FutureWarning at the
    user's line, then the reference's steps, bit for bit."""
    runs = []
    for backend in ("reference", "torch"):
        params = make_params([(5, 3), (7,)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = kind(params, lr=0.1, momentum=0.9, backend=backend)
        renamed = [w for w in caught if issubclass(w.category, FutureWarning)]
        assert len(renamed) == (backend == "torch")
        if renamed:
            assert "backend='reference'" in str(renamed[0].message) and renamed[0].filename == __file__
        assert optimizer.backend == "reference"
        if kind is FusedSGDScheduleFree:
            optimizer.train()
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
