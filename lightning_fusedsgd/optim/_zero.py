"""Flat partitions that an engine puts in the optimizer's param groups in place of the model's tensors.

DeepSpeed's ZeRO stages 1 and 2 hand each rank one flat fp32 partition per param group, spanning many
tensors and parts of tensors. Plain SGD is elementwise and steps a partition as it is; the options that need
norms (LARS, clipping by the global norm: ``Option.needs_norms``) need each tensor's norm and the global one,
which a partition does not give. Where the
engine says where each tensor lies in it (DeepSpeed's per-parameter ``_hp_mapping``, kept for its universal
checkpoints; :func:`attach_deepspeed` registers the partitions), a step that needs norms presents the
partition as one fragment view per model tensor, in the same order on every rank (empty where the rank holds
none of the tensor), each summed over the data-parallel group: the step's one all-reduce then gives every
tensor's norms and the global norm, as for uneven and empty DTensor shards. Where it does not, such a step is
refused before anything is written: the tensors handed to a FusedSGD are recorded (:func:`register_given`),
so that one an engine put in their place is seen. (docs: scaling, "DeepSpeed".)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_fusedsgd import _abi

__all__ = ["attach_deepspeed"]

# The tensors handed to some FusedSGD (constructor, add_param_group, an unpickled optimizer's groups).
_GIVEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The flat partitions whose layout an engine gives (attach_deepspeed): partition -> _Partition.
_PARTITIONS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class _Wrapper:
    """A DeepSpeed optimizer wrapper with mapped partitions: the attributes that hold, per param group, the
    model's tensors in the order every rank lists them (each with its ``_hp_mapping``: where its fragment lies
    in this rank's partition, or None) and this rank's partition; its data-parallel groups are
    ``real_dp_process_group``."""

    name: str
    model_tensors: str
    partitions: str
    # DeepSpeedZeroOptimizer calls the optimizer's step once per param group, with that group alone.
    steps_groups_one_by_one: bool


_MAPPED = (
    _Wrapper(
        "ZeRO stage 1/2 (DeepSpeedZeroOptimizer)", "bit16_groups", "single_partition_of_fp32_groups", True
    ),
    _Wrapper("bf16 ZeRO stage 1 (BF16_Optimizer)", "bf16_groups", "fp32_groups_flat_partition", False),
)


@dataclass(frozen=True)
class _Partition:
    wrapper: weakref.ref  # the engine's optimizer wrapper (weakly: it holds the partition)
    kind: _Wrapper
    index: int  # its param group


@dataclass(frozen=True)
class Fragments:
    """How a step presents one flat partition: ``(start, numel)`` of each model tensor's fragment in it, as
    many on every rank, and the process groups over which their partial sums add up."""

    pieces: list[tuple[int, int]]
    reduce_key: tuple[Hashable, ...]


def register_given(params: Iterable[Any]) -> None:
    """Records the tensors a FusedSGD was handed."""
    for param in params:
        if isinstance(param, Tensor):
            _GIVEN[param] = True


def needs_norms(group: dict[str, Any]) -> bool:
    return bool(_abi.options_on(group, "needs_norms"))


def _norm_options() -> str:
    return " and ".join(o.key for o in _abi.options() if o.needs_norms)


def attach_deepspeed(engine: Any) -> None:
    """Tells the FusedSGD inside a DeepSpeed engine where each of the model's tensors lies in the flat
    partitions DeepSpeed hands it, so that LARS and clipping by the global norm are exact under ZeRO stages 1
    and 2.

    Call it once after ``deepspeed.initialize``; under Lightning's ``DeepSpeedStrategy`` the
    ``AttachDeepSpeed`` callback, which every ``Trainer`` gets, calls it. Each step that needs norms then
    takes the partial sums of every tensor's fragments on each rank and one ``all_reduce`` per step call over
    the data-parallel group: the trust ratios and the global norm are an unsharded run's, to the order in
    which sums are added. Plain SGD needs none of this and steps the partitions as they are.

    ZeRO stage 1/2 steps each param group by itself, so clipping by the global norm is exact there with one
    param group; with several, clip with DeepSpeed's ``gradient_clipping``, which clips by the global norm
    before the optimizer's step (``Trainer(gradient_clip_val=...)`` under ``DeepSpeedStrategy``). bf16
    weights under ZeRO stage 1 (DeepSpeed's ``BF16_Optimizer``) step every group at once: exact with several.

    Args:
        engine: What ``deepspeed.initialize`` returned first (a ``DeepSpeedEngine``), or its ``optimizer``.

    Raises:
        ValueError: Where the optimizer needs norms (a group with LARS or clipping by norm) that this
            engine's partitions cannot give (ZeRO stage 3, a DeepSpeed without fragment maps), or clips where
            DeepSpeed clips too (its ``gradient_clipping``, 1.0 unless the config says otherwise). Nothing is
            changed then.
    """
    is_engine = hasattr(engine, "module") and callable(getattr(engine, "gradient_clipping", None))
    wrapper = engine.optimizer if is_engine else engine
    inner = getattr(wrapper, "optimizer", wrapper)  # what DeepSpeed wraps, or the optimizer itself (ZeRO off)
    if not hasattr(inner, "param_groups"):
        return
    groups = inner.param_groups
    _check_one_clipper(
        groups, engine.gradient_clipping() if is_engine else getattr(wrapper, "clip_grad", 0.0)
    )
    if inner is wrapper:
        return  # the optimizer steps the model's own tensors
    kind = next(
        (k for k in _MAPPED if hasattr(wrapper, k.model_tensors) and hasattr(wrapper, k.partitions)), None
    )
    if kind is None or not _has_fragment_maps(getattr(wrapper, kind.model_tensors)):
        if any(map(needs_norms, groups)):
            raise ValueError(_unmapped_message(type(wrapper).__name__))
        return
    partitions = getattr(wrapper, kind.partitions)
    for group in groups:
        _check_step_sees_global_norm(kind, group, len(partitions))
    for index, partition in enumerate(partitions):
        _PARTITIONS[partition] = _Partition(weakref.ref(wrapper), kind, index)


def _has_fragment_maps(tensor_groups: Sequence[Sequence[Tensor]]) -> bool:
    """Whether DeepSpeed linked each model tensor to its fragment (``link_hp_params``: an ``_hp_mapping``,
    None where this rank holds none of the tensor)."""
    return all(hasattr(t, "_hp_mapping") for tensors in tensor_groups for t in tensors)


def _unmapped_message(made_by: str) -> str:
    return (
        f"{_norm_options()} need each tensor's norm and the global one, and the optimizer steps tensors "
        f"that {made_by} put in its param groups without saying which of the model's tensors they hold "
        "(ZeRO puts flat partitions of many tensors there). FusedSGD takes the norms from DeepSpeed's ZeRO "
        "stages 1 and 2: call lightning_fusedsgd.attach_deepspeed(engine) after deepspeed.initialize "
        "(Lightning's DeepSpeedStrategy does). Otherwise use lars=False and clip with DeepSpeed's "
        "gradient_clipping (Trainer(gradient_clip_val=...) under DeepSpeedStrategy)."
    )


def _check_one_clipper(groups: Sequence[dict[str, Any]], deepspeed_clip: float | None) -> None:
    own = sorted(
        {
            f"{key}={group[key]}"
            for group in groups
            for key in _abi.clip_thresholds().values()
            if group.get(key)
        }
    )
    if deepspeed_clip and own:
        raise ValueError(
            f"DeepSpeed clips the gradients to a global norm of {deepspeed_clip:g} (gradient_clipping in its "
            "config, 1.0 where the config does not say; Lightning's DeepSpeedStrategy sets it from "
            f"Trainer(gradient_clip_val)), and the optimizer's own {', '.join(own)} would clip them a second "
            "time: set gradient_clipping to 0 to clip in the optimizer's step, or drop the optimizer's "
            "clipping."
        )


def _check_step_sees_global_norm(kind: _Wrapper, group: dict[str, Any], groups: int) -> None:
    global_norms = [o.key for o in _abi.options() if o.step_wide and o.needs_norms and group.get(o.key)]
    if global_norms and kind.steps_groups_one_by_one and groups > 1:
        raise ValueError(
            f"{global_norms[0]} takes the norm of the whole gradient, and DeepSpeed's "
            f"{kind.name} steps each of the optimizer's {groups} param groups by itself, so no step sees it. "
            "Clip with DeepSpeed's gradient_clipping instead (Trainer(gradient_clip_val=...) under "
            "DeepSpeedStrategy), which clips by the global norm before the optimizer steps, or put every "
            "parameter in one param group."
        )


def _check_no_counts(param: Tensor, group: dict[str, Any], label: Callable[[], str]) -> None:
    """A count slot (``Slot.count``) is one 0-d tensor for its whole param: fragments cannot share it."""
    counts = [s for s in _abi.SLOTS if s.count and s.held(group, param.dtype)]
    if counts:
        options = sorted({f"{s.option}={group[s.option]!r}" for s in counts})
        norms, keys = ", ".join(_abi.options_on(group, "needs_norms")), ", ".join(s.key for s in counts)
        raise ValueError(
            f"{label()} is a flat partition that this step presents as per-tensor fragments, for the norms "
            f"of {norms}, but its {keys} "
            "count the steps of the whole partition, which its fragments cannot share: under DeepSpeed, "
            f"step it without {' and '.join(options)}, or without the norms."
        )


def fragments(param: Tensor, group: dict[str, Any], label: Callable[[], str]) -> Fragments | None:
    """How the step presents ``param``: None to step it as it is (a tensor the optimizer was given, or a group
    that needs no norms), or its fragments where it is a mapped flat partition and the group needs norms.

    Raises:
        ValueError: For a tensor not given to the optimizer whose norms the step needs but no engine mapped.
    """
    if not needs_norms(group) or torch.compiler.is_compiling():
        return None
    partition = _PARTITIONS.get(param)
    if partition is None:
        if param in _GIVEN:
            return None
        raise ValueError(
            f"{label()} was not given to this optimizer (one of yours? add it with add_param_group). "
            + _unmapped_message("an engine")
        )
    wrapper = partition.wrapper()
    if wrapper is None or getattr(wrapper, partition.kind.partitions)[partition.index] is not param:
        raise ValueError(
            f"{label()} was registered by attach_deepspeed for an engine that no longer holds it: attach the "
            "engine that trains it."
        )
    tensor_groups = getattr(wrapper, partition.kind.model_tensors)
    _check_step_sees_global_norm(partition.kind, group, len(tensor_groups))
    _check_no_counts(param, group, label)
    pieces = []
    for tensor in tensor_groups[partition.index]:
        mapping = tensor._hp_mapping
        if mapping is None:  # this rank holds none of it: an empty fragment keeps every rank's rows aligned
            pieces.append((0, 0))
            continue
        start, numel = mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel
        at = param.data_ptr() + start * param.element_size()
        if mapping.hp_fragment.data_ptr() != at or start + numel > param.numel():
            raise ValueError(
                f"DeepSpeed's map of {label()} does not point into it (a fragment of {numel} elements at "
                f"{start}): call attach_deepspeed(engine) again after the engine rebuilt its partitions."
            )
        pieces.append((start, numel))
    return Fragments(pieces, (wrapper.real_dp_process_group[partition.index],))


# The lists of a bucket (_plan.Bucket) that a partition's entry is split over: views of the partition (its
# param, grad and state), or its values repeated per fragment; reduce_keys takes the fragments' process
# groups.
VIEWED = ("params", "grads", "state")
REPEATED = ("sources", "state_slots", "tensor_group")
SPLIT_FIELDS = (*VIEWED, *REPEATED, "reduce_keys")


def mark(plan: Any) -> dict[Any, dict[str, int]]:
    """The length of every list of every bucket of ``plan``, before a partition is planned."""
    return {
        key: {name: len(getattr(bucket, name)) for name in SPLIT_FIELDS}
        for key, bucket in plan.buckets.items()
    }


def split(plan: Any, before: dict[Any, dict[str, int]], parts: Fragments, label: Callable[[], str]) -> None:
    """Replaces the entries just planned for a flat partition (one in each list its bucket appended to; its
    state slot by slot) by one per fragment: views of the partition, its grad and its state, its other values
    repeated. State the kernel seeds this step (a new momentum buffer) starts at zero, so that the elements
    between fragments (DeepSpeed's padding) hold what a plain step gives them."""
    for key, bucket in plan.buckets.items():
        lengths = before.get(key, {})
        entries = {name: getattr(bucket, name)[lengths.get(name, 0) :] for name in SPLIT_FIELDS}
        if not entries["params"]:
            continue
        held, fresh = _abi.slots_in(entries["state_slots"][0])
        slots = [slot for slot, holds in zip(_abi.SLOTS, held) if holds]
        for name in SPLIT_FIELDS:
            del getattr(bucket, name)[lengths.get(name, 0) :]
        for slot, value in zip(slots, entries["state"]):
            if fresh[_abi.SLOTS.index(slot)]:
                value.zero_()
        for start, numel in parts.pieces:
            for name in VIEWED:
                getattr(bucket, name).extend(t.narrow(0, start, numel) for t in entries[name])
            for name in REPEATED:
                getattr(bucket, name).extend(entries[name])
            bucket.reduce_keys.append(parts.reduce_key)
        plan.sharded = True
        return
