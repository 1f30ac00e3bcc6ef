"""Params that share memory: an ``expand()``ed param, whose elements share memory, and params that are
overlapping views of one storage. One fused call would update shared elements twice at once, where
torch.optim.SGD updates them one param after the other, so the plan refuses both before anything is
written."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def has_internal_overlap(tensor: Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (an ``expand()``ed tensor): no step can write it."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _element_offsets(tensor: Tensor) -> Tensor:
    """The storage offset of every element of ``tensor``."""
    offsets = torch.full((), tensor.storage_offset(), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.flatten()


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose address ranges intersect share an element (exactly, for one dtype)."""
    if a.dtype != b.dtype or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    return bool(torch.isin(_element_offsets(a), _element_offsets(b)).any())


def check_no_overlap(stepped: Sequence[tuple[Tensor, Callable[[], str]]]) -> None:
    """Refuses params (each with the function that names it in a message) that are overlapping views of one
    storage."""
    spans = []  # (device, first byte, end byte, index in stepped), sorted by device and first byte
    for index, (param, _) in enumerate(stepped):
        if param.numel():
            extent = 1 + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))
            start = param.data_ptr()
            spans.append((str(param.device), start, start + extent * param.element_size(), index))
    spans.sort(key=lambda span: span[:2])
    for i, (device, _, end, index) in enumerate(spans):
        for next_device, next_start, _, next_index in spans[i + 1 :]:
            if next_device != device or next_start >= end:
                break
            (param, label), (next_param, next_label) = stepped[index], stepped[next_index]
            if not _overlap(param, next_param):
                continue
            raise ValueError(
                f"{label()} and {next_label()} are overlapping views of one tensor's memory, so one step "
                "would update the shared elements twice: pass parameters that do not overlap (e.g. the base "
                "tensor once, or views that split it), or use torch.optim.SGD for this case."
            )
