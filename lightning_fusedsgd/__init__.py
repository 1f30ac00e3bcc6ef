"""FusedSGD and LARS in one compiled multi-tensor kernel, for PyTorch Lightning."""

from lightning_fusedsgd.optim import FusedLARS, FusedSGD, FusedSGDScheduleFree, attach_deepspeed
from lightning_fusedsgd.param_groups import param_groups
from lightning_fusedsgd.schedule import WarmupLR, scaled_lr

__version__ = "0.2.0.dev0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "FusedLARS",
    "FusedSGD",
    "FusedSGDScheduleFree",
    "WarmupLR",
    "__version__",
    "attach_deepspeed",
    "param_groups",
    "scaled_lr",
]
