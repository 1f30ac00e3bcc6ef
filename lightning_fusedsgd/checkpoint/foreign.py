"""Starting a run from a checkpoint made elsewhere: a Lightning run, torchvision's reference script
(its unnamed groups reconstructed from its arguments) or a bare state dict, validated against the module
before anything changes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_fusedsgd import _abi
from lightning_fusedsgd._abi import LOW_PRECISION, seeded
from lightning_fusedsgd.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_fusedsgd.checkpoint.files import check_optimizer_state_dict, read_checkpoint_file
from lightning_fusedsgd.checkpoint.remap import group_names, listed, match_names, state_shapes


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
        weights = checkpoint["state_dict"]
        if not (isinstance(weights, Mapping) and all(isinstance(v, torch.Tensor) for v in weights.values())):
            raise CheckpointError(
                f"checkpoint {path!r} is a Lightning checkpoint whose 'state_dict' is not a dict of tensors "
                "(names to weights): it is damaged or was edited; use the checkpoint the run wrote"
            )
        optimizer_states = [] if weights_only else checkpoint.get("optimizer_states") or [None]
        if not isinstance(optimizer_states, (list, tuple)):
            raise CheckpointError(
                f"checkpoint {path!r} is a Lightning checkpoint whose 'optimizer_states' is a "
                f"{type(optimizer_states).__name__}, not a list of optimizer state dicts: it is damaged or "
                "was edited; use the checkpoint the run wrote, or start from its weights only "
                "(weights_only=True)"
            )
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
        return "lightning", weights, next(iter(optimizer_states), None), meta
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
    keys = listed(sorted(map(str, checkpoint)))
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


def _named_optimizer_state(
    optimizer_state: Any, module: nn.Module, kind: str, args: Any, path: str
) -> dict[str, Any]:
    """The saved optimizer state with ``param_names`` (the module's names) in every group, checked by name
    and shape against ``module`` now, so a CLI validating its inputs before building the Trainer fails
    there, before it creates or overwrites anything."""
    check_optimizer_state_dict(optimizer_state, source=f"the optimizer state in checkpoint {path!r}")
    saved_groups = optimizer_state["param_groups"]
    names = group_names(saved_groups)
    if names is None:
        names = (
            _torchvision_group_names(module, args)
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
    state = optimizer_state["state"]
    saved_shapes = {
        name: state_shapes(state.get(index, {}))
        for group_names, group in zip(names, saved_groups, strict=True)
        for name, index in zip(group_names, group["params"], strict=True)
    }
    # Parameters without saved state (e.g. frozen ones) are checked later against the real optimizer.
    to_module = match_names(
        saved_shapes,
        {name: p.shape for name, p in module.named_parameters()},
        source=path,
        what="optimizer parameter names",
        allow_missing=True,
    )
    return {
        "state": state,
        "param_groups": [
            group | {"param_names": [to_module[n] for n in group_names]}
            for group_names, group in zip(names, saved_groups, strict=True)
        ],
    }


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
    rename = match_names(
        {name: {"": tensor.shape} for name, tensor in weights.items()},
        expected,
        source=path,
        what="model weights",
    )
    model_state = {rename[name]: tensor for name, tensor in weights.items()}

    if weights_only or optimizer_state is None:
        optimizer_state = None
    else:
        optimizer_state = _named_optimizer_state(optimizer_state, module, kind, meta.get("args"), path)
    return StartState(
        path=path,
        kind=kind,
        model_state=model_state,
        optimizer_state=optimizer_state,
        epoch=meta.get("epoch"),
        global_step=meta.get("global_step"),
        lr_scheduler_states=meta.get("lr_scheduler_states"),
    )


def seed_state_from_weights(
    optimizer: torch.optim.Optimizer, module: nn.Module, weights: Mapping[str, torch.Tensor]
) -> None:
    """Start the state of each bf16/fp16 parameter that is seeded from its weight (the slots whose
    ``Slot.seed`` is ``"weight"`` or ``"residual"``: fp32 master weights, Kahan compensations, schedule-free's
    z) from the checkpoint's fp32 weights, where the parameter's group holds it and its state does not yet
    (state loaded from the checkpoint's optimizer state, such as a z, is kept).

    Under ``precision="bf16-true"`` Lightning casts the module before the optimizer exists, so a master
    copy made from the parameter would lose the low bits the checkpoint still has, and a compensation
    started at 0 would too. A compensation holds what rounding the fp32 weight to the parameter dropped,
    where the parameter holds that rounding (the kernel keeps it below half an ulp of the parameter).
    Parameters that are not bf16/fp16, hold no such state, or have no fp32 weight in ``weights`` are left
    alone, as are groups of an optimizer other than FusedSGD.

    Args:
        optimizer: The optimizer (FusedSGD) whose state receives the seeded state.
        module: The module the optimizer's parameters belong to; names them.
        weights: Weights under ``module``'s parameter names, e.g. :attr:`StartState.model_state`.
    """
    names = {id(param): name for name, param in module.named_parameters()}
    for group in optimizer.param_groups:
        if not all(option.key in group for option in _abi.options()):
            continue  # not FusedSGD's: no slots
        for param in group["params"]:
            saved = weights.get(names.get(id(param), ""))
            if saved is None or saved.dtype != torch.float32 or param.dtype not in LOW_PRECISION:
                continue
            for slot in _abi.SLOTS:
                held = slot.held(group, param.dtype) and slot.key not in optimizer.state.get(param, {})
                if slot.seed in ("weight", "residual") and held:
                    dtype = slot.dtype(group, param.dtype)
                    value = seeded(slot, param.detach(), saved.to(param.device), dtype)
                    optimizer.state[param][slot.key] = value
