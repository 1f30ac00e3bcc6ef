"""The one step path, for every kind of step: which buckets run (a plan kept from an earlier step, or a new
one), then norms -> reduce -> update, then what a new plan leaves behind.

Eager, kept (C++), sharded, traced (torch.compile) and capturable steps differ only in where their buckets
come from (a plan made now, or one kept from an earlier step) and what the step's row holds (tensors on the
device for capturable steps); :func:`run` is the same for all of them:

1. norms: where a group clips by global norm, each bucket's ``grad_sq_sum``; under sharding, each bucket's
   ``lars_sq_sums`` (LARS tensors) and the clip sums per process group; 2. reduce: under sharding, one
   ``all_reduce`` per process group of every sum taken over it; 3. update: each bucket's ``sgd_step`` with the
   total.

Unsharded LARS needs no separate pass: ``sgd_step`` takes each tensor's norms itself, and a LARS step that
does not clip by norm has it report the sum of squares of every gradient it took there (its
``unscaled_grad_sq_sum``), its gradient norm at no extra read of a LARS tensor's gradient. Under sharding that
sum comes from the reduced ``lars_sq_sums`` rows (their ``grad_sq``), and the other tensors' from a
``grad_sq_sum`` of theirs reduced in the same collective. :class:`Steps` chooses
the buckets and keeps plans; a schedule-free step first advances its per-group scalars
(``schedule_free_scalars``), whose lrs and average weights the buckets' row then holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_fusedsgd._abi import LARS_SUM_NAMES, LARS_SUMS, SCHEDULE_FREE_SCALARS, StepRow, plan_key, table
from lightning_fusedsgd.ops import reference
from lightning_fusedsgd.optim import _backends, _kept, _sparse
from lightning_fusedsgd.optim._dtensor import ReduceKey
from lightning_fusedsgd.optim._plan import (
    Bucket,
    BucketKey,
    Plan,
    StepInputs,
    bucket_name,
    plan_step,
    plan_switch,
)


class BucketStep(Protocol):
    """A bucket the path runs: one made now (:class:`PlannedBucket`) or kept in C++ (``_kept.KeptBucket``).
    ``sgd_step`` takes the table and the step row as the op does, the row on the bucket's device."""

    key: BucketKey

    def grad_sq_sum(self) -> Tensor: ...

    def sgd_step(
        self, table: Tensor, step: list[Tensor | None], unscaled_grad_sq_sum: Tensor | None
    ) -> None: ...


@dataclass
class PlannedBucket:
    """A bucket of a plan made in Python, run by one implementation's ops (``backend``: compiled, reference or
    emulated CUDA)."""

    key: BucketKey
    bucket: Bucket
    ops: Any
    backend: str

    def grad_sq_sum(self) -> Tensor:
        return self.ops.grad_sq_sum(self.bucket.grads)

    def lars_sq_sums(self, table: Tensor, step: list[Tensor | None]) -> Tensor:
        b = self.bucket
        return self.ops.lars_sq_sums(b.params, b.grads, b.state, b.state_slots, table, b.tensor_group, step)

    def sgd_step(self, table: Tensor, step: list[Tensor | None], unscaled_grad_sq_sum: Tensor | None) -> None:
        b = self.bucket
        self.ops.sgd_step(
            b.params, b.grads, b.state, b.state_slots, table, b.tensor_group, step, unscaled_grad_sq_sum
        )


def _sum_on(sums: Sequence[Tensor], device: torch.device) -> Tensor:
    """The sum of 0-d tensors on ``device``, without a host sync."""
    return (
        torch.stack([s.reshape(()).to(device) for s in sums]).sum() if len(sums) > 1 else sums[0].to(device)
    )


@dataclass
class StepNorm:
    """The sum of squares of every gradient a step took, where it took one, on the device: ``grad_sq_sum``
    where it clipped by norm (still scaled, as the clip takes it), else ``unscaled_grad_sq_sum`` where a LARS
    step's norm pass took it (unscaled); reduced over the ranks under sharding."""

    grad_sq_sum: Tensor | None = None
    unscaled_grad_sq_sum: Tensor | None = None


def run(
    buckets: Sequence[BucketStep], inputs: StepInputs, sharded: bool, lars_groups: Sequence[bool]
) -> StepNorm:
    """One optimizer step over ``buckets``: norms, their reduction, then the update. ``sharded``: some
    tensor's norms must be summed over other ranks (then every bucket is a :class:`PlannedBucket`);
    ``lars_groups``: which groups LARS adapts (``lars_adapts``: only their tensors have rows).

    Returns:
        The step's gradient norm's sum of squares (:class:`StepNorm`): the clip's where it clips by norm,
        else the one a LARS step's norm pass takes.
    """
    if not buckets:
        return StepNorm()
    lars_sums: dict[BucketKey, Tensor] = {}
    norm = StepNorm()
    reports = any(lars_groups) and inputs.row["max_grad_norm"] is None
    if sharded:
        lars_sums, norm = _global_norm_sums(buckets, inputs, lars_groups, reports)  # type: ignore[arg-type]
    elif inputs.row.wants("grad_sq_sum"):
        norm.grad_sq_sum = _sum_on([bucket.grad_sq_sum() for bucket in buckets], buckets[0].key[0])
    # The unsharded norm pass adds to one zero per device, summed at the end (no host sync).
    reported: dict[torch.device, Tensor] = {}
    for bucket in buckets:
        device = bucket.key[0]
        if reports and not sharded and device not in reported:
            reported[device] = torch.zeros((), dtype=torch.float64, device=device)
        row = inputs.row.with_values(grad_sq_sum=norm.grad_sq_sum, lars_sq_sums=lars_sums.get(bucket.key))
        bucket.sgd_step(inputs.table, row.on(device), reported.get(device))
    if reported:
        norm.unscaled_grad_sq_sum = _sum_on(list(reported.values()), buckets[0].key[0])
    return norm


class Steps:
    """The steps of one optimizer: each runs the plan kept from an earlier step while it holds (checked in
    bulk, its arguments in C++), else a new plan, kept for the next steps where it can be. ``last_backends``
    says which implementation ran each bucket of the last step, by "device/dtype"."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.kept: _kept.KeptPlan | _kept.KeptShardedPlan | None = None
        # A schedule-free switch's plan, by what decides it (Steps.switch).
        self.kept_switch: tuple[list[Hashable], Plan] | None = None
        #: Updated in place: dynamo replays in-place dict updates of a traced step, not attribute stores.
        self.last_backends: dict[str, str] = {}

    def step(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], inputs: StepInputs
    ) -> StepNorm:
        """One step of ``groups``; a step a GradScaler skipped (``found_inf``) writes nothing where the host
        can see it without a sync (on CUDA the kernels skip themselves), and stores no (uninitialized)
        state. Returns :func:`run`'s norm (none where the step returned before it)."""
        # Under torch.compile the step is traced from a new plan (no kept plan, no address checks).
        tracing = torch.compiler.is_compiling()
        kept = None if tracing or self.kept is None else self._kept_buckets(groups, state)
        plan = None if kept is not None else plan_step(groups, state, tracing)
        found_inf = inputs.row["found_inf"]
        if (
            not tracing
            and found_inf is not None
            and (found_inf.device.type == "cpu" or (plan is not None and (plan.new_state or plan.sparse)))
            and bool(found_inf.item())
        ):
            return StepNorm()
        if kept is not None:
            buckets, sharded, names = kept
        else:
            buckets, names = self._planned_buckets(plan)
            sharded = plan.sharded
        if inputs.scalars is not None:
            inputs = self._advance_schedule_free(inputs)
        norm = run(buckets, inputs, sharded, list(map(reference.lars_adapts, groups)))
        self.last_backends.clear()
        self.last_backends.update(names)
        if plan is not None:
            self._finish(groups, state, plan, inputs.row["grad_scale"], tracing, buckets)
        return norm

    def switch(
        self,
        groups: Sequence[dict[str, Any]],
        state: dict[Tensor, dict[str, Any]],
        switching: list[int],
        train: bool,
    ) -> None:
        """A schedule-free mode switch of the ``switching`` groups (``schedule_free_switch``: y to x, or x to
        y), a step that reads no gradient: its buckets planned, or kept from the last switch, and what a new
        plan leaves behind written back as a step's is."""
        plan = self._switch_plan(groups, state, switching)
        buckets, _ = self._planned_buckets(plan)
        rows = table(groups, lr_on_device=True)  # the switch reads no lr
        for planned in buckets:
            b = planned.bucket
            planned.ops.schedule_free_switch(b.params, b.state, b.state_slots, rows, b.tensor_group, train)
        _write_back(plan, state)

    def _switch_plan(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], switching: list[int]
    ) -> Plan:
        """The switch's plan: the one kept from the last switch where the groups, params (by identity and
        layout) and state tensors (by identity) are the same, else a new one, kept where it stores nothing and
        steps the params themselves (not DTensor shards or copies, which a later switch must take anew).
        Planning costs about as much as a third of the pass over ResNet-50's weights."""
        key: list[Hashable] = [tuple(switching)]
        for index in switching:
            key.append(plan_key(groups[index]))
            for param in groups[index]["params"]:
                held = state.get(param)
                key.append(
                    (id(param), param.stride(), None if held is None else tuple(map(id, held.values())))
                )
        if self.kept_switch is not None and self.kept_switch[0] == key:
            return self.kept_switch[1]
        plan = plan_switch(groups, state, switching)
        steps_params = all(p is s for b in plan.buckets.values() for p, s in zip(b.params, b.sources))
        keep = steps_params and not (plan.staged or plan.new_state or plan.dtensors)
        self.kept_switch = (key, plan) if keep else None
        return plan

    def _advance_schedule_free(self, inputs: StepInputs) -> StepInputs:
        """A schedule-free step's scalars advanced on their device (nothing where the step was skipped), every
        group's, whether or not its params have grads; the inputs of its buckets, whose row reads this step's
        lrs (after warmup) and average weights from them."""
        scalars = inputs.scalars
        ops = _backends.implementation(self.backend, scalars.device)[1]
        read = StepRow({name: inputs.row[name] for name in ("found_inf", "lrs")})  # what the op reads
        ops.schedule_free_scalars(scalars, inputs.table, read.on(scalars.device))
        rows = dict(zip(SCHEDULE_FREE_SCALARS, scalars))
        return StepInputs(inputs.table, inputs.row.with_values(lrs=rows["scheduled_lr"], ckp1=rows["ckp1"]))

    def _kept_buckets(
        self, groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]]
    ) -> tuple[list[Any], bool, dict[str, str]] | None:
        """The buckets of the kept plan, if it still holds (else None, nothing changed)."""
        kept = self.kept
        if isinstance(kept, _kept.KeptPlan):
            buckets = kept.buckets_for(groups, state)
            if buckets is None:
                return None
            return buckets, False, {bucket_name(b.key): f"{kept.backend} (kept plan)" for b in buckets}
        plan = kept.plan_for(groups, state)
        if plan is None:
            return None
        buckets, names = self._planned_buckets(plan)
        return buckets, plan.sharded, names

    def _planned_buckets(self, plan: Plan) -> tuple[list[PlannedBucket], dict[str, str]]:
        """The plan's buckets with the implementation that runs each, all resolved before any runs, so a
        refusal leaves every bucket untouched."""
        chosen = {key: _backends.implementation(self.backend, key[0]) for key in plan.buckets}
        buckets = [
            PlannedBucket(key, bucket, ops, name)
            for key, bucket in plan.buckets.items()
            for name, ops in [chosen[key]]
        ]
        return buckets, {bucket_name(key): name for key, (name, _) in chosen.items()}

    def _finish(
        self,
        groups: Sequence[dict[str, Any]],
        state: Mapping[Tensor, dict[str, Any]],
        plan: Plan,
        grad_scale: Tensor | None,
        tracing: bool,
        buckets: list[PlannedBucket],
    ) -> None:
        """What a new plan does after its buckets ran: sparse gradients, params updated through a copy, the
        new state; and the plan kept for the next steps where it can be."""
        if plan.sparse:
            _sparse.step_sparse(plan.sparse, groups, state, grad_scale)
        _write_back(plan, state)
        if not tracing:
            ran_by = {(bucket.backend, bucket.ops) for bucket in buckets}
            self.kept = _kept.keep(groups, state, plan, ran_by.pop() if len(ran_by) == 1 else None)


def _write_back(plan: Plan, state: Mapping[Tensor, dict[str, Any]]) -> None:
    """What a new plan's buckets wrote elsewhere than in place: params stepped through a dense copy, and the
    state it made (seeded slots) or dropped (stale ones)."""
    for param, dense in plan.staged:
        param.copy_(dense)
    for param, key, value in plan.new_state:
        if value is None:
            del state[param][key]
        else:
            state[param][key] = value


def _global_norm_sums(
    buckets: Sequence[PlannedBucket], inputs: StepInputs, lars_groups: Sequence[bool], reports: bool
) -> tuple[dict[BucketKey, Tensor], StepNorm]:
    """The sums of squares a sharded step needs, made global: each bucket's ``lars_sq_sums`` (where it has
    LARS tensors) and, under norm clipping, the sum of squares of every stepped gradient; where it
    ``reports`` its norm, that of the gradients of tensors without LARS (whose rows hold no ``grad_sq``).

    One kernel call per bucket produces the local partial sums; the rows and gradient sums of the tensors
    split over one process group travel in one vector and one ``all_reduce`` (SUM), so a step costs one
    collective per process group, whatever the number of tensors. Tensors split nowhere add their sums
    locally."""
    lars_sums: dict[BucketKey, Tensor] = {}
    clips = inputs.row.wants("grad_sq_sum")
    # Per reduce key of each bucket: (bucket key, LARS row indices, whether the clip sum follows, the groups),
    # and its local sums as one vector (the rows, then the clip sum).
    entries: list[tuple[BucketKey, list[int], bool, ReduceKey]] = []
    sums: list[Tensor] = []
    grad_sqs: list[Tensor] = []  # the clip norm's sums: local ones, then each entry's reduced one
    for planned in buckets:
        key, bucket, device = planned.key, planned.bucket, planned.key[0]
        lars = [lars_groups[g] for g in bucket.tensor_group]
        if any(lars):  # taken before the clip, whose global norm the same collective makes
            norm_row = StepRow({"grad_scale": inputs.row["grad_scale"]})
            lars_sums[key] = planned.lars_sq_sums(inputs.table, norm_row.on(device))
        by_key: dict[ReduceKey | None, list[int]] = {}
        for i, reduce_key in enumerate(bucket.reduce_keys):
            by_key.setdefault(reduce_key, []).append(i)
        for reduce_key, indices in by_key.items():
            summed = indices if clips else [i for i in indices if not lars[i]] if reports else []
            sq = planned.ops.grad_sq_sum([bucket.grads[i] for i in summed]) if summed else None
            if reduce_key is None:
                if sq is not None:
                    grad_sqs.append(sq)
                continue
            rows = [i for i in indices if lars[i]]
            if rows or sq is not None:
                parts = [lars_sums[key][rows].reshape(-1)] if rows else []
                parts += [sq.reshape(1).to(device)] if sq is not None else []
                entries.append((key, rows, sq is not None, reduce_key))
                sums.append(torch.cat(parts))
    # One all-reduce per process group, over the entries split on it (a tensor split over two mesh dimensions
    # is summed over both, one after the other). Every rank meets the groups in its plan's order.
    for group in dict.fromkeys(group for *_, reduce_key in entries for group in reduce_key):
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
    if clips:
        return lars_sums, StepNorm(grad_sq_sum=_sum_on(grad_sqs, grad_sqs[0].device))
    if not reports:
        return lars_sums, StepNorm()
    # The LARS tensors' grad_sq, unscaled in the kernel; the others' scaled, unscaled here as the kernel does.
    column = LARS_SUM_NAMES.index("grad_sq")
    unscaled = [rows[:, column].sum() for rows in lars_sums.values()]
    device = buckets[0].key[0]
    if grad_sqs:
        unscaled.append(_sum_on(grad_sqs, device) * inverse_scale(inputs.row["grad_scale"], device) ** 2)
    return lars_sums, StepNorm(unscaled_grad_sq_sum=_sum_on(unscaled, device) if unscaled else None)


def inverse_scale(grad_scale: Tensor | None, device: torch.device) -> Tensor | float:
    """1 / grad_scale as the kernels unscale by it (GradScaler's float32 reciprocal of its scale), in
    float64 on ``device``; 1.0 without a scale."""
    if grad_scale is None:
        return 1.0
    return reference.inverse_scale(torch.as_tensor(grad_scale, device=device)).double()
