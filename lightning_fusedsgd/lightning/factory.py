"""``configure_optimizers`` for FusedSGD/LARS: parameter groups, linear lr scaling, warmup + decay.

Use it in your own LightningModule::

    def configure_optimizers(self):
        return configure_fused_sgd(self, base_lr=0.1, weight_decay=1e-4,
                                   schedule=Schedule(warmup=5, decay="multistep", milestones=(30, 60, 80)))

or as a Hydra node (``_target_: lightning_fusedsgd.lightning.configure_fused_sgd`` with
``_partial_: true``) whose result the module calls with itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_fusedsgd._abi import masters_by_default, number_problem
from lightning_fusedsgd._checks import check_flag
from lightning_fusedsgd.lightning._arguments import check_arguments
from lightning_fusedsgd.lightning.clipping import clip_in_the_step
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.optim import FusedSGD, FusedSGDScheduleFree
from lightning_fusedsgd.param_groups import param_groups
from lightning_fusedsgd.schedule import WarmupLR, scaled_lr

__all__ = ["Schedule", "configure_fused_sgd"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Warmup and decay, with lengths in epochs or optimizer steps; resolved into a :class:`WarmupLR`.

    Args:
        decay: ``cosine``, ``multistep``, ``poly``, ``linear`` or ``constant`` (see ``WarmupSchedule``).
        warmup: Length of the linear warmup, in ``unit`` (fractions of an epoch allowed).
        milestones: ``multistep`` lr drops, in ``unit``. Milestones at or past the end of the run are
            dropped: they would never fire, so the lr of every step taken is unchanged.
        unit: ``"epoch"`` or ``"step"`` (optimizer steps), for ``warmup`` and ``milestones``.
        start_factor: Warmup's first lr as a fraction of the peak.
        start_lr: Warmup's first lr as an absolute value (overrides ``start_factor``); Goyal et al.
            warm up from the base lr, i.e. ``start_lr = lr``. A value at or above the peak means no ramp.
        gamma: ``multistep`` factor per milestone.
        power: ``poly`` exponent.
        end_lr: Absolute final lr of ``cosine`` / ``poly`` / ``linear``.
    """

    decay: str = "cosine"
    warmup: float = 0.0
    milestones: Sequence[float] = ()
    unit: Literal["epoch", "step"] = "epoch"
    start_factor: float = 0.0
    start_lr: float | None = None
    gamma: float = 0.1
    power: float = 2.0
    end_lr: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.milestones, str) or not isinstance(self.milestones, Sequence):
            raise ConfigError(f"schedule.milestones must be a list of numbers, got {self.milestones!r}")
        object.__setattr__(self, "milestones", tuple(self.milestones))  # Hydra passes a ListConfig
        if self.unit not in ("epoch", "step"):
            raise ConfigError(f"schedule.unit must be 'epoch' or 'step', got {self.unit!r}")
        numbers = dict(warmup=self.warmup, start_factor=self.start_factor, gamma=self.gamma, power=self.power)
        numbers |= dict(end_lr=self.end_lr, start_lr=self.start_lr)
        numbers |= {f"milestones[{index}]": value for index, value in enumerate(self.milestones)}
        for name, value in numbers.items():
            if not (name == "start_lr" and value is None) and number_problem(value) is not None:
                raise ConfigError(f"schedule.{name} must be a number, got {value!r}")

    def _scale(self, steps_per_epoch: int | None) -> int:
        """Optimizer steps per ``unit``."""
        in_epochs = self.unit == "epoch" and (self.warmup or self.milestones)
        if in_epochs and steps_per_epoch is None:
            raise ConfigError(
                "the training data has no length, so epochs cannot be converted: use schedule.unit=step"
            )
        return steps_per_epoch if in_epochs else 1

    def warmup_steps(self, steps_per_epoch: int | None) -> int:
        """The warmup's length in optimizer steps, ``steps_per_epoch`` per epoch."""
        return round(self.warmup * self._scale(steps_per_epoch))

    def build(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        steps_per_epoch: int | None,
        peak_lr: float,
    ) -> WarmupLR:
        """The scheduler for a run of ``total_steps`` optimizer steps, ``steps_per_epoch`` per epoch.

        Raises:
            ConfigError: If epochs are used with an unknown epoch length, or the schedule does not fit
                the run.
        """
        warmup_steps = self.warmup_steps(steps_per_epoch)
        scale = self._scale(steps_per_epoch)
        start_factor = self.start_factor
        if self.start_lr is not None:
            start_factor = min(1.0, self.start_lr / peak_lr) if peak_lr > 0 else 1.0
        if warmup_steps >= total_steps:
            # Ramp over the whole run rather than start at a large peak lr unwarmed.
            if start_factor < 1:
                rank_zero_warn(
                    f"Schedule: warmup of {warmup_steps} steps does not fit in this run of {total_steps} "
                    f"steps; warming up over {total_steps - 1} steps instead"
                )
            warmup_steps = total_steps - 1
        milestones = [step for step in (round(m * scale) for m in self.milestones) if step < total_steps]
        # With every milestone past the end, multistep is constant for every step taken.
        decay = "constant" if self.decay == "multistep" and self.milestones and not milestones else self.decay
        try:
            return WarmupLR(
                optimizer,
                total_steps=total_steps,
                warmup_steps=warmup_steps,
                start_factor=start_factor,
                decay=decay,
                milestones=milestones,
                gamma=self.gamma,
                power=self.power,
                end_lr=self.end_lr,
            )
        except ValueError as err:
            raise ConfigError(f"schedule: {err} (steps per epoch: {steps_per_epoch})") from err


def configure_fused_sgd(
    module: pl.LightningModule,
    *,
    lr: float | None = None,
    base_lr: float | None = None,
    reference_batch_size: int = 256,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    lars: bool = False,
    master_weights: bool | None = None,
    no_decay_bias: bool = True,
    no_decay_norm: bool = True,
    no_lars_bias: bool = True,
    no_lars_norm: bool = True,
    extra_no_decay: Sequence[str] = (),
    schedule: Schedule | None = None,
    batch_size: int | None = None,
    schedule_free: bool = False,
    **optimizer_kwargs: Any,
) -> dict[str, Any]:
    """Build parameter groups -> :class:`FusedSGD` -> :class:`WarmupLR` for ``module``'s trainer (or
    :class:`FusedSGDScheduleFree`, with no scheduler).

    Call it from ``configure_optimizers``. Lightning's ``gradient_clip_val`` then clips inside the fused
    step under every precision (see :func:`clip_gradients`). The peak lr follows the linear scaling rule
    with the global batch ``per-device batch x trainer.world_size x accumulate_grad_batches`` when given as
    ``base_lr`` (the world size counts the training processes: devices x nodes under Lightning's own
    launchers, the workers under Ray Train, whose Trainers have one device each); the schedule spans
    ``trainer.estimated_stepping_batches``. Logs one line with the resolved values (where the warmup starts).

    ``lr`` is always the absolute peak lr, the value a group has after warmup: what Lightning's
    ``Tuner.lr_find(update_attr=True)`` suggests and writes to ``module.lr``, so
    ``configure_fused_sgd(self, lr=self.lr)`` trains with the lr it found. ``base_lr`` is the lr of a
    recipe stated per ``reference_batch_size`` images (0.1 per 256 for ResNet-50), scaled linearly to the
    run's global batch.

    Args:
        module: The LightningModule, attached to a trainer.
        lr: The peak lr, used as given; when set, ``base_lr`` and ``reference_batch_size`` are not used.
        base_lr: The lr for ``reference_batch_size`` images per step, scaled to the global batch (used
            when ``lr`` is None; 0.1 when both are None).
        reference_batch_size: Batch size ``base_lr`` was tuned for.
        momentum: Momentum factor.
        weight_decay: L2 weight decay of the decayed group.
        lars: LARS trust ratio on the weights (not on biases/norm parameters, per the ``no_lars_*`` flags).
        master_weights: fp32 master weights; ``None`` turns them on when the module's parameters are
            bf16/fp16 (``precision="bf16-true"``), unless the optimizer's keyword arguments choose stochastic
            or Kahan rounding of bf16 updates instead (bf16 without masters, see :class:`FusedSGD`).
        no_decay_bias: No weight decay on biases.
        no_decay_norm: No weight decay on normalization and other 1-d parameters.
        no_lars_bias: No LARS on biases.
        no_lars_norm: No LARS on normalization and other 1-d parameters.
        extra_no_decay: fnmatch patterns of more parameter names with neither decay nor LARS.
        schedule: Warmup and decay; default cosine to zero without warmup.
        batch_size: Per-device batch size; read from the training DataLoader when ``None``.
        schedule_free: Schedule-free SGD (:class:`~lightning_fusedsgd.FusedSGDScheduleFree`, ``momentum`` its
            interpolation) and no lr scheduler: the lr is the peak from the first step after warmup, the
            schedule's ``warmup`` its ``warmup_steps``; the schedule's decay, milestones and warmup start are
            not used (the average replaces the decay; the warmup starts at ``lr / warmup_steps``, as
            schedulefree's). The ScheduleFreeModes callback switches its modes.
        **optimizer_kwargs: Further :class:`~lightning_fusedsgd.FusedSGD` arguments, as FusedSGD takes them:
            ``nesterov``, ``dampening``, the LARS options (``trust_coefficient``, ``trust_clip``, ...),
            ``wd_after_momentum``, ``capturable``, ``backend``, ...; with ``schedule_free``, those of
            FusedSGDScheduleFree (``r``, ``weight_lr_power``, ...).

    Returns:
        ``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": "step"}}``; with
        ``schedule_free``, ``{"optimizer": ...}``.

    Raises:
        ConfigError: If a switch is a string (a config's ``"false"``, which Python takes as true), the
            optimizer does not take an option or refuses a value (an lr that is no number included), a LARS
            option or ``no_lars_*`` is changed with ``lars=False`` (no step would read it), the module has no
            trainer, the run length or batch size cannot be found, or the schedule does not fit the run.
    """
    switches = dict(lars=lars, master_weights=master_weights, no_decay_bias=no_decay_bias)
    switches |= dict(no_decay_norm=no_decay_norm, no_lars_bias=no_lars_bias, no_lars_norm=no_lars_norm)
    switches |= dict(schedule_free=schedule_free)
    try:
        for key, value in switches.items():
            check_flag(key, value)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    no_lars = dict(no_lars_bias=no_lars_bias, no_lars_norm=no_lars_norm)
    check_arguments(configure_fused_sgd, lr, lars, schedule_free, no_lars, optimizer_kwargs)
    try:
        trainer = module.trainer
    except RuntimeError:
        trainer = None  # Lightning raises where the module is not attached
    if trainer is None:
        raise ConfigError(
            "configure_fused_sgd needs the module attached to a Trainer: call it from configure_optimizers"
        )
    if schedule_free and lars:
        raise ConfigError("schedule_free=True steps without LARS: set lars=False (or schedule_free=False)")
    schedule = schedule or Schedule(decay="constant" if schedule_free else "cosine")

    total_steps, steps_per_epoch = _run_length(trainer)
    accumulate = trainer.accumulate_grad_batches
    if batch_size is None:
        batch_size = _per_device_batch_size(trainer)
    global_batch = batch_size * trainer.world_size * accumulate
    if lr is not None:
        peak_lr = float(lr)
        scaling = " (lr, as given)"
    else:
        base_lr = 0.1 if base_lr is None else base_lr
        try:
            peak_lr = scaled_lr(base_lr, global_batch, reference_batch_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        scaling = f" = base_lr {base_lr:g} x {global_batch}/{reference_batch_size}"

    if not lars:
        # One decayed and one excluded group, as plain SGD recipes have.
        no_lars_bias, no_lars_norm = no_decay_bias, no_decay_norm
    groups = param_groups(
        module,
        weight_decay,
        no_decay_bias=no_decay_bias,
        no_decay_norm=no_decay_norm,
        no_lars_bias=no_lars_bias,
        no_lars_norm=no_lars_norm,
        extra_no_decay=tuple(extra_no_decay),
    )
    if not lars:
        for group in groups:
            group["name"] = "decay" if group["weight_decay"] else "no_decay"
    if master_weights is None:
        master_weights = masters_by_default(optimizer_kwargs, (p.dtype for p in module.parameters()))

    common = dict(lr=peak_lr, momentum=momentum, weight_decay=weight_decay, master_weights=master_weights)
    try:
        if schedule_free:
            warmup = schedule.warmup_steps(steps_per_epoch)
            optimizer = FusedSGDScheduleFree(groups, warmup_steps=warmup, **common, **optimizer_kwargs)
        else:
            optimizer = FusedSGD(groups, lars=lars, **common, **optimizer_kwargs)
    except ValueError as error:  # a value the optimizer refuses: the user's to fix, in one line
        raise ConfigError(f"optimizer: {error}") from None
    clip_in_the_step(module)
    _warn_if_bf16_is_emulated(trainer)
    if schedule_free:
        rank_zero_info(
            f"configure_fused_sgd: schedule-free SGD lr {peak_lr:g}{scaling}, global batch {global_batch}, "
            f"warmup {warmup} of {total_steps} steps (the schedule's warmup; its decay={schedule.decay!r} is "
            f"not used), master_weights={master_weights}, groups: {_group_sizes(optimizer)}"
        )
        return {"optimizer": optimizer}
    scheduler = schedule.build(
        optimizer, total_steps=total_steps, steps_per_epoch=steps_per_epoch, peak_lr=peak_lr
    )

    rank_zero_info(
        f"configure_fused_sgd: {'LARS' if lars else 'SGD'} peak lr {peak_lr:g}{scaling}, "
        f"global batch {global_batch} "
        f"({batch_size} per device x {trainer.world_size} processes x {accumulate} accumulated), "
        f"warmup {scheduler.schedule.warmup_steps} of {total_steps} steps{_warmup_start(scheduler, peak_lr)} "
        f"({steps_per_epoch}/epoch, {schedule.decay}), master_weights={master_weights}, "
        f"groups: {_group_sizes(optimizer)}"
    )
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
    }


def _run_length(trainer: pl.Trainer) -> tuple[int, int | None]:
    """The run's optimizer steps, and per epoch (None when the training data has no length)."""
    if trainer.train_dataloader is None:
        # As estimated_stepping_batches does; needed here even when max_steps alone sets the length.
        trainer.fit_loop.setup_data()
    total_steps = trainer.estimated_stepping_batches
    if not math.isfinite(total_steps) or total_steps < 1:
        raise ConfigError(
            f"cannot size the lr schedule: the run has {total_steps} optimizer steps; set trainer.max_epochs "
            "or trainer.max_steps"
        )
    batches = trainer.num_training_batches
    accumulate = trainer.accumulate_grad_batches
    steps_per_epoch = max(1, math.ceil(batches / accumulate)) if math.isfinite(batches) else None
    return int(total_steps), steps_per_epoch


def _warmup_start(scheduler: WarmupLR, peak_lr: float) -> str:
    """Where the warmup starts, as the first step's lr is: a start_lr at or above the peak means no ramp
    (Goyal et al.'s warmup from the base lr, where the global batch is at most the reference batch)."""
    schedule = scheduler.schedule
    if not schedule.warmup_steps:
        return ""
    if schedule.start_factor >= 1:
        return " at the peak lr (the warmup's start is not below it: no ramp)"
    return f" from lr {schedule.start_factor * peak_lr:g}"


def _group_sizes(optimizer: torch.optim.Optimizer) -> str:
    return ", ".join(
        f"{group['name']} {len(group['params'])} tensors/{sum(p.numel() for p in group['params']) / 1e6:.2f}M"
        for group in optimizer.param_groups
    )


def _per_device_batch_size(trainer: pl.Trainer) -> int:
    loader = trainer.train_dataloader
    if isinstance(loader, DataLoader):
        size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if size:
            return int(size)
    raise ConfigError(
        "configure_fused_sgd cannot read the per-device batch size from the training dataloader "
        f"({type(loader).__name__}); pass batch_size=..."
    )


def _warn_if_bf16_is_emulated(trainer: pl.Trainer) -> None:
    """One line where a bf16 precision runs on a CPU without native bf16: the model's convolutions and matmuls
    are then tens of times slower than in fp32, which users would otherwise blame on the optimizer."""
    precision = str(trainer.precision)
    on_cpu = type(trainer.accelerator).__name__ == "CPUAccelerator"
    if precision.startswith("bf16") and on_cpu and not cpu_has_native_bf16():
        rank_zero_warn(
            f"precision={precision} on a CPU without native bf16 (no AVX512-BF16, AMX or Arm BF16): "
            "PyTorch runs this model's bf16 convolutions and matmuls tens of times slower than fp32 here "
            "(oneDNN has no fast bf16 path on it). The optimizer step is not the slow part. Use "
            "precision=32-true on this machine, or bf16 where the hardware has it (recent GPUs, Sapphire "
            "Rapids and later)."
        )


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX on x86, the BF16 extension on Arm), from
    the flags Linux lists; False where they cannot be read."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags.split(":", 1)[-1].split()))
