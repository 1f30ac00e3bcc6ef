"""``WarmupLR``: a ``torch.optim.lr_scheduler.LRScheduler`` that sets every group's lr to f(t) of
:class:`~lightning_fusedsgd.schedule.WarmupSchedule`, stepped once per optimizer step (with Lightning,
``interval: "step"``), counting only the steps the optimizer applied; on a capturable optimizer the schedule
runs on the device."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_fusedsgd.checkpoint import CheckpointMismatchError
from lightning_fusedsgd.schedule.function import WarmupSchedule

__all__ = ["DeviceLrs", "ReportsSkips", "WarmupLR"]


@runtime_checkable
class ReportsSkips(Protocol):
    """An optimizer that says whether its last ``step()`` was applied: ``True``, or a 0-d bool tensor made
    from a
    GradScaler's ``found_inf`` (``FusedSGD.last_step_applied``). Other optimizers' skips cannot be seen."""

    last_step_applied: Tensor | bool


@runtime_checkable
class DeviceLrs(Protocol):
    """What :class:`WarmupLR` needs of an optimizer to run its schedule on the device: the groups' lrs as one
    tensor there (``FusedSGD(capturable=True)``), and the op that sets them from the schedule after each step,
    reading on the device whether that step was applied."""

    capturable: bool

    def lr_tensor(self) -> Tensor: ...

    def schedule_lrs(self, position: Tensor, schedule: Tensor, peaks: Tensor, advance: bool) -> None: ...


def _last_step_applied(optimizer: Optimizer) -> Tensor | bool:
    return optimizer.last_step_applied if isinstance(optimizer, ReportsSkips) else True


def _on_device(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, DeviceLrs) and optimizer.capturable


def _as_float(lr: float | torch.Tensor) -> float:
    return lr.item() if isinstance(lr, torch.Tensor) else float(lr)


def _check_loadable(state_dict: dict[str, Any]) -> None:
    """Refuses, before anything changes, a scheduler state whose steps are not counts, whose peaks are not
    lrs or whose schedule is not one (the values ``WarmupLR.state_dict`` saves)."""
    fix = "the state is damaged or not WarmupLR's: load what scheduler.state_dict() saved"
    if "last_epoch" not in state_dict:  # it would start the schedule again at step 0
        raise ValueError(f"the lr scheduler checkpoint has no last_epoch, the steps taken: {fix}.")
    for key in ("last_epoch", "skipped_steps"):
        value = state_dict.get(key, 0)  # a state of an earlier version counts no skipped steps
        try:
            count = operator.index(value)  # an int, or a 0-d integer tensor
        except TypeError:
            count = -1
        if count < 0 or isinstance(value, bool):
            raise ValueError(
                f"the lr scheduler checkpoint's {key} is {value!r}, but it is a count of steps, "
                f"an int >= 0: {fix}."
            )
    peaks = state_dict.get("base_lrs", [])
    if not isinstance(peaks, Sequence) or not all(_is_lr(peak) for peak in peaks):
        raise ValueError(
            f"the lr scheduler checkpoint's base_lrs is {peaks!r}, but it is each group's peak lr, a number "
            f">= 0: {fix}."
        )
    saved_schedule = state_dict.get("schedule")
    if saved_schedule:
        try:
            WarmupSchedule(**saved_schedule)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"the lr scheduler checkpoint's schedule is no WarmupSchedule ({error}): {fix}."
            ) from None


def _is_lr(value: Any) -> bool:
    """Whether ``value`` is an lr: a finite number >= 0, or a one-element tensor of one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return False
        value = value.item()
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


@dataclasses.dataclass
class _DeviceSchedule:
    """WarmupLR's position and schedule on a capturable optimizer's device, stepped by its
    ``schedule_lrs``."""

    optimizer: DeviceLrs
    position: Tensor  # int64 [applied steps, skipped steps]
    row: Tensor  # WarmupSchedule.row()
    peaks: Tensor  # float64 [groups]

    @classmethod
    def create(
        cls, optimizer: DeviceLrs, row: Tensor, peaks: list[float], counts: list[int]
    ) -> _DeviceSchedule:
        on_device = dict(device=optimizer.lr_tensor().device)
        return cls(
            optimizer,
            torch.tensor(counts, dtype=torch.int64, **on_device),
            row.to(**on_device),
            torch.tensor(peaks, dtype=torch.float64, **on_device),
        )

    def run(self, advance: bool) -> None:
        groups = self.optimizer.lr_tensor().numel()
        if groups != self.peaks.numel():
            raise ValueError(
                f"the optimizer has {groups} parameter groups, WarmupLR was created for "
                f"{self.peaks.numel()}: create the scheduler after adding every parameter group"
            )
        self.optimizer.schedule_lrs(self.position, self.row, self.peaks, advance)


class WarmupLR(LRScheduler):
    """``torch.optim.lr_scheduler.LRScheduler`` that sets every group's lr to :class:`WarmupSchedule`'s f(t).

    Each group's peak is its ``initial_lr`` (its ``lr`` when the scheduler is created), so groups
    with different lrs keep their ratio through warmup; ``end_lr`` is absolute and shared (see
    :class:`WarmupSchedule`). Step it once after every optimizer step: with Lightning, return it
    with ``"interval": "step"``. Group lrs may be floats or 0-d tensors; tensors are filled in place.

    The position t counts APPLIED optimizer steps: when the optimizer skipped its last step (a GradScaler
    found inf/NaN; :class:`FusedSGD` says so in ``last_step_applied``), ``step()`` leaves the lr where it
    is and counts the skip in ``skipped_steps``, so the applied steps use f(0), f(1), ... with nothing lost
    to a skip. Lightning's ``global_step`` counts optimizer step calls, skipped ones included: it is
    ``last_epoch + skipped_steps``. With other optimizers a skip cannot be seen, and every call advances.
    Reading the flag is free on the CPU; on CUDA it synchronizes once per step under a GradScaler, unless
    the optimizer is capturable.

    **On a capturable optimizer** (``FusedSGD(capturable=True)``) the schedule runs on the params' device:
    the position is a device counter ``[applied steps, skipped steps]`` (``device_position``), and each
    ``step()`` is one ``schedule_lrs`` op that counts the optimizer's outcome (``last_step_applied``, read
    there) and writes f(applied steps) into the groups' lr tensors. Nothing is read back to the host, so
    ``optimizer.step(); scheduler.step()`` can be captured in a CUDA graph and replayed. Reading
    ``last_epoch`` or ``skipped_steps``, ``get_last_lr()`` and ``state_dict()`` copy the values to the host
    (a sync on CUDA); checkpoints have the same format in both modes.

    ``state_dict`` holds the step counter, the skipped steps, the peaks and the schedule as plain Python
    values.
    :meth:`load_state_dict` restores the step and immediately sets every group to ``f(step)``, so
    the next optimizer step uses the lr an uninterrupted run would, whichever order the optimizer
    and scheduler states are loaded in. The schedule and peaks this scheduler was constructed with
    are kept and apply from the resumed step. A checkpoint saved with another schedule warns only if
    that changes the lr of a step already taken (:meth:`WarmupSchedule.changes_within`): resuming a
    multistep run with a larger ``max_epochs`` is silent, since it is exactly the longer run, while
    resuming a cosine run with another length warns.

    Args:
        optimizer: The wrapped optimizer.
        total_steps: See :class:`WarmupSchedule` for this and the following arguments.
        warmup_steps: Linear warmup steps.
        start_factor: lr at step 0 as a fraction of each group's peak.
        decay: One of :data:`DECAYS`.
        milestones: ``multistep`` drop points, in global steps.
        gamma: ``multistep`` factor.
        power: ``poly`` exponent.
        end_lr: Absolute final lr of ``cosine`` / ``poly`` / ``linear``.
        last_epoch: Index of the last step taken; leave at -1 and resume with :meth:`load_state_dict`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        total_steps: int,
        warmup_steps: int = 0,
        start_factor: float = 0.0,
        decay: str = "cosine",
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
        power: float = 2.0,
        end_lr: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.schedule = WarmupSchedule(
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            start_factor=start_factor,
            decay=decay,
            milestones=tuple(milestones),
            gamma=gamma,
            power=power,
            end_lr=end_lr,
        )
        # [last_epoch, skipped_steps]: host ints, or the device counter on a capturable optimizer.
        self._counts: list[int] | Tensor = [last_epoch, 0]
        self._device: _DeviceSchedule | None = None
        # A device schedule's row, built (or refused) before the optimizer's groups take an initial_lr.
        self._row: Tensor | None = self.schedule.row() if _on_device(optimizer) else None
        # The optimizer's step outcome already acted on (each step under a GradScaler makes a new one).
        self._seen_outcome = _last_step_applied(optimizer)
        super().__init__(optimizer, last_epoch)

    @property
    def last_epoch(self) -> int:
        """Applied optimizer steps taken (copied from the device on a capturable optimizer)."""
        return int(self._counts[0])

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self._counts[0] = value

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients, which did not advance the schedule."""
        return int(self._counts[1])

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._counts[1] = value

    @property
    def device_position(self) -> Tensor | None:
        """The device counter ``[applied steps, skipped steps]`` on a capturable optimizer, else None."""
        return self._device.position if self._device is not None else None

    def step(self, epoch: int | None = None) -> None:
        """Advance to the next applied step, or stay after a skipped one (see the class docstring)."""
        if _on_device(self.optimizer):
            self._step_on_device(epoch)
            return
        applied = _last_step_applied(self.optimizer)
        if epoch is None and applied is not self._seen_outcome:
            self._seen_outcome = applied
            if not bool(applied):
                self.skipped_steps += 1
                return
        super().step(epoch)

    def _step_on_device(self, epoch: int | None) -> None:
        if epoch is not None:
            raise ValueError(
                "WarmupLR on a capturable optimizer keeps its position on the device: call step() without an "
                "epoch, and resume with load_state_dict"
            )
        self._step_count += 1
        if self._device is None:  # the constructor's initial step: the lrs of the position
            peaks = [_as_float(peak) for peak in self.base_lrs]
            self._device = _DeviceSchedule.create(
                self.optimizer, self._row, peaks, [self.last_epoch + 1, self.skipped_steps]
            )
            self._row = None  # on the device now
            self._counts = self._device.position
            self._device.run(advance=False)
            return
        self._device.run(advance=True)

    def get_last_lr(self) -> list[float | Tensor]:
        """The lrs set by the last ``step()``; on a capturable optimizer copies of the groups' lr tensors."""
        if self._device is not None:
            return [group["lr"].clone() for group in self.optimizer.param_groups]
        return super().get_last_lr()

    def get_lr(self) -> list[float]:
        """Return f(``last_epoch``) for every group, from its peak."""
        return self._lrs_at(self.last_epoch)

    def _lrs_at(self, step: int) -> list[float]:
        return [self.schedule.lr_at(step, _as_float(peak)) for peak in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        """Return the state, with the schedule as a plain dict so ``weights_only=True`` loads it."""
        state = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("optimizer", "schedule", "_seen_outcome", "_counts", "_device", "_row")
        }
        state.update(
            last_epoch=self.last_epoch,
            skipped_steps=self.skipped_steps,
            schedule=dataclasses.asdict(self.schedule),
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step counter and set every group's lr to f(step).

        Raises:
            CheckpointMismatchError: (a ValueError) If the checkpoint was saved with a different number of
                parameter groups.
            ValueError: If its steps are not counts (ints >= 0), its peaks not lrs (numbers >= 0) or its
                schedule not one; nothing changes then.
        """
        _check_loadable(state_dict)
        saved_peaks = state_dict.get("base_lrs", [])
        if len(saved_peaks) != len(self.base_lrs):
            raise CheckpointMismatchError(
                f"the lr scheduler checkpoint has {len(saved_peaks)} parameter groups, this optimizer has "
                f"{len(self.base_lrs)}: the saved run grouped its parameters differently (other no_decay_* / "
                "no_lars_* / lars settings). Resume with the saved run's settings, or start a new run from "
                "its weights and momentum (train.py: init.path=<checkpoint> instead of ckpt_path)"
            )
        # Resuming with another schedule (a longer run, for one) is fine as long as the steps already
        # taken had the lrs the new schedule gives them: then the resumed run is exactly the new run.
        taken = int(state_dict["last_epoch"])
        saved_schedule = state_dict.get("schedule")
        changed = (
            WarmupSchedule(**saved_schedule).changes_within(self.schedule, taken) if saved_schedule else {}
        )
        if changed:
            differences = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
            warnings.warn(
                f"WarmupLR: the {taken} steps already taken followed another lr schedule than the one "
                f"resumed with ({differences}); "
                f"the new schedule applies from step {taken} on, so this run differs from one that used the "
                "new schedule from the start",
                UserWarning,
                stacklevel=2,
            )
        current_peaks = [_as_float(peak) for peak in self.base_lrs]
        saved = [_as_float(peak) for peak in saved_peaks]
        if taken and saved != current_peaks:
            warnings.warn(
                f"WarmupLR: resuming with peak lrs {current_peaks}, the checkpoint has {saved}; the new "
                f"peaks apply from step {taken} on",
                UserWarning,
                stacklevel=2,
            )
        counts = ("last_epoch", "skipped_steps")
        keep = ("schedule", "base_lrs", *counts)
        self.__dict__.update({key: value for key, value in state_dict.items() if key not in keep})
        self.last_epoch = taken
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self._device is not None:
            self._device.run(advance=False)
            return
        for group, lr in zip(self.optimizer.param_groups, self._lrs_at(self.last_epoch), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # in place: a tensor lr may be captured by a compiled step
            else:
                group["lr"] = lr
        self._last_lr = [
            group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            for group in self.optimizer.param_groups
        ]
