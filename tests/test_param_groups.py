"""param_groups: which tensors get weight decay and LARS, in what order."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torchvision
from torch import nn

from lightning_fusedsgd.param_groups import param_groups

GROUP_ORDER = ["decay_lars", "decay_no_lars", "no_decay_lars", "no_decay_no_lars"]


def names_by_group(groups: list[dict]) -> dict[str, list[str]]:
    return {group["name"]: [name for name, _ in group["params"]] for group in groups}


@pytest.fixture(scope="module")
def resnet50() -> nn.Module:
    return torchvision.models.resnet50(weights=None, zero_init_residual=True)


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    return torchvision.models.resnet18(weights=None)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ls1 = nn.Parameter(torch.full((dim,), 1e-5))  # layer scale: 1-D, not a bias, not a norm
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)


class TinyViT(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}


VIT_DECAYED = [
    "patch_embed.weight",
    "blocks.0.qkv.weight",
    "blocks.0.proj.weight",
    "blocks.0.mlp.weight",
    "blocks.1.qkv.weight",
    "blocks.1.proj.weight",
    "blocks.1.mlp.weight",
    "head.weight",
]
VIT_TOKENS = ["cls_token", "pos_embed"]
VIT_BIASES = (
    ["patch_embed.bias"] + [f"blocks.{i}.{m}.bias" for i in range(2) for m in ("qkv", "mlp")] + ["head.bias"]
)
VIT_SCALES = [
    f"blocks.{i}.{n}" for i in range(2) for n in ("norm1.weight", "norm1.bias", "ls1", "norm2.weight")
] + [
    "norm.weight",
    "norm.bias",
]


def in_model_order(model: nn.Module, names: list[str]) -> list[str]:
    wanted = set(names)
    return [name for name, _ in model.named_parameters() if name in wanted]


@pytest.mark.parametrize(("arch", "decayed", "excluded"), [("resnet18", 21, 41), ("resnet50", 54, 107)])
def test_resnet_split(arch: str, decayed: int, excluded: int, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(arch)
    groups = param_groups(model, 1e-4)

    assert [group["name"] for group in groups] == ["decay_lars", "no_decay_no_lars"]
    # Only the exclusion is written: the decayed group leaves LARS to the optimizer's own `lars`.
    assert [(group["weight_decay"], group.get("lars")) for group in groups] == [(1e-4, None), (0.0, False)]
    by_group = names_by_group(groups)
    assert (len(by_group["decay_lars"]), len(by_group["no_decay_no_lars"])) == (decayed, excluded)
    # Oracle from module types: conv and linear weights decay; BN parameters and biases do not.
    expected_decayed = [
        f"{module_name}.weight"
        for module_name, module in model.named_modules()
        if isinstance(module, (nn.Conv2d, nn.Linear))
    ]
    assert by_group["decay_lars"] == expected_decayed
    assert by_group["no_decay_no_lars"] == [
        name for name, _ in model.named_parameters() if name not in set(expected_decayed)
    ]


def test_zero_initialized_gammas_are_never_lars_adapted(resnet50: nn.Module) -> None:
    zero_gammas = [name for name, p in resnet50.named_parameters() if name.endswith("bn3.weight")]
    assert len(zero_gammas) == 16 and all(not resnet50.get_parameter(n).any() for n in zero_gammas)
    # Even with decay switched back on for norms, they must stay out of LARS.
    for groups in (param_groups(resnet50, 5e-5), param_groups(resnet50, 5e-5, no_decay_norm=False)):
        lars_names = {name for group in groups if group.get("lars", True) for name, _ in group["params"]}
        assert lars_names.isdisjoint(zero_gammas)


def test_vit_like_model() -> None:
    model = TinyViT()
    by_group = names_by_group(param_groups(model, 0.05))
    assert list(by_group) == ["decay_lars", "no_decay_no_lars"]
    assert by_group["decay_lars"] == VIT_DECAYED
    assert by_group["no_decay_no_lars"] == in_model_order(model, VIT_TOKENS + VIT_BIASES + VIT_SCALES)


def test_no_weight_decay_names_ignore_the_norm_and_bias_switches() -> None:
    model = TinyViT()
    groups = param_groups(
        model, 0.05, no_decay_bias=False, no_decay_norm=False, no_lars_bias=False, no_lars_norm=False
    )
    by_group = names_by_group(groups)
    assert by_group["decay_lars"] == in_model_order(model, VIT_DECAYED + VIT_BIASES + VIT_SCALES)
    assert by_group["no_decay_no_lars"] == VIT_TOKENS


NORMS = {
    "BatchNorm1d": lambda: nn.BatchNorm1d(6),
    "BatchNorm2d": lambda: nn.BatchNorm2d(6),
    "BatchNorm3d": lambda: nn.BatchNorm3d(6),
    "SyncBatchNorm": lambda: nn.SyncBatchNorm(6),
    "InstanceNorm1d": lambda: nn.InstanceNorm1d(6, affine=True),
    "InstanceNorm2d": lambda: nn.InstanceNorm2d(6, affine=True),
    "InstanceNorm3d": lambda: nn.InstanceNorm3d(6, affine=True),
    "GroupNorm": lambda: nn.GroupNorm(2, 6),
    # Multi-dimensional normalized shapes: 2-D weights that only the module-type rule catches.
    "LayerNorm2dShape": lambda: nn.LayerNorm((2, 3)),
    "RMSNorm2dShape": lambda: nn.RMSNorm((2, 3)),
}


@pytest.mark.parametrize("norm_name", list(NORMS))
def test_every_norm_type_is_excluded(norm_name: str) -> None:
    model = nn.Sequential(nn.Linear(6, 6, bias=False), NORMS[norm_name]())
    norm_params = [f"1.{name}" for name, _ in model[1].named_parameters()]
    assert norm_params  # an affine norm: something to classify
    assert names_by_group(param_groups(model, 0.1)) == {
        "decay_lars": ["0.weight"],
        "no_decay_no_lars": norm_params,
    }
    # With both norm switches off, the norm's parameters are treated like any weight.
    loose = param_groups(model, 0.1, no_decay_norm=False, no_lars_norm=False)
    assert names_by_group(loose) == {"decay_lars": ["0.weight"] + norm_params}


SWITCHES = ("no_decay_bias", "no_decay_norm", "no_lars_bias", "no_lars_norm")


@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=4)), ids=str)
def test_switches_route_bias_and_norm_independently(flags: tuple[bool, ...]) -> None:
    switches = dict(zip(SWITCHES, flags))
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.PReLU(4))

    def group_of(no_decay: bool, no_lars: bool) -> str:
        return f"{'no_decay' if no_decay else 'decay'}_{'no_lars' if no_lars else 'lars'}"

    expected: dict[str, list[str]] = {}
    for name, no_decay, no_lars in [
        ("0.weight", False, False),
        ("0.bias", switches["no_decay_bias"], switches["no_lars_bias"]),
        ("1.weight", switches["no_decay_norm"], switches["no_lars_norm"]),
        ("1.bias", switches["no_decay_norm"], switches["no_lars_norm"]),
        ("2.weight", switches["no_decay_norm"], switches["no_lars_norm"]),  # 1-D PReLU slope: a scale
    ]:
        expected.setdefault(group_of(no_decay, no_lars), []).append(name)

    groups = param_groups(model, 0.1, **switches)
    assert [group["name"] for group in groups] == [name for name in GROUP_ORDER if name in expected]
    assert names_by_group(groups) == expected
    for group in groups:
        assert group["weight_decay"] == (0.1 if group["name"].startswith("decay") else 0.0)
        assert group.get("lars", True) is not group["name"].endswith("no_lars")


def test_frozen_parameters_are_left_out() -> None:
    model = torchvision.models.resnet18(weights=None)
    for module in (model.conv1, model.bn1, model.layer1):
        module.requires_grad_(False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert len(frozen) == 1 + 2 + 4 * 3  # conv1, bn1, two blocks of (conv, bn, conv, bn)

    grouped = [name for group in param_groups(model, 1e-4) for name, _ in group["params"]]
    assert set(grouped) == {name for name, _ in model.named_parameters()} - frozen
    assert len(grouped) == 21 + 41 - len(frozen)


def test_all_frozen_is_an_error() -> None:
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model, 1e-4)


def test_tied_parameters_appear_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    groups = param_groups(model, 1e-4)
    assert names_by_group(groups) == {"decay_lars": ["0.weight"], "no_decay_no_lars": ["0.bias", "2.bias"]}
    torch.optim.SGD(groups, lr=0.1)  # torch rejects a tensor listed twice across groups


def test_tied_parameter_held_by_a_norm_is_a_norm_parameter() -> None:
    model = nn.ModuleDict({"proj": nn.Linear(4, 4, bias=False), "norm": nn.LayerNorm((4, 4))})
    model["proj"].weight = model["norm"].weight  # first registered as proj.weight, a 2-D weight
    by_group = names_by_group(param_groups(model, 1e-4))
    assert by_group == {"no_decay_no_lars": ["proj.weight", "norm.bias"]}


def test_groups_are_deterministic() -> None:
    torch.manual_seed(0)
    first = names_by_group(param_groups(TinyViT(), 0.05, no_lars_norm=False, extra_no_decay=("head.*",)))
    second = names_by_group(param_groups(TinyViT(), 0.05, no_lars_norm=False, extra_no_decay=("head.*",)))
    model = TinyViT()
    repeat = [
        names_by_group(param_groups(model, 0.05, no_lars_norm=False, extra_no_decay=("head.*",)))
        for _ in range(2)
    ]
    assert first == second == repeat[0] == repeat[1]
    assert list(first) == ["decay_lars", "no_decay_lars", "no_decay_no_lars"]


@pytest.mark.parametrize(
    ("patterns", "excluded"),
    [
        (("head.weight",), ["head.weight"]),
        (("*.qkv.weight",), ["blocks.0.qkv.weight", "blocks.1.qkv.weight"]),
        (("blocks.1.*",), ["blocks.1.qkv.weight", "blocks.1.proj.weight", "blocks.1.mlp.weight"]),
        (("blocks.[0].mlp.weight", "patch_*"), ["patch_embed.weight", "blocks.0.mlp.weight"]),
    ],
)
def test_extra_no_decay_patterns(patterns: tuple[str, ...], excluded: list[str]) -> None:
    model = TinyViT()
    by_group = names_by_group(param_groups(model, 0.05, extra_no_decay=patterns))
    assert by_group["decay_lars"] == [name for name in VIT_DECAYED if name not in excluded]
    assert set(excluded) <= set(by_group["no_decay_no_lars"])


def test_pattern_matching_nothing_warns() -> None:
    with pytest.warns(UserWarning, match=r"pattern '\*.pos_embedding' matches no parameter of TinyViT"):
        param_groups(TinyViT(), 0.05, extra_no_decay=("*.pos_embedding",))


def test_groups_drive_torch_sgd() -> None:
    model = TinyViT()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    groups = param_groups(model, 0.01)
    optimizer = torch.optim.SGD(groups, lr=0.5)

    assert [group["param_names"] for group in optimizer.param_groups] == [
        VIT_DECAYED,
        in_model_order(model, VIT_TOKENS + VIT_BIASES + VIT_SCALES),
    ]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # Zero gradient: only coupled weight decay moves a weight, by the factor (1 - lr * wd).
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.5 * 0.01) if name in VIT_DECAYED else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0)


def test_zero_weight_decay_keeps_the_layout(resnet18: nn.Module) -> None:
    decayed = param_groups(resnet18, 1e-4)
    undecayed = param_groups(resnet18, 0.0)
    assert names_by_group(undecayed) == names_by_group(decayed)
    assert [group["weight_decay"] for group in undecayed] == [0.0, 0.0]


def test_summary_is_logged_once(resnet50: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_fusedsgd.param_groups"):
        param_groups(resnet50, 1e-4)
    records = [r for r in caplog.records if r.name == "lightning_fusedsgd.param_groups"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    decayed_numel = sum(m.weight.numel() for m in resnet50.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    excluded_numel = sum(p.numel() for p in resnet50.parameters()) - decayed_numel
    message = records[0].getMessage()
    assert f"decay_lars (wd=0.0001): 54 tensors, {decayed_numel:,} params" in message
    assert f"no_decay_no_lars (wd=0): 107 tensors, {excluded_numel:,} params" in message


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "message"),
    [
        (nn.Linear(2, 2), dict(weight_decay=-1e-4), ValueError, "weight_decay must be a finite number >= 0"),
        (nn.Linear(2, 2), dict(weight_decay=float("nan")), ValueError, "weight_decay must be"),
        (nn.Linear(2, 2), dict(weight_decay="1e-4"), ValueError, "weight_decay must be"),
        ([nn.Parameter(torch.zeros(2))], dict(weight_decay=0.1), TypeError, "expects an nn.Module, got list"),
        (nn.Linear(2, 2), dict(weight_decay=0.1, extra_no_decay="bias"), TypeError, r"write \('bias',\)"),
        (nn.LazyLinear(2), dict(weight_decay=0.1), ValueError, "uninitialized lazy parameter"),
    ],
)
def test_bad_input(model: object, kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        param_groups(model, **kwargs)


def test_the_optimizer_decides_lars_on_the_eligible_groups() -> None:
    """The README's example: param_groups' groups with FusedSGD(lars=False) are plain SGD everywhere,
    as with torch.optim.SGD; with lars=True only the eligible group is adapted."""
    from lightning_fusedsgd import FusedSGD

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)) for _ in range(3)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    plain = FusedSGD(param_groups(models[0], weight_decay=1e-4), lr=0.1, momentum=0.9, lars=False)
    oracle = torch.optim.SGD(param_groups(models[1], weight_decay=1e-4), lr=0.1, momentum=0.9)
    lars = FusedSGD(param_groups(models[2], weight_decay=1e-4), lr=0.1, momentum=0.9, lars=True)
    assert [group["lars"] for group in lars.param_groups] == [True, False]
    x = torch.randn(16, 64)
    for _ in range(3):
        for model, optimizer in zip(models, (plain, oracle, lars)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for mine, theirs in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(mine, theirs)
    # LARS shrinks the weight's update (trust ratio ~ 1e-3 ||w|| / ||g||); the excluded BN params move alike.
    assert not torch.allclose(models[2][0].weight, models[1][0].weight)


@pytest.mark.parametrize(
    ("declared", "message"),
    [(lambda: 3, "must return a collection of parameter names, got int"), (lambda: {1}, r"got \[1\]")],
)
def test_no_weight_decay_that_is_not_names_is_refused(declared, message: str) -> None:
    model = TinyViT()
    model.no_weight_decay = declared
    with pytest.raises(TypeError, match=message):
        param_groups(model, 0.05)


def test_no_weight_decay_returning_none_declares_nothing() -> None:
    model = TinyViT()
    model.no_weight_decay = lambda: None
    assert "pos_embed" in names_by_group(param_groups(model, 0.05))["decay_lars"]


def test_no_weight_decay_name_matching_nothing_warns() -> None:
    model = TinyViT()
    model.no_weight_decay = lambda: {"pos_embed", "pos_embedding"}
    with pytest.warns(UserWarning, match=r"no_weight_decay\(\) name 'pos_embedding' matches no parameter"):
        param_groups(model, 0.05)
