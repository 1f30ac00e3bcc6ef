"""A parameter group's hyperparameters: checked before anything is written, and encoded into the table the ops
read (columns and encodings: ``lightning_fusedsgd._abi``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi

TORCH_SWITCHES = ("foreach", "fused", "differentiable")
"""``torch.optim.SGD``'s implementation switches: accepted, so configs written for it work, and choosing
nothing (every step runs the fused kernel); ``differentiable=True`` is refused."""


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return str(value.item()) if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, str) else str(value)


def check_group(group: dict[str, Any]) -> None:
    """Raises ValueError, naming the value and the fix, for a hyperparameter the step cannot use. Where
    ``torch.optim.SGD`` refuses the same value, the message starts with torch's words."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}: set a float or a 0-d tensor."
        )
    for column in (*_abi.HPARAMS, *_abi.STEP_HPARAMS):
        value = group[column.key]
        if column.check is None or (isinstance(value, Tensor) and torch.compiler.is_compiling()):
            continue  # a traced step cannot branch on a tensor's value; eager steps check it
        problem = column.check(value)
        if problem is not None:
            start = (column.refused or f"Invalid {column.key}: {{}}").format(_shown(value))
            raise ValueError(f"{start}. {problem}")
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            "Nesterov momentum requires a momentum and zero dampening "
            f"(got momentum={group['momentum']}, dampening={group['dampening']}): "
            "set nesterov=False or choose a momentum > 0 with dampening = 0."
        )
    if group["max_grad_norm"] is not None and group["max_grad_value"] is not None:
        raise ValueError(
            "max_grad_norm and max_grad_value are alternatives (as Lightning's gradient_clip_algorithm "
            "'norm' and 'value'): set one of them, and None for the other."
        )
    for key in TORCH_SWITCHES:
        if group[key] not in (None, False, True):
            raise ValueError(f"Invalid {key}: {_shown(group[key])}. It must be None, True or False.")
    if group["differentiable"]:
        raise ValueError(
            "FusedSGD(differentiable=True): the fused step is not differentiable (it writes the params in "
            "place, outside autograd). Use torch.optim.SGD(differentiable=True) to differentiate through "
            "optimizer steps."
        )


def check_groups(groups: Sequence[dict[str, Any]], label: str = "param_groups") -> None:
    """Every group's check, naming the group, and the one global norm clipping takes."""
    for index, group in enumerate(groups):
        try:
            check_group(group)
        except ValueError as error:
            raise ValueError(f"{label}[{index}]: {error}") from None
    for column in _abi.STEP_HPARAMS:
        values = {group[column.key] for group in groups}
        if len(values) > 1:
            raise ValueError(
                f"{column.key} differs between parameter groups ({sorted(map(str, values))}), but it is one "
                "value for the whole step (max_grad_norm clips the one global norm of every group's "
                f"gradients): set it on the optimizer (FusedSGD(..., {column.key}=...)), not per group."
            )


def step_hparams(groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The values one for the whole step (``_abi.STEP_HPARAMS``, equal in every group: ``check_groups``), as
    the ops take them."""
    return {column.name: column.encode(groups[0][column.key]) for column in _abi.STEP_HPARAMS}


def table(groups: Sequence[dict[str, Any]], lr_on_device: bool) -> Tensor:
    """The hyperparameter table of these groups (``_abi.encode_groups``)."""
    return torch.tensor(_abi.encode_groups(groups, lr_on_device), dtype=torch.float64)


def stacked_lrs(groups: Sequence[dict[str, Any]]) -> Tensor | None:
    """The groups' lrs as one float64 ``[groups]`` tensor where some group's lr is a tensor (the pattern torch
    recommends for compiled optimizers: a traced step reads it without a graph break), else None."""
    lrs = [group["lr"] for group in groups]
    tensors = [lr for lr in lrs if isinstance(lr, Tensor)]
    if not tensors:
        return None
    device = tensors[0].device
    return torch.stack([torch.as_tensor(lr, dtype=torch.float64, device=device).reshape(()) for lr in lrs])
