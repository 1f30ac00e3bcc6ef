"""Sharded params (DTensor, as FSDP2's ``fully_shard`` makes them): the kernels step the local shards, the
optimizer state is stored as DTensors placed like their params (what ``torch.distributed.checkpoint``
expects), and the norms that LARS and norm clipping need are made global by one all-reduce per step per
process group (docs/design.md, "Norm passes")."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # isinstance(x, ()) is False: no tensor is sharded
    DTensor = ()  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from lightning_fusedsgd.plan import Plan

# The process groups over which a tensor's local sums of squares add up to its global ones: its mesh and the
# mesh dimensions on which it is sharded (a replicated dimension holds the same sums on every rank).
ReduceKey = tuple[Hashable, tuple[int, ...]]
# Columns of a lars_sq_sums row (kNumLarsSums in csrc/sgd_math.h).
LARS_SUMS = 3


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
    """Where ``param``'s partial norms must be summed, or None when the local sums are already global."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    dims = tuple(d for d, p in enumerate(param.placements) if p.is_shard() and mesh.size(d) > 1)
    return (mesh, dims) if dims else None


def is_fsdp1_flattened(param: Tensor) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) flattened ``param``: it marks such tensors
    ``_fsdp_flattened`` (torch.distributed.fsdp._common_utils.FSDP_FLATTENED)."""
    return getattr(param, "_fsdp_flattened", False)


def check_fsdp1_norms(group: dict[str, Any], label: str) -> None:
    """Refuses LARS and norm clipping on an FSDP1 flattened param: FSDP1 makes 1-D shards of a buffer that
    spans many tensors, with no placement to say what a rank holds, so neither a tensor's norm nor the
    global norm can be taken from them."""
    if group["lars"] or group["max_grad_norm"] is not None:
        raise ValueError(
            f"{label} is an FSDP1 (FullyShardedDataParallel) flattened parameter: LARS and max_grad_norm "
            "need per-tensor and global norms, which its shards of a flat buffer do not give. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard, or Lightning's ModelParallelStrategy), whose DTensor "
            "params FusedSGD steps with one all-reduce for the norms; or, with FSDP1, lars=False and "
            "FSDP's own FullyShardedDataParallel.clip_grad_norm_."
        )


def check_grad_placement(param: Tensor, label: str) -> None:
    """A sharded param's grad must be sharded as the param (FSDP2 reduce-scatters it so): the kernel pairs
    their local shards element by element."""
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


def global_norm_sums(
    plan: Plan,
    backends: dict[Any, tuple[str, Any]],
    groups: list[dict[str, Any]],
    table: Tensor,
    grad_scale: Tensor | None,
    clip_norm: bool,
) -> tuple[dict[Any, Tensor], Tensor | None]:
    """The sums of squares a sharded step needs, made global: each bucket's ``lars_sq_sums`` (by bucket key,
    where it has LARS tensors) and, under norm clipping, the sum of squares of every stepped gradient.

    One kernel call per bucket produces the local partial sums; the rows and gradient sums of the tensors
    sharded over one process group travel in one vector and one ``all_reduce`` (SUM), so a step costs one
    collective per process group, whatever the number of tensors. Tensors that are not sharded add their sums
    locally.
    """
    lars_sums: dict[Any, Tensor] = {}
    # Per reduce key: (bucket key, LARS row indices, gradient sum of squares or None) of each bucket.
    pieces: dict[ReduceKey, list[tuple[Any, list[int], Tensor | None]]] = {}
    grad_sqs: list[Tensor] = []  # the clip norm's sums: local ones, then each process group's reduced one
    for key, bucket in plan.buckets.items():
        ops = backends[key][1]
        lars = [bool(groups[g]["lars"]) for g in bucket.tensor_group]
        if any(lars):
            lars_sums[key] = ops.lars_sq_sums(
                bucket.params,
                bucket.grads,
                bucket.master_params,
                table,
                bucket.tensor_group,
                None if grad_scale is None else grad_scale.to(key[0]),
            )
        by_key: dict[ReduceKey | None, list[int]] = {}
        for i, rk in enumerate(bucket.reduce_keys):
            by_key.setdefault(rk, []).append(i)
        for rk, indices in by_key.items():
            sq = ops.grad_sq_sum([bucket.grads[i] for i in indices]) if clip_norm else None
            if rk is None:
                if sq is not None:
                    grad_sqs.append(sq)
                continue
            rows = [i for i in indices if lars[i]]
            if rows or sq is not None:
                pieces.setdefault(rk, []).append((key, rows, sq))
    for (mesh, dims), entries in pieces.items():
        device = entries[0][0][0]
        parts = [lars_sums[key][rows].reshape(-1).to(device) for key, rows, _ in entries if rows]
        parts += [sq.reshape(1).to(device) for _, _, sq in entries if sq is not None]
        vector = torch.cat(parts)
        for dim in dims:  # one group per sharded mesh dimension; a 1-D mesh (FSDP2) has one
            torch.distributed.all_reduce(vector, group=mesh.get_group(dim))
        offset = 0
        for key, rows, _ in entries:
            if rows:
                count = LARS_SUMS * len(rows)
                reduced = vector[offset : offset + count].view(len(rows), LARS_SUMS)
                lars_sums[key][rows] = reduced.to(lars_sums[key].device)
                offset += count
        for _, _, sq in entries:
            if sq is not None:
                grad_sqs.append(vector[offset])
                offset += 1
    if not clip_norm:
        return lars_sums, None
    first = grad_sqs[0].device
    return lars_sums, torch.stack([s.reshape(()).to(first) for s in grad_sqs]).sum()
