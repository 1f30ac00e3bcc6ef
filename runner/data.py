"""DataModules: scikit-learn's digits (offline quickstart), CIFAR-10 and ImageFolder from disk, synthetic.

They stay thin: the image folders' pipeline has modules of its own (``files``: reading bytes, ``decode``,
``augment``: augmentation on the device, ``image_pipeline``: the worker side and the device side),
``synthetic`` makes synthetic images, ``sampling`` the data order and augmentation seeds.

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
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchvision.datasets.folder import find_classes
from torchvision.transforms import v2

from lightning_fusedsgd.lightning import ConfigError
from runner.augment import normalize
from runner.decode import device_failure, jpeg_decoder
from runner.files import EncodedFolder, EncodedImage, UnreadableImage, jpeg_size, refuse_empty_classes
from runner.image_pipeline import FolderSamples, LoadedBatch, collate
from runner.sampling import EachView, EpochSampler, SeededDataset, Transform
from runner.synthetic import SYNTHETIC_MEAN, SYNTHETIC_STD, Indices, SyntheticImages, SyntheticPool

__all__ = [
    "CIFAR10DataModule",
    "DataNotFoundError",
    "DigitsDataModule",
    "EachView",
    "EpochSampler",
    "ImageFolderDataModule",
    "SeededDataset",
    "SyntheticDataModule",
    "UnreadableImagesError",
]


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


class UnreadableImagesError(ConfigError):
    """Files of the data that cannot be read or decoded (empty, truncated, not an image, a link to a missing
    file): each named with the reason."""

    def __init__(self, unreadable: list[UnreadableImage]) -> None:
        files = "\n".join(f"  {image}" for image in unreadable)
        super().__init__(
            f"{len(unreadable)} file(s) of the data cannot be read or decoded:\n{files}\n"
            "  remove or re-encode them, or add data.skip_unreadable=true to leave such files out of their "
            "batches (each is warned about and counted)"
        )


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _to_normalized_tensor(mean: Sequence[float], std: Sequence[float]) -> Transform:
    """The last transform of every image pipeline: PIL image or [0, 1] tensor -> normalized float tensor."""
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


class _SeededDataModule(pl.LightningDataModule):
    """Shared loader logic: :class:`EpochSampler` for training, sequential evaluation.

    ``state_dict`` (saved in Lightning checkpoints) records the epoch training is in and how many of
    its batches were used; ``load_state_dict`` positions the training sampler there. It is restored
    before ``configure_optimizers`` asks for the training loader, so even loader workers that start
    drawing indices at once start at the right place.
    """

    def __init__(
        self,
        batch_size: int,
        num_workers: int,
        seed: int,
        drop_last: bool,
        num_classes: int,
        in_channels: int,
        views: Transform | None,
        bank_size: int | None,
    ) -> None:
        super().__init__()
        #: Label count and image channels, as the data config declares them (the model config reads them).
        self.num_classes = num_classes
        self.in_channels = in_channels
        _check_at_least("batch_size", batch_size, 1, " (the per-device batch)")
        _check_at_least("num_workers", num_workers, 0, " (0: loaded in the training process)")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.drop_last = drop_last
        if bank_size is not None and bank_size < 1:
            raise ConfigError(f"data.bank_size={bank_size} must be >= 1, or null for every training image")
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

    def _build(
        self,
        train: Dataset,
        val: Dataset,
        augment: list[Transform],
        evaluate: list[Transform],
        finish: Transform,
    ) -> None:
        """The datasets from raw images: training through ``augment`` (or ``views``), evaluation through
        ``evaluate``, each then through ``finish`` (to a normalized tensor)."""
        evaluation = v2.Compose([*evaluate, finish])
        if self.views is None:
            self.train_set = SeededDataset(train, v2.Compose([*augment, finish]))
        else:
            self.train_set = SeededDataset(train, EachView(self.views, finish))
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


def _check_at_least(key: str, value: int, least: int, meaning: str = "") -> None:
    if value < least:
        raise ConfigError(f"data.{key}={value} must be >= {least}{meaning}")


class DigitsDataModule(_SeededDataModule):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), upsampled; ships offline.

    A fixed stratified split (independent of ``seed``) keeps ``val_fraction`` of the images for
    validation. Training images get a small random affine transform.

    Args:
        batch_size: Per-device batch size.
        image_size: Side the 8x8 images are upsampled to (bilinear).
        val_fraction: Share of images held out for validation.
        augment: Random rotation/translation/scale of training images.
        num_workers: Loader processes; the data lives in memory, so 0 is fastest.
        seed: Seed of the training order and augmentation.
        drop_last: Drop the last incomplete training batch.
        num_classes, in_channels: As the config declares them; must be 10 and 1.
        views: A multi-view transform for self-supervised training (lightly's ``SimCLRTransform``,
            say, with ``normalize=None``); see the module docstring. ``None``: supervised batches.
        bank_size: With ``views``: training images in the kNN memory bank (a fixed random subset);
            ``None``: all of them.
    """

    def __init__(
        self,
        batch_size: int = 64,
        image_size: int = 32,
        val_fraction: float = 0.2,
        augment: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        num_classes: int = 10,
        in_channels: int = 1,
        views: Transform | None = None,
        bank_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, drop_last, num_classes, in_channels, views, bank_size)
        self._check_declared(num_classes=10, in_channels=1)
        _check_at_least("image_size", image_size, 1)
        if not 0 < val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction={val_fraction} must be between 0 and 1 (the share held out)"
            )
        self.image_size = image_size
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
        normalize = v2.Normalize([train_images.mean().item()], [train_images.std().item()])
        # Augment before normalizing so the affine fill (0) is the background colour.
        augment = (
            [v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))] if self.augment else []
        )
        train = TensorDataset(train_images, targets[train_idx])
        self._build(train, TensorDataset(images[val_idx], targets[val_idx]), augment, [], normalize)


class CIFAR10DataModule(_SeededDataModule):
    """CIFAR-10 from a local folder (torchvision's python version), standard crop + flip augmentation.

    Args:
        root: Folder holding ``cifar-10-batches-py/``.
        batch_size: Per-device batch size.
        image_size: Side of the images the model sees (CIFAR's 32, or resized to it).
        download: Let torchvision download the data into ``root`` if it is missing.
        num_workers: Loader processes.
        seed: Seed of the training order and augmentation.
        drop_last: Drop the last incomplete training batch.
        num_classes, in_channels: As the config declares them; must be 10 and 3.
        views: A multi-view transform for self-supervised training (lightly's ``SimCLRTransform``,
            say, with ``normalize=None``); see the module docstring. ``None``: supervised batches.
        bank_size: With ``views``: training images in the kNN memory bank (a fixed random subset);
            ``None``: all of them.
    """

    _FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")

    def __init__(
        self,
        root: str = "data/cifar10",
        batch_size: int = 128,
        image_size: int = 32,
        download: bool = False,
        num_workers: int = 4,
        seed: int = 0,
        drop_last: bool = False,
        num_classes: int = 10,
        in_channels: int = 3,
        views: Transform | None = None,
        bank_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, drop_last, num_classes, in_channels, views, bank_size)
        self._check_declared(num_classes=10, in_channels=3)
        _check_at_least("image_size", image_size, 1)
        self.root = root
        self.image_size = image_size
        self.download = download

    def check_data(self) -> None:
        folder = Path(self.root).expanduser().resolve() / "cifar-10-batches-py"
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
        resize = [v2.Resize(self.image_size)] if self.image_size != 32 else []
        augment = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *resize]
        self._build(
            CIFAR10(self.root, train=True),
            CIFAR10(self.root, train=False),
            augment,
            resize,
            _to_normalized_tensor(CIFAR10_MEAN, CIFAR10_STD),
        )


class ImageFolderDataModule(_SeededDataModule):
    """ImageNet layout (``root/train/<class>/*``, ``root/val/<class>/*``), standard ResNet transforms.

    Training: RandomResizedCrop (per image) + horizontal flip. Validation: resize to ``image_size / 0.875``
    then center crop (256 -> 224). The loader workers read the files' bytes; where they are decoded is
    ``decode``'s choice (``runner.image_pipeline``), and the batch is normalized on the training device in
    channels-last (``on_after_batch_transfer``). With ``views`` (self-supervised), the workers decode with PIL
    and run the view transform per image.

    Args:
        root: Dataset folder with ``train/`` and ``val/``.
        batch_size: Per-device batch size.
        image_size: Crop size.
        num_workers: Loader processes per device.
        seed: Seed of the training order and augmentation.
        drop_last: Drop the last incomplete training batch.
        num_classes: Class folders in ``train/`` (checked); in_channels: 3 (RGB).
        decode: ``gpu``: the training GPU decodes each batch (nvJPEG) and crops, resizes and flips it;
            ``cpu``: the workers decode, crop and resize; ``auto``: ``gpu`` where training runs on a GPU and
            the decoder decodes there (tried once at setup), else ``cpu``. Setup says which decoder runs
            where; a JPEG the GPU refuses during training is decoded on the CPU in the training process,
            warned about once, counted in ``decoded_on_host`` and the run's summary.
        skip_unreadable: Leave files that cannot be read or decoded out of their batches (warned about once
            by the rank that meets them, counted in ``unreadable`` and the run's summary) instead of stopping
            the run with their names.
        views: A multi-view transform for self-supervised training (lightly's ``SimCLRTransform``,
            say, with ``normalize=None``); see the module docstring. ``None``: supervised batches.
        bank_size: With ``views``: training images in the kNN memory bank (a fixed random subset);
            ``None``: all of them.
    """

    LAYOUT = (
        "<root>/train/<class>/<image> and <root>/val/<class>/<image> (the torchvision ImageFolder layout)"
    )

    def __init__(
        self,
        root: str = "data/imagenet",
        batch_size: int = 32,
        image_size: int = 224,
        num_workers: int = 8,
        seed: int = 0,
        drop_last: bool = False,
        num_classes: int = 1000,
        in_channels: int = 3,
        decode: str = "auto",
        skip_unreadable: bool = False,
        views: Transform | None = None,
        bank_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, drop_last, num_classes, in_channels, views, bank_size)
        self._check_declared(num_classes=num_classes, in_channels=3)
        if decode not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"data.decode={decode!r}: choose auto, gpu or cpu")
        _check_at_least("image_size", image_size, 1)
        self.root = root
        self.image_size = image_size
        self.decode = decode
        self.skip_unreadable = skip_unreadable
        #: This rank's files left out of their batches in this fit (``skip_unreadable``): path -> why, each
        #: file once, in the order met (:class:`~runner.summary.RunSummary` counts every rank's).
        self.unreadable: dict[str, str] = {}
        #: This rank's JPEGs the training device refused, decoded on the CPU in the training process instead.
        self.decoded_on_host: dict[str, str] = {}

    def check_data(self) -> None:
        root = Path(self.root).expanduser().resolve()
        classes = {}
        for split in ("train", "val"):
            classes[split] = _class_folders(root / split)
            if not classes[split]:
                raise DataNotFoundError("ImageNet-style (ImageFolder) data", str(root / split), self.LAYOUT)
        if len(classes["train"]) != self.num_classes:
            raise ConfigError(
                f"{root / 'train'} has {len(classes['train'])} class folders, the config declares "
                f"data.num_classes={self.num_classes}: set data.num_classes={len(classes['train'])}"
            )
        _check_same_classes(root / "train", classes["train"], root / "val", classes["val"])

    def _decode_on_device(self, files: EncodedFolder) -> bool:
        """Where JPEGs are decoded, chosen once and said: on the training GPU (``gpu``, or ``auto`` on a GPU)
        where the decoder decodes some of ``files``'s first JPEGs there, else by the loader workers."""
        decoder = jpeg_decoder()
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        if self.decode == "gpu" and device.type != "cuda":
            raise ConfigError(
                "data.decode=gpu decodes on the training GPU, and this run trains on the CPU: "
                "use data.decode=cpu (or auto)"
            )
        failure = None
        if self.decode != "cpu" and device.type == "cuda":
            failure = device_failure(_first_jpegs(files), device)
            if failure is None:
                rank_zero_info(
                    f"data.decode={self.decode}: {decoder.name} decodes the JPEGs on {device}, a batch a "
                    "call; the loader workers read the files (and decode those of other formats with PIL)"
                )
                return True
            if self.decode == "gpu":
                raise ConfigError(
                    f"data.decode=gpu: {decoder.name} cannot decode JPEGs on {device} ({failure}): use "
                    "data.decode=cpu (or auto, which then decodes in the loader workers)"
                )
            rank_zero_warn(f"data.decode=auto: {decoder.name} cannot decode JPEGs on {device} ({failure})")
        rank_zero_info(
            f"data.decode={self.decode}: the loader workers decode on the CPU ({decoder.name} for JPEGs, PIL "
            "for other formats), crop and resize"
        )
        return False

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.check_data()
        train, val = os.path.join(self.root, "train"), os.path.join(self.root, "val")
        if self.views is None:
            train_files = EncodedFolder(train)
            on_device = self._decode_on_device(train_files)
            self.train_set = FolderSamples(train_files, self.image_size, on_device)
            self.val_set = FolderSamples(EncodedFolder(val, train_files.classes), self.image_size, on_device)
            self.collate_fn = collate
            return
        from torchvision.datasets import ImageFolder

        splits = ImageFolder(train, allow_empty=True), ImageFolder(val, allow_empty=True)
        for split in splits:  # labelled alike: check_data refused splits whose class folders differ
            refuse_empty_classes(split.root, split.classes, split.samples)
        self._build(
            *splits,
            [],
            [v2.Resize(round(self.image_size / 0.875), antialias=True), v2.CenterCrop(self.image_size)],
            _to_normalized_tensor(IMAGENET_MEAN, IMAGENET_STD),
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, LoadedBatch):
            return batch
        finished = batch.finish(self.image_size, IMAGENET_MEAN, IMAGENET_STD)
        if finished.unreadable and not self.skip_unreadable:
            raise UnreadableImagesError(finished.unreadable)
        for image in finished.unreadable:
            self._note(self.unreadable, image.path, image.reason, "left out", "unreadable file(s)")
        for image in finished.decoded_on_host:  # the rate the device decode was chosen for is lost on these
            self._note(self.decoded_on_host, image.path, image.reason, "decoded on the CPU", "such file(s)")
        return finished.images, finished.labels

    def _note(self, record: dict[str, str], path: str, reason: str, what: str, counted: str) -> None:
        """Records a file in ``record`` and warns about it, once whichever epoch meets it again; every rank
        warns, each reading its own share of the files."""
        if path not in record:
            record[path] = reason
            message = f"{what} {path}: {reason} ({len(record)} {counted} so far)"
            rank = self.trainer.global_rank if self.trainer is not None else None
            warnings.warn(rank_prefixed_message(message, rank), stacklevel=3)

    def files_report(self) -> dict[str, dict[str, str]]:
        """This rank's files that the run did not read as planned, by kind (path -> why), for the summary."""
        return {"unreadable_files": dict(self.unreadable), "host_decoded_files": dict(self.decoded_on_host)}


def _first_jpegs(files: EncodedFolder, count: int = 8, looked_at: int = 64) -> list[EncodedImage]:
    """Up to ``count`` readable JPEGs among the first ``looked_at`` files, to try the device decode on."""
    jpegs = []
    for index in range(min(len(files), looked_at)):
        try:
            image = files[index]
        except UnreadableImage:
            continue
        if jpeg_size(image.data) is not None:
            jpegs.append(image)
        if len(jpegs) == count:
            break
    return jpegs


def _class_folders(split: Path) -> list[str]:
    """A split's class folders, sorted (ImageFolder's labels); none where the split is missing."""
    try:
        return find_classes(str(split))[0]
    except (FileNotFoundError, NotADirectoryError):  # no folder, or none in it
        return []


def _check_same_classes(train: Path, classes: list[str], split: Path, split_classes: list[str]) -> None:
    """Every split is labelled by the training split's class folders, so it must hold the same ones: a
    validation split lacking a class would shift every later label by one."""
    lacking = sorted(set(classes) - set(split_classes))
    extra = sorted(set(split_classes) - set(classes))
    if not lacking and not extra:
        return
    problems = [f"{split} lacks {_names(lacking)}"] if lacking else []
    problems += [f"{split} has {_names(extra)}, which {train} lacks"] if extra else []
    raise ConfigError(
        f"{split} and {train} must hold the same class folders (the labels are {train}'s classes, in sorted "
        f"order): {'; '.join(problems)}. Give both splits the same class folders"
    )


def _names(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class SyntheticDataModule(_SeededDataModule):
    """Random images for smoke tests and throughput runs; no data needed.

    Supervised batches are gathered on the training device from a pool of uint8 images made once per rank
    (``runner.synthetic``); with ``views``, each image is made on the host for the view transform.

    Args:
        batch_size: Per-device batch size.
        image_size: Image side.
        num_classes: Label range (the model config reads it).
        in_channels: Image channels (the model config reads it).
        train_samples: Images per training epoch.
        val_samples: Images per validation pass.
        pool_size: Distinct images per rank (training and validation each); sample ``i`` is image
            ``i % pool_size``.
        num_workers: Loader processes.
        seed: Seed of the images and the training order.
        drop_last: Drop the last incomplete training batch.
        views: A multi-view transform for self-supervised training (lightly's ``SimCLRTransform``,
            say, with ``normalize=None``); see the module docstring. ``None``: supervised batches.
        bank_size: With ``views``: training images in the kNN memory bank (a fixed random subset);
            ``None``: all of them.
    """

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int = 224,
        num_classes: int = 1000,
        in_channels: int = 3,
        train_samples: int = 1024,
        val_samples: int = 256,
        pool_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        views: Transform | None = None,
        bank_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, drop_last, num_classes, in_channels, views, bank_size)
        for key, value in (("image_size", image_size), ("train_samples", train_samples)):
            _check_at_least(key, value, 1)
        _check_at_least("val_samples", val_samples, 1, " (trainer.limit_val_batches=0 turns validation off)")
        _check_at_least("pool_size", pool_size, 1)
        self.image_size = image_size
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
            [],
            [],
            v2.Normalize([0.5] * self.in_channels, [1 / 12**0.5] * self.in_channels),
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.views is not None:
            return batch
        training = self.trainer is None or self.trainer.training
        images, labels = self._pools[training].take(batch)
        return normalize(
            images, [SYNTHETIC_MEAN] * self.in_channels, [SYNTHETIC_STD] * self.in_channels
        ), labels
