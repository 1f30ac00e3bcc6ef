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


# A tensor's bits as the integer type of its size, for an exchange by xor without a temporary.
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The params that hold their averages now, by where their values are (device, address): a nested swap leaves
# them in, and the averaged state dict reads the average there.
_HOLDING: set[tuple[torch.device, int]] = set()


def _where(tensor: Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.data_ptr()


def holds_average(param: Tensor) -> bool:
    """Whether ``param`` (a local tensor) holds its average now, inside a :func:`swap`."""
    return param.numel() > 0 and _where(param) in _HOLDING


def _exchange(a: Tensor, b: Tensor) -> None:
    """Exchanges the values of two tensors of one dtype and shape, bit for bit: three xors of their bits where
    an integer type has their element size (no temporary), else through a copy (complex128)."""
    integer = _INTEGER_OF_SIZE.get(a.element_size())
    if integer is None:
        copy = a.clone()
        a.copy_(b)
        b.copy_(copy)
        return
    a, b = a.view(integer), b.view(integer)
    a.bitwise_xor_(b)
    b.bitwise_xor_(a)
    a.bitwise_xor_(b)


Swapped = list[tuple[Tensor, Tensor, Tensor | None]]


@torch.no_grad()
def swap(pairs: list[tuple[Tensor, Tensor]]) -> Swapped:
    """Puts each average into its param and the param's values into the average, in place; returns the swaps
    made, for :func:`unswap`. Where both have one dtype they are exchanged bit for bit; a 16-bit param takes
    its fp32 average rounded to nearest, and its own values wait in a copy of its dtype. A param that holds
    its average already (a swap inside a swap) is left as it is, so the averages stay in until the outer
    swap is undone."""
    swapped: Swapped = []
    for param, average in pairs:
        if holds_average(param):
            continue
        if param.dtype == average.dtype:
            _exchange(param, average)
            swapped.append((param, average, None))
        else:
            swapped.append((param, average, param.clone()))
            param.copy_(average)
        if param.numel() > 0:
            _HOLDING.add(_where(param))
    return swapped


@torch.no_grad()
def unswap(swapped: Swapped) -> None:
    """Undoes a :func:`swap`: every param and average it swapped as they were, bit for bit."""
    for param, average, copy in swapped:
        if copy is None:
            _exchange(param, average)
        else:
            param.copy_(copy)
        _HOLDING.discard(_where(param))


def averaged_state_dict(module: nn.Module, state: Mapping[Tensor, dict[str, Any]]) -> dict[str, Any]:
    """``module.state_dict()`` with each param that has an average replaced by it, in the param's dtype (a
    copy: the module and the optimizer are left as they are); buffers as the module has them."""
    averages = {
        id(p): _held_average(p, state[p][AVERAGE]) for p in module.parameters() if AVERAGE in state.get(p, {})
    }
    names = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}
    result = module.state_dict()
    for name, value in list(result.items()):
        if names.get(name) in averages:
            result[name] = averages[names[name]].to(value.dtype, copy=True)
    return result


def _held_average(param: Tensor, average: Tensor) -> Tensor:
    """Where ``param``'s average is now: in the param while a swap of one dtype has exchanged them, else in
    its state."""
    swapped = param.dtype == average.dtype and holds_average(_dtensor.local(param))
    return param.detach() if swapped else average


def iterate(pairs: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """A context of the averages in their params (:func:`swap`, then :func:`unswap` on leaving)."""
    swapped = swap(pairs)
    try:
        yield
    finally:
        unswap(swapped)
