"""A validated step plan, kept for the next steps while params, state and group structure are unchanged.

Planning costs a few microseconds of Python per parameter, which on models with thousands of small tensors is
as much as the update itself. A kept plan is checked in bulk instead: here, with C-level ``map`` only, the
same params (by identity) and the switches that decide what the plan checks (momentum, master weights, the
rounding mode, LARS, clipping), the same state mapping (keys and per-param dicts by identity, in order) and
the same state tensors (by identity); then, in C++ (``torch.classes.lightning_fusedsgd.KeptPlan``, the one
place that checks layouts), that grads and params are laid out (and params located) as recorded, collecting
this step's grads:

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
from lightning_fusedsgd._abi import MOMENTUM_BUFFER, ROUNDING_STEP
from lightning_fusedsgd.optim import _dtensor
from lightning_fusedsgd.optim._plan import (
    MASTER_STATE,
    NO_MASTERS,
    BucketKey,
    Plan,
    StepScalars,
)

_get_buffer = operator.methodcaller("get", MOMENTUM_BUFFER)
_NO_STATE: dict[str, Any] = {}


def _group_key(groups: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What of the groups decides what a plan checks and stores (plan_step's refusals included)."""
    return [
        (
            len(g["params"]),
            g["momentum"] != 0,
            bool(g["master_weights"]),
            g["update_rounding"],
            bool(g["lars"]),
            g["max_grad_norm"] is not None,
            g["max_grad_value"] is not None,
        )
        for g in groups
    ]


@dataclass
class _Record:
    """What :meth:`matches` compares: the groups' switches, the params, and the state as the plan saw it."""

    group_key: list[tuple[Any, ...]]
    params: list[Tensor]
    state_keys: list[Tensor]
    state_dicts: list[dict[str, Any]]
    stepped_dicts: list[dict[str, Any]]
    buffers: list[Tensor | None]
    # By state key: the masters or compensations, and the rounding steps, for the kinds some bucket keeps.
    tracked: dict[str, list[Tensor | None]]

    @classmethod
    def of(
        cls, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], plan: Plan
    ) -> _Record:
        params = [p for g in groups for p in g["params"]]
        tracked_keys = {MASTER_STATE[masters][0] for *_, masters in plan.buckets if masters != NO_MASTERS}
        if any(bucket.rounding_steps for bucket in plan.buckets.values()):
            tracked_keys.add(ROUNDING_STEP)
        stepped_dicts = [state.get(p, _NO_STATE) for p in params if p.grad is not None]
        return cls(
            group_key=_group_key(groups),
            params=params,
            state_keys=list(state),
            state_dicts=list(state.values()),
            stepped_dicts=stepped_dicts,
            buffers=list(map(_get_buffer, stepped_dicts)),
            tracked={
                key: list(map(operator.methodcaller("get", key), stepped_dicts)) for key in tracked_keys
            },
        )

    def matches(self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]) -> bool:
        return (
            _group_key(groups) == self.group_key
            and all(
                map(operator.is_, itertools.chain.from_iterable(g["params"] for g in groups), self.params)
            )
            and len(state) == len(self.state_keys)
            and all(map(operator.is_, state, self.state_keys))
            and all(map(operator.is_, state.values(), self.state_dicts))
            and all(map(operator.is_, map(_get_buffer, self.stepped_dicts), self.buffers))
            and all(
                all(map(operator.is_, map(operator.methodcaller("get", key), self.stepped_dicts), stored))
                for key, stored in self.tracked.items()
            )
        )


@dataclass
class KeptBucket:
    """One bucket of a :class:`KeptPlan`: the ops called on the arguments the C++ class holds."""

    cpp: Any  # torch.classes.lightning_fusedsgd.KeptPlan
    index: int
    key: BucketKey

    def grad_sq_sum(self) -> Tensor:
        return self.cpp.grad_sq_sum(self.index)

    def sgd_step(self, scalars: StepScalars, grad_sq_sum: Tensor | None, lars_sq_sums: Tensor | None) -> None:
        del lars_sq_sums  # a plan of plain params has no sharded norms
        s = scalars
        self.cpp.sgd_step(self.index, s.table, s.grad_scale, s.found_inf, grad_sq_sum, s.max_grad_norm, s.lrs)


def _cpp_plan(record: _Record, plan: Plan, namespace: str, local: bool) -> Any:
    """The plan in C++: the params (``local``: their local shards), whether each had a grad, the stepped ones'
    layouts, and each bucket's arguments, its tensors placed among the stepped params."""
    params = [_dtensor.local(p) if local else p for p in record.params]
    stepped = [p for p, source in zip(params, record.params) if source.grad is not None]
    position = {id(p): i for i, p in enumerate(p for p in record.params if p.grad is not None)}
    ops.load("cpu")  # the class is in the CPU library
    cpp = torch.classes.lightning_fusedsgd.KeptPlan(
        params, [p.grad is not None for p in record.params], [p.detach() for p in stepped], namespace
    )
    for bucket in plan.buckets.values():
        cpp.add_bucket(
            bucket.params,
            bucket.momentum_buffers,
            bucket.master_params,
            bucket.rounding_steps,
            bucket.tensor_group,
            [position[id(p)] for p in bucket.sources],
        )
    return cpp


@dataclass
class KeptPlan:
    """A plan of plain (not DTensor) params on one device, its bucket arguments held in C++, which calls the
    ops of the backend that ran the plan (``compiled``, or ``cuda_emulated``)."""

    record: _Record
    cpp: Any  # torch.classes.lightning_fusedsgd.KeptPlan
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
        return cls(record, _cpp_plan(record, plan, namespace, local=False), list(plan.buckets), backend)

    def buckets_for(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]
    ) -> list[KeptBucket] | None:
        """This step's buckets, or None (nothing changed) where the plan no longer holds."""
        if not self.record.matches(groups, state) or not self.cpp.gather():
            return None
        return [KeptBucket(self.cpp, index, key) for index, key in enumerate(self.keys)]


@dataclass
class KeptShardedPlan:
    """A plan of DTensor params: the plan made in Python, whose buckets get this step's local grad shards, and
    the same plan in C++ on the local shards, which checks their layouts."""

    record: _Record
    plan: Plan
    cpp: Any  # torch.classes.lightning_fusedsgd.KeptPlan

    @classmethod
    def of(
        cls,
        groups: Sequence[dict[str, Any]],
        state: Mapping[Tensor, dict[str, Any]],
        plan: Plan,
        namespace: str,
    ) -> KeptShardedPlan:
        record = _Record.of(groups, state, plan)
        return cls(record, plan, _cpp_plan(record, plan, namespace, local=True))

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
        if not self.cpp.take(params, grads):
            return None
        for index, bucket in enumerate(self.plan.buckets.values()):
            bucket.grads[:] = self.cpp.grads(index)
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
