"""Checkpoints that keep momentum, master weights and the schedule: read, validate, remap, write.

Plain PyTorch (the Lightning glue is in :mod:`lightning_fusedsgd.lightning.checkpointing`). Four jobs,
each usable on its own:

* **Read safely.** :func:`read_checkpoint_file` verifies the zip records' CRC32 (``torch.load`` does
  not, so a flipped byte in tensor data would load silently) and turns every failure into a
  :class:`CheckpointError` that names the file.
* **Remap optimizer state by name.** :func:`remap_optimizer_state_dict` moves per-parameter state
  (``momentum_buffer``, ``master_param``) from a saved grouping to another, e.g. a one-group
  ``torch.optim.SGD`` checkpoint into a FusedSGD with decay / no-decay groups. Tensors are moved, not
  recomputed, so buffers stay bit-identical.
* **Start a run from a foreign checkpoint.** :func:`read_start_checkpoint` reads a Lightning, a
  torchvision-reference (``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``) or a plain
  weights file and validates it against a module before anything changes; :func:`load_optimizer_state`
  and :func:`seed_master_weights` apply it.
* **Write atomically.** :func:`save_checkpoint_file` writes to a temporary file in the target
  directory, fsyncs, renames and fsyncs the directory, so the target is always either the old or the
  new complete checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import pickle
import secrets
import zipfile
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "InvalidOptimizerStateError",
    "check_optimizer_state_dict",
    "StartState",
    "load_optimizer_state",
    "read_checkpoint_file",
    "read_start_checkpoint",
    "remap_optimizer_state_dict",
    "same_param_layout",
    "save_checkpoint_file",
    "seed_master_weights",
]

# torchvision's reference script stores its argparse namespace under "args".
_SAFE_GLOBALS = [argparse.Namespace]
# How many names an error message lists per category before summarizing.
_MAX_LISTED = 8
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_USE_INTACT = "Nothing was loaded; use an intact checkpoint, e.g. an earlier one from the same directory."


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: missing, unreadable, truncated, corrupted or of unknown layout."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (parameter names or shapes)."""


class InvalidOptimizerStateError(CheckpointError, ValueError):
    """An optimizer state dict is malformed: not a dict, missing keys, or values that cannot be state."""


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _verify_zip_integrity(path: str) -> None:
    """Check every record's CRC32; a non-zip file (legacy format or truncated) is left to torch.load."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad_record = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path!r}: it is truncated or corrupted ({exc}). {_USE_INTACT}"
        ) from exc
    if bad_record is not None:
        raise CheckpointError(
            f"checkpoint {path!r} is corrupted: record {bad_record!r} fails its CRC check (the bytes "
            f"changed after it was written). {_USE_INTACT}"
        )


def _unreadable(path: str, exc: BaseException) -> CheckpointError:
    """The error for a file ``torch.load`` could not read, telling unsafe content from corruption."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, pickle.UnpicklingError) and message.startswith("Weights only load failed"):
        # torch's message is long; the line naming the refused object is the useful part.
        detail = next(
            (line.strip() for line in str(exc).splitlines() if "Unsupported global" in line), message
        )
        return CheckpointError(
            f"checkpoint {path!r} holds pickled Python objects that a weights-only load refuses "
            f"({detail}). Nothing was loaded; if you trust the file's source, load it without that "
            "restriction (trusted=True here, Trainer.fit(..., weights_only=False) for a ckpt_path)."
        )
    return CheckpointError(
        f"cannot read checkpoint {path!r}: it is truncated or corrupted ({type(exc).__name__}: "
        f"{message}). {_USE_INTACT}"
    )


def read_checkpoint_file(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    trusted: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint file after checking that it is complete and uncorrupted.

    Args:
        path: The checkpoint file.
        map_location: Passed to ``torch.load``.
        trusted: Allow arbitrary pickled objects (``weights_only=False``). Only for files from a
            source you trust; the default also accepts torchvision's ``args`` namespace.

    Returns:
        The checkpoint dict.

    Raises:
        CheckpointError: If the file is missing, truncated, corrupted, holds objects a weights-only
            load refuses, or is not a dict. The message names the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist or is not a file; check the path")
    _verify_zip_integrity(path)
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            checkpoint = torch.load(path, map_location=map_location, weights_only=not trusted)
    except Exception as exc:  # torch.load raises many types for damaged files; all mean "unreadable"
        raise _unreadable(path, exc) from exc
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"checkpoint {path!r} holds a {type(checkpoint).__name__}, not a checkpoint dict; expected a "
            "Lightning checkpoint, a torchvision reference checkpoint or a state dict"
        )
    return checkpoint


# --------------------------------------------------------------------------------------------------
# Matching names
# --------------------------------------------------------------------------------------------------


def _listed(items: Sequence[str]) -> str:
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


def _match_names(
    saved_shapes: Mapping[str, Collection[torch.Size]],
    target_shapes: Mapping[str, torch.Size],
    *,
    source: str,
    what: str,
    allow_missing: bool = False,
) -> dict[str, str]:
    """Map every saved name to a target name, or raise naming what is missing, extra or reshaped.

    Args:
        saved_shapes: Saved name -> shapes of the tensors stored for it (empty if none).
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
        f"{mapping[name]} (checkpoint {' / '.join(str(list(s)) for s in sorted(set(shapes), key=tuple))}, "
        f"model {list(target_shapes[mapping[name]])})"
        for name, shapes in saved_shapes.items()
        if mapping[name] in target_shapes and any(s != target_shapes[mapping[name]] for s in shapes)
    ]
    problems = [
        f"  {label} ({len(items)}): {_listed(items)}"
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


def _group_names(groups: Sequence[Mapping[str, Any]]) -> list[list[str]] | None:
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


def check_optimizer_state_dict(state_dict: Any, source: str = "the optimizer state dict") -> None:
    """Checks that ``state_dict`` is laid out as ``Optimizer.state_dict()`` makes it, with usable tensors.

    Raises:
        InvalidOptimizerStateError: Naming what is wrong (and the parameter, where it has a name).
    """
    fix = (
        "load what optimizer.state_dict() returned "
        "(for a Lightning checkpoint: checkpoint['optimizer_states'][0])"
    )
    if not isinstance(state_dict, Mapping):
        raise InvalidOptimizerStateError(f"{source} is a {type(state_dict).__name__}, not a dict: {fix}.")
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        raise InvalidOptimizerStateError(f"{source} has no {' or '.join(map(repr, missing))} entry: {fix}.")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(state, Mapping) or not isinstance(groups, Sequence):
        raise InvalidOptimizerStateError(
            f"{source}: 'state' must be a dict and 'param_groups' a list: {fix}."
        )
    names = {}
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise InvalidOptimizerStateError(
                f"{source}: param_groups[{index}] has no 'params' list of parameter ids: {fix}."
            )
        names.update(zip(group["params"], group.get("param_names") or ()))
    for saved_id, entry in state.items():
        label = f"'{names[saved_id]}'" if saved_id in names else f"parameter {saved_id!r}"
        if not isinstance(entry, Mapping):
            raise InvalidOptimizerStateError(
                f"{source}: the state of {label} is a {type(entry).__name__}, not a dict: {fix}."
            )
        for key, value in entry.items():
            if key == "step" or value is None:  # other optimizers' step counts; torch's absent buffer
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidOptimizerStateError(
                    f"{source}: the {key} of {label} is a {type(value).__name__}, not a tensor: the state "
                    f"is damaged or not an optimizer's; {fix}."
                )
            if value.is_meta:
                raise InvalidOptimizerStateError(
                    f"{source}: the {key} of {label} is on the meta device and holds no values: load the "
                    "checkpoint with its data (torch.load(path, map_location='cpu')), not a meta-device copy."
                )


def _state_shapes(state: Mapping[str, Any]) -> list[torch.Size]:
    """Shapes of a parameter's per-element state tensors (0-d ones, like a step count, are skipped)."""
    return [value.shape for value in state.values() if isinstance(value, torch.Tensor) and value.ndim > 0]


# --------------------------------------------------------------------------------------------------
# Optimizer state remapping
# --------------------------------------------------------------------------------------------------


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
    saved_names, target_names = _group_names(saved_groups), _group_names(target_groups)
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

    Per-parameter state (``momentum_buffer``, ``master_param``, ...) follows its parameter's name into
    whichever target group holds it; the tensors are the saved ones, shared, not copied or recomputed.
    The target groups' hyperparameters (lr, weight_decay, lars, ...) are kept: the saved groups no
    longer correspond to them. Names may differ by a shared leading prefix (``module.`` from DDP,
    ``model.`` from a LightningModule attribute), which is swapped automatically.

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
        CheckpointMismatchError: If names are unavailable or their count is wrong, a parameter is
            missing on either side, or a state tensor's shape differs from its target parameter. The
            message names the parameters; nothing is modified.
    """
    saved_groups = saved["param_groups"]
    saved_by_group = _group_names(saved_groups)
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
    target_by_group = _group_names(target_groups)
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
        raise CheckpointMismatchError(f"{source}: parameter names repeat ({_listed(repeated)})")
    saved_index = dict(zip(flat_saved, (i for group in saved_groups for i in group["params"]), strict=True))
    saved_state = saved["state"]
    saved_shapes = {name: _state_shapes(saved_state.get(index, {})) for name, index in saved_index.items()}
    target_shapes = {
        name: param.shape
        for names, group in zip(target_by_group, target_groups, strict=True)
        for name, param in zip(names, group["params"], strict=True)
    }
    to_target = _match_names(saved_shapes, target_shapes, source=source, what="optimizer parameter names")
    from_target = {target: saved_name for saved_name, target in to_target.items()}

    groups, state, next_index = [], {}, 0
    for names, group in zip(target_by_group, target_groups, strict=True):
        indices = list(range(next_index, next_index + len(names)))
        next_index += len(names)
        groups.append(
            {k: v for k, v in group.items() if k not in ("params", "param_names")}
            | {"params": indices, "param_names": list(names)}
        )
        for index, name in zip(indices, names, strict=True):
            old_index = saved_index[from_target[name]]
            if old_index in saved_state:
                state[index] = saved_state[old_index]
    return {"state": state, "param_groups": groups}


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
    if _group_names(optimizer.param_groups) is None and module is not None:
        target_names = _names_by_identity(optimizer, module)
    remapped = remap_optimizer_state_dict(
        saved, optimizer.param_groups, saved_names=saved_names, target_names=target_names, source=source
    )
    optimizer.load_state_dict(remapped)


# --------------------------------------------------------------------------------------------------
# Starting a run from a checkpoint made elsewhere
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StartState:
    """A checkpoint validated against a module, ready to start a run from.

    Attributes:
        path: The file it came from.
        kind: ``"lightning"``, ``"torchvision"`` or ``"weights"`` (a bare state dict).
        model_state: Weights and buffers under the module's ``state_dict`` names.
        optimizer_state: The saved optimizer state dict with ``param_names`` (the module's names) in
            every group, or None for a weights-only start.
        epoch: The epoch recorded in the file, if any (torchvision: the last completed epoch;
            Lightning: the epoch in progress when saved).
        global_step: Optimizer steps recorded in the file (Lightning checkpoints only).
        lr_scheduler_states: The saved lr schedulers' states (Lightning checkpoints only; None when the
            file has no ``lr_schedulers`` entry).
    """

    path: str
    kind: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    epoch: int | None = None
    global_step: int | None = None
    lr_scheduler_states: list[dict[str, Any]] | None = None


def _is_state_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def _unpack(
    checkpoint: dict[str, Any], path: str, weights_only: bool
) -> tuple[str, Mapping[str, torch.Tensor], Any, dict[str, Any]]:
    """(kind, weights, optimizer state or None, metadata) of a checkpoint in any supported layout."""
    if "pytorch-lightning_version" in checkpoint and "state_dict" in checkpoint:
        optimizer_states = [] if weights_only else checkpoint.get("optimizer_states") or [None]
        if len(optimizer_states) > 1:
            raise CheckpointError(
                f"checkpoint {path!r} holds {len(optimizer_states)} optimizers; starting from it supports "
                "one. Start from its weights only (weights_only=True)."
            )
        meta = {
            "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step"),
            "lr_scheduler_states": checkpoint.get("lr_schedulers"),
        }
        return "lightning", checkpoint["state_dict"], next(iter(optimizer_states), None), meta
    if _is_state_dict(checkpoint.get("model")):
        return (
            "torchvision",
            checkpoint["model"],
            checkpoint.get("optimizer"),
            {
                "epoch": checkpoint.get("epoch"),
                "args": checkpoint.get("args"),
            },
        )
    if _is_state_dict(checkpoint.get("state_dict")):
        return "weights", checkpoint["state_dict"], None, {}
    if _is_state_dict(checkpoint):
        return "weights", checkpoint, None, {}
    keys = _listed(sorted(map(str, checkpoint)))
    raise CheckpointError(
        f"checkpoint {path!r} has an unknown layout (top-level keys: {keys}); "
        "expected a Lightning checkpoint, a torchvision reference checkpoint ({'model', 'optimizer', "
        "'lr_scheduler', 'epoch'}) or a state dict of tensors"
    )


# torchvision's default norm classes for --norm-weight-decay (references/classification/utils.py).
_TORCHVISION_NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def _torchvision_group_names(module: nn.Module, args: Any) -> list[list[str]]:
    """Reconstruct the groups torchvision's reference script built from its command-line ``args``.

    Its optimizer holds no names: parameters were sorted into groups "other", "norm" (only with
    ``--norm-weight-decay``) and one per custom key (``--bias-weight-decay``,
    ``--transformer-embedding-decay``), each in module traversal order, frozen ones left out, empty
    groups dropped. A key containing a dot is compared with the qualified name, others with the
    attribute name. Scripts too old to have these options built one group of all parameters.
    """
    if args is None or not hasattr(args, "norm_weight_decay"):
        return [[name for name, _ in module.named_parameters()]]
    keys: list[str] = []
    if getattr(args, "bias_weight_decay", None) is not None:
        keys.append("bias")
    if getattr(args, "transformer_embedding_decay", None) is not None:
        keys += ["class_token", "position_embedding", "relative_position_bias_table"]
    groups: dict[str, list[str]] = {"other": [], "norm": []} | {key: [] for key in keys}
    for prefix, submodule in module.named_modules():
        for attr, param in submodule.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            qualified = f"{prefix}.{attr}" if prefix else attr
            key = next((k for k in keys if k == (qualified if "." in k else attr)), None)
            if key is None:
                norm = args.norm_weight_decay is not None and isinstance(submodule, _TORCHVISION_NORMS)
                key = "norm" if norm else "other"
            groups[key].append(qualified)
    return [names for names in groups.values() if names]


def _fallback_names(
    module: nn.Module, saved_groups: Sequence[Mapping[str, Any]], path: str
) -> list[list[str]]:
    """Names for an unnamed single-group optimizer: the module's parameter order (all, or trainable)."""
    count = sum(len(group["params"]) for group in saved_groups)
    every = [name for name, _ in module.named_parameters()]
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    if len(saved_groups) == 1 and count in (len(every), len(trainable)):
        return [every if count == len(every) else trainable]
    raise CheckpointMismatchError(
        f"checkpoint {path!r}: its optimizer state has no param_names, {len(saved_groups)} group(s) and "
        f"{count} parameters, while the model has {len(every)} ({len(trainable)} trainable), so they "
        "cannot be matched by name. Nothing was loaded; start from its weights only "
        "(weights_only=True), or remap it yourself with remap_optimizer_state_dict(saved_names=...)."
    )


def read_start_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    *,
    weights_only: bool = False,
    trusted: bool = False,
) -> StartState:
    """Read a checkpoint to start a run from and validate it against ``module``, changing nothing.

    Accepted layouts: a Lightning checkpoint (``state_dict``, ``optimizer_states``), a torchvision
    reference checkpoint (``model``, ``optimizer`` from ``torch.optim.SGD``, ``args``, ``epoch``; its
    unnamed parameter groups are reconstructed from ``args``), and bare state dicts (weights only).
    Weight names may differ from the module's by a shared prefix (``module.`` from DDP, ``model.``
    when the LightningModule holds the network as ``self.model``).

    Args:
        path: The checkpoint file.
        module: The module (usually the LightningModule) the run trains.
        weights_only: Ignore any optimizer state in the file.
        trusted: See :func:`read_checkpoint_file`.

    Returns:
        The validated :class:`StartState`.

    Raises:
        CheckpointError: If the file is missing, damaged or of an unknown layout.
        CheckpointMismatchError: If weights or optimizer state do not fit ``module``: the message
            names the missing, extra and reshaped parameters.
    """
    path = os.fspath(path)
    checkpoint = read_checkpoint_file(path, trusted=trusted)
    kind, weights, optimizer_state, meta = _unpack(checkpoint, path, weights_only)

    expected = {name: tensor.shape for name, tensor in module.state_dict().items()}
    rename = _match_names(
        {name: [tensor.shape] for name, tensor in weights.items()},
        expected,
        source=path,
        what="model weights",
    )
    model_state = {rename[name]: tensor for name, tensor in weights.items()}

    if weights_only or optimizer_state is None:
        optimizer_state = None
    else:
        check_optimizer_state_dict(optimizer_state, source=f"the optimizer state in checkpoint {path!r}")
        saved_groups = optimizer_state["param_groups"]
        names = _group_names(saved_groups)
        if names is None:
            names = (
                _torchvision_group_names(module, meta["args"])
                if kind == "torchvision"
                else _fallback_names(module, saved_groups, path)
            )
            saved_sizes = [len(g["params"]) for g in saved_groups]
            if [len(n) for n in names] != saved_sizes:
                raise CheckpointMismatchError(
                    f"checkpoint {path!r}: its optimizer groups have sizes {saved_sizes}, the model's "
                    f"parameters grouped as the saving script did give {[len(n) for n in names]}. "
                    "Nothing was loaded; the checkpoint comes from a different model, or start from its "
                    "weights only (weights_only=True)."
                )
        # Check names and shapes now, so a CLI validating its inputs before building the Trainer fails
        # there, before it creates or overwrites anything.
        state = optimizer_state["state"]
        saved_shapes = {
            name: _state_shapes(state.get(index, {}))
            for group_names, group in zip(names, saved_groups, strict=True)
            for name, index in zip(group_names, group["params"], strict=True)
        }
        # Parameters without saved state (e.g. frozen ones) are checked later against the real optimizer.
        to_module = _match_names(
            saved_shapes,
            {name: p.shape for name, p in module.named_parameters()},
            source=path,
            what="optimizer parameter names",
            allow_missing=True,
        )
        optimizer_state = {
            "state": state,
            "param_groups": [
                group | {"param_names": [to_module[n] for n in group_names]}
                for group_names, group in zip(names, saved_groups, strict=True)
            ],
        }
    return StartState(
        path=path,
        kind=kind,
        model_state=model_state,
        optimizer_state=optimizer_state,
        epoch=meta.get("epoch"),
        global_step=meta.get("global_step"),
        lr_scheduler_states=meta.get("lr_scheduler_states"),
    )


def seed_master_weights(
    optimizer: torch.optim.Optimizer, module: nn.Module, weights: Mapping[str, torch.Tensor]
) -> None:
    """Give master-weighted bf16/fp16 parameters the checkpoint's fp32 weights as their master copy.

    Under ``precision="bf16-true"`` Lightning casts the module before the optimizer exists, so a master
    copy made from the parameter would lose the low bits the checkpoint still has. Parameters that are
    not bf16/fp16, not in a ``master_weights`` group, or have no fp32 weight in ``weights`` are left
    alone.

    Args:
        optimizer: The optimizer (FusedSGD) whose state receives the master copies.
        module: The module the optimizer's parameters belong to; names them.
        weights: Weights under ``module``'s parameter names, e.g. :attr:`StartState.model_state`.
    """
    names = {id(param): name for name, param in module.named_parameters()}
    for group in optimizer.param_groups:
        if not group.get("master_weights"):
            continue
        for param in group["params"]:
            saved = weights.get(names.get(id(param), ""))
            if param.dtype in _LOW_PRECISION and saved is not None and saved.dtype == torch.float32:
                optimizer.state[param]["master_param"] = saved.to(param.device, copy=True)


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------


def _temp_name(target: Path) -> Path:
    # Hidden and not ending in .ckpt, so ModelCheckpoint never mistakes it for a checkpoint; the pid
    # lets a later save tell a dead writer's leftover from a live one.
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _remove_stale_temps(target: Path) -> None:
    """Delete temporary files of ``target`` left by writers that were killed mid-write."""
    for temp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        pid = temp.name[len(target.name) + 2 :].split(".")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            temp.unlink(missing_ok=True)
        except PermissionError:  # alive, owned by someone else
            continue


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a local ``path`` so that it is always either the old or the new complete file.

    Writes a hidden temporary file next to ``path`` (same filesystem, so the rename is atomic), flushes
    and fsyncs it, renames it over ``path`` with ``os.replace`` and fsyncs the directory, so the rename
    survives a power loss too. A failed write removes its temporary file; one left by a killed process
    is removed by the next save of the same file.

    Args:
        obj: What to save (a checkpoint dict).
        path: The target file; its directory is created if needed.

    Raises:
        OSError: If writing fails (disk full...); ``path`` then still holds the previous checkpoint.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    temp = _temp_name(target)
    try:
        # O_EXCL never clobbers; mode 0o666 leaves permissions to the umask, as a plain open() would.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)
