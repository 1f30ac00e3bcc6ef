"""The lr schedule as a pure function of the step: linear scaling, linear warmup, then a decay.

The lr at global step ``t`` is ``f(t)`` (:meth:`WarmupSchedule.lr_at`), never a chained update of the previous
lr, so a resumed run only needs ``t`` to continue exactly. :class:`~lightning_fusedsgd.schedule.WarmupLR`
steps an optimizer through it."""

from __future__ import annotations

import array
import bisect
import dataclasses
import math
import numbers
import operator
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from lightning_fusedsgd._abi import DECAYS, SCHEDULE_HEADER

__all__ = ["DECAYS", "DEVICE_ROW_STEPS", "WarmupSchedule", "scaled_lr"]

DEVICE_ROW_STEPS = 2**24
"""The most steps, from ``warmup_steps`` to ``total_steps``, of a cosine, poly or linear decay whose row
(:meth:`WarmupSchedule.row`) is built: a factor of 8 bytes a step, on the host and again on the device of a
capturable optimizer (128 MiB each at the bound)."""


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
            return peak * self._factor(bisect.bisect_right(self.milestones, step))
        return self.end_lr + (peak - self.end_lr) * self._factor(step)

    def _factor(self, index: int) -> float:
        """The decay's factor at ``index`` (:meth:`_factors`)."""
        return next(self._factors((index,)))

    def _factors(self, indices: Iterable[int]) -> Iterator[float]:
        """The decay's factor at each of ``indices``: ``gamma ** index`` (multistep, ``index`` milestones
        reached), or the shape at step ``index`` from ``warmup_steps`` to ``total_steps`` (cosine, poly,
        linear). Built of maps of Python's own operations, so that a row of millions of steps takes no Python
        loop and no list, and each value is the one :meth:`lr_at` computes, bit for bit."""
        if self.decay == "multistep":
            return map(operator.pow, repeat(self.gamma), indices)
        steps = map(operator.sub, indices, repeat(self.warmup_steps))
        progress = map(operator.truediv, steps, repeat(self.total_steps - self.warmup_steps))
        if self.decay == "cosine":  # 0.5 * (1 + cos(pi * progress))
            cosines = map(math.cos, map(operator.mul, repeat(math.pi), progress))
            return map(operator.mul, repeat(0.5), map(operator.add, repeat(1.0), cosines))
        power = 1.0 if self.decay == "linear" else self.power  # (1 - progress) ** power
        return map(operator.pow, map(operator.sub, repeat(1.0), progress), repeat(power))

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

    def row(self) -> Tensor:
        """The schedule as the device op ``schedule_lrs`` reads it (csrc/schedule.h), a float64 CPU tensor:
        the fields named by :data:`~lightning_fusedsgd._abi.SCHEDULE_HEADER` in its order (the decay as its
        index in :data:`DECAYS`, ``milestone_count`` the number of milestones), the milestones, then the
        decay's factors as :meth:`lr_at` computes them here: ``gamma ** k`` for k = 0 ... milestones
        (multistep), the shape of each step from ``warmup_steps`` to ``total_steps`` (cosine, poly, linear),
        none (constant). The device takes these rather than its own ``cos`` and ``pow``, whose last bits
        differ from the host's (CUDA's libm is not glibc's), so that its lrs are :meth:`lr_at`'s bit for bit:
        the rest is +, -, * and / in the same order, rounded alike everywhere.

        The shape takes 8 bytes a step, built without a Python list (10^7 steps: 80 MB, and 4 s on a busy CPU
        core), up to :data:`DEVICE_ROW_STEPS` steps.

        Raises:
            ValueError: Where a cosine, poly or linear decay runs over more than :data:`DEVICE_ROW_STEPS`
                steps, naming the ways out: a host schedule (an optimizer with ``capturable=False``), a
                multistep or constant decay, or a shorter run.
        """
        header = [
            DECAYS.index(self.decay)
            if name == "decay"
            else len(self.milestones)
            if name == "milestone_count"
            else getattr(self, name)
            for name in SCHEDULE_HEADER
        ]
        row = array.array("d", [float(value) for value in (*header, *self.milestones)])
        if self.decay == "multistep":
            row.extend(self._factors(range(len(self.milestones) + 1)))
        elif self.decay != "constant":
            steps = self.total_steps - self.warmup_steps + 1
            if steps > DEVICE_ROW_STEPS:
                raise ValueError(
                    f"decay={self.decay!r} from warmup_steps={self.warmup_steps} to total_steps="
                    f"{self.total_steps} takes a factor for each of its {steps} steps in the row a device "
                    f"schedule reads (8 bytes a step, {8 * steps / 2**20:.0f} MiB on the host and on the "
                    f"device), and the row holds at most {DEVICE_ROW_STEPS} (DEVICE_ROW_STEPS). Run the "
                    "schedule on the host (WarmupLR on an optimizer with capturable=False computes each "
                    "step's lr there), use decay='multistep' or 'constant', whose rows hold a few numbers, "
                    "or a shorter total_steps."
                )
            row.extend(self._factors(range(self.warmup_steps, self.total_steps + 1)))
        return torch.frombuffer(row, dtype=torch.float64)  # shares the array's memory, and keeps it

    def as_row(self) -> list[float]:
        """:meth:`row` as a list of floats."""
        return self.row().tolist()

    @classmethod
    def from_row(cls, row: Sequence[float]) -> WarmupSchedule:
        """The schedule :meth:`row` encoded (its header and milestones; the factors follow from them)."""
        fields = dict(zip(SCHEDULE_HEADER, row[: len(SCHEDULE_HEADER)], strict=True))
        fields["decay"] = DECAYS[int(fields["decay"])]
        for name in ("total_steps", "warmup_steps", "milestone_count"):
            fields[name] = int(fields[name])
        milestones = row[len(SCHEDULE_HEADER) : len(SCHEDULE_HEADER) + fields.pop("milestone_count")]
        return cls(**fields, milestones=tuple(int(m) for m in milestones))

    def curve(self, peak: float, num_steps: int | None = None) -> list[float]:
        """``[f(0), ..., f(num_steps - 1)]``: the lrs of a run, ``total_steps`` of them by default."""
        return [
            self.lr_at(step, peak) for step in range(self.total_steps if num_steps is None else num_steps)
        ]
