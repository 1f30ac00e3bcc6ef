"""Reading an image folder as bytes: the loader workers' only I/O. The files and labels are torchvision
``ImageFolder``'s (its own scan), so a label means what it means there; each sample is the file's bytes and
what its header says (a JPEG's size), read without decoding. A file that cannot be read, here or by a decoder,
is an :class:`UnreadableImage`, which travels beside the batch instead of stopping a loader worker."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from lightning_fusedsgd.lightning import ConfigError

__all__ = [
    "EncodedFolder",
    "EncodedImage",
    "UnreadableImage",
    "as_stored",
    "jpeg_size",
]

# Start-of-frame markers carry the size: baseline, extended, progressive, lossless and arithmetic-coded ones
# (0xC4 is a Huffman table, 0xC8 reserved, 0xCC arithmetic conditioning).
_START_OF_FRAME = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class UnreadableImage(Exception):
    """A file that cannot be read or decoded: ``path`` and the ``reason`` (its ``args``, so that it pickles
    from a loader worker)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class EncodedImage(NamedTuple):
    """A file as read: its path, its bytes (a 1-D uint8 tensor) and its label."""

    path: str
    data: torch.Tensor
    label: int


def _segments(raw: memoryview) -> Iterator[tuple[int, int, int]]:
    """``(marker, start, end)`` of each marker segment of a JPEG's header (its payload is ``raw[start:end]``),
    up to and with the first start-of-frame; none where ``raw`` is no JPEG. Stops where the header is cut
    short or holds something that is no marker."""
    if raw[:2] != b"\xff\xd8":
        return
    at = 2
    while at + 4 <= len(raw):
        if raw[at] != 0xFF:
            return
        marker = raw[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        (length,) = struct.unpack(">H", raw[at + 2 : at + 4])
        end = at + 2 + length
        if length < 2 or end > len(raw):
            return
        yield marker, at + 4, end
        if marker in _START_OF_FRAME:
            return
        at = end


def _view(data: bytes | torch.Tensor) -> memoryview:
    return memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)  # read in place


def jpeg_size(data: bytes | torch.Tensor) -> tuple[int, int] | None:
    """(height, width) from a JPEG's start-of-frame header, as stored (its EXIF orientation not applied);
    ``None`` where ``data`` is no JPEG (a PNG named .JPEG, an empty file) or its header is cut short."""
    raw = _view(data)
    for marker, start, end in _segments(raw):
        if marker in _START_OF_FRAME and end - start >= 5:
            height, width = struct.unpack(">HH", raw[start + 1 : start + 5])
            return (height, width) if height and width else None
    return None


def _orientation_tag(raw: memoryview) -> tuple[int, str] | None:
    """Where a JPEG's EXIF orientation tag holds its value (the offset of its two bytes) and their byte order
    (``"big"`` or ``"little"``); ``None`` where it has none (or an EXIF block that does not parse)."""
    for marker, start, end in _segments(raw):
        if marker != 0xE1 or raw[start : start + 6] != b"Exif\x00\x00":
            continue
        tiff = start + 6  # the EXIF block is a TIFF file: byte order, 42, the offset of its first directory
        order = {b"II": "<", b"MM": ">"}.get(bytes(raw[tiff : tiff + 2]))
        if order is None or tiff + 8 > end:
            return None
        magic, directory = struct.unpack(order + "HI", raw[tiff + 2 : tiff + 8])
        if magic != 42 or tiff + directory + 2 > end:
            return None
        (count,) = struct.unpack(order + "H", raw[tiff + directory : tiff + directory + 2])
        for entry in range(tiff + directory + 2, min(tiff + directory + 2 + 12 * count, end - 11), 12):
            tag, kind = struct.unpack(order + "HH", raw[entry : entry + 4])
            if tag == 0x0112 and kind == 3:  # Orientation, a SHORT held in the entry itself
                return entry + 8, "little" if order == "<" else "big"
        return None
    return None


def as_stored(data: torch.Tensor) -> torch.Tensor:
    """A JPEG's bytes with its EXIF orientation tag set to 1 (as stored: no rotation or flip), a copy where it
    says otherwise; ``data`` itself where it has none.

    The image folders' one rule: pixels as stored, as PIL reads them, and so torchvision's ImageFolder and its
    reference recipes. TorchCodec's decoders turn an image as its orientation says (torchvision's did not),
    and the crop the device path draws comes from the stored size (:func:`jpeg_size`), so whatever decodes a
    JPEG is handed these bytes."""
    found = _orientation_tag(_view(data))
    if found is None:
        return data
    at, byteorder = found
    if int.from_bytes(bytes(_view(data)[at : at + 2]), byteorder) == 1:
        return data
    stored = data.clone()
    stored[at : at + 2] = torch.tensor(list((1).to_bytes(2, byteorder)), dtype=torch.uint8)
    return stored


class EncodedFolder(Dataset):
    """An ImageFolder (``root/<class>/<image>``) whose samples are :class:`EncodedImage`: bytes, not pixels.

    Args:
        root: The split's folder.
        classes: The class folders, in label order: the training split's, which every split is labelled by
            (and must have); ``None``: ``root``'s own, sorted, as ImageFolder's.
    """

    def __init__(self, root: str | Path, classes: Sequence[str] | None = None) -> None:
        self.root = str(root)
        self.classes = find_classes(self.root)[0] if classes is None else list(classes)
        class_to_idx = {name: label for label, name in enumerate(self.classes)}
        self.samples = make_dataset(self.root, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
        _refuse_empty_classes(self.root, self.classes, self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> EncodedImage:
        """The file's bytes.

        Raises:
            UnreadableImage: the file cannot be read (a link to a missing file, no permission, an I/O error).
        """
        path, label = self.samples[index]
        try:
            with open(path, "rb") as file:
                data = bytearray(file.read())
        except OSError as error:
            raise UnreadableImage(path, _cannot_read(path, error)) from None
        return EncodedImage(
            path,
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8),
            label,
        )


def _cannot_read(path: str, error: OSError) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return f"a link to {os.readlink(path)}, which does not exist"
    return f"cannot be read: {error.strerror or error}"


def _refuse_empty_classes(root: str, classes: Sequence[str], samples: Sequence[tuple[str, int]]) -> None:
    """A class folder without an image file is a label no image has (torchvision's scan stops at it with a
    traceback): one message naming each.

    Raises:
        ConfigError: some class folder of ``root`` holds no file of an image extension.
    """
    empty = sorted(set(range(len(classes))) - {label for _, label in samples})
    if empty:
        folders = ", ".join(os.path.join(root, classes[label]) for label in empty)
        raise ConfigError(
            f"{len(empty)} class folder(s) hold no image file ({', '.join(IMG_EXTENSIONS)}): {folders}; "
            "add images to each or remove it from both splits (and set data.num_classes)"
        )
