"""A validated step plan, kept for the next steps while params, state and group structure are unchanged.

Planning costs a few microseconds of Python per parameter, which on models with thousands of small tensors is
as much as the update itself. A kept plan is checked in bulk instead: here, with C-level ``map`` only, the
same params (by identity) and what of the groups decides the plan (``_abi.plan_key``: the options declared
to decide it), the same state mapping (keys and per-param dicts by identity, in order) and the same state
tensors of every slot the plan holds (by identity); then, in C++ (``torch.classes.lightning_fusedsgd.
PlanArguments``, the one place that checks layouts), that grads and params are laid out (and params located)
as recorded, collecting this step's grads:

* :class:`KeptPlan`: plain params, the buckets' op arguments held in C++, whose ``gather()`` reads each
  param's grad, so a step converts no tensor lists from Python;
* :class:`KeptShardedPlan`: DTensor params, whose grads are checked to be placed as their params here and
  whose local shards the C++ class then takes; its buckets run the ops from Python (the sharded norms need an
  all-reduce).

Either gives the buckets that the one step path (``_step.run``) runs, or None where the plan no longer holds,
in which case nothing changed and the step plans anew."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd import ops
from lightning_fusedsgd._abi import plan_key, slot_keys, slots_in
from lightning_fusedsgd.optim import _dtensor
from lightning_fusedsgd.optim._plan import BucketKey, Plan

_NO_STATE: dict[str, Any] = {}


@dataclass
class _Record:
    """What :meth:`matches` compares: what of the groups decides the plan (``_abi.plan_key``), the params,
    and the state as the plan saw it."""

    group_keys: list[tuple[Any, ...]]
    params: list[Tensor]
    state_keys: list[Tensor]
    state_dicts: list[dict[str, Any]]
    stepped_dicts: list[dict[str, Any]]
    # By state key, for the slots some stepped param holds: each stepped param's stored value.
    tracked: dict[str, list[Any]]

    @classmethod
    def of(
        cls, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], plan: Plan
    ) -> _Record:
        params = [p for g in groups for p in g["params"]]
        masks = [mask for bucket in plan.buckets.values() for mask in bucket.state_slots]
        held = {key for mask in masks for key, holds in zip(slot_keys(), slots_in(mask)[0]) if holds}
        stepped_dicts = [state.get(p, _NO_STATE) for p in params if p.grad is not None]
        return cls(
            group_keys=list(map(plan_key, groups)),
            params=params,
            state_keys=list(state),
            state_dicts=list(state.values()),
            stepped_dicts=stepped_dicts,
            tracked={key: list(map(operator.methodcaller("get", key), stepped_dicts)) for key in held},
        )

    def matches(self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]) -> bool:
        return (
            list(map(plan_key, groups)) == self.group_keys
            and all(
                map(operator.is_, itertools.chain.from_iterable(g["params"] for g in groups), self.params)
            )
            and len(state) == len(self.state_keys)
            and all(map(operator.is_, state, self.state_keys))
            and all(map(operator.is_, state.values(), self.state_dicts))
            and all(
                all(map(operator.is_, map(operator.methodcaller("get", key), self.stepped_dicts), stored))
                for key, stored in self.tracked.items()
            )
        )


@dataclass
class KeptBucket:
    """One bucket of a :class:`KeptPlan`: the ops called on the arguments its ``PlanArguments`` holds."""

    arguments: Any  # torch.classes.lightning_fusedsgd.PlanArguments
    index: int
    key: BucketKey

    def grad_sq_sum(self) -> Tensor:
        return self.arguments.grad_sq_sum(self.index)

    def sgd_step(self, table: Tensor, step: list[Tensor | None], unscaled_grad_sq_sum: Tensor | None) -> None:
        self.arguments.sgd_step(self.index, table, step, unscaled_grad_sq_sum)


def _plan_arguments(record: _Record, plan: Plan, namespace: str, local: bool) -> Any:
    """The plan's op arguments in C++: the params (``local``: their local shards), whether each had a grad,
    the stepped ones' layouts, and each bucket's arguments, its tensors placed among the stepped params."""
    params = [_dtensor.local(p) if local else p for p in record.params]
    stepped = [p for p, source in zip(params, record.params) if source.grad is not None]
    position = {id(p): i for i, p in enumerate(p for p in record.params if p.grad is not None)}
    ops.load("cpu")  # the class is in the CPU library
    arguments = torch.classes.lightning_fusedsgd.PlanArguments(
        params, [p.grad is not None for p in record.params], [p.detach() for p in stepped], namespace
    )
    for bucket in plan.buckets.values():
        positions = [position[id(p)] for p in bucket.sources]
        arguments.add_bucket(bucket.params, bucket.state, bucket.state_slots, bucket.tensor_group, positions)
    return arguments


@dataclass
class KeptPlan:
    """A plan of plain (not DTensor) params on one device, its bucket arguments held in C++, which calls the
    ops of the backend that ran the plan (``compiled``, or ``cuda_emulated``)."""

    record: _Record
    arguments: Any  # torch.classes.lightning_fusedsgd.PlanArguments
    keys: list[BucketKey]
    backend: str

    @classmethod
    def of(
        cls,
        groups: Sequence[dict[str, Any]],
        state: Mapping[Tensor, dict[str, Any]],
        plan: Plan,
        backend: str,
        namespace: str,
    ) -> KeptPlan:
        record = _Record.of(groups, state, plan)
        return cls(record, _plan_arguments(record, plan, namespace, local=False), list(plan.buckets), backend)

    def buckets_for(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]
    ) -> list[KeptBucket] | None:
        """This step's buckets, or None (nothing changed) where the plan no longer holds."""
        if not self.record.matches(groups, state) or not self.arguments.gather():
            return None
        return [KeptBucket(self.arguments, index, key) for index, key in enumerate(self.keys)]


@dataclass
class KeptShardedPlan:
    """A plan of DTensor params: the plan made in Python, whose buckets get this step's local grad shards, and
    the same plan in C++ on the local shards, which checks their layouts."""

    record: _Record
    plan: Plan
    arguments: Any  # torch.classes.lightning_fusedsgd.PlanArguments

    @classmethod
    def of(
        cls,
        groups: Sequence[dict[str, Any]],
        state: Mapping[Tensor, dict[str, Any]],
        plan: Plan,
        namespace: str,
    ) -> KeptShardedPlan:
        record = _Record.of(groups, state, plan)
        return cls(record, plan, _plan_arguments(record, plan, namespace, local=True))

    def plan_for(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]
    ) -> Plan | None:
        """The kept plan with this step's local gradient shards, or None (nothing changed) where it no longer
        holds: each grad must still be placed as its param, and params and grads laid out (and params located)
        as recorded."""
        if not self.record.matches(groups, state):
            return None
        for param in self.record.params:
            grad = param.grad
            if grad is not None and (
                _dtensor.is_sharded(grad) != _dtensor.is_sharded(param)
                or (
                    _dtensor.is_sharded(param)
                    and (grad.placements != param.placements or grad.device_mesh != param.device_mesh)
                )
            ):
                return None
        params = [_dtensor.local(p) for p in self.record.params]
        grads = [None if p.grad is None else _dtensor.local(p.grad) for p in self.record.params]
        if not self.arguments.take(params, grads):
            return None
        for index, bucket in enumerate(self.plan.buckets.values()):
            bucket.grads[:] = self.arguments.grads(index)
        return self.plan


# The backends whose plans are kept: our kernels (a plan of the reference backend is made anew each step).
KEPT_BACKENDS = ("compiled", "cuda_emulated")


def keep(
    groups: Sequence[dict[str, Any]],
    state: Mapping[Tensor, dict[str, Any]],
    plan: Plan,
    ran_by: tuple[str, Any] | None,
) -> KeptPlan | KeptShardedPlan | None:
    """The step just run, kept for the next steps, where one backend of our kernels ran all its buckets
    (``ran_by``: its name and ops, None where several did) on one device, and it created or converted no
    state, staged no param, stepped no sparse gradient and no fragments of a flat partition; else None."""
    devices = {key[0] for key in plan.buckets}
    if not (
        ran_by is not None
        and ran_by[0] in KEPT_BACKENDS
        and len(devices) == 1
        and not plan.new_state
        and not plan.staged
        and not plan.sparse
        and (plan.dtensors or not plan.sharded)  # fragments of flat partitions (_zero) are planned each step
    ):
        return None
    backend, ops_namespace = ran_by
    if plan.dtensors:
        return KeptShardedPlan.of(groups, state, plan, ops_namespace.name)
    return KeptPlan.of(groups, state, plan, backend, ops_namespace.name)
