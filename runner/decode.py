"""Decoding image bytes to uint8 RGB (3, H, W) tensors: one at a time on the CPU (a loader worker), or a batch
in one call on the GPU (nvJPEG).

JPEGs are decoded by TorchCodec where it loads: torchvision 0.29 deprecated its own image decoders for it (a
warning on every call); it installs from pip beside torch, decodes the same pixels (libjpeg-turbo) and was the
faster of the two per image on the CPU here (0.85 against 1.1 ms for a 500x375 JPEG, one thread). Its image
decoders (0.16+) need torch 2.11 or newer, and the library supports torch 2.6: where TorchCodec does not load,
torchvision's own decoders (CPU and nvJPEG, present through torchvision 0.29) decode, the same pixels. Which
one is chosen once per process (:func:`jpeg_decoder`). Grayscale and CMYK JPEGs decode to RGB. A file of
another format (a BMP, TIFF or PNG, whatever its name) is decoded on the CPU by PIL, as torchvision's
ImageFolder reads it. Pixels are as stored: a JPEG's EXIF orientation is not applied, as PIL and torchvision's
ImageFolder do not (:func:`~runner.files.as_stored`); a JPEG a decoder gives in another size than its
header's all the same is PIL's. A file that decodes nowhere (empty, truncated, not an image) is an
:class:`UnreadableImage`, which names it; a JPEG the device refuses (one nvJPEG cannot decode) or turns is
decoded on the CPU, and :func:`decode_batch` says which (:class:`DecodedOnHost`)."""

from __future__ import annotations

import functools
import io
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from lightning_fusedsgd.lightning import ConfigError
from runner.files import EncodedImage, UnreadableImage, as_stored, jpeg_size

__all__ = [
    "DecodedOnHost",
    "JpegDecoder",
    "decode_batch",
    "decode_on_cpu",
    "device_failure",
    "jpeg_decoder",
    "pil_image",
]

CPU = torch.device("cpu")


class JpegDecoder(NamedTuple):
    """One library's JPEG decoders: ``on_cpu(data)`` (libjpeg-turbo) and ``on_device(batch, device)``, a list
    of JPEGs decoded in one call on ``device`` (nvJPEG on a GPU). Both take and give uint8 tensors, RGB."""

    name: str
    on_cpu: Callable[[torch.Tensor], torch.Tensor]
    on_device: Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


class DecodedOnHost(NamedTuple):
    """A JPEG the device decoder refused, decoded on the CPU instead: its path and the device's reason."""

    path: str
    reason: str


def _torchcodec() -> JpegDecoder:
    import torchcodec
    import torchcodec.decoders as decoders

    return JpegDecoder(
        f"TorchCodec {torchcodec.__version__}",
        lambda data: decoders.decode_jpeg(data, mode="RGB"),
        lambda batch, device: list(decoders.decode_jpeg(batch, mode="RGB", device=device)),
    )


def _torchvision() -> JpegDecoder:
    import torchvision
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as decode

    def quiet(
        data: torch.Tensor | list[torch.Tensor], device: torch.device
    ) -> torch.Tensor | list[torch.Tensor]:
        with warnings.catch_warnings():  # chosen because TorchCodec did not load: its deprecation is known
            warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision")
            return decode(data, mode=ImageReadMode.RGB, device=device)

    return JpegDecoder(
        f"torchvision {torchvision.__version__}",
        lambda data: quiet(data, CPU),
        lambda batch, device: list(quiet(batch, device)),
    )


@functools.cache
def jpeg_decoder() -> JpegDecoder:
    """The JPEG decoder of this process: TorchCodec's, else torchvision's, each tried on a small JPEG when an
    image folder is set up (in the main process, so that a build that does not work with this torch is one
    message with the fix, not a loader worker's traceback); the other recipes run without either.

    Raises:
        ConfigError: neither decodes.
    """
    failures = []
    for make in (_torchcodec, _torchvision):
        try:
            decoder = make()
            decoder.on_cpu(_SMALL_JPEG)
        # A build for another torch fails to load in any of these ways; AttributeError: a torchvision
        # without its decoders.
        except (ImportError, OSError, RuntimeError, ValueError, AttributeError) as error:
            failures.append(f"{make.__name__.strip('_')}: {_first_line(error)}")
            continue
        return decoder
    raise ConfigError(
        f"decoding an image folder needs TorchCodec or torchvision's image decoders, and neither works "
        f"({'; '.join(failures)}): pip install torchcodec (the recipes extra), a version built for this "
        "torch (TorchCodec 0.16+ needs torch 2.11+), or a torchvision with image decoders (through 0.29)"
    )


def _small_jpeg() -> torch.Tensor:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 140, 200)).save(buffer, "JPEG")
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


_SMALL_JPEG = _small_jpeg()


# The place in the decoder's source that its C++ errors start with: "decode_rows, /.../DecodeJpeg.cpp:287, ".
_SOURCE_LOCATION = re.compile(r"^\w+, \S+:\d+, ")


def _reason(error: Exception, data: torch.Tensor) -> str:
    """Why a decoder refused a file: its message, without the place in its source (or what torch adds below
    it); where PIL found no format it reads, what the file starts with."""
    if isinstance(error, UnidentifiedImageError):  # its message names a BytesIO object, not the file
        return (
            f"not an image PIL or the JPEG decoder reads (the file starts with {bytes(data[:8].tolist())!r})"
        )
    return _SOURCE_LOCATION.sub("", _first_line(error)) or type(error).__name__


def _first_line(error: Exception) -> str:
    """An error's message without what torch adds below it (a C++ backtrace, where to search for the code)."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def decode_on_cpu(image: EncodedImage) -> torch.Tensor:
    """``image`` decoded on the CPU by its format (whatever its name says): a JPEG by the JPEG decoder, any
    other as :func:`pil_image` reads it. A JPEG the decoder gives in another size than its header's (turned by
    an orientation :func:`~runner.files.as_stored` did not remove) is PIL's, as stored.

    Raises:
        UnreadableImage: the file is empty, cut short or no image, or a JPEG that PIL too decodes to another
            size than its header's (the crop drawn from the header would leave the image).
    """
    header = jpeg_size(image.data)
    if header is None:
        return _pil_pixels(image)
    try:
        pixels = jpeg_decoder().on_cpu(as_stored(image.data))
    except (RuntimeError, ValueError) as error:
        raise UnreadableImage(image.path, _reason(error, image.data)) from None
    if _other_size(pixels, header) is None:
        return pixels
    pixels = _pil_pixels(image)
    if (differs := _other_size(pixels, header)) is not None:
        raise UnreadableImage(image.path, f"PIL {differs}")
    return pixels


def _pil_pixels(image: EncodedImage) -> torch.Tensor:
    return torch.from_numpy(np.array(pil_image(image))).permute(2, 0, 1)  # (C, H, W) over (H, W, C) memory


def _other_size(pixels: torch.Tensor, header: tuple[int, int]) -> str | None:
    """How ``pixels`` differ in size from a JPEG's ``header``; ``None`` where they do not."""
    height, width = pixels.shape[-2:]
    if (height, width) == header:
        return None
    return f"decodes it to {height}x{width} pixels, its header says {header[0]}x{header[1]} (height x width)"


def pil_image(image: EncodedImage) -> Image.Image:
    """``image`` as torchvision's ImageFolder loader reads it: PIL, whatever the format (BMP, TIFF, PPM/PGM,
    PNG, WebP, GIF, JPEG), converted to RGB (an animation's first frame).

    Raises:
        UnreadableImage: the file is empty, cut short or no image.
    """
    if image.data.numel() == 0:
        raise UnreadableImage(image.path, "the file is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(memoryview(image.data.numpy()))) as opened:
            return opened.convert("RGB")
    # PIL's format plugins raise many kinds of errors on damaged bytes (OSError, SyntaxError, struct.error
    # and more): each is the file's, not the run's.
    except Exception as error:
        raise UnreadableImage(image.path, _reason(error, image.data)) from None


def decode_batch(
    images: list[EncodedImage], device: torch.device
) -> tuple[list[torch.Tensor | UnreadableImage], list[DecodedOnHost]]:
    """The JPEGs of ``images`` decoded on ``device`` (:func:`_on_device`), and each one the device refused (a
    JPEG nvJPEG cannot decode) or gave in another size than its header's (turned by an orientation) on the
    CPU, in this process (:func:`decode_on_cpu`).

    Returns:
        Each image or the :class:`UnreadableImage` it is, and the images decoded on the CPU instead.
    """
    decoded: list[torch.Tensor | UnreadableImage] = []
    on_host: list[DecodedOnHost] = []
    for image, pixels in zip(images, _on_device(images, device)):
        if isinstance(pixels, torch.Tensor):
            differs = _other_size(pixels, jpeg_size(image.data))
            if differs is None:
                decoded.append(pixels)
                continue
            # Turned by an orientation after all: cropping it by its header's size would leave the image.
            pixels = f"{jpeg_decoder().name} on {device} {differs}"
        try:
            decoded.append(decode_on_cpu(image).to(device, non_blocking=True))
            on_host.append(DecodedOnHost(image.path, pixels))
        except UnreadableImage as unreadable:
            decoded.append(unreadable)
    return decoded, on_host


def _on_device(images: list[EncodedImage], device: torch.device) -> list[torch.Tensor | str]:
    """The JPEGs of ``images`` decoded on ``device`` in one batched call; where that call fails (it returns
    nothing then), each image alone. Each entry: the image, or why the device refused it."""
    decoder = jpeg_decoder()
    try:
        return decoder.on_device([as_stored(image.data) for image in images], device)
    except (RuntimeError, ValueError):
        pass
    decoded: list[torch.Tensor | str] = []
    for image in images:
        try:
            decoded.append(decoder.on_device([as_stored(image.data)], device)[0])
        except (RuntimeError, ValueError) as refused:
            decoded.append(f"{decoder.name} on {device}: {_reason(refused, image.data)}")
    return decoded


def device_failure(images: list[EncodedImage], device: torch.device) -> str | None:
    """Why ``device`` decodes none of ``images`` (JPEGs: a TorchCodec without nvJPEG, say), tried once as
    training would; ``None`` where it decodes one of them, or there are none."""
    decoded = _on_device(images, device) if images else []
    return decoded[0] if decoded and all(isinstance(pixels, str) for pixels in decoded) else None
