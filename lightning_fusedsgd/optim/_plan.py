"""The step plan: every param with a grad checked and gathered into buckets, before anything is written.

A bucket is one (device, dtype, masters) set of tensors in the ops' argument order; the plan also lists
the state to store once the kernels ran and the params updated through a copy. Nothing here knows the
optimizer: ``plan_step`` reads its groups and state."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd._abi import KAHAN_COMPENSATION, MASTER_PARAM, MOMENTUM_BUFFER, ROUNDING_STEP
from lightning_fusedsgd.optim import _dtensor, _zero
from lightning_fusedsgd.optim._overlap import check_no_overlap, has_internal_overlap

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Complex params are stepped as their real views, as torch.optim.SGD does.
_SUPPORTED_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION, torch.complex64, torch.complex128)
_NO_STATE: dict[str, Any] = {}

# What a bucket's master_params hold (the ops' contract): nothing, fp32 master weights, or bf16 Kahan
# compensations (update_rounding="kahan"); each kind with the state key that stores it and its dtype.
NO_MASTERS, FP32_MASTERS, KAHAN_COMPENSATIONS = "", "fp32 master", "kahan compensation"
MASTER_STATE = {
    FP32_MASTERS: (MASTER_PARAM, torch.float32),
    KAHAN_COMPENSATIONS: (KAHAN_COMPENSATION, torch.bfloat16),
}
BucketKey = tuple[torch.device, torch.dtype, str]  # (device, param dtype, what master_params hold)


@dataclass
class Bucket:
    """The tensors of one (device, dtype, masters) bucket, in the kernel's argument order."""

    params: list[Tensor] = field(default_factory=list)  # dense views: real views of complex params
    sources: list[Tensor] = field(default_factory=list)  # the optimizer's params behind them
    grads: list[Tensor] = field(default_factory=list)
    momentum_buffers: list[Tensor] = field(default_factory=list)  # of the params with momentum, in order
    master_params: list[Tensor] = field(default_factory=list)  # fp32 masters or Kahan compensations, or none
    rounding_steps: list[Tensor] = field(
        default_factory=list
    )  # of the params rounded stochastically, in order
    tensor_group: list[int] = field(default_factory=list)
    first_step: list[bool] = field(default_factory=list)
    # Per tensor: where its partial norms are all-reduced (_dtensor.reduce_key), None when not sharded.
    reduce_keys: list[_dtensor.ReduceKey | None] = field(default_factory=list)


@dataclass
class StepScalars:
    """A step's inputs besides the buckets: the hyperparameter table, GradScaler's two tensors (or None), the
    lrs read on the device (or None), and the threshold of clipping by global norm (or None)."""

    table: Tensor
    grad_scale: Tensor | None
    found_inf: Tensor | None
    lrs: Tensor | None
    max_grad_norm: float | None

    def on(self, device: torch.device) -> StepScalars:
        """The same scalars, their tensors on ``device`` (the table stays on the CPU)."""
        moved = [None if t is None else t.to(device) for t in (self.grad_scale, self.found_inf, self.lrs)]
        return StepScalars(self.table, *moved[:2], moved[2], self.max_grad_norm)


@dataclass
class Plan:
    """A step's buckets by (device, dtype, masters); the state entries to store once the kernels ran
    (new buffers, masters and compensations, buffers converted to the param's layout or to fp32, and ``None``
    for a master or compensation to drop because its group turned it off); and the (param, dense copy) pairs
    of params that are not dense and are updated through a copy. For DTensor params the buckets hold local
    shards, the new state is DTensors placed like the params, and ``sharded`` says whether any tensor's norms
    need an all-reduce."""

    buckets: dict[BucketKey, Bucket] = field(default_factory=dict)
    new_state: list[tuple[Tensor, str, Tensor | None]] = field(default_factory=list)
    staged: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # Params with sparse gradients and their group index: stepped by torch's own SGD (_step_sparse).
    sparse: list[tuple[Tensor, int]] = field(default_factory=list)
    dtensors: bool = False
    sharded: bool = False


def _is_dense(tensor: Tensor) -> bool:
    """Whether the kernel can walk the tensor's storage as a flat array (contiguous or channels_last)."""
    return (
        tensor.is_contiguous()
        or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))
        or (tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d))
    )


def param_label(group: dict[str, Any], group_index: int, param_index: int, param: Tensor) -> str:
    names = group.get("param_names")
    if names:
        return f"'{names[param_index]}'"
    return f"parameter {param_index} of group {group_index} (shape {tuple(param.shape)})"


# Where a param sits: (group, group index, index in the group), for error messages only.
_Place = tuple[dict[str, Any], int, int]


def bucket_name(key: BucketKey) -> str:
    device, dtype, masters = key
    suffix = "" if masters == NO_MASTERS else f" + {masters}"
    return f"{device}/{str(dtype).removeprefix('torch.')}{suffix}"


def real_view(tensor: Tensor) -> Tensor:
    """Complex tensors are stepped as their real views, as torch.optim.SGD steps them."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _check_steppable(param: Tensor, place: _Place) -> None:
    """Refuses, before anything is written, a param that no step of ours can update (the message names it,
    so the label is only built for a refusal)."""
    grad = param.grad
    if grad.is_sparse:
        _check_sparse_steppable(param, place)
        return
    if param.dtype not in _SUPPORTED_DTYPES:
        label = param_label(*place, param)
        raise TypeError(
            f"FusedSGD cannot step {label}: its dtype is {param.dtype}. Parameters must be floating point "
            "(float32, float64, bfloat16, float16) or complex64/complex128; convert it, or leave it out of "
            "the optimizer."
        )
    group = place[0]
    if group["update_rounding"] != "nearest" and param.dtype == torch.float16 and not group["master_weights"]:
        label = param_label(*place, param)
        raise ValueError(
            f"update_rounding={group['update_rounding']!r} rounds updates to bfloat16, and {label} is "
            "float16 without master weights: set master_weights=True for it, make it bfloat16, or put it in "
            "a group with update_rounding='nearest'."
        )
    if param.is_complex() and group["max_grad_value"] is not None:
        label = param_label(*place, param)
        raise ValueError(
            f"max_grad_value clips each gradient element, and {label} is complex ({param.dtype}), which "
            "torch.nn.utils.clip_grad_value_ refuses too (clamp is not defined for complex numbers): use "
            "max_grad_norm for this group, or leave it unclipped."
        )
    if grad.shape != param.shape:
        label = param_label(*place, param)
        raise ValueError(
            f"The gradient of {label} has shape {tuple(grad.shape)} but the parameter has shape "
            f"{tuple(param.shape)}: assign a gradient of the parameter's shape."
        )
    if has_internal_overlap(param):
        label = param_label(*place, param)
        raise ValueError(
            f"FusedSGD cannot step {label}: it is an expand()ed view whose elements share memory "
            f"(strides {param.stride()}), so no in-place update can write it. Make it a real tensor, e.g. "
            "nn.Parameter(tensor.clone()), or leave it out of the optimizer."
        )


# Group options that only the fused kernel has: a sparse gradient steps through torch's own SGD without them.
_FUSED_ONLY = ("lars", "max_grad_norm", "max_grad_value", "wd_after_momentum")


def _check_sparse_steppable(param: Tensor, place: _Place) -> None:
    """A param with a sparse gradient is stepped as torch.optim.SGD steps it (its own single-tensor path);
    refused where its group asks for what only the fused kernel does."""
    group = place[0]
    options = [name for name in _FUSED_ONLY if group[name] not in (None, False)]
    if group["master_weights"] and param.dtype in LOW_PRECISION:
        options.append("master_weights")
    if group["update_rounding"] != "nearest" and param.dtype == torch.bfloat16:
        options.append(f"update_rounding={group['update_rounding']!r}")
    if group["weight_decay"] != 0:
        label = param_label(*place, param)
        raise RuntimeError(
            f"{label} has a sparse gradient, which FusedSGD steps as torch.optim.SGD does, and neither adds "
            "weight decay to one (torch raises 'add(sparse, dense) is not supported'): put it in a group "
            "with weight_decay=0, or make its gradient dense (e.g. nn.Embedding(sparse=False))."
        )
    if options:
        label = param_label(*place, param)
        raise RuntimeError(
            f"{label} has a sparse gradient, which FusedSGD steps as torch.optim.SGD does, without "
            f"{', '.join(options)} (set in its group): put it in a group without them, step it with "
            "torch.optim.SGD, or make its gradient dense (e.g. nn.Embedding(sparse=False))."
        )


def plan_step(
    groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], tracing: bool = False
) -> Plan:
    """Validates every parameter with a grad and gathers the kernel inputs, changing nothing.

    ``tracing`` (under torch.compile): the overlap check, which reads tensor addresses, is left out, and
    new buffers start at zero, since a skipped first step cannot be seen on the host without a graph
    break (eager creates no buffer then; a traced step stores a zero one).
    """
    plan = Plan()
    stepped: list[tuple[Tensor, _Place]] = []
    for group_index, group in enumerate(groups):
        for param_index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            place = (group, group_index, param_index)
            _check_steppable(param, place)
            if param.grad.is_sparse:
                plan.sparse.append((param, group_index))
                continue
            if _dtensor.is_fsdp1_flattened(param):
                _dtensor.check_fsdp1_norms(group, param_label(*place, param))
            if _dtensor.is_sharded(param):
                _dtensor.check_grad_placement(param, param_label(*place, param))
                plan.dtensors = True
            stepped.append((_dtensor.local(param), place))
            # An engine's flat partition whose norms this step needs: stepped as per-tensor fragments (_zero).
            label = functools.partial(param_label, *place, param)
            fragments = _zero.fragments(param, group, label)
            before = None if fragments is None else _zero.mark(plan)
            _plan_param(plan, state.get(param, _NO_STATE), param, group, group_index, param_index, tracing)
            if fragments is not None:
                _zero.split(plan, before, fragments, label)
    if not tracing:
        check_no_overlap(
            [(param, lambda place=place, param=param: param_label(*place, param)) for param, place in stepped]
        )
    return plan


def _plan_param(
    plan: Plan,
    state: dict[str, Any],
    param: Tensor,
    group: dict[str, Any],
    group_index: int,
    param_index: int,
    tracing: bool,
) -> None:
    """Adds one param to its bucket: dense views of param and grad (real views of complex ones), and
    its momentum buffer and master or compensation, converted to the param's layout where needed."""
    has_momentum = group["momentum"] != 0
    masters = _masters_of(group, param.dtype)
    # A DTensor param is stepped as its local shard; its state is stored as DTensors placed like it.
    shard = _dtensor.local(param)
    dense = shard if _is_dense(shard) else shard.contiguous()
    if dense is not shard:
        plan.staged.append((shard, dense))
    stride = dense.stride()
    grad = _dtensor.local(param.grad)
    if grad.dtype != param.dtype or grad.stride() != stride:
        grad = torch.empty_like(dense).copy_(grad)

    bucket = plan.buckets.setdefault((dense.device, param.dtype, masters), Bucket())
    bucket.params.append(real_view(dense))
    bucket.sources.append(param)
    bucket.grads.append(real_view(grad))
    bucket.tensor_group.append(group_index)
    reduce_key = _dtensor.reduce_key(param)
    bucket.reduce_keys.append(reduce_key)
    plan.sharded = plan.sharded or reduce_key is not None
    buffer = state.get(MOMENTUM_BUFFER) if has_momentum else None
    bucket.first_step.append(has_momentum and buffer is None)
    if has_momentum:
        buffer_dtype = torch.float32 if masters == FP32_MASTERS else param.dtype
        if buffer is None:
            new_buffer = torch.zeros_like if tracing else torch.empty_like
            buffer = new_buffer(dense, dtype=buffer_dtype)
            plan.new_state.append((param, MOMENTUM_BUFFER, _dtensor.like_param(buffer, param)))
        else:
            # A sparse buffer comes from a step of torch's sparse path (plan.sparse): dense from now on.
            local_buffer = buffer.to_dense() if buffer.is_sparse else _dtensor.local(buffer)
            if buffer.is_sparse or not _steppable_as_stored(buffer, local_buffer, param, dense, buffer_dtype):
                check_state_shapes(state, group, group_index, param_index, param)
                local_buffer = torch.empty_like(dense, dtype=buffer_dtype).copy_(local_buffer)
                plan.new_state.append((param, MOMENTUM_BUFFER, _dtensor.like_param(local_buffer, param)))
            buffer = local_buffer
        bucket.momentum_buffers.append(real_view(buffer))
    for kind, (key, dtype) in MASTER_STATE.items():
        stored = state.get(key)
        if kind != masters:
            if stored is not None:  # stale once the param steps without it: seeded anew if turned back on
                plan.new_state.append((param, key, None))
            continue
        local = None if stored is None else _dtensor.local(stored)
        if stored is None or not _steppable_as_stored(stored, local, param, dense, dtype):
            check_state_shapes(state, group, group_index, param_index, param)
            source = _new_master_state(kind, dense, state) if local is None else local
            local = torch.empty_like(dense, dtype=dtype).copy_(source)  # in the param's layout
            plan.new_state.append((param, key, _dtensor.like_param(local, param)))
        bucket.master_params.append(local)
    if masters == NO_MASTERS and param.dtype == torch.bfloat16 and group["update_rounding"] == "stochastic":
        bucket.rounding_steps.append(_rounding_step(plan, state, param, dense.device))


def _rounding_step(plan: Plan, state: dict[str, Any], param: Tensor, device: torch.device) -> Tensor:
    """The param's count of stochastic steps as the op takes it, a one-element int64 tensor on its device: the
    stored one, or a new one holding its value (0 for a param's first stochastic step)."""
    stored = state.get(ROUNDING_STEP)
    if (
        isinstance(stored, Tensor)
        and stored.dtype == torch.int64
        and stored.numel() == 1
        and stored.device == device
        and not _dtensor.is_sharded(stored)
    ):
        return stored
    count = torch.zeros((), dtype=torch.int64, device=device)
    if stored is not None:
        count.fill_(int(stored))
    plan.new_state.append((param, ROUNDING_STEP, count))
    return count


def _steppable_as_stored(
    stored: Tensor, local: Tensor, param: Tensor, dense: Tensor, dtype: torch.dtype
) -> bool:
    """Whether a stored state tensor (``local``: its local shard) can step with the param as it is: the
    param's shape and sharding, the state's dtype, and the dense param's strides and device."""
    return (
        stored.shape == param.shape
        and _dtensor.is_sharded(stored) == _dtensor.is_sharded(param)
        and local.dtype == dtype
        and local.stride() == dense.stride()
        and local.device == dense.device
    )


def _new_master_state(kind: str, dense: Tensor, state: dict[str, Any]) -> Tensor:
    """The values of a new master or compensation: the weight the param's state holds, kept where its group
    switched between the two (a master from param + compensation, a compensation from what rounding the
    master to the param dropped, where the param holds that rounding); else the param, or a compensation of
    0."""
    master, compensation = (state.get(MASTER_STATE[k][0]) for k in (FP32_MASTERS, KAHAN_COMPENSATIONS))
    if kind == FP32_MASTERS:
        if compensation is None:
            return dense
        return dense.float() + _dtensor.local(compensation).to(dense.device).float()
    if master is None:
        return torch.zeros_like(dense)
    master = _dtensor.local(master).to(dense.device).float()
    return torch.where(dense == master.to(dense.dtype), master - dense.float(), 0.0)


def _masters_of(group: dict[str, Any], dtype: torch.dtype) -> str:
    """What the kernel keeps beside a param of this dtype in this group: fp32 masters (bf16/fp16 params with
    master_weights), a Kahan compensation (bf16 params without them, update_rounding="kahan"), or nothing."""
    if group["master_weights"] and dtype in LOW_PRECISION:
        return FP32_MASTERS
    if group["update_rounding"] == "kahan" and dtype == torch.bfloat16:
        return KAHAN_COMPENSATIONS
    return NO_MASTERS


def check_state_shapes(
    state: dict[str, Any], group: dict[str, Any], group_index: int, param_index: int, param: Tensor
) -> None:
    for key in (MOMENTUM_BUFFER, *(key for key, _ in MASTER_STATE.values())):
        value = state.get(key)
        if isinstance(value, Tensor) and _dtensor.is_sharded(value) != _dtensor.is_sharded(param):
            kinds = ["a DTensor", "a plain tensor"]
            if not _dtensor.is_sharded(value):
                kinds.reverse()
            raise ValueError(
                f"The {key} of {param_label(group, group_index, param_index, param)} is {kinds[0]} but the "
                f"parameter is {kinds[1]}: sharded (FSDP2) optimizer state is loaded with "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which places it like the "
                "parameters; a plain optimizer.load_state_dict cannot reshard it."
            )
        if value is not None and value.shape != param.shape:
            raise ValueError(
                f"The {key} of {param_label(group, group_index, param_index, param)} has shape "
                f"{tuple(value.shape)} but the parameter has shape {tuple(param.shape)}: the optimizer "
                "state belongs to a different model. Load a matching checkpoint, or drop the optimizer "
                "state to restart momentum from zero."
            )
