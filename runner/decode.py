"""Decoding image bytes to uint8 RGB (3, H, W) tensors: one at a time on the CPU (a loader worker), or a batch
in one call on the GPU (nvJPEG).

JPEGs are decoded by TorchCodec: torchvision 0.29 deprecated its own image decoders for it (a warning on every
call); it installs from pip beside torch, decodes the same pixels (libjpeg-turbo) and was the faster of the
two per image on the CPU here (0.85 against 1.1 ms for a 500x375 JPEG, one thread). Grayscale and CMYK JPEGs
decode to RGB. A file of another format (a BMP, TIFF or PNG, whatever its name) is decoded on the CPU by PIL,
as torchvision's ImageFolder reads it. Pixels are as stored: a JPEG's EXIF orientation is not applied, as PIL
and torchvision's ImageFolder do not (:func:`~runner.files.as_stored`). A file that decodes nowhere (empty,
truncated, not an image) is an :class:`UnreadableImage`, which names it."""

from __future__ import annotations

import functools
import io
import re
from types import ModuleType

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from lightning_fusedsgd.lightning import ConfigError
from runner.files import EncodedImage, UnreadableImage, as_stored, jpeg_size

__all__ = ["decode_batch", "decode_on_cpu", "decoders"]


@functools.cache
def decoders() -> ModuleType:
    """TorchCodec's decoders, imported when an image folder is set up (in the main process, so that a build
    that does not load with this torch is one message with the fix, not a loader worker's traceback); the
    other recipes run without it."""
    try:
        import torchcodec.decoders
    except (ImportError, OSError, RuntimeError) as error:
        raise ConfigError(
            f"decoding an image folder needs TorchCodec, which did not load ({error}); "
            "pip install torchcodec (the recipes extra), a version built for this torch"
        ) from None
    return torchcodec.decoders


# The place in the decoder's source that its C++ errors start with: "decode_rows, /.../DecodeJpeg.cpp:287, ".
_SOURCE_LOCATION = re.compile(r"^\w+, \S+:\d+, ")


def _reason(error: Exception, data: torch.Tensor) -> str:
    """Why a decoder refused a file: its whole message on one line, without the place in its source (or a C++
    backtrace); where PIL found no format it reads, what the file starts with."""
    if isinstance(error, UnidentifiedImageError):  # its message names a BytesIO object, not the file
        return (
            f"not an image PIL or the JPEG decoder reads (the file starts with {bytes(data[:8].tolist())!r})"
        )
    message = str(error).split("\nException raised from", 1)[0]  # torch's C++ backtrace, where it adds one
    return _SOURCE_LOCATION.sub("", " ".join(message.split())) or type(error).__name__


def decode_on_cpu(image: EncodedImage) -> torch.Tensor:
    """``image`` decoded on the CPU by its format (whatever its name says): a JPEG by the JPEG decoder, any
    other by PIL, as torchvision's ImageFolder loader reads it (BMP, TIFF, PPM/PGM, PNG, WebP, GIF: converted
    to RGB, an animation's first frame).

    Raises:
        UnreadableImage: the file is empty, cut short or no image.
    """
    if image.data.numel() == 0:
        raise UnreadableImage(image.path, "the file is empty (0 bytes)")
    if jpeg_size(image.data) is None:
        return _decode_with_pil(image)
    try:
        return decoders().decode_jpeg(as_stored(image.data), mode="RGB")
    except (RuntimeError, ValueError) as error:
        raise UnreadableImage(image.path, _reason(error, image.data)) from None


def _decode_with_pil(image: EncodedImage) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(memoryview(image.data.numpy()))) as opened:
            pixels = np.array(opened.convert("RGB"))
    # PIL's format plugins raise many kinds of errors on damaged bytes (OSError, SyntaxError, struct.error
    # and more): each is the file's, not the run's.
    except Exception as error:
        raise UnreadableImage(image.path, _reason(error, image.data)) from None
    return torch.from_numpy(pixels).permute(2, 0, 1)  # (C, H, W) over (H, W, C) memory, as the decoders give


def decode_batch(images: list[EncodedImage], device: torch.device) -> list[torch.Tensor | UnreadableImage]:
    """The JPEGs of ``images`` decoded on ``device`` in one batched call; where that call fails (it returns
    nothing then), each image alone on the device, and one the device cannot decode (a JPEG nvJPEG refuses) on
    the CPU. Each entry: the image, or the :class:`UnreadableImage` it is."""
    try:
        data = [as_stored(image.data) for image in images]
        return list(decoders().decode_jpeg(data, mode="RGB", device=device))
    except (RuntimeError, ValueError):
        pass
    decoded: list[torch.Tensor | UnreadableImage] = []
    for image in images:
        try:
            decoded.append(decoders().decode_jpeg(as_stored(image.data), mode="RGB", device=device))
        except (RuntimeError, ValueError):
            try:
                decoded.append(decode_on_cpu(image).to(device, non_blocking=True))
            except UnreadableImage as unreadable:
                decoded.append(unreadable)
    return decoded
