"""PyTorch Lightning integration: :func:`configure_fused_sgd` for ``configure_optimizers`` (parameter groups,
linear lr scaling, warmup and decay), clipping inside the fused step, FusedSGD's norms under
``DeepSpeedStrategy`` (:class:`AttachDeepSpeed`), the average of the weights in the step
(:class:`EMAWeightAveraging`, Lightning's drop-in), schedule-free SGD's train/eval modes
(:class:`ScheduleFreeModes`), and checkpoint glue (atomic checkpoint files, starting a fit from another run's
or torchvision's checkpoint). Needs ``lightning`` only; the recipe runner behind
``train.py`` sits beside it, outside the package (``runner/``)."""

from lightning_fusedsgd.lightning.checkpointing import AtomicCheckpointIO, InitFromCheckpoint
from lightning_fusedsgd.lightning.clipping import ClipInTheStep, clip_gradients
from lightning_fusedsgd.lightning.deepspeed import AttachDeepSpeed
from lightning_fusedsgd.lightning.ema import EMAWeightAveraging
from lightning_fusedsgd.lightning.errors import ConfigError
from lightning_fusedsgd.lightning.factory import Schedule, configure_fused_sgd
from lightning_fusedsgd.lightning.schedule_free import ScheduleFreeModes

__all__ = [
    "AtomicCheckpointIO",
    "AttachDeepSpeed",
    "ClipInTheStep",
    "ConfigError",
    "EMAWeightAveraging",
    "InitFromCheckpoint",
    "Schedule",
    "ScheduleFreeModes",
    "clip_gradients",
    "configure_fused_sgd",
]
