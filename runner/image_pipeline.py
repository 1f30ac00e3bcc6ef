"""An image folder's samples from bytes to a normalized batch: what a loader worker does with one file, and
what ``on_after_batch_transfer`` does with the batch on the training device.

``decode_on_device=False`` (``data.decode=cpu``): the worker decodes, crops and resizes to uint8 at the
training size; the device normalizes the stacked batch. ``True`` (``data.decode=gpu``): the worker reads the
bytes and draws the crop from the JPEG's header; the device decodes the batch in one call, then crops,
resizes, flips and normalizes. Either way each training image's crop comes from its sample seed, so the two
agree on every box. A file that cannot be read or decoded travels as an :class:`UnreadableImage` beside the
batch, never as a worker traceback; the DataModule refuses or skips it (with a view transform, SimCLR's
:class:`PilImages`, it refuses it). A JPEG the device refuses is decoded
on the CPU in the training process, and the batch says which (the DataModule counts them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate

from runner.augment import Crop, center_crop, draw_crop, normalize, resized_crop
from runner.decode import DecodedOnHost, decode_batch, decode_on_cpu, pil_image
from runner.files import EncodedImage, SplitFiles, UnreadableImage, jpeg_size

__all__ = [
    "FinishedBatch",
    "FolderSamples",
    "LoadedBatch",
    "PilImages",
    "SetAside",
    "collate",
    "collate_set_aside",
]


class Pending(NamedTuple):
    """A training or validation image still to decode (``image.data``: the bytes) or, where it is no JPEG,
    decoded by the worker already (``pixels``), with the crop drawn for it (None: validation's center
    crop)."""

    image: EncodedImage
    pixels: torch.Tensor | None
    crop: Crop | None


class FolderSamples(Dataset):
    """What a loader worker makes of one file of ``files``: keyed ``(index, seed)`` by ``EpochSampler``
    (training: a random resized crop and flip) or by ``index`` (validation: resize and center crop).

    Args:
        files: The split's files, as bytes: an :class:`~runner.files.EncodedFolder` or the same samples from
            shards (:class:`~runner.shard_files.ShardedFiles`).
        size: The side of the images the model sees.
        decode_on_device: Leave decoding and resizing to the device (see the module docstring).
    """

    def __init__(self, files: SplitFiles, size: int, decode_on_device: bool) -> None:
        self.files = files
        self.size = size
        self.decode_on_device = decode_on_device

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, int]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        try:
            image = self.files[index]
            # The device decodes JPEGs; anything else (a PNG named .JPEG) is decoded here, by its format.
            header = jpeg_size(image.data) if self.decode_on_device else None
            pixels = None if header is not None else decode_on_cpu(image)
            height, width = header if pixels is None else pixels.shape[-2:]
            crop = None if seed is None else draw_crop(height, width, seed)
            if self.decode_on_device:
                return Pending(
                    image._replace(data=image.data if pixels is None else None), pixels, crop
                ), image.label
            return _transform(pixels, crop, self.size), image.label
        except UnreadableImage as unreadable:
            return unreadable, self.files.label(index)


def _transform(pixels: torch.Tensor, crop: Crop | None, size: int) -> torch.Tensor:
    return (
        center_crop(pixels, size, round(size / 0.875)) if crop is None else resized_crop(pixels, crop, size)
    )


class FinishedBatch(NamedTuple):
    """:meth:`LoadedBatch.finish`'s batch, and what it says about the files."""

    images: torch.Tensor
    labels: torch.Tensor
    unreadable: list[UnreadableImage]
    decoded_on_host: list[DecodedOnHost]


class LoadedBatch:
    """A collated batch: the workers' uint8 images (``pixels``) or the images still to decode (``pending``),
    the labels of both, and the files no decoder read. ``to(device)`` (Lightning's transfer) moves the pixels
    and labels and leaves the bytes on the host, where the decoder takes them."""

    def __init__(
        self,
        pixels: torch.Tensor | None,
        pending: list[Pending],
        labels: torch.Tensor,
        unreadable: list[UnreadableImage],
    ) -> None:
        self.pixels = pixels
        self.pending = pending
        self.labels = labels
        self.unreadable = unreadable

    def pin_memory(self) -> LoadedBatch:
        pixels = None if self.pixels is None else self.pixels.pin_memory()
        return LoadedBatch(pixels, self.pending, self.labels.pin_memory(), self.unreadable)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LoadedBatch:
        pixels = None if self.pixels is None else self.pixels.to(device, non_blocking=non_blocking)
        return LoadedBatch(
            pixels, self.pending, self.labels.to(device, non_blocking=non_blocking), self.unreadable
        )

    def finish(self, size: int, mean: Sequence[float], std: Sequence[float]) -> FinishedBatch:
        """On the labels' device: the normalized float batch (channels-last), its labels, the unreadable files
        (left out of both) and the JPEGs the device refused, decoded on the CPU here instead."""
        device = self.labels.device
        if self.pixels is not None:
            return FinishedBatch(normalize(self.pixels, mean, std), self.labels, self.unreadable, [])
        to_decode = [item.image for item in self.pending if item.pixels is None]
        decoded, on_host = decode_batch(to_decode, device) if to_decode else ([], [])
        from_device = iter(decoded)
        images, keep, unreadable = [], [], list(self.unreadable)
        for item in self.pending:
            pixels = next(from_device) if item.pixels is None else item.pixels.to(device, non_blocking=True)
            if isinstance(pixels, UnreadableImage):
                unreadable.append(pixels)
                keep.append(False)
                continue
            images.append(_transform(pixels, item.crop, size))
            keep.append(True)
        labels = self.labels if all(keep) else self.labels[torch.tensor(keep, device=device)]
        if not images:  # every file of the batch is unreadable: an empty batch, which trains nothing
            return FinishedBatch(torch.empty(0, 3, size, size, device=device), labels, unreadable, on_host)
        return FinishedBatch(normalize(torch.stack(images), mean, std), labels, unreadable, on_host)


def collate(samples: list[tuple[Any, int]]) -> LoadedBatch:
    """The samples of one batch, the unreadable files set aside with their labels."""
    readable = [(sample, label) for sample, label in samples if not isinstance(sample, UnreadableImage)]
    unreadable = [sample for sample, _ in samples if isinstance(sample, UnreadableImage)]
    labels = torch.tensor([label for _, label in readable], dtype=torch.long)
    if readable and isinstance(readable[0][0], Pending):
        return LoadedBatch(None, [sample for sample, _ in readable], labels, unreadable)
    pixels = torch.stack([sample for sample, _ in readable]) if readable else None
    return LoadedBatch(pixels, [], labels, unreadable)


class PilImages(Dataset):
    """A folder's files as PIL images for a view transform (SimCLR), as torchvision's ImageFolder loader reads
    them (:func:`~runner.decode.pil_image`): ``(image, label)``, the image the :class:`UnreadableImage` it is
    where the file cannot be read or decoded (:class:`~runner.sampling.SeededDataset` hands it on)."""

    def __init__(self, files: SplitFiles) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Image.Image | UnreadableImage, int]:
        try:
            return pil_image(self.files[index]), self.files.label(index)
        except UnreadableImage as unreadable:
            return unreadable, self.files.label(index)


class SetAside(NamedTuple):
    """A batch of the default collation (``None`` where no sample was readable) and the unreadable files set
    aside from it."""

    batch: Any
    unreadable: list[UnreadableImage]


def collate_set_aside(samples: list[tuple[Any, int]]) -> SetAside:
    """The readable samples collated as the DataLoader would, the unreadable files set aside."""
    readable = [sample for sample in samples if not isinstance(sample[0], UnreadableImage)]
    unreadable = [sample[0] for sample in samples if isinstance(sample[0], UnreadableImage)]
    return SetAside(default_collate(readable) if readable else None, unreadable)
