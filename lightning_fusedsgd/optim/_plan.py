"""The step plan: every param with a grad checked and gathered into buckets, before anything is written.

A bucket is one (device, dtype, weight slot) set of tensors in the ops' argument order; the plan also lists
the state to store once the kernels ran and the params updated through a copy. Nothing here knows the
optimizer: ``plan_step`` reads its groups and state."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import _abi, _checks
from lightning_fusedsgd._abi import LOW_PRECISION, Slot, StepRow, seeded, state_slots, stored_weight
from lightning_fusedsgd.optim import _dtensor, _zero
from lightning_fusedsgd.optim._overlap import check_no_overlap, has_internal_overlap

# Complex params are stepped as their real views, as torch.optim.SGD does.
_SUPPORTED_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION, torch.complex64, torch.complex128)
_NO_STATE: dict[str, Any] = {}

# (device, param dtype, the slot that holds the rest of the weight: a master or a compensation, or "")
BucketKey = tuple[torch.device, torch.dtype, str]


@dataclass
class Bucket:
    """The tensors of one (device, dtype, weight slot) bucket, in the op's argument order."""

    params: list[Tensor] = field(default_factory=list)  # dense views: real views of complex params
    sources: list[Tensor] = field(default_factory=list)  # the optimizer's params behind them
    grads: list[Tensor] = field(default_factory=list)
    state: list[Tensor] = field(default_factory=list)  # each param's slots in turn, as the op takes them
    state_slots: list[int] = field(default_factory=list)  # per param: which slots it holds (_abi.state_slots)
    tensor_group: list[int] = field(default_factory=list)
    # Per tensor: where its partial norms are all-reduced (_dtensor.reduce_key), None when not sharded.
    reduce_keys: list[_dtensor.ReduceKey | None] = field(default_factory=list)


@dataclass
class StepInputs:
    """A step's inputs besides the buckets: the hyperparameter table (on the CPU), the step row, and a
    schedule-free step's per-group scalars (``_abi.SCHEDULE_FREE_SCALARS`` rows on the params' device), which
    the step advances before its buckets run."""

    table: Tensor
    row: StepRow
    scalars: Tensor | None = None


@dataclass
class Plan:
    """A step's buckets by (device, dtype, weight slot); the state entries to store once the kernels ran
    (new state, state converted to the param's layout or its slot's dtype, and ``None`` for state to drop
    that goes stale while its group does not hold it); and the (param, dense copy) pairs
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
    device, dtype, weight = key
    return f"{device}/{str(dtype).removeprefix('torch.')}{f' + {weight}' if weight else ''}"


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
    _checks.check_param(place[0], param, functools.partial(param_label, *place, param))
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


def _check_sparse_steppable(param: Tensor, place: _Place) -> None:
    """A param with a sparse gradient is stepped as torch.optim.SGD steps it (its own single-tensor path);
    refused where its group asks for what only the fused kernel does."""
    group = place[0]
    options = _abi.options_on(group, "fused_only")
    # The state torch's SGD does not keep, named by the options that ask for it (each once).
    asking = dict.fromkeys(
        slot.option
        for slot in _abi.SLOTS
        if not slot.torch_sgd and slot.held(group, param.dtype) and slot.option not in options
    )
    options += [f"{option}={group[option]!r}" for option in asking]
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
            _plan_param(
                plan, state.get(param, _NO_STATE), param, param.grad, group, group_index, param_index, tracing
            )
            if fragments is not None:
                _zero.split(plan, before, fragments, label)
    if not tracing:
        check_no_overlap(
            [(param, lambda place=place, param=param: param_label(*place, param)) for param, place in stepped]
        )
    return plan


def plan_switch(
    groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], switching: Sequence[int]
) -> Plan:
    """The buckets of a schedule-free mode switch (``schedule_free_switch``): every param of the ``switching``
    groups that holds a z, with its state as a step takes it (the param standing in for its gradient, which a
    switch does not read)."""
    plan = Plan()
    for group_index in switching:
        group = groups[group_index]
        for param_index, param in enumerate(group["params"]):
            param_state = state.get(param, _NO_STATE)
            if param_state.get("z") is not None:
                _plan_param(plan, param_state, param, param, group, group_index, param_index, tracing=False)
    return plan


def _plan_param(
    plan: Plan,
    state: dict[str, Any],
    param: Tensor,
    grad: Tensor,
    group: dict[str, Any],
    group_index: int,
    param_index: int,
    tracing: bool,
) -> None:
    """Adds one param to its bucket: dense views of param and ``grad`` (real views of complex ones), and its
    state slot by slot (``_abi.SLOTS``): as stored, converted to the param's layout and the slot's dtype, or
    seeded anew."""
    # A DTensor param is stepped as its local shard; its state is stored as DTensors placed like it.
    shard = _dtensor.local(param)
    dense = shard if _is_dense(shard) else shard.contiguous()
    if dense is not shard:
        plan.staged.append((shard, dense))
    grad = _dtensor.local(grad)
    if grad.dtype != param.dtype or grad.stride() != dense.stride():
        grad = torch.empty_like(dense).copy_(grad)

    slots = _abi.SLOTS
    held = [s.held(group, param.dtype) for s in slots]
    weight = next((s.key for s, h in zip(slots, held) if h and s.weight is not None), "")
    bucket = plan.buckets.setdefault((dense.device, param.dtype, weight), Bucket())
    bucket.params.append(real_view(dense))
    bucket.sources.append(param)
    bucket.grads.append(real_view(grad))
    bucket.tensor_group.append(group_index)
    reduce_key = _dtensor.reduce_key(param)
    bucket.reduce_keys.append(reduce_key)
    plan.sharded = plan.sharded or reduce_key is not None
    fresh = [
        holds and slot.seed == "gradient" and state.get(slot.key) is None for slot, holds in zip(slots, held)
    ]
    bucket.state_slots.append(state_slots(held, fresh))
    for slot, holds in zip(slots, held):
        if holds:
            value = _slot_value(plan, slot, state, param, dense, (group, group_index, param_index), tracing)
            bucket.state.append(value if slot.count else real_view(value))
        elif slot.stale_unheld and state.get(slot.key) is not None:  # seeded anew if its group holds it again
            plan.new_state.append((param, slot.key, None))


def _slot_value(
    plan: Plan, slot: Slot, state: dict[str, Any], param: Tensor, dense: Tensor, place: _Place, tracing: bool
) -> Tensor:
    """The param's state of ``slot`` as the op takes it: the stored one where it can step as it is, else a
    new one (stored with the new state) holding the stored values, or seeded."""
    stored = state.get(slot.key)
    dtype = slot.dtype(place[0], param.dtype)
    if slot.count:
        if (
            isinstance(stored, Tensor)
            and stored.dtype == dtype
            and stored.dim() == 0
            and stored.device == dense.device
            and not _dtensor.is_sharded(stored)
        ):
            return stored
        value = seeded(slot, dense, dense, dtype)
        if stored is not None:
            check_state_shapes(state, *place, param)
            value.fill_(int(stored))
        plan.new_state.append((param, slot.key, value))
        return value
    if stored is not None:
        # A sparse buffer comes from a step of torch's sparse path (plan.sparse): dense from now on.
        local = stored.to_dense() if stored.is_sparse else _dtensor.local(stored)
        if not stored.is_sparse and _steppable_as_stored(stored, local, param, dense, dtype):
            return local
        check_state_shapes(state, *place, param)
        value = torch.empty_like(dense, dtype=dtype).copy_(local)
    elif slot.seed in ("weight", "residual"):
        check_state_shapes(state, *place, param)
        weight = stored_weight(
            dense, {k: _dtensor.local(v) for k, v in state.items() if isinstance(v, Tensor)}
        )
        value = seeded(slot, dense, weight, dtype)
    else:
        value = seeded(slot, dense, dense, dtype, zeros=tracing)
    plan.new_state.append((param, slot.key, _dtensor.like_param(value, param)))
    return value


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


def check_state_shapes(
    state: dict[str, Any], group: dict[str, Any], group_index: int, param_index: int, param: Tensor
) -> None:
    """Refuses a param's state whose slots are not shaped as ``_abi.SLOTS`` declares them: a count one number
    (a 0-d tensor), every other slot the param's shape, sharded (a DTensor) where the param is. ``group``
    names the param in the message (its ``param_names``)."""
    for slot in _abi.SLOTS:
        value = state.get(slot.key)
        if not isinstance(value, Tensor):
            continue
        if slot.count:
            if value.dim() != 0:
                raise ValueError(
                    f"The {slot.key} of {param_label(group, group_index, param_index, param)} has shape "
                    f"{tuple(value.shape)} but it is a count, one number (shape "
                    "()): the optimizer state is damaged or was not saved by FusedSGD. Load the state the "
                    "run saved (optimizer.state_dict()), or drop the optimizer state to start it anew."
                )
            continue
        if _dtensor.is_sharded(value) != _dtensor.is_sharded(param):
            kinds = ["a DTensor", "a plain tensor"]
            if not _dtensor.is_sharded(value):
                kinds.reverse()
            raise ValueError(
                f"The {slot.key} of {param_label(group, group_index, param_index, param)} is {kinds[0]} but "
                f"the parameter is {kinds[1]}: sharded (FSDP2) optimizer state is loaded with "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which places it like the "
                "parameters; a plain optimizer.load_state_dict cannot reshard it."
            )
        if value.shape != param.shape:
            raise ValueError(
                f"The {slot.key} of {param_label(group, group_index, param_index, param)} has shape "
                f"{tuple(value.shape)} but the parameter has shape {tuple(param.shape)}: the optimizer "
                "state belongs to a different model. Load a matching checkpoint, or drop the optimizer "
                "state to start it anew (momentum from zero)."
            )
