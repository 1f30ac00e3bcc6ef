"""What the optimizer tests share, written once: parameter sets, gradients, copies, and snapshots that prove a
refusal changed nothing."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn

# A script for a fresh Python: two steps that must fall back to the reference (the kernel refused to load) and
# still reach the hand-computed result, 1 - 2 x 0.5 x 1 = 0.
STEP_TWICE_ON_THE_REFERENCE = """
import torch
from lightning_fusedsgd import FusedSGD
p = torch.nn.Parameter(torch.ones(4))
optimizer = FusedSGD([p], lr=0.5)
for _ in range(2):
    p.grad = torch.ones(4)
    optimizer.step()
assert optimizer.last_backends == {"cpu/float32": "reference"}, optimizer.last_backends
assert torch.equal(p.detach(), torch.zeros(4))
"""

# Shapes a step meets in vision models: a conv weight (channels_last), a bias, an odd-sized matrix, a tensor
# spanning several kernel chunks and past the single-thread threshold, and a small conv weight.
SHAPES = [(8, 3, 3, 3), (8,), (33, 17), (70_000,), (3, 5, 4, 4)]

# Elements of a 16-bit param whose step runs on whole vectors then element by element: two vectors of the
# widest build (AVX-512: 32 bf16/fp16 a vector) and a tail of 3.
VECTORS_AND_TAIL = 67


def make_params(
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    channels_last: bool = True,
) -> list[nn.Parameter]:
    """Random params of ``shapes``; 4-d ones channels_last unless told otherwise."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        if channels_last and p.dim() == 4:
            p = p.contiguous(memory_format=torch.channels_last)
        params.append(nn.Parameter(p))
    return params


def clone_params(params: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    """Independent copies, with the same values and memory formats."""
    return [nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in params]


def set_grads(param_sets: Sequence[Sequence[torch.Tensor]], step: int, generator: torch.Generator) -> None:
    """The same gradients on every copy. Some params get no grad on some steps (skipped, as torch does) and
    4-d
    grads alternate between layouts, so steps see params without grads and grads laid out unlike their
    param."""
    for i, p in enumerate(param_sets[0]):
        if (step + i) % 7 == 3:
            grad = None
        else:
            grad = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
            if p.dim() == 4 and step % 2:
                grad = grad.contiguous(memory_format=torch.channels_last)
        for params in param_sets:
            params[i].grad = None if grad is None else grad.clone(memory_format=torch.preserve_format)


def two_groups(params: Sequence[torch.Tensor], weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """The params in two groups with their own lr and decay (the second decays where the first does not)."""
    return [
        {"params": list(params[:3])},
        {"params": list(params[3:]), "lr": 0.02, "weight_decay": 0.0 if weight_decay else 1e-3},
    ]


def snapshot(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> tuple[list, dict]:
    """The params' values and a deep copy of the optimizer's state dict."""
    return [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors (an lr) element by element, a NaN (a refused dampening) equal to itself."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b)
    return a == b or (a != a and b != b)


def assert_unchanged(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], before: tuple) -> None:
    """Params, groups and every state tensor are bit-identical to ``before`` (a :func:`snapshot`)."""
    weights, state = before
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = optimizer.state_dict()
    assert len(after["param_groups"]) == len(state["param_groups"])
    for group, saved in zip(after["param_groups"], state["param_groups"]):
        assert group.keys() == saved.keys()
        for key, value in saved.items():
            assert _same(group[key], value), key
    assert after["state"].keys() == state["state"].keys()
    for key, value in state["state"].items():
        assert value.keys() == after["state"][key].keys()
        for name, tensor in value.items():
            assert torch.equal(after["state"][key][name], tensor)


def end_worker_process() -> NoReturn:
    """End a distributed worker whose work is done without finalizing its interpreter. Once DDP or FSDP2
    ran, PyTorch 2.14 keeps a gloo process group's worker threads alive past ``destroy_process_group()``; one
    of them can drop the last reference to a Python tensor of the final collective while the interpreter
    finalizes, and the GIL it takes for that aborts the process ("terminate called without an active
    exception", about one run in ten here; the race pytorch/pytorch#179291 describes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port free on this machine now, for a distributed run's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def counting_calls(owner: Any, name: str):
    """Counts the calls of ``owner.name`` made inside the block."""
    original = getattr(owner, name)
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield count
    finally:
        setattr(owner, name, original)


def op_state(
    count: int, first_step: Sequence[bool] = (), **slots: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int]]:
    """The ops' ``state`` and ``state_slots`` for ``count`` tensors from each slot's list
    (``momentum_buffer=[...]``, ...: one per tensor, or none), and which buffers the kernel seeds this
    step."""
    from lightning_fusedsgd._abi import slot_keys, state_slots

    keys = slot_keys()
    unknown = set(slots) - set(keys)
    assert not unknown, unknown
    state, masks = [], []
    for t in range(count):
        held = [bool(slots.get(key)) for key in keys]
        fresh = [
            holds and bool(first_step) and first_step[t] and key == "momentum_buffer"
            for key, holds in zip(keys, held)
        ]
        state += [slots[key][t] for key, holds in zip(keys, held) if holds]
        masks.append(state_slots(held, fresh))
    return state, masks


def op_row(device: torch.device | str = "cpu", **values: Any) -> list[torch.Tensor | None]:
    """The ops' step row from its values by name (``grad_scale=..., max_grad_norm=0.5``), numbers as tensors
    of their declared dtype on ``device``."""
    from lightning_fusedsgd._abi import StepRow

    return StepRow(values).on(torch.device(device))
