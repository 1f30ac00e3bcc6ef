"""Learning-rate schedules for large-batch SGD: the schedule as a pure function of the step
(:class:`WarmupSchedule`, :func:`scaled_lr`) and the ``LRScheduler`` that steps an optimizer through it
(:class:`WarmupLR`)."""

from lightning_fusedsgd.schedule.function import DECAYS, DEVICE_ROW_STEPS, WarmupSchedule, scaled_lr
from lightning_fusedsgd.schedule.lr_scheduler import DeviceLrs, ReportsSkips, WarmupLR

__all__ = [
    "DECAYS",
    "DEVICE_ROW_STEPS",
    "DeviceLrs",
    "ReportsSkips",
    "WarmupLR",
    "WarmupSchedule",
    "scaled_lr",
]
