"""PyTorch Lightning integration: the optimizer factory, an image classifier, DataModules, callbacks."""

from lightning_fusedsgd.lightning.callbacks import RunSummary
from lightning_fusedsgd.lightning.checkpointing import AtomicCheckpointIO, InitFromCheckpoint
from lightning_fusedsgd.lightning.data import (
    CIFAR10DataModule,
    DigitsDataModule,
    EpochSampler,
    ImageFolderDataModule,
    SyntheticDataModule,
)
from lightning_fusedsgd.lightning.errors import ConfigError, DataNotFoundError
from lightning_fusedsgd.lightning.factory import Schedule, clip_gradients, configure_fused_sgd
from lightning_fusedsgd.lightning.module import ImageClassifier, build_resnet

__all__ = [
    "AtomicCheckpointIO",
    "CIFAR10DataModule",
    "ConfigError",
    "DataNotFoundError",
    "DigitsDataModule",
    "EpochSampler",
    "ImageClassifier",
    "ImageFolderDataModule",
    "InitFromCheckpoint",
    "RunSummary",
    "Schedule",
    "SyntheticDataModule",
    "build_resnet",
    "clip_gradients",
    "configure_fused_sgd",
]
