"""The average of the weights a FusedSGD keeps in its step (``state[p]["ema"]``), put to use: swapped into the
params for evaluation and back, and read out as a model's state dict."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fusedsgd import _abi
from lightning_fusedsgd.optim import _dtensor

AVERAGE = "ema"  # the average's slot (lightning_fusedsgd._abi.SLOTS)


def averaged_params(
    params: Iterable[Tensor], state: Mapping[Tensor, dict[str, Any]]
) -> list[tuple[Tensor, Tensor]]:
    """Each param that has an average, with it (local shards of DTensors)."""
    return [
        (_dtensor.local(p), _dtensor.local(state[p][AVERAGE])) for p in params if AVERAGE in state.get(p, {})
    ]


def check_averaged(decay: float, params: list[Any]) -> None:
    """Refuses a group that asks an average of a param the kernel cannot average (``_abi.check_average``),
    when it is built: ``params`` as a group lists them (tensors, or (name, tensor) pairs)."""
    for index, entry in enumerate(params):
        name, param = entry if isinstance(entry, tuple) else (f"parameter {index}", entry)
        if isinstance(param, Tensor):
            _abi.check_average(decay, param, lambda name=name: name)


def _bits(tensor: Tensor) -> Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@torch.no_grad()
def swap(pairs: list[tuple[Tensor, Tensor]]) -> list[Tensor | None]:
    """Puts each average into its param and the param's values into the average, in place. Where both have
    one dtype (fp32, fp64) they are exchanged bit for bit without a temporary (three xors); a 16-bit param
    takes its fp32 average rounded to nearest, and its own values wait in a copy of its dtype (returned, for
    :func:`unswap`)."""
    kept: list[Tensor | None] = []
    for param, average in pairs:
        if param.dtype == average.dtype:
            a, b = _bits(param), _bits(average)
            a.bitwise_xor_(b)
            b.bitwise_xor_(a)
            a.bitwise_xor_(b)
            kept.append(None)
        else:
            kept.append(param.clone())
            param.copy_(average)
    return kept


@torch.no_grad()
def unswap(pairs: list[tuple[Tensor, Tensor]], kept: list[Tensor | None]) -> None:
    """Undoes :func:`swap`: every param and average as they were, bit for bit."""
    for (param, average), copy in zip(pairs, kept, strict=True):
        if copy is None:
            a, b = _bits(param), _bits(average)
            a.bitwise_xor_(b)
            b.bitwise_xor_(a)
            a.bitwise_xor_(b)
        else:
            param.copy_(copy)


def averaged_state_dict(module: nn.Module, state: Mapping[Tensor, dict[str, Any]]) -> dict[str, Any]:
    """``module.state_dict()`` with each param that has an average replaced by it, in the param's dtype (a
    copy: the module and the optimizer are left as they are); buffers as the module has them."""
    averages = {id(p): state[p][AVERAGE] for p in module.parameters() if AVERAGE in state.get(p, {})}
    names = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}
    result = module.state_dict()
    for name, value in list(result.items()):
        if names.get(name) in averages:
            result[name] = averages[names[name]].to(value.dtype, copy=True)
    return result


def iterate(pairs: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """A context of the averages in their params (:func:`swap`, then :func:`unswap` on leaving)."""
    kept = swap(pairs)
    try:
        yield
    finally:
        unswap(pairs, kept)
