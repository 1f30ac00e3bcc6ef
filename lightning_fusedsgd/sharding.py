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

# The process groups over whose ranks a tensor's local sums of squares add up to its global ones: one per mesh
# dimension on which it is sharded (a replicated dimension holds the same sums on every rank). Submeshes share
# their parent's group objects, so FSDP2 over TP-sharded params names one data-parallel group.
ReduceKey = tuple[Hashable, ...]
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
    # Per reduce key of each bucket: (bucket key, LARS row indices, whether the clip sum follows, the groups),
    # and its local sums as one vector (the rows, then the clip sum).
    entries: list[tuple[Any, list[int], bool, ReduceKey]] = []
    sums: list[Tensor] = []
    grad_sqs: list[Tensor] = []  # the clip norm's sums: local ones, then each entry's reduced one
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
                parts = [lars_sums[key][rows].reshape(-1)] if rows else []
                parts += [sq.reshape(1).to(key[0])] if sq is not None else []
                entries.append((key, rows, sq is not None, rk))
                sums.append(torch.cat(parts))
    # One all-reduce per process group, over the entries sharded on it (a tensor sharded over two mesh
    # dimensions is summed over both, one after the other). Every rank meets the groups in its plan's order.
    for group in dict.fromkeys(group for *_, rk in entries for group in rk):
        members = [i for i, entry in enumerate(entries) if group in entry[3]]
        device = sums[members[0]].device
        vector = torch.cat([sums[i].to(device) for i in members])
        torch.distributed.all_reduce(vector, group=group)
        for i, reduced in zip(members, vector.split([sums[i].numel() for i in members])):
            sums[i] = reduced
    for (key, rows, has_sq, _), reduced in zip(entries, sums):
        if rows:
            count = LARS_SUMS * len(rows)
            lars_sums[key][rows] = reduced[:count].view(len(rows), LARS_SUMS).to(lars_sums[key].device)
        if has_sq:
            grad_sqs.append(reduced[-1])
    if not clip_norm:
        return lars_sums, None
    first = grad_sqs[0].device
    return lars_sums, torch.stack([s.reshape(()).to(first) for s in grad_sqs]).sum()
