"""What the image-folder tests share: the training size, a DataModule's first batch, PIL's pixels, and JPEGs
given an EXIF orientation in each of the ways cameras and tools write one."""

from __future__ import annotations

import io
import shutil
import struct
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode

from runner.data import ImageFolderDataModule

SIZE = 64  # the tests' training size: small, so that resizing stays cheap

# How an EXIF orientation is written: the tag's TIFF type (each its code and the bytes of the value field:
# the value first, padded to four), and the place of the EXIF block in the file.
_TYPES = {"SHORT": (3, "H", 2), "LONG": (4, "I", 0), "BYTE": (1, "B", 3)}
# Each (type, byte order, place) in turn: every type in both byte orders, and a block after the start-of-frame
# and between a progressive JPEG's scans.
ENCODINGS = [(kind, order, "start") for kind in _TYPES for order in ("little", "big")] + [
    ("SHORT", "little", "after_frame"),
    ("SHORT", "big", "between_scans"),
]


def first_batch(module: ImageFolderDataModule, *, validation: bool = False):
    loader = module.val_dataloader() if validation else module.train_dataloader()
    return module.on_after_batch_transfer(next(iter(loader)), 0)


def pil_reference(path: str, box: tuple[int, int, int, int] | None, flip: bool, size: int) -> torch.Tensor:
    """torchvision's reference pipeline on one file: PIL decode, the crop resized (bilinear, PIL's antialias)
    and flipped, or validation's Resize(size / 0.875) + CenterCrop(size); as a uint8 tensor."""
    image = Image.open(path).convert("RGB")
    if box is None:
        image = TF.center_crop(TF.resize(image, round(size / 0.875)), size)
    else:
        image = TF.resized_crop(image, *box, [size, size], InterpolationMode.BILINEAR)
        image = TF.hflip(image) if flip else image
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def pil_pixels(path) -> torch.Tensor:
    """The file as torchvision's ImageFolder loader reads it (PIL: pixels as stored), a (C, H, W) tensor."""
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def with_orientation(
    jpeg: bytes, orientation: int, byteorder: str = "little", kind: str = "SHORT", place: str = "start"
) -> bytes:
    """``jpeg`` with an EXIF block holding an orientation tag of TIFF type ``kind`` in ``byteorder``, inserted
    at ``place``: after the start marker, after the start-of-frame segment, or before a progressive JPEG's
    second scan. The compressed image is the same bytes."""
    order = "<" if byteorder == "little" else ">"
    code, value_format, padding = _TYPES[kind]
    tiff = (b"II" if byteorder == "little" else b"MM") + struct.pack(order + "HI", 42, 8)
    entry = struct.pack(order + "HHI", 0x0112, code, 1) + struct.pack(order + value_format, orientation)
    tiff += struct.pack(order + "H", 1) + entry + b"\x00" * padding + struct.pack(order + "I", 0)
    payload = b"Exif\x00\x00" + tiff
    block = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    at = {"start": lambda jpeg: 2, "after_frame": _after_frame, "between_scans": _second_scan}[place](jpeg)
    return jpeg[:at] + block + jpeg[at:]


def _after_frame(jpeg: bytes) -> int:
    at = 2
    while jpeg[at + 1] not in (0xC0, 0xC1, 0xC2):
        at += 2 + struct.unpack(">H", jpeg[at + 2 : at + 4])[0]
    return at + 2 + struct.unpack(">H", jpeg[at + 2 : at + 4])[0]


def _second_scan(jpeg: bytes) -> int:
    # A scan's coded data holds no 0xFF 0xDA (each 0xFF there is followed by 0x00 or a restart marker).
    return jpeg.index(b"\xff\xda", jpeg.index(b"\xff\xda") + 2)


def progressive(jpeg: bytes) -> bytes:
    """``jpeg`` re-encoded as a progressive JPEG (several scans)."""
    buffer = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(buffer, "JPEG", quality=90, progressive=True)
    return buffer.getvalue()


def oriented_copy(folder: Path, root: Path) -> Path:
    """A copy of ``folder`` at ``root``, each JPEG given an EXIF orientation (2-8 in turn: flips, rotations by
    90, 180 and 270 degrees), written in each of :data:`ENCODINGS` in turn."""
    shutil.copytree(folder, root)
    for number, path in enumerate(sorted(root.rglob("*.JPEG"))):
        kind, byteorder, place = ENCODINGS[number % len(ENCODINGS)]
        jpeg = path.read_bytes()
        jpeg = progressive(jpeg) if place == "between_scans" else jpeg
        path.write_bytes(with_orientation(jpeg, 2 + number % 7, byteorder, kind, place))
    return root
