"""The average of the weights a FusedSGD keeps in its step (``state[p]["ema"]``), put to use: swapped into the
params for evaluation and back, and read out as a model's state dict."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_avg_fn

from lightning_fusedsgd import _abi, _checks
from lightning_fusedsgd.optim import _dtensor

# The average's slots (lightning_fusedsgd._abi.SLOTS): the average, its applied steps, its updates.
AVERAGE, STEP, UPDATES = "ema", "ema_step", "ema_updates"


def averaged_params(
    params: Iterable[Tensor], state: Mapping[Tensor, dict[str, Any]]
) -> list[tuple[Tensor, Tensor]]:
    """Each param that has an average, with it (local shards of DTensors)."""
    return [
        (_dtensor.local(p), _dtensor.local(state[p][AVERAGE])) for p in params if AVERAGE in state.get(p, {})
    ]


def check_group(defaults: Mapping[str, Any], group: Mapping[str, Any]) -> None:
    """Refuses a new group (``add_param_group``) that asks an average of a param the kernel cannot average."""
    decay = {**defaults, **group}["ema_decay"]
    if decay is not None:
        check_averaged(decay, group["params"])


def check_averaged(decay: float, params: list[Any]) -> None:
    """Refuses a group that asks an average of a param the kernel cannot average (``_checks.check_average``),
    when it is built: ``params`` as a group lists them (tensors, or (name, tensor) pairs)."""
    for index, entry in enumerate(params):
        name, param = entry if isinstance(entry, tuple) else (f"parameter {index}", entry)
        if isinstance(param, Tensor):
            _checks.check_average(decay, param, lambda name=name: name)


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


@torch.no_grad()
def update_outside_step(groups: list[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]) -> None:
    """An update of every average outside a step, by the function ``torch.optim.swa_utils.get_ema_avg_fn``
    applies (its group's decay, no warmup; the first update copies), on the weight the state holds, counted
    as an update of each."""
    for group in groups:
        update = get_ema_avg_fn(group["ema_decay"]) if group["ema_decay"] is not None else None
        for param in group["params"]:
            held = state.get(param, {})
            if update is None or AVERAGE not in held:
                continue
            average, updates = held[AVERAGE], int(held[UPDATES])
            weight = _abi.stored_weight(param.detach(), held).to(average.dtype)
            average.copy_(weight if updates == 0 else update(average, weight, updates))
            held[UPDATES] += 1


def seed(
    groups: list[dict[str, Any]],
    state: dict[Tensor, dict[str, Any]],
    averages: Mapping[Tensor, Tensor],
    step: int,
    updates: int,
) -> int:
    """Gives each param of an averaging group that has no average the one in ``averages`` (by param: another
    callback's or a checkpoint's), as of ``step`` applied steps and ``updates`` updates; returns how many."""
    seeded = 0
    for group in groups:
        if group["ema_decay"] is None:
            continue
        for param in group["params"]:
            held = state[param]
            if AVERAGE in held or param not in averages:
                continue
            dtype = _abi.slot(AVERAGE).dtype(group, param.dtype)
            held[AVERAGE] = averages[param].to(param.device, dtype, copy=True)
            held[STEP] = torch.tensor(step, device=param.device)
            held[UPDATES] = torch.tensor(updates, device=param.device)
            seeded += 1
    return seeded


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
