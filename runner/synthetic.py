"""Synthetic images for smoke and throughput runs, made where the model trains.

Supervised batches come from a fixed pool of uint8 images and labels per rank, made once from ``(seed, rank)``
and moved to the device once: the loader hands over sample indices only, and the device gathers and normalizes
the batch, so a synthetic run measures the model and the step, not the loader. Multi-view (self-supervised)
transforms need images on the host: :class:`SyntheticImages` makes each one there."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["SYNTHETIC_MEAN", "SYNTHETIC_STD", "Indices", "SyntheticImages", "SyntheticPool"]

# Uniform bytes 0..255, in [0, 1]: mean 1/2, standard deviation sqrt((256^2 - 1) / 12) / 255.
SYNTHETIC_MEAN = 0.5
SYNTHETIC_STD = ((256**2 - 1) / 12) ** 0.5 / 255


class Indices(Dataset):
    """``length`` samples, each its own index (an ``EpochSampler`` key's index): the loader's whole job."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | tuple[int, int]) -> int:
        return key[0] if isinstance(key, tuple) else key


class SyntheticPool:
    """``size`` uniform uint8 images of ``shape`` with uniform labels below ``num_classes``, a pure function
    of ``seed``; sample ``i`` is pool entry ``i % size``.

    Args:
        size: Images in the pool.
        shape: (channels, height, width).
        num_classes: Label range.
        seed: Seed of the pool (the run's seed and the rank).
    """

    def __init__(self, size: int, shape: tuple[int, int, int], num_classes: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (size, *shape), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(num_classes, (size,), generator=generator)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The uint8 images and labels of samples ``indices``, on their device (the pool moves there once)."""
        if self.images.device != indices.device:
            self.images = self.images.to(indices.device)
            self.labels = self.labels.to(indices.device)
        rows = indices % len(self.labels)
        return self.images[rows], self.labels[rows]


class SyntheticImages(Dataset):
    """Uniform-noise images in [0, 1] with random labels, each a pure function of ``(seed, index)``, on the
    host: what a multi-view transform takes."""

    def __init__(self, length: int, shape: tuple[int, int, int], num_classes: int, seed: int) -> None:
        self.length = length
        self.shape = shape
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.rand(self.shape, generator=generator)
        return image, int(torch.randint(self.num_classes, (), generator=generator))
