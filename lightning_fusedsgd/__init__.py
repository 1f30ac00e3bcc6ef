"""FusedSGD and LARS in one compiled multi-tensor kernel, for PyTorch Lightning."""

from lightning_fusedsgd.optim import FusedLARS, FusedSGD

__version__ = "0.1.0"

__all__ = ["FusedLARS", "FusedSGD", "__version__"]
