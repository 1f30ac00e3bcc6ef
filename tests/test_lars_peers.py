"""LARS as the libraries that train with it use it: FusedLARS against each peer's own LARS (lightly, timm
and pytorch-optimizer, installed from PyPI with the dev extra), the peer's parameter grouping passed
unchanged, and against a float64 formula of every variant (``always_adapt``, ``lars_zero_norm``) on both
backends, Nesterov and dampening included.

The model has what makes the variants differ: conv, BN and linear layers with biases (groups whose weight
decay is 0), a BN whose gamma starts at zero (||w|| = 0, as a residual block's last BN with zero-init) and, on
some steps, a layer whose gradient is all zero (||g|| = 0, a branch that got none)."""

from __future__ import annotations

import itertools

import pytest
import torch
from oracles import assert_close_rel
from torch import nn

from lightning_fusedsgd import FusedLARS, param_groups

STEPS = 50
LR, MOMENTUM, WEIGHT_DECAY = 0.2, 0.9, 5e-4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, bias=False),
        nn.BatchNorm2d(16),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )
    nn.init.zeros_(model[4].weight)  # ||w|| = 0 for the first steps
    return model


def gradients(model: nn.Module, step: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The step's gradients, the same for both runs: small random ones, the second conv's all zero on even
    steps."""
    grads = {name: torch.randn(p.shape, generator=generator) * 0.01 for name, p in model.named_parameters()}
    if step % 2 == 0:
        grads["3.weight"].zero_()
    return list(grads.values())


def run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> None:
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p, g in zip(model.parameters(), gradients(model, step, generator)):
            p.grad = g.clone()  # a clone: some peers write p.grad in place
        optimizer.step()


def assert_same_run(ours: nn.Module, optimizer: torch.optim.Optimizer, theirs: nn.Module, peer) -> None:
    assert_close_rel(list(ours.parameters()), list(theirs.parameters()), 2e-6)
    buffers = [optimizer.state[p]["momentum_buffer"] for p in ours.parameters()]
    assert_close_rel(buffers, [peer.state[p]["momentum_buffer"] for p in theirs.parameters()], 2e-6)


@pytest.mark.parametrize("grouping", ["lightly's groups", "one group"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_lightly(grouping, nesterov):
    lightly_lars = pytest.importorskip("lightly.utils.lars").LARS
    from lightly.models.utils import get_weight_decay_parameters

    def groups(model):
        if grouping == "one group":
            return model.parameters()
        decayed, undecayed = get_weight_decay_parameters([model])
        return [{"params": decayed}, {"params": undecayed, "weight_decay": 0.0}]

    hparams = dict(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=nesterov)
    ours, theirs = make_model(), make_model()
    optimizer = FusedLARS(
        groups(ours), always_adapt=False, lars_zero_norm="plain_grad", lars_eps=1e-8, **hparams
    )
    peer = lightly_lars(groups(theirs), **hparams)
    run(ours, optimizer)
    run(theirs, peer)
    assert_same_run(ours, optimizer, theirs, peer)


@pytest.mark.parametrize("trust_clip", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_timm(trust_clip, nesterov):
    timm_optim = pytest.importorskip("timm.optim")
    hparams = dict(lr=LR, momentum=MOMENTUM, nesterov=nesterov)
    ours, theirs = make_model(), make_model()
    optimizer = FusedLARS(
        timm_optim.param_groups_weight_decay(ours, WEIGHT_DECAY),
        always_adapt=False,
        lars_eps=1e-8,
        trust_clip=trust_clip,
        **hparams,
    )
    peer = timm_optim.Lars(
        timm_optim.param_groups_weight_decay(theirs, WEIGHT_DECAY), trust_clip=trust_clip, **hparams
    )
    run(ours, optimizer)
    run(theirs, peer)
    assert_same_run(ours, optimizer, theirs, peer)


def test_pytorch_optimizer():
    """pytorch-optimizer adapts and decays tensors of more than one dimension: param_groups' grouping. Its
    buffer starts at zero, which equals torch's seeding without dampening; a zero gradient gets eta / lambda
    from it (1 here), so its runs keep every gradient nonzero."""
    peer_lars = pytest.importorskip("pytorch_optimizer").LARS
    ours, theirs = make_model(), make_model()
    optimizer = FusedLARS(param_groups(ours, WEIGHT_DECAY), lr=LR, momentum=MOMENTUM, lars_eps=0.0)
    peer = peer_lars(theirs.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    for model, opt in ((ours, optimizer), (theirs, peer)):
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 0.01
            opt.step()
    assert_same_run(ours, optimizer, theirs, peer)


def lars_variant_step(
    weights, buffers, grads, groups, *, lr, momentum, dampening, nesterov, eta, eps, trust_clip
):
    """One step of each variant's formula in float64, on lists updated in place. ``groups``: per tensor, its
    group's (lars, always_adapt, zero_norm, weight_decay)."""
    for i, (w, g) in enumerate(zip(weights, grads)):
        lars, always_adapt, zero_norm, weight_decay = groups[i]
        if lars and (always_adapt or weight_decay != 0):
            w_norm, g_norm = w.norm().item(), g.norm().item()
            if w_norm == 0 or g_norm == 0:
                r, decay = 1.0, (0.0 if zero_norm == "plain_grad" else weight_decay)
            else:
                r, decay = eta * w_norm / (g_norm + weight_decay * w_norm + eps), weight_decay
                if trust_clip:
                    r = min(r / lr, 1.0)
            d = r * (g + decay * w)
        else:
            d = g + weight_decay * w
        buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + (1 - dampening) * d
        weights[i] = w - lr * (d + momentum * buffers[i] if nesterov else buffers[i])


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize(
    "always_adapt, zero_norm, nesterov, dampening, trust_clip",
    [
        (*variant, nesterov, dampening, trust_clip)
        for variant in itertools.product((True, False), ("unit_ratio", "plain_grad"))
        for nesterov, dampening, trust_clip in ((False, 0.0, False), (True, 0.0, True), (False, 0.3, False))
    ],
)
def test_every_variant_follows_its_float64_formula(
    always_adapt, zero_norm, nesterov, dampening, trust_clip, backend
):
    """Three groups: weights (decayed, LARS), BN and biases with weight decay 0 and LARS not said (the peers'
    grouping), and the linear layer's bias with LARS off."""
    model = make_model()
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight") and p.dim() > 1]
    undecayed = [p for n, p in named if not (n.endswith("weight") and p.dim() > 1) and n != "6.bias"]
    groups = [
        {"params": weights},
        {"params": undecayed, "weight_decay": 0.0},
        {"params": [model[6].bias], "lars": False},
    ]
    optimizer = FusedLARS(
        groups,
        lr=LR,
        momentum=MOMENTUM,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=WEIGHT_DECAY,
        lars_eps=1e-8,
        trust_clip=trust_clip,
        always_adapt=always_adapt,
        lars_zero_norm=zero_norm,
        backend=backend,
    )
    per_tensor = {id(p): (True, always_adapt, zero_norm, WEIGHT_DECAY) for p in weights}
    per_tensor |= {id(p): (True, always_adapt, zero_norm, 0.0) for p in undecayed}
    per_tensor[id(model[6].bias)] = (False, always_adapt, zero_norm, WEIGHT_DECAY)
    params = list(model.parameters())
    expected = [p.detach().double() for p in params]
    buffers = [None] * len(params)
    generator = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = gradients(model, step, generator)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        lars_variant_step(
            expected,
            buffers,
            [g.double() for g in grads],
            [per_tensor[id(p)] for p in params],
            lr=LR,
            momentum=MOMENTUM,
            dampening=dampening,
            nesterov=nesterov,
            eta=1e-3,
            eps=1e-8,
            trust_clip=trust_clip,
        )
    assert_close_rel(params, expected, 1e-5)
    assert_close_rel([optimizer.state[p]["momentum_buffer"] for p in params], buffers, 1e-5)


def test_the_variants_change_the_steps_they_should():
    """Not vacuous: each option moves the run, on the tensors the docs say."""
    runs = {}
    for always_adapt, zero_norm in itertools.product((True, False), ("unit_ratio", "plain_grad")):
        model = make_model()
        decayed, undecayed = param_groups(model, WEIGHT_DECAY, no_lars_bias=False, no_lars_norm=False)
        optimizer = FusedLARS(
            [decayed, undecayed],
            lr=LR,
            momentum=MOMENTUM,
            always_adapt=always_adapt,
            lars_zero_norm=zero_norm,
        )
        run(model, optimizer, steps=4)
        runs[always_adapt, zero_norm] = [p.detach().clone() for p in model.parameters()]
    names = [n for n, _ in make_model().named_parameters()]
    differs = {
        option: {n for n, a, b in zip(names, runs[first], runs[second]) if not torch.equal(a, b)}
        for option, (first, second) in {
            "always_adapt": ((True, "unit_ratio"), (False, "unit_ratio")),
            "lars_zero_norm": ((True, "unit_ratio"), (True, "plain_grad")),
        }.items()
    }
    assert differs["always_adapt"] == {"0.bias", "1.weight", "1.bias", "4.weight", "4.bias", "6.bias"}
    # The conv whose gradient is zero on even steps (||g|| = 0): no decay with "plain_grad". The zero-init
    # gamma (||w|| = 0) is in the group without decay, where the two rules agree.
    assert differs["lars_zero_norm"] == {"3.weight"}
