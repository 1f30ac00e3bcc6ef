"""Augmentation of decoded uint8 images, the same code on the CPU (loader workers, ``data.decode=cpu``) and on
the GPU (``on_after_batch_transfer``, ``data.decode=gpu``): torchvision's RandomResizedCrop, drawn per image,
horizontal flip, resize, and the batch normalized to float in channels-last.

Each image's crop and flip are drawn from a generator seeded by its sample seed (``EpochSampler``), so a run
sees the same crops whichever device decodes and however many workers load. Validation: resize the short side
to ``size / 0.875``, center crop, as torchvision's reference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Crop", "center_crop", "draw_crop", "normalize", "resized_crop"]

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults
RATIO = (3 / 4, 4 / 3)


class Crop(NamedTuple):
    """A crop box (top, left, height, width) in the decoded image and whether to flip it."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def draw_crop(
    height: int,
    width: int,
    seed: int,
    scale: Sequence[float] = SCALE,
    ratio: Sequence[float] = RATIO,
) -> Crop:
    """torchvision's ``RandomResizedCrop.get_params`` draw by draw (the same box for a generator seeded
    alike), then a flip with probability 1/2, from a generator seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    box = None
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            box = (top, left, h, w)
            break
    if box is None:  # torchvision's fallback: the whole image, its ratio clamped to the range, centered
        in_ratio = width / height
        if in_ratio < min(ratio):
            w, h = width, round(width / min(ratio))
        elif in_ratio > max(ratio):
            h, w = height, round(height * max(ratio))
        else:
            w, h = width, height
        box = ((height - h) // 2, (width - w) // 2, h, w)
    return Crop(*box, flip=bool(torch.rand(1, generator=generator).item() < 0.5))


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear with antialiasing, as torchvision's tensor Resize: uint8 stays uint8 on the CPU (torch's uint8
    kernel, rounded); on the GPU, which has no uint8 kernel, float values in [0, 255] come out, unrounded."""
    # The decoders hand out (C, H, W) views of (H, W, C) memory; a crop of one is channels-last only once
    # copied as such, and the CPU's uint8 kernel runs 1.5x faster on it than on the strided view.
    batch = image.unsqueeze(0).contiguous(memory_format=torch.channels_last)
    if image.device.type != "cpu":
        batch = batch.float()
    return F.interpolate(batch, size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def resized_crop(image: torch.Tensor, crop: Crop, size: int) -> torch.Tensor:
    """``image`` (C, H, W) cropped to ``crop``'s box, resized to ``size`` x ``size``, flipped if asked."""
    out = _resize(
        image[:, crop.top : crop.top + crop.height, crop.left : crop.left + crop.width], (size, size)
    )
    return out.flip(-1) if crop.flip else out


def center_crop(image: torch.Tensor, size: int, resize: int) -> torch.Tensor:
    """torchvision's ``Resize(resize)`` (the short side to ``resize``) then ``CenterCrop(size)``."""
    height, width = image.shape[-2:]
    short, long = (height, width) if height <= width else (width, height)
    new_long = int(resize * long / short)
    new_size = (resize, new_long) if height <= width else (new_long, resize)
    resized = _resize(image, new_size)
    top = int(round((new_size[0] - size) / 2.0))
    left = int(round((new_size[1] - size) / 2.0))
    return resized[:, top : top + size, left : left + size]


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """A batch of images with values in [0, 255] (N, C, H, W) -> float32, ``(x / 255 - mean) / std``, on the
    batch's device in one pass: written channels-last on a GPU, where the convolutions want it; contiguous on
    the CPU, whose models train contiguous (``model.channels_last=auto``) and where writing channels-last
    costs five times the pass."""
    scale = torch.tensor([1 / (255 * s) for s in std], device=images.device).view(1, -1, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], device=images.device).view(1, -1, 1, 1)
    if images.device.type == "cpu":  # contiguous first: a channels-last batch (the crops) takes 2.4x longer
        return torch.addcmul(shift, images.float().contiguous(), scale)
    out = torch.empty(
        images.shape, dtype=torch.float32, device=images.device, memory_format=torch.channels_last
    )
    return torch.addcmul(shift, images.float(), scale, out=out)
