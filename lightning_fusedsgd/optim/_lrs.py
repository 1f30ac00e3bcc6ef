"""Where a step reads its lrs when they are tensors: a capturable optimizer's lr storage, one float64
``[groups]`` tensor on the params' device whose elements are the groups' ``lr`` (0-d views), which the kernel
reads there; or, for a plain step, the groups' lrs stacked where one is a tensor (the pattern torch recommends
for
compiled optimizers: a traced step reads it without a graph break)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class LrStorage:
    """A capturable optimizer's lrs on the params' device: ``tensor`` holds them, each group's ``lr`` a view
    of it; an lr the user replaced (a number, another tensor) is copied in at the next :meth:`of`."""

    def __init__(self) -> None:
        self.tensor: Tensor | None = None
        self.views: list[Tensor] = []

    def of(self, groups: Sequence[dict[str, Any]]) -> Tensor:
        """The groups' lrs as the one float64 ``[groups]`` tensor, bound anew where groups were added."""
        if self.tensor is None or len(self.views) != len(groups):
            self.bind(groups)
        for group, view in zip(groups, self.views, strict=True):
            if group["lr"] is not view:
                _store(view, group["lr"])
                group["lr"] = view
        return self.tensor

    def bind(self, groups: Sequence[dict[str, Any]]) -> None:
        """Makes every group's lr a view of a new ``[groups]`` float64 tensor on the params' device."""
        devices = {p.device for group in groups for p in group["params"]}
        if len(devices) != 1:
            raise ValueError(
                f"capturable=True keeps the lrs on the params' device, and these params are on "
                f"{sorted(map(str, devices))}: move the model to one device, or use one optimizer per device."
            )
        lrs = torch.empty(len(groups), dtype=torch.float64, device=devices.pop())
        self.views = list(lrs.unbind())
        for group, view in zip(groups, self.views, strict=True):
            _store(view, group["lr"])
            group["lr"] = view
        self.tensor = lrs

    def check_device(self, devices: set[torch.device]) -> None:
        """Refuses a new group whose params are not on the lrs' device."""
        if self.tensor is not None and devices and devices != {self.tensor.device}:
            raise ValueError(
                f"capturable=True keeps the lrs on the params' device, {self.tensor.device}, and this "
                f"group's params are on {next(iter(devices))}: move them there, or use one optimizer per "
                "device."
            )


def _store(view: Tensor, lr: float | Tensor) -> None:
    """Writes an lr into its slot of the storage, on the device."""
    if isinstance(lr, Tensor):
        view.copy_(lr)
    else:
        view.fill_(lr)


def stacked_lrs(groups: Sequence[dict[str, Any]]) -> Tensor | None:
    """The groups' lrs as one float64 ``[groups]`` tensor where some group's lr is a tensor, else None."""
    lrs = [group["lr"] for group in groups]
    tensors = [lr for lr in lrs if isinstance(lr, Tensor)]
    if not tensors:
        return None
    device = tensors[0].device
    return torch.stack([torch.as_tensor(lr, dtype=torch.float64, device=device).reshape(()) for lr in lrs])


def as_numbers(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A capturable optimizer's state dict with its lrs (and a scheduler's ``initial_lr``) as numbers, read
    from the device, so that checkpoints are those of a plain step."""
    for group in state_dict["param_groups"]:
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), Tensor) and group[key].numel() == 1:
                group[key] = float(group[key])
    return state_dict
