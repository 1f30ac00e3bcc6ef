"""Learning-rate schedules for large-batch SGD: linear scaling, linear warmup, then a decay.

The lr at global step ``t`` is a pure function ``f(t)`` (:meth:`WarmupSchedule.lr_at`), never a
chained update of the previous lr, so a resumed run only needs ``t`` to continue exactly.
:class:`WarmupLR` wraps that function as a ``torch.optim.lr_scheduler.LRScheduler`` that Lightning
steps once per optimizer step (``interval: "step"``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_fusedsgd.checkpoint import CheckpointMismatchError

__all__ = ["DECAYS", "WarmupLR", "WarmupSchedule", "scaled_lr"]

#: Decay shapes applied after warmup.
DECAYS: tuple[str, ...] = ("cosine", "multistep", "poly", "linear", "constant")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def scaled_lr(base_lr: float, global_batch_size: int, reference_batch_size: int = 256) -> float:
    """Linear scaling rule (Goyal et al. 2017): the lr grows with the global batch size.

    Args:
        base_lr: The lr tuned for ``reference_batch_size`` (0.1 for ResNet-50 at 256).
        global_batch_size: Images per optimizer step summed over all devices (and accumulation).
        reference_batch_size: The batch size ``base_lr`` was tuned for.

    Returns:
        ``base_lr * global_batch_size / reference_batch_size``.

    Raises:
        ValueError: If ``base_lr`` is negative or not finite, or a batch size is not a positive
            integer.
    """
    if not _is_real(base_lr) or base_lr < 0:
        raise ValueError(f"base_lr must be a finite number >= 0, got {base_lr!r}")
    for label, size in (
        ("global_batch_size", global_batch_size),
        ("reference_batch_size", reference_batch_size),
    ):
        if not _is_int(size) or size <= 0:
            raise ValueError(f"{label} must be a positive integer, got {size!r}")
    return float(base_lr) * global_batch_size / reference_batch_size


@dataclasses.dataclass(frozen=True)
class WarmupSchedule:
    """Linear warmup followed by a decay, as a pure function of the global step.

    With ``w = warmup_steps``, ``T = total_steps`` and ``p = (t - w) / (T - w)``:

    * ``t < w``: ``peak * (start_factor + (1 - start_factor) * t / w)``, so ``f(0) =
      start_factor * peak`` and ``f(w) = peak``.
    * ``w <= t <= T``, by ``decay``:

      - ``cosine``: ``end_lr + (peak - end_lr) * (1 + cos(pi * p)) / 2``
      - ``poly``: ``end_lr + (peak - end_lr) * (1 - p) ** power``
      - ``linear``: ``poly`` with ``power = 1``
      - ``multistep``: ``peak * gamma ** k``, ``k`` = number of milestones ``<= t``
      - ``constant``: ``peak``

    * ``t > T``: holds ``f(T)``.

    Step ``t`` is the number of optimizer steps already taken, so a run of ``T`` steps uses
    ``f(0) ... f(T - 1)``, and ``f(T)`` (``end_lr`` for cosine / poly / linear) is the value left
    after the last ``scheduler.step()``; this is the convention of ``CosineAnnealingLR`` and optax.

    ``end_lr`` is an **absolute** lr shared by every group, as in the MLPerf ResNet-50 LARS recipe
    (poly power 2 to 1e-4) and torch's ``eta_min``, not a fraction of each group's peak: recipes
    state it as a number, and a group whose peak is below it is rejected rather than silently
    warmed *up* by the decay. ``start_factor``, by contrast, is a fraction of the peak, as in
    ``LinearLR``. ``end_lr`` is ignored by ``multistep`` and ``constant``.

    Args:
        total_steps: Length of the run in optimizer steps (>= 1).
        warmup_steps: Steps of linear warmup, ``0 <= warmup_steps < total_steps``.
        start_factor: lr at step 0 as a fraction of the peak, in [0, 1].
        decay: One of :data:`DECAYS`.
        milestones: ``multistep`` only: strictly increasing global step indices with
            ``warmup_steps < m < total_steps``.
        gamma: ``multistep`` factor per milestone, in (0, 1].
        power: ``poly`` exponent, > 0.
        end_lr: Absolute final lr of ``cosine`` / ``poly`` / ``linear``, >= 0.

    Raises:
        ValueError: On any argument outside the ranges above, with the fix in the message.
    """

    total_steps: int
    warmup_steps: int = 0
    start_factor: float = 0.0
    decay: str = "cosine"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    power: float = 2.0
    end_lr: float = 0.0

    def __post_init__(self) -> None:
        # Hydra hands over ListConfig, users lists: store a tuple so the dataclass stays hashable.
        object.__setattr__(self, "milestones", tuple(self.milestones))
        if not _is_int(self.total_steps) or self.total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {self.total_steps!r}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} is not shorter than the run "
                f"(total_steps={self.total_steps}): the peak lr would never be used; "
                "shorten the warmup or lengthen the run"
            )
        if not _is_real(self.start_factor) or not 0.0 <= self.start_factor <= 1.0:
            raise ValueError(
                f"start_factor must be in [0, 1] (a fraction of the peak lr), got {self.start_factor!r}"
            )
        if self.decay not in DECAYS:
            raise ValueError(f"unknown decay {self.decay!r}; valid decays: {', '.join(DECAYS)}")
        if not _is_real(self.end_lr) or self.end_lr < 0:
            raise ValueError(f"end_lr must be a finite absolute lr >= 0, got {self.end_lr!r}")
        if not _is_real(self.power) or self.power <= 0:
            raise ValueError(f"power must be a finite number > 0, got {self.power!r}")
        if not _is_real(self.gamma) or not 0.0 < self.gamma <= 1.0:
            raise ValueError(
                f"gamma must be in (0, 1] (the lr is multiplied by it at each milestone), got {self.gamma!r}"
            )
        self._validate_milestones()

    def _validate_milestones(self) -> None:
        if self.decay != "multistep":
            if self.milestones:
                raise ValueError(f"milestones only apply to decay='multistep', got decay={self.decay!r}")
            return
        if not self.milestones:
            raise ValueError("decay='multistep' needs milestones (global step indices where the lr drops)")
        if not all(_is_int(m) for m in self.milestones):
            raise ValueError(f"milestones must be integer step indices, got {self.milestones!r}")
        if any(later <= earlier for earlier, later in zip(self.milestones, self.milestones[1:])):
            raise ValueError(f"milestones must be strictly increasing, got {self.milestones!r}; sort them")
        out_of_range = [m for m in self.milestones if not self.warmup_steps < m < self.total_steps]
        if out_of_range:
            raise ValueError(
                f"milestones {out_of_range} are outside warmup_steps < m < total_steps "
                f"({self.warmup_steps} < m < {self.total_steps}); milestones are global optimizer "
                "steps, not epochs (multiply epochs by steps per epoch)"
            )

    def lr_at(self, step: int, peak: float) -> float:
        """Return the lr at global step ``step`` for a group whose peak lr is ``peak``.

        Args:
            step: Optimizer steps already taken (>= 0).
            peak: The group's lr at the end of warmup (>= 0; >= ``end_lr`` for decays using it).

        Returns:
            The lr as a float.

        Raises:
            ValueError: If ``step`` is negative, or ``peak`` is negative or below ``end_lr``.
        """
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not _is_real(peak) or peak < 0:
            raise ValueError(f"peak lr must be a finite number >= 0, got {peak!r}")
        if self.decay in ("cosine", "poly", "linear") and peak < self.end_lr:
            raise ValueError(
                f"peak lr {peak} is below end_lr={self.end_lr} (an absolute lr), so decay={self.decay!r} "
                "would raise the lr; lower end_lr or raise this group's lr"
            )
        if step < self.warmup_steps:
            return peak * (self.start_factor + (1.0 - self.start_factor) * step / self.warmup_steps)
        step = min(step, self.total_steps)
        if self.decay == "constant":
            return peak
        if self.decay == "multistep":
            return peak * self.gamma ** bisect.bisect_right(self.milestones, step)
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = (1.0 - progress) ** (1.0 if self.decay == "linear" else self.power)
        return self.end_lr + (peak - self.end_lr) * shape

    def changes_within(self, other: WarmupSchedule, num_steps: int) -> dict[str, tuple[Any, Any]]:
        """The differences from ``other`` that change the lr of one of steps ``0 ... num_steps - 1``.

        Empty means both schedules give bit-identical lrs on those steps, for any peak; for example a
        longer run whose multistep milestones all lie ahead, or whose warmup is unchanged and still
        in progress. Differences that only matter later (``total_steps`` of a multistep schedule, a
        milestone not yet reached) are not reported. Conservative: a reported difference may, by
        coincidence, leave every lr unchanged.

        Args:
            other: The schedule to compare with.
            num_steps: How many steps, from step 0, are compared (the steps a run already took).

        Returns:
            ``{parameter: (this value, other value)}`` for the parameters that differ and shape the lr
            of those steps.
        """
        mine, theirs = self._determinants(num_steps), other._determinants(num_steps)
        if mine == theirs:
            return {}
        relevant = mine.keys() | theirs.keys()
        return {
            field.name: (getattr(self, field.name), getattr(other, field.name))
            for field in dataclasses.fields(self)
            if field.name in relevant and getattr(self, field.name) != getattr(other, field.name)
        }

    def _determinants(self, num_steps: int) -> dict[str, Any]:
        """The parameters ``f(0) ... f(num_steps - 1)`` depend on, equivalent shapes written alike."""
        if num_steps <= 0:
            return {}
        found: dict[str, Any] = {"warmup_steps": self.warmup_steps}
        if self.warmup_steps:
            found["start_factor"] = self.start_factor
        last = num_steps - 1
        if last < self.warmup_steps:
            return found
        if self.decay in ("constant", "multistep"):
            # Both give exactly the peak until the first milestone is reached.
            reached = tuple(m for m in self.milestones if m <= last)
            found["decay"] = "multistep" if reached else "constant"
            if reached:
                found.update(milestones=reached, gamma=self.gamma)
            return found
        # cosine / poly / linear: the peak (shape 1.0) at the warmup's end, the curve after it.
        found.update(decay="cosine" if self.decay == "cosine" else "poly", end_lr=self.end_lr)
        if last > self.warmup_steps:
            found["total_steps"] = self.total_steps
            if self.decay != "cosine":
                found["power"] = 1.0 if self.decay == "linear" else self.power
        return found

    def as_row(self) -> list[float]:
        """The schedule as the device op ``schedule_lrs`` reads it (csrc/schedule.h): ``total_steps``,
        ``warmup_steps``, ``start_factor``, the decay's index in :data:`DECAYS`, ``gamma``, ``power``,
        ``end_lr``, then the milestones."""
        header = [self.total_steps, self.warmup_steps, self.start_factor, DECAYS.index(self.decay)]
        return [float(v) for v in (*header, self.gamma, self.power, self.end_lr, *self.milestones)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> WarmupSchedule:
        """The schedule :meth:`as_row` encoded."""
        total, warmup, start_factor, decay, gamma, power, end_lr, *milestones = row
        return cls(
            total_steps=int(total),
            warmup_steps=int(warmup),
            start_factor=start_factor,
            decay=DECAYS[int(decay)],
            milestones=tuple(int(m) for m in milestones),
            gamma=gamma,
            power=power,
            end_lr=end_lr,
        )

    def curve(self, peak: float, num_steps: int | None = None) -> list[float]:
        """``[f(0), ..., f(num_steps - 1)]``: the lrs of a run, ``total_steps`` of them by default."""
        return [
            self.lr_at(step, peak) for step in range(self.total_steps if num_steps is None else num_steps)
        ]


def _as_float(lr: float | torch.Tensor) -> float:
    return lr.item() if isinstance(lr, torch.Tensor) else float(lr)


@dataclasses.dataclass
class _DeviceSchedule:
    """WarmupLR's position and schedule on a capturable optimizer's device, stepped by ``schedule_lrs``."""

    optimizer: Any  # a FusedSGD with capturable=True
    position: Tensor  # int64 [applied steps, skipped steps]
    row: Tensor  # WarmupSchedule.as_row()
    peaks: Tensor  # float64 [groups]
    op: Callable[..., None]

    @classmethod
    def create(
        cls, optimizer: Any, schedule: WarmupSchedule, peaks: list[float], counts: list[int]
    ) -> _DeviceSchedule:
        from lightning_fusedsgd import backends

        lrs = optimizer.lr_tensor()
        on_device = dict(device=lrs.device)
        return cls(
            optimizer,
            torch.tensor(counts, dtype=torch.int64, **on_device),
            torch.tensor(schedule.as_row(), dtype=torch.float64, **on_device),
            torch.tensor(peaks, dtype=torch.float64, **on_device),
            backends.schedule_function(optimizer.backend, lrs.device),
        )

    def run(self, applied: Tensor | None, advance: bool) -> None:
        lrs = self.optimizer.lr_tensor()
        if lrs.shape != self.peaks.shape:
            raise ValueError(
                f"the optimizer has {lrs.numel()} parameter groups, WarmupLR was created for "
                f"{self.peaks.numel()}: create the scheduler after adding every parameter group"
            )
        self.op(lrs, self.position, self.row, self.peaks, applied, advance)


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
        # The optimizer's step outcome already acted on (each step under a GradScaler makes a new one).
        self._seen_outcome = getattr(optimizer, "last_step_applied", True)
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
        if getattr(self.optimizer, "capturable", False):
            self._step_on_device(epoch)
            return
        applied = getattr(self.optimizer, "last_step_applied", True)
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
                self.optimizer, self.schedule, peaks, [self.last_epoch + 1, self.skipped_steps]
            )
            self._counts = self._device.position
            self._device.run(None, advance=False)
            return
        applied = getattr(self.optimizer, "last_step_applied", True)
        self._device.run(None if applied is True else applied, advance=True)

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
            if key not in ("optimizer", "schedule", "_seen_outcome", "_counts", "_device")
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
        """
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
        taken = int(state_dict.get("last_epoch", 0))
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
            self._device.run(None, advance=False)
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
