"""The runner's DataModules, the config's ``data`` targets: scikit-learn's digits (offline quickstart),
CIFAR-10 and ImageFolder from disk (``runner.image_folder``), synthetic images.

They stay thin: what they share is :class:`~runner.datamodule.SeededDataModule`; every augmentation is
``runner.augment``'s; the image folders' pipeline has modules of its own (``files``: reading bytes,
``decode``, ``image_pipeline``: the worker side and the device side); ``synthetic`` makes synthetic images,
``sampling`` the data order and augmentation seeds.

Every training loader draws from :class:`~runner.sampling.EpochSampler`: the order of epoch ``e`` is a
function of ``(seed, e)`` only, and each sample's augmentation is seeded from ``(seed, e, index)``. The
DataModules save their position in the data (epoch, batches used) in Lightning checkpoints, so a run resumed
at an epoch boundary or mid-epoch sees the same batches and the same augmented pixels as an uninterrupted run,
whatever the number of loader workers or the global RNG state.

Given ``views`` (a multi-view transform such as lightly's ``SimCLRTransform``), any of them serves
self-supervised training instead: training batches hold the views of each image, and validation has two
loaders, the un-augmented training images (a kNN memory bank) and the validation images.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import TensorDataset

from lightning_fusedsgd.lightning import ConfigError
from runner.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    cifar10_transforms,
    digits_transforms,
    normalize,
    synthetic_view_transforms,
)
from runner.datamodule import DataNotFoundError, SeededDataModule
from runner.image_folder import ImageFolderDataModule, UnreadableImagesError
from runner.options import check_at_least, check_flags
from runner.sampling import EachView, EpochSampler, SeededDataset
from runner.synthetic import SYNTHETIC_MEAN, SYNTHETIC_STD, Indices, SyntheticImages, SyntheticPool

__all__ = [  # IMAGENET_MEAN and IMAGENET_STD: runner.augment's, imported from here by bench/
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CIFAR10DataModule",
    "DataNotFoundError",
    "DigitsDataModule",
    "EachView",
    "EpochSampler",
    "ImageFolderDataModule",
    "SeededDataModule",
    "SeededDataset",
    "SyntheticDataModule",
    "UnreadableImagesError",
]


class DigitsDataModule(SeededDataModule):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), upsampled; ships offline.

    A fixed stratified split (independent of ``seed``) keeps ``val_fraction`` of the images for
    validation. Training images get a small random affine transform.

    Args:
        val_fraction: Share of images held out for validation.
        augment: Random rotation/translation/scale of training images.
        shared: :class:`~runner.datamodule.SeededDataModule`'s arguments; ``image_size``: the side the 8x8
            images are upsampled to (bilinear); ``num_classes``, ``in_channels``: must be 10 and 1;
            ``num_workers``: the data lives in memory, so 0 is fastest.
    """

    DEFAULTS: ClassVar[dict[str, int]] = {
        "batch_size": 64,
        "image_size": 32,
        "num_workers": 0,
        "num_classes": 10,
        "in_channels": 1,
    }

    def __init__(self, val_fraction: float = 0.2, augment: bool = True, **shared: Any) -> None:
        super().__init__(**shared)
        self._check_declared(num_classes=10, in_channels=1)
        check_flags("data", augment=augment)
        if not 0 < val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction={val_fraction} must be between 0 and 1 (the share held out)"
            )
        self.val_fraction = val_fraction
        self.augment = augment

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # in [0, 1]
        images = torch.nn.functional.interpolate(
            images, size=self.image_size, mode="bilinear", align_corners=False
        )
        targets = torch.tensor(digits.target, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            range(len(targets)), test_size=self.val_fraction, stratify=digits.target, random_state=0
        )
        train_images = images[train_idx]
        self._build(
            TensorDataset(train_images, targets[train_idx]),
            TensorDataset(images[val_idx], targets[val_idx]),
            digits_transforms(train_images, self.augment),
        )


class CIFAR10DataModule(SeededDataModule):
    """CIFAR-10 from a local folder (torchvision's python version), standard crop + flip augmentation.

    Args:
        root: Folder holding ``cifar-10-batches-py/`` (``~`` is the home folder).
        download: Let torchvision download the data into ``root`` if it is missing.
        shared: :class:`~runner.datamodule.SeededDataModule`'s arguments; ``image_size``: CIFAR's 32, or
            resized to it; ``num_classes``, ``in_channels``: must be 10 and 3.
    """

    DEFAULTS: ClassVar[dict[str, int]] = {
        "batch_size": 128,
        "image_size": 32,
        "num_workers": 4,
        "num_classes": 10,
        "in_channels": 3,
    }
    _FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")

    def __init__(self, root: str = "data/cifar10", download: bool = False, **shared: Any) -> None:
        super().__init__(**shared)
        self._check_declared(num_classes=10, in_channels=3)
        check_flags("data", download=download)
        self.root = os.path.expanduser(root)
        self.download = download

    def check_data(self) -> None:
        folder = Path(self.root).resolve() / "cifar-10-batches-py"
        if self.download or all((folder / name).is_file() for name in self._FILES):
            return
        raise DataNotFoundError(
            "CIFAR-10 (python version)",
            str(folder),
            f"<root>/cifar-10-batches-py/{{{','.join(self._FILES)},batches.meta}}; "
            "or add data.download=true to fetch it",
        )

    def prepare_data(self) -> None:
        if self.download:
            from torchvision.datasets import CIFAR10

            CIFAR10(self.root, train=True, download=True)
            CIFAR10(self.root, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from torchvision.datasets import CIFAR10

        self.check_data()
        self._build(
            CIFAR10(self.root, train=True),
            CIFAR10(self.root, train=False),
            cifar10_transforms(self.image_size),
        )


class SyntheticDataModule(SeededDataModule):
    """Random images for smoke tests and throughput runs; no data needed.

    Supervised batches are gathered on the training device from a pool of uint8 images made once per rank
    (``runner.synthetic``); with ``views``, each image is made on the host for the view transform.

    Args:
        train_samples: Images per training epoch.
        val_samples: Images per validation pass.
        pool_size: Distinct images per rank (training and validation each); sample ``i`` is image
            ``i % pool_size``.
        shared: :class:`~runner.datamodule.SeededDataModule`'s arguments; ``num_classes``, ``in_channels``:
            the label range and image channels, any; ``seed`` also seeds the images.
    """

    DEFAULTS: ClassVar[dict[str, int]] = {
        "batch_size": 32,
        "image_size": 224,
        "num_workers": 0,
        "num_classes": 1000,
        "in_channels": 3,
    }

    def __init__(
        self, train_samples: int = 1024, val_samples: int = 256, pool_size: int = 256, **shared: Any
    ) -> None:
        super().__init__(**shared)
        check_at_least("train_samples", train_samples, 1)
        check_at_least("val_samples", val_samples, 1, " (trainer.limit_val_batches=0 turns validation off)")
        check_at_least("pool_size", pool_size, 1)
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.pool_size = pool_size
        self._pools: dict[bool, SyntheticPool] = {}

    def setup(self, stage: str | None = None) -> None:
        shape = (self.in_channels, self.image_size, self.image_size)
        if self.views is None:
            rank = self.trainer.global_rank if self.trainer is not None else 0
            for training, offset in ((True, 0), (False, 1)):  # a different seed stream for validation
                seed = (self.seed + offset) * 1_000_003 + 2 * rank
                self._pools[training] = SyntheticPool(self.pool_size, shape, self.num_classes, seed)
            self.train_set, self.val_set = Indices(self.train_samples), Indices(self.val_samples)
            return
        # Images in [0, 1], as a view transform expects; a different seed stream for validation.
        self._build(
            SyntheticImages(self.train_samples, shape, self.num_classes, self.seed),
            SyntheticImages(self.val_samples, shape, self.num_classes, self.seed + 1),
            synthetic_view_transforms(self.in_channels),
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.views is not None:
            return batch
        training = self.trainer is None or self.trainer.training
        images, labels = self._pools[training].take(batch)
        return normalize(
            images, [SYNTHETIC_MEAN] * self.in_channels, [SYNTHETIC_STD] * self.in_channels
        ), labels
