"""Sharded params (DTensor, as FSDP2's ``fully_shard`` makes them): the kernels step the local shards, the
optimizer state is stored as DTensors placed like their params (what ``torch.distributed.checkpoint``
expects), and the norms that LARS and norm clipping need are summed over the process groups ``reduce_key``
names (the step's one all-reduce per process group: ``_step``; docs: design, "Norm passes")."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # isinstance(x, ()) is False: no tensor is sharded
    DTensor = ()  # type: ignore[assignment,misc]

# The process groups over whose ranks a tensor's local sums of squares add up to its global ones: one per mesh
# dimension on which it is sharded (a replicated dimension holds the same sums on every rank). Submeshes share
# their parent's group objects, so FSDP2 over TP-sharded params names one data-parallel group.
ReduceKey = tuple[Hashable, ...]


def is_sharded(tensor: Tensor | None) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """The tensor the kernels step: a DTensor's local shard (an alias: writes reach the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_param(local_tensor: Tensor, param: Tensor) -> Tensor:
    """State for ``param`` from its local shard: a DTensor on the param's mesh and placements (uneven and
    empty shards included), or the tensor itself for a plain param."""
    if not isinstance(param, DTensor):
        return local_tensor
    return DTensor.from_local(
        local_tensor,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def reduce_key(param: Tensor) -> ReduceKey | None:
    """The process groups over which ``param``'s partial norms must be summed, or None when the local sums
    are already global. Every placement but Replicate splits the tensor: Shard, and the _StridedShard that
    FSDP2 makes of a dimension tensor parallelism already shards (its ``is_shard()`` is False)."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    groups = tuple(
        mesh.get_group(d) for d, p in enumerate(param.placements) if not p.is_replicate() and mesh.size(d) > 1
    )
    return groups or None


def is_fsdp1_flattened(param: Tensor) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) flattened ``param``: it marks such tensors
    ``_fsdp_flattened`` (torch.distributed.fsdp._common_utils.FSDP_FLATTENED)."""
    return getattr(param, "_fsdp_flattened", False)


def check_fsdp1_norms(group: dict[str, Any], label: str) -> None:
    """Refuses LARS and norm clipping on an FSDP1 flattened param: FSDP1 makes 1-D shards of a buffer that
    spans many tensors, with no placement to say what a rank holds, so neither a tensor's norm nor the
    global norm can be taken from them."""
    norms = _abi.options_on(group, "needs_norms")
    if norms:
        raise ValueError(
            f"{label} is an FSDP1 (FullyShardedDataParallel) flattened parameter: {' and '.join(norms)} "
            "need per-tensor and global norms, which its shards of a flat buffer do not give. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard, or Lightning's ModelParallelStrategy), whose DTensor "
            "params FusedSGD steps with one all-reduce for the norms; or, with FSDP1, lars=False and "
            "FSDP's own FullyShardedDataParallel.clip_grad_norm_."
        )


def check_grad_placement(param: Tensor, label: str) -> None:
    """A sharded param's grad must be sharded as the param (FSDP2 reduce-scatters it so): the kernel pairs
    their local shards element by element."""
    if any(p.is_partial() for p in param.placements):
        raise ValueError(
            f"{label} is a DTensor with a Partial placement ({param.placements}): its local values add up to "
            "the parameter rather than split it, so no step can update them. Redistribute it to Shard or "
            "Replicate."
        )
    grad = param.grad
    if (
        not isinstance(grad, DTensor)
        or grad.placements != param.placements
        or grad.device_mesh != param.device_mesh
    ):
        found = f"{type(grad).__name__} {getattr(grad, 'placements', '')}".strip()
        raise ValueError(
            f"The gradient of {label} is a {found}, but the parameter is a DTensor with placements "
            f"{param.placements}: FusedSGD steps local shards and needs the gradient placed as its "
            "parameter. Let FSDP2 (fully_shard) produce the gradients, or redistribute them to the "
            "parameter's placements."
        )
