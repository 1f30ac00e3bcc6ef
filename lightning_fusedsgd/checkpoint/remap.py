"""Optimizer state moved between groupings by parameter name (e.g. torch.optim.SGD's one group into
FusedSGD's decay / no-decay groups), tensors moved, not recomputed, so buffers stay bit-identical."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_fusedsgd._abi import GROUP_STATE
from lightning_fusedsgd.checkpoint.errors import CheckpointMismatchError
from lightning_fusedsgd.checkpoint.files import check_optimizer_state_dict

# How many names an error message lists per category before summarizing.
_MAX_LISTED = 8


def listed(items: Sequence[str]) -> str:
    """Names for a message: the first few, and how many more."""
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _dotted_prefixes(names: Collection[str]) -> list[str]:
    """``""`` and each leading dotted prefix shared by all names, shortest first."""
    prefixes = [""]
    first = next(iter(names), None)
    if first is None:
        return prefixes
    parts = first.split(".")[:-1]
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end]) + "."
        if not all(name.startswith(prefix) for name in names):
            break
        prefixes.append(prefix)
    return prefixes


def _name_translation(saved: Collection[str], target: Collection[str]) -> Callable[[str], str]:
    """Map saved names to target names by swapping a shared leading prefix.

    Covers DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` and a LightningModule holding the
    network as ``self.model``: the (strip, add) pair matching the most names wins, shortest on ties.
    """
    target_set = set(target)
    best, best_score = ("", ""), -1
    for strip in _dotted_prefixes(saved):
        for add in _dotted_prefixes(target):
            score = sum(add + name[len(strip) :] in target_set for name in saved)
            if score > best_score:
                best, best_score = (strip, add), score
    strip, add = best
    return lambda name: add + name[len(strip) :]


def match_names(
    saved_shapes: Mapping[str, Mapping[str, torch.Size]],
    target_shapes: Mapping[str, torch.Size],
    *,
    source: str,
    what: str,
    allow_missing: bool = False,
) -> dict[str, str]:
    """Map every saved name to a target name, or raise naming what is missing, extra or reshaped.

    Args:
        saved_shapes: Saved name -> the shapes of the tensors stored for it, each under what it is (a state
            key, or "" for a weight; empty if none).
        target_shapes: Target name -> expected shape.
        source: What was saved, for the message (usually the file).
        what: What is matched, for the message ("model weights", "optimizer state").
        allow_missing: Accept target names that nothing was saved for.

    Returns:
        Saved name -> target name.

    Raises:
        CheckpointMismatchError: If the names differ (beyond a shared prefix) or a shape differs.
    """
    translate = _name_translation(saved_shapes, target_shapes)
    mapping = {name: translate(name) for name in saved_shapes}
    extra = sorted(name for name, target in mapping.items() if target not in target_shapes)
    missing = [] if allow_missing else sorted(set(target_shapes) - set(mapping.values()))
    reshaped = [
        f"{mapping[name]} (checkpoint {', '.join(differing)}, model {list(target_shapes[mapping[name]])})"
        for name, shapes in saved_shapes.items()
        if mapping[name] in target_shapes
        and (
            differing := [
                f"{key} {list(shape)}".lstrip()
                for key, shape in shapes.items()
                if shape != target_shapes[mapping[name]]
            ]
        )
    ]
    problems = [
        f"  {label} ({len(items)}): {listed(items)}"
        for label, items in (
            ("missing from the checkpoint", missing),
            ("in the checkpoint but not in the model", extra),
            ("different shape", reshaped),
        )
        if items
    ]
    if problems:
        raise CheckpointMismatchError(
            f"{source}: {what} do not match the model\n"
            + "\n".join(problems)
            + "\nNothing was loaded or changed. Use a checkpoint saved from this model architecture, or "
            "configure the model (architecture, number of classes) to match the checkpoint."
        )
    return mapping


def group_names(groups: Sequence[Mapping[str, Any]]) -> list[list[str]] | None:
    """Each group's ``param_names``, or None unless every group has them."""
    if groups and all("param_names" in group for group in groups):
        return [list(group["param_names"]) for group in groups]
    return None


def _split_flat(names: Sequence[str], groups: Sequence[Mapping[str, Any]], side: str) -> list[list[str]]:
    """Cut a flat name list into per-group lists by the groups' sizes."""
    sizes = [len(group["params"]) for group in groups]
    if len(names) != sum(sizes):
        raise CheckpointMismatchError(
            f"{len(names)} {side} names given for {sum(sizes)} {side} parameters (groups of {sizes}); "
            f"pass one name per parameter, in the {side} optimizer's order"
        )
    out, start = [], 0
    for size in sizes:
        out.append(list(names[start : start + size]))
        start += size
    return out


def state_shapes(state: Mapping[str, Any]) -> dict[str, torch.Size]:
    """Shapes of a parameter's per-element state tensors by key (0-d ones, like a step count, are skipped:
    FusedSGD's loader checks each of its slots by its declaration)."""
    return {
        key: value.shape for key, value in state.items() if isinstance(value, torch.Tensor) and value.ndim > 0
    }


def same_param_layout(saved: Mapping[str, Any], target_groups: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``Optimizer.load_state_dict`` would line saved parameters up with the right targets.

    True when the group count and sizes agree and, where both sides carry ``param_names``, the names
    agree group by group and in order. Without names only the sizes can be compared, which is all
    torch itself checks.

    Args:
        saved: An optimizer state dict.
        target_groups: The target optimizer's ``param_groups``.

    Returns:
        Whether a plain ``load_state_dict`` is correct; if not, use :func:`remap_optimizer_state_dict`.
    """
    saved_groups = saved["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in target_groups]:
        return False
    saved_names, target_names = group_names(saved_groups), group_names(target_groups)
    return saved_names is None or target_names is None or saved_names == target_names


def remap_optimizer_state_dict(
    saved: Mapping[str, Any],
    target_groups: Sequence[Mapping[str, Any]],
    *,
    saved_names: Sequence[str] | None = None,
    target_names: Sequence[str] | None = None,
    source: str = "saved optimizer state",
) -> dict[str, Any]:
    """Rewrite an optimizer state dict into another optimizer's group layout, matching by name.

    Per-parameter state (momentum buffers, master weights, every slot) follows its parameter's name into
    whichever target group holds it; the tensors are the saved ones, shared, not copied or recomputed.
    The target groups' hyperparameters (lr, weight_decay, lars, ...) are kept: the saved groups no
    longer correspond to them. A group's state (``_abi.GROUP_STATE``: schedule-free SGD's mode and
    scalars) comes from the saved groups that held the target group's parameters, which must agree. Names
    may differ by a shared leading prefix (``module.`` from DDP, ``model.`` from a LightningModule
    attribute), which is swapped automatically.

    Args:
        saved: The state dict to remap (``{"state", "param_groups"}``), e.g. from ``torch.optim.SGD``.
        target_groups: The target optimizer's live ``param_groups`` (``params`` holds tensors, whose
            shapes are checked against the saved state).
        saved_names: Names of the saved parameters in the saved flat order, for a state dict without
            ``param_names`` (an optimizer built from ``model.parameters()``: pass the names of
            ``model.named_parameters()``). Ignored when every saved group has ``param_names``.
        target_names: Names of the target parameters in flat group order, when the target groups
            have no ``param_names``.
        source: What ``saved`` is, for error messages (e.g. the checkpoint's path).

    Returns:
        A state dict ``Optimizer.load_state_dict`` accepts for the target optimizer: its groups (with
        ``param_names``) in its order, state keyed by the matching indices.

    Raises:
        InvalidOptimizerStateError: If ``saved`` is not an optimizer state dict, or holds values that cannot
            be state (:func:`check_optimizer_state_dict`).
        CheckpointMismatchError: If names are unavailable or their count is wrong, a parameter is
            missing on either side, or a state tensor's shape differs from its target parameter. The
            message names the parameters; nothing is modified.
    """
    check_optimizer_state_dict(saved, source=source)
    saved_groups = saved["param_groups"]
    saved_by_group = group_names(saved_groups)
    if saved_by_group is None:
        if saved_names is None:
            raise CheckpointMismatchError(
                f"{source} has no param_names, so its groups (sizes "
                f"{[len(g['params']) for g in saved_groups]}) cannot be matched by name to this "
                f"optimizer's (sizes {[len(g['params']) for g in target_groups]}). Pass saved_names "
                "(for an optimizer built from model.parameters(): [name for name, _ in "
                "model.named_parameters()])."
            )
        saved_by_group = _split_flat(saved_names, saved_groups, "saved")
    target_by_group = group_names(target_groups)
    if target_by_group is None:
        if target_names is None:
            raise CheckpointMismatchError(
                "the target optimizer's groups have no param_names; build it from named parameters "
                "(e.g. param_groups(model, ...) or model.named_parameters()) or pass target_names"
            )
        target_by_group = _split_flat(target_names, target_groups, "target")

    flat_saved = [name for names in saved_by_group for name in names]
    repeated = sorted(name for name, count in Counter(flat_saved).items() if count > 1)
    if repeated:
        raise CheckpointMismatchError(f"{source}: parameter names repeat ({listed(repeated)})")
    saved_index = dict(zip(flat_saved, (i for group in saved_groups for i in group["params"]), strict=True))
    saved_state = saved["state"]
    saved_shapes = {name: state_shapes(saved_state.get(index, {})) for name, index in saved_index.items()}
    target_shapes = {
        name: param.shape
        for names, group in zip(target_by_group, target_groups, strict=True)
        for name, param in zip(names, group["params"], strict=True)
    }
    to_target = match_names(saved_shapes, target_shapes, source=source, what="optimizer parameter names")
    from_target = {target: saved_name for saved_name, target in to_target.items()}

    saved_group_of = {
        name: group for names, group in zip(saved_by_group, saved_groups, strict=True) for name in names
    }
    groups, state, next_index = [], {}, 0
    for names, group in zip(target_by_group, target_groups, strict=True):
        indices = list(range(next_index, next_index + len(names)))
        next_index += len(names)
        carried = _group_state(group, [saved_group_of[from_target[name]] for name in names], names, source)
        groups.append(
            {k: v for k, v in group.items() if k not in ("params", "param_names")}
            | carried
            | {"params": indices, "param_names": list(names)}
        )
        for index, name in zip(indices, names, strict=True):
            old_index = saved_index[from_target[name]]
            if old_index in saved_state:
                state[index] = saved_state[old_index]
    return {"state": state, "param_groups": groups}


def _group_state(
    target: Mapping[str, Any], saved: Sequence[Mapping[str, Any]], names: Sequence[str], source: str
) -> dict[str, Any]:
    """The group state (``_abi.GROUP_STATE``: schedule-free SGD's mode and scalars) a target group takes from
    the saved groups that held its params, for the keys it has; they must agree."""
    carried = {}
    for key in GROUP_STATE:
        values = {repr(group[key]): group[key] for group in saved if key in group}
        if key not in target or not values:
            continue
        if len(values) > 1:
            raise CheckpointMismatchError(
                f"{source}: the parameters {listed(list(names))} of one target group come from saved groups "
                f"with different {key} ({listed(sorted(values))}), which is a group's state (schedule-free "
                "SGD's), not a hyperparameter to choose: group them as the checkpoint did, or load it "
                "into an optimizer grouped like the saved one"
            )
        carried[key] = next(iter(values.values()))
    return carried


def _names_by_identity(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """Flat names of an optimizer's parameters, found by identity in ``module``."""
    names = {id(param): name for name, param in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = sum(id(p) not in names for p in params)
    if unknown:
        raise CheckpointMismatchError(
            f"{unknown} of the optimizer's parameters do not belong to {type(module).__name__}; pass "
            "the module the optimizer was built from"
        )
    return [names[id(p)] for p in params]


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    *,
    module: nn.Module | None = None,
    saved_names: Sequence[str] | None = None,
    source: str = "saved optimizer state",
) -> None:
    """Load optimizer state saved under any grouping into ``optimizer``, matching parameters by name.

    Args:
        optimizer: The optimizer to load into (e.g. FusedSGD with decay / no-decay groups).
        saved: The saved optimizer state dict.
        module: The module the optimizer's parameters belong to; names them when its groups carry no
            ``param_names``.
        saved_names: See :func:`remap_optimizer_state_dict`.
        source: What ``saved`` is, for error messages.

    Raises:
        CheckpointMismatchError: See :func:`remap_optimizer_state_dict`; the optimizer is unchanged.
    """
    target_names = None
    if group_names(optimizer.param_groups) is None and module is not None:
        target_names = _names_by_identity(optimizer, module)
    remapped = remap_optimizer_state_dict(
        saved, optimizer.param_groups, saved_names=saved_names, target_names=target_names, source=source
    )
    optimizer.load_state_dict(remapped)
