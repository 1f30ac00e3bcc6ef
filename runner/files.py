"""Reading an image folder as bytes: the loader workers' only I/O. The files and labels are torchvision
``ImageFolder``'s (its own scan), so a label means what it means there; each sample is the file's bytes and
what its header says (a JPEG's size), read without decoding. A file that cannot be read, here or by a decoder,
is an :class:`UnreadableImage`, which travels beside the batch instead of stopping a loader worker."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from lightning_fusedsgd.lightning import ConfigError

__all__ = [
    "EncodedFolder",
    "EncodedImage",
    "SplitFiles",
    "UnreadableImage",
    "as_stored",
    "jpeg_size",
    "refuse_empty_classes",
]

# Start-of-frame markers carry the size: baseline, extended, progressive, lossless and arithmetic-coded ones
# (0xC4 is a Huffman table, 0xC8 reserved, 0xCC arithmetic conditioning).
_START_OF_FRAME = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_START_OF_SCAN, _END_OF_IMAGE = 0xDA, 0xD9
_APP1 = 0xE1  # EXIF (its orientation among it) and XMP metadata
# In a scan's coded data 0xFF is followed by 0x00 (a data byte), a restart marker (0xD0-0xD7) or more fill
# bytes: anything else is the next marker.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


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


def _segments(raw: memoryview, *, past_scans: bool = False) -> Iterator[tuple[int, int, int]]:
    """``(marker, start, end)`` of each marker segment of a JPEG (its payload is ``raw[start:end]``): its
    header's, every one before its first scan (SOS), so the tables and metadata after the start-of-frame too;
    with ``past_scans`` also each scan's and those between scans (a progressive JPEG's). None where ``raw`` is
    no JPEG. Stops at the end of the image, or where the bytes are cut short or hold something that is no
    marker."""
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
        if marker == _END_OF_IMAGE or (marker == _START_OF_SCAN and not past_scans):
            return
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        (length,) = struct.unpack(">H", raw[at + 2 : at + 4])
        end = at + 2 + length
        if length < 2 or end > len(raw):
            return
        yield marker, at + 4, end
        at = end
        if marker == _START_OF_SCAN:  # its coded data runs to the next marker
            following = _NEXT_MARKER.search(raw, end)
            if following is None:
                return
            at = following.start()


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


def as_stored(data: torch.Tensor) -> torch.Tensor:
    """A JPEG's bytes without its APP1 segments (its EXIF and XMP metadata, the EXIF orientation among it), a
    copy; ``data`` itself where it has none (or is no JPEG).

    The image folders' one rule: pixels as stored, as PIL reads them, and so torchvision's ImageFolder and its
    reference recipes. TorchCodec's decoders turn an image as its EXIF orientation says (torchvision's did
    not), and read it loosely: the CPU decoder the first APP1 segment libjpeg saves, whatever it holds and
    wherever it sits (after the start-of-frame, between a progressive JPEG's scans), the CUDA decoder the
    first EXIF one before the scan, each the tag's first two bytes whatever its type (SHORT, LONG, BYTE).
    Clearing the tag would have to read the blocks as each of them does; without the segments there is
    nothing to read, and no pixel depends on them. The crop the device path draws comes from the stored size
    (:func:`jpeg_size`), so whatever decodes a JPEG is handed these bytes."""
    raw = _view(data)
    metadata = [(start - 4, end) for marker, start, end in _segments(raw, past_scans=True) if marker == _APP1]
    if not metadata:
        return data
    kept, at = [], 0
    for begin, end in metadata:  # each segment from its marker
        kept.append(data[at:begin])
        at = end
    kept.append(data[at:])
    return torch.cat(kept)


class SplitFiles(Protocol):
    """A split's samples as bytes, what the pipeline reads: an :class:`EncodedFolder`, or the same samples
    from shards (:class:`~runner.shard_files.ShardedFiles`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> EncodedImage:
        """Sample ``index``; raises :class:`UnreadableImage` where its file cannot be read."""
        ...

    def label(self, index: int) -> int:
        """The label of sample ``index``, read or not."""
        ...


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
        labelled = {label for _, label in self.samples}
        #: The class folders that hold no file of an image extension (:func:`refuse_empty_classes`).
        self.empty_classes = [
            os.path.join(self.root, name) for label, name in enumerate(self.classes) if label not in labelled
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, index: int) -> int:
        """The label of sample ``index``, read or not."""
        return self.samples[index][1]

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
    """Why ``path`` could not be read: the OS's cause, and where it is a link, what it points to (a missing
    file, a loop of links, or another link that fails)."""
    reason = f"cannot be read: {error.strerror or error}"
    return f"{reason} (a link to {os.readlink(path)})" if os.path.islink(path) else reason


def refuse_empty_classes(*folders: EncodedFolder) -> None:
    """A class folder without an image file is a label no image has (torchvision's scan stops at it with a
    traceback): one message naming each, of every split.

    Raises:
        ConfigError: some class folder of ``folders`` holds no file of an image extension.
    """
    empty = [path for folder in folders for path in folder.empty_classes]
    if empty:
        raise ConfigError(
            f"{len(empty)} class folder(s) hold no image file ({', '.join(IMG_EXTENSIONS)}): "
            f"{', '.join(empty)}; add images to each or remove it from both splits (and set data.num_classes)"
        )
