"""Data order and per-sample augmentation seeds: the training order of epoch ``e`` is a function of
``(seed, e)`` only (:class:`EpochSampler`), and each sample's host-side transform runs under CPU generators
seeded from ``(seed, e, index)`` (:class:`SeededDataset`), so a resumed run sees the same batches and pixels,
whatever the number of loader workers."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from runner.files import UnreadableImage

__all__ = ["EachView", "EpochSampler", "SeededDataset", "Transform"]

Transform = Callable[[Any], Any]


class EpochSampler(DistributedSampler):
    """Shuffles by ``(seed, epoch)``, shards over ranks, and pairs each index with an augmentation seed.

    It yields ``(index, sample_seed)`` keys for :class:`SeededDataset`. Lightning calls
    ``set_epoch`` before every epoch; :meth:`resume_at` makes the next pass start part-way into an
    epoch, as a resumed run needs. Subclassing ``DistributedSampler`` matters: Lightning keeps a
    sampler of that type under DDP instead of replacing it, so the datamodule passes the rank and
    world size itself (1 and 0 on a single device).

    Args:
        dataset: The dataset to sample from.
        num_replicas: Number of processes sharing the data (``trainer.world_size``).
        rank: This process's rank (``trainer.global_rank``).
        shuffle: Shuffle the order each epoch.
        seed: Base seed of order and augmentation; the same on every rank.
        drop_last: Drop the tail that does not divide evenly over ranks instead of padding it.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, skip: int) -> None:
        """Set the epoch and make the next pass over it leave out its first ``skip`` samples (this rank's).

        Args:
            epoch: The epoch training continues in.
            skip: Samples of this rank's order of ``epoch`` already trained on.
        """
        self.set_epoch(epoch)
        self._resume = (epoch, skip)

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        skip = 0
        if self._resume is not None:
            epoch, skip = self._resume
            self._resume = None
            if epoch != self.epoch:  # Lightning moved on to another epoch: nothing to leave out
                skip = 0
        # A stream separate from the shuffle's (seed + epoch), identical on every rank.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch + 1)
        sample_seeds = torch.randint(2**31 - 1, (len(self.dataset),), generator=generator).tolist()
        for index in itertools.islice(super().__iter__(), skip, None):
            yield index, sample_seeds[index]


class SeededDataset(Dataset):
    """Applies a transform to ``base[index]`` under a CPU RNG seeded per sample.

    Keys are ``(index, seed)`` from :class:`EpochSampler` (random augmentation, reproducible) or a
    plain ``index`` (evaluation transforms, which draw no random numbers). An image that is a
    :class:`~runner.files.UnreadableImage` is handed on untransformed.

    Args:
        base: A dataset returning ``(image, target)``.
        transform: Applied to the image; ``None`` returns it unchanged.
    """

    def __init__(self, base: Dataset, transform: Transform | None = None) -> None:
        self.base = base
        self.transform = transform

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, Any]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, target = self.base[index]
        if self.transform is None or isinstance(image, UnreadableImage):  # a file to name, not to transform
            return image, target
        if seed is None:
            return self.transform(image), target
        with _seeded_host_rngs(seed):
            return self.transform(image), target


@contextlib.contextmanager
def _seeded_host_rngs(seed: int) -> Iterator[None]:
    """Seeds torch's CPU generator, ``random`` and NumPy's global RNG, and restores all three after.

    Transforms draw from any of them (lightly's blur and solarization draw from NumPy). CUDA RNG streams
    are left untouched.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class EachView:
    """Applies a multi-view transform, then ``finish`` to each view: ``image -> [view, ...]``.

    Args:
        views: ``image -> list of views``, each a float tensor in [0, 1] (lightly's view transforms with
            ``normalize=None``).
        finish: What the datamodule does last to every image it serves (its normalization).
    """

    def __init__(self, views: Transform, finish: Transform) -> None:
        self.views = views
        self.finish = finish

    def __call__(self, image: Any) -> list[Any]:
        return [self.finish(view) for view in self.views(image)]
