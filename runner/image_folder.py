"""The image-folder DataModule (ImageNet's layout): its checks of the folders, where it decodes, and what it
says about the files it could not read as planned. The pipeline itself is ``runner.image_pipeline``'s."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchvision.datasets.folder import find_classes

from lightning_fusedsgd.lightning import ConfigError
from runner.augment import IMAGENET_MEAN, IMAGENET_STD, folder_view_transforms
from runner.datamodule import DataNotFoundError, SeededDataModule
from runner.decode import device_failure, jpeg_decoder
from runner.files import (
    EncodedFolder,
    EncodedImage,
    SplitFiles,
    UnreadableImage,
    jpeg_size,
    refuse_empty_classes,
)
from runner.image_pipeline import FolderSamples, LoadedBatch, PilImages, SetAside, collate, collate_set_aside
from runner.options import check_flags

__all__ = ["ImageFolderDataModule", "UnreadableImagesError", "class_folders"]


class UnreadableImagesError(ConfigError):
    """Files of the data that cannot be read or decoded (empty, truncated, not an image, a link to a missing
    file): each named with the reason, and the fixes (``skippable``: whether ``data.skip_unreadable`` is one;
    not with views, whose batches stay whole)."""

    def __init__(self, unreadable: list[UnreadableImage], skippable: bool = True) -> None:
        files = "\n".join(f"  {image}" for image in unreadable)
        fix = (
            "remove or re-encode them, or add data.skip_unreadable=true to leave such files out of their "
            "batches (each is warned about and counted)"
            if skippable
            else "remove or re-encode them (with data.views they cannot be left out: SimCLR's batches stay "
            "whole)"
        )
        super().__init__(
            f"{len(unreadable)} file(s) of the data cannot be read or decoded:\n{files}\n  {fix}"
        )


class ImageFolderDataModule(SeededDataModule):
    """ImageNet layout (``root/train/<class>/*``, ``root/val/<class>/*``), standard ResNet transforms.

    Training: RandomResizedCrop (per image) + horizontal flip. Validation: resize to ``image_size / 0.875``
    then center crop (256 -> 224). The loader workers read the files' bytes; where they are decoded is
    ``decode``'s choice (``runner.image_pipeline``), and the batch is normalized on the training device in
    channels-last (``on_after_batch_transfer``). With ``views`` (self-supervised), the workers decode with PIL
    and run the view transform per image.

    Args:
        root: Dataset folder with ``train/`` and ``val/`` (``~`` is the home folder).
        decode: ``gpu``: the training GPU decodes each batch (nvJPEG) and crops, resizes and flips it;
            ``cpu``: the workers decode, crop and resize; ``auto``: ``gpu`` where training runs on a GPU and
            the decoder decodes there (tried once at setup), else ``cpu``. Setup says which decoder runs
            where; a JPEG the GPU refuses during training is decoded on the CPU in the training process,
            warned about once, counted in ``decoded_on_host`` and the run's summary.
        skip_unreadable: Leave files that cannot be read or decoded out of their batches (warned about once
            by the rank that meets them, counted in ``unreadable`` and the run's summary) instead of stopping
            the run with their names.
        shared: :class:`~runner.datamodule.SeededDataModule`'s arguments; ``num_classes``: the class folders
            of ``train/`` (checked), ``in_channels``: 3 (RGB).
    """

    LAYOUT = (
        "<root>/train/<class>/<image> and <root>/val/<class>/<image> (the torchvision ImageFolder layout)"
    )

    DEFAULTS: ClassVar[dict[str, int]] = {
        "batch_size": 32,
        "image_size": 224,
        "num_workers": 8,
        "num_classes": 1000,
        "in_channels": 3,
    }

    def __init__(
        self, root: str = "data/imagenet", decode: str = "auto", skip_unreadable: bool = False, **shared: Any
    ) -> None:
        super().__init__(**shared)
        self._check_declared(num_classes=self.num_classes, in_channels=3)
        check_flags("data", skip_unreadable=skip_unreadable)
        if decode not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"data.decode={decode!r}: choose auto, gpu or cpu")
        if skip_unreadable and self.views is not None:
            raise ConfigError(
                "data.skip_unreadable=true with data.views: SimCLR's batches stay whole (its negatives are "
                "gathered from every rank's batch, of one size), so a file that cannot be read stops the "
                "run, named; remove or re-encode such files instead"
            )
        self.root = os.path.expanduser(root)
        self.decode = decode
        self.skip_unreadable = skip_unreadable
        #: This rank's files left out of their batches in this fit (``skip_unreadable``): path -> why, each
        #: file once, in the order met (:class:`~runner.summary.RunSummary` counts every rank's).
        self.unreadable: dict[str, str] = {}
        #: This rank's JPEGs the training device refused, decoded on the CPU in the training process instead.
        self.decoded_on_host: dict[str, str] = {}

    def check_data(self) -> None:
        root = Path(self.root).resolve()
        classes = {}
        for split in ("train", "val"):
            classes[split] = class_folders(root / split)
            if not classes[split]:
                raise DataNotFoundError("ImageNet-style (ImageFolder) data", str(root / split), self.LAYOUT)
        if len(classes["train"]) != self.num_classes:
            raise ConfigError(
                f"{root / 'train'} has {len(classes['train'])} class folders, the config declares "
                f"data.num_classes={self.num_classes}: set data.num_classes={len(classes['train'])}"
            )
        _check_same_classes(root / "train", classes["train"], root / "val", classes["val"])

    def _decode_on_device(self, files: SplitFiles) -> bool:
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

    def split_files(self) -> tuple[SplitFiles, SplitFiles]:
        """The training and validation splits' files, checked (:meth:`check_data`, no empty class)."""
        self.check_data()
        train_files = EncodedFolder(os.path.join(self.root, "train"))
        val_files = EncodedFolder(os.path.join(self.root, "val"), train_files.classes)
        refuse_empty_classes(train_files, val_files)
        return train_files, val_files

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train_files, val_files = self.split_files()
        if self.views is None:
            on_device = self._decode_on_device(train_files)
            self.train_set = FolderSamples(train_files, self.image_size, on_device)
            self.val_set = FolderSamples(val_files, self.image_size, on_device)
            self.collate_fn = collate
            return
        self._build(PilImages(train_files), PilImages(val_files), folder_view_transforms(self.image_size))
        self.collate_fn = collate_set_aside

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, SetAside):  # the views' batches: a file that cannot be read stops the run
            if batch.unreadable:
                raise UnreadableImagesError(batch.unreadable, skippable=False)
            return batch.batch
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
            # Said from the hook that leaves the file out (the caller beyond it is Lightning's).
            warnings.warn(rank_prefixed_message(message, rank), stacklevel=2)

    def unreadable_in(self, split: str) -> dict[str, str]:
        """This rank's files of ``split`` (``"train"`` or ``"val"``) left out so far: path -> why."""
        folder = os.path.join(self.root, split, "")
        return {path: reason for path, reason in self.unreadable.items() if path.startswith(folder)}

    def files_report(self) -> dict[str, dict[str, str]]:
        """This rank's files that the run did not read as planned, by kind (path -> why), for the summary."""
        return {"unreadable_files": dict(self.unreadable), "host_decoded_files": dict(self.decoded_on_host)}


def _first_jpegs(files: SplitFiles, count: int = 8, looked_at: int = 64) -> list[EncodedImage]:
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


def class_folders(split: Path) -> list[str]:
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
