"""Reading an image folder as bytes: the loader workers' only I/O. The files and labels are torchvision
``ImageFolder``'s (its own scan), so a label means what it means there; each sample is the file's bytes and
what its header says (a JPEG's size), read without decoding."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

__all__ = ["EncodedFolder", "EncodedImage", "jpeg_size"]

# Start-of-frame markers carry the size: baseline, extended, progressive, lossless and arithmetic-coded ones
# (0xC4 is a Huffman table, 0xC8 reserved, 0xCC arithmetic conditioning).
_START_OF_FRAME = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class EncodedImage(NamedTuple):
    """A file as read: its path, its bytes (a 1-D uint8 tensor) and its label."""

    path: str
    data: torch.Tensor
    label: int


def jpeg_size(data: bytes | torch.Tensor) -> tuple[int, int] | None:
    """(height, width) from a JPEG's start-of-frame header; ``None`` where ``data`` is no JPEG (a PNG named
    .JPEG, an empty file) or its header is cut short."""
    raw = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data  # the header, read in place
    if raw[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 4 <= len(raw):
        if raw[at] != 0xFF:
            return None
        marker = raw[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        (length,) = struct.unpack(">H", raw[at + 2 : at + 4])
        if marker in _START_OF_FRAME:
            if at + 9 > len(raw):
                return None
            height, width = struct.unpack(">HH", raw[at + 5 : at + 9])
            return (height, width) if height and width else None
        at += 2 + length
    return None


class EncodedFolder(Dataset):
    """An ImageFolder (``root/<class>/<image>``) whose samples are :class:`EncodedImage`: bytes, not pixels.

    Args:
        root: The split's folder.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = str(root)
        self.classes, class_to_idx = find_classes(self.root)
        self.samples = make_dataset(self.root, class_to_idx, extensions=IMG_EXTENSIONS)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> EncodedImage:
        path, label = self.samples[index]
        with open(path, "rb") as file:
            data = bytearray(file.read())
        return EncodedImage(
            path,
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8),
            label,
        )
