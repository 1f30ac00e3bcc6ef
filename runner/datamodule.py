"""What every DataModule of the runner shares (:class:`SeededDataModule`), and the refusal of missing data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.transforms import v2

from lightning_fusedsgd.lightning import ConfigError
from runner.augment import HostTransforms
from runner.options import check_at_least, check_flags
from runner.sampling import EachView, EpochSampler, SeededDataset, Transform

__all__ = ["DataNotFoundError", "SeededDataModule"]


class DataNotFoundError(ConfigError):
    """A dataset is missing or not laid out as expected.

    Args:
        dataset: What was looked for, e.g. ``"ImageNet-style (ImageFolder) data"``.
        path: The path that was checked.
        layout: The directory layout the datamodule expects.
        setting: The config key that sets the path, e.g. ``"data.root"``.
    """

    def __init__(self, dataset: str, path: str, layout: str, setting: str = "data.root") -> None:
        self.dataset = dataset
        self.path = path
        self.layout = layout
        self.setting = setting
        super().__init__(self.describe())

    def describe(self, recipe: str | None = None) -> str:
        """The message, naming ``recipe`` (and how to run it without data) when given."""
        who = f"recipe '{recipe}' needs" if recipe else "needs"
        lines = [
            f"{who} {self.dataset}, but found none at {self.path}",
            f"  expected layout: {self.layout}",
            f"  point {self.setting}=/path/to/data at it",
        ]
        if recipe:
            lines.append(f"  or try the recipe without data: python train.py recipe={recipe} data=synthetic")
        else:
            lines.append("  or use synthetic data (SyntheticDataModule / data=synthetic)")
        return "\n".join(lines)


class SeededDataModule(pl.LightningDataModule):
    """What every DataModule of the runner shares: its arguments, :class:`EpochSampler` for training,
    sequential evaluation, the SimCLR views, and its position in the data in checkpoints.

    ``state_dict`` (saved in Lightning checkpoints) records the epoch training is in and how many of
    its batches were used; ``load_state_dict`` positions the training sampler there. It is restored
    before ``configure_optimizers`` asks for the training loader, so even loader workers that start
    drawing indices at once start at the right place.

    Args (every DataModule's, which passes them on as ``**shared``; ``None``: its ``DEFAULTS``):
        batch_size: Per-device batch size.
        image_size: Side of the images the model sees.
        num_classes, in_channels: Label count and image channels, as the data config declares them (the
            model config reads them); a dataset whose own are fixed checks them.
        num_workers: Loader processes per device.
        seed: Seed of the training order and augmentation.
        drop_last: Drop the last incomplete training batch.
        views: A multi-view transform for self-supervised training (lightly's ``SimCLRTransform``,
            say, with ``normalize=None``); see ``runner.data``. ``None``: supervised batches.
        bank_size: With ``views``: training images in the kNN memory bank (a fixed random subset);
            ``None``: all of them.
    """

    #: A DataModule's own defaults of the sizes, counts and workers, for the arguments given as ``None``.
    DEFAULTS: ClassVar[dict[str, int]] = {}

    def __init__(
        self,
        *,
        batch_size: int | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
        in_channels: int | None = None,
        num_workers: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        views: Transform | None = None,
        bank_size: int | None = None,
    ) -> None:
        super().__init__()
        own = self.DEFAULTS
        self.batch_size = own["batch_size"] if batch_size is None else batch_size
        self.image_size = own["image_size"] if image_size is None else image_size
        self.num_classes = own["num_classes"] if num_classes is None else num_classes
        self.in_channels = own["in_channels"] if in_channels is None else in_channels
        self.num_workers = own["num_workers"] if num_workers is None else num_workers
        check_at_least("batch_size", self.batch_size, 1, " (the per-device batch)")
        check_at_least("image_size", self.image_size, 1)
        check_at_least("num_workers", self.num_workers, 0, " (0: loaded in the training process)")
        check_flags("data", drop_last=drop_last)
        if bank_size is not None and bank_size < 1:
            raise ConfigError(f"data.bank_size={bank_size} must be >= 1, or null for every training image")
        self.seed = seed
        self.drop_last = drop_last
        self.views = views
        self.bank_size = bank_size
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.bank_set: Dataset | None = None  # with views: the training images as validation sees them
        self._train_sampler: EpochSampler | None = None
        self._resume: tuple[int, int] | None = None  # (epoch, batches used), from a checkpoint
        self.collate_fn: Callable[[list[Any]], Any] | None = None  # None: the DataLoader's own

    def _check_declared(self, num_classes: int, in_channels: int) -> None:
        """A dataset whose classes and channels are fixed must be declared with those."""
        for key, declared, actual in (
            ("num_classes", self.num_classes, num_classes),
            ("in_channels", self.in_channels, in_channels),
        ):
            if declared != actual:
                raise ConfigError(
                    f"{type(self).__name__} has {key}={actual}, the config declares data.{key}={declared}: "
                    f"set data.{key}={actual}"
                )

    def state_dict(self) -> dict[str, int]:
        """The position in the training data: ``{"epoch", "batches"}`` (batches of it already used)."""
        trainer, sampler = self.trainer, self._train_sampler
        if trainer is None or sampler is None:
            return {}
        epoch = sampler.epoch  # the epoch in progress or, after its end, the one just finished
        used = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if used >= trainer.num_training_batches:
            epoch, used = epoch + 1, 0
        return {"epoch": epoch, "batches": used}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue at a position from :meth:`state_dict` (an empty dict: from the start)."""
        self._resume = (state_dict["epoch"], state_dict["batches"]) if state_dict else None
        if self._train_sampler is not None:
            self._apply_resume(self._train_sampler)

    def _apply_resume(self, sampler: EpochSampler) -> None:
        if self._resume is not None:
            epoch, batches = self._resume
            sampler.resume_at(epoch, batches * self.batch_size)
            self._resume = None  # once: a loader rebuilt later starts its epochs from the beginning

    def check_data(self) -> None:
        """Raise :class:`DataNotFoundError` if the data is not on disk (cheap; no decoding)."""

    def _build(self, train: Dataset, val: Dataset, transforms: HostTransforms) -> None:
        """The datasets from raw images: training through ``transforms.augment`` (or ``views``), evaluation
        through ``transforms.evaluate``, each then through ``transforms.finish`` (to a normalized tensor)."""
        evaluation = v2.Compose([*transforms.evaluate, transforms.finish])
        if self.views is None:
            self.train_set = SeededDataset(train, v2.Compose([*transforms.augment, transforms.finish]))
        else:
            self.train_set = SeededDataset(train, EachView(self.views, transforms.finish))
            bank = SeededDataset(train, evaluation)
            if self.bank_size is not None and self.bank_size < len(bank):
                # A fixed random subset (seed 0), the same for every run and every rank.
                order = torch.randperm(len(bank), generator=torch.Generator().manual_seed(0))
                bank = Subset(bank, sorted(order[: self.bank_size].tolist()))
            self.bank_set = bank
        self.val_set = SeededDataset(val, evaluation)

    def _ready(self, dataset: Dataset | None) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not been called")
        return dataset

    def _loader(self, dataset: Dataset, sampler: EpochSampler | None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            drop_last=self.drop_last and sampler is not None,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn,
        )

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        train_set = self._ready(self.train_set)
        self._train_sampler = EpochSampler(train_set, num_replicas=world_size, rank=rank, seed=self.seed)
        self._apply_resume(self._train_sampler)
        return self._loader(train_set, self._train_sampler)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        val = self._loader(self._ready(self.val_set), None)
        if self.views is None:
            return val
        return [self._loader(self._ready(self.bank_set), None), val]
