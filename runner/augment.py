"""Every dataset's augmentation and normalization, in one place.

The image folders' (supervised): decoded uint8 images, the same code on the CPU (loader workers,
``data.decode=cpu``) and on the GPU (``on_after_batch_transfer``, ``data.decode=gpu``): torchvision's
RandomResizedCrop, drawn per image, horizontal flip, resize, and the batch normalized to float in
channels-last. Each image's crop and flip are drawn from a generator seeded by its sample seed
(``EpochSampler``), so a run sees the same crops whichever device decodes and however many workers load.
Validation: resize the short side to ``size / 0.875``, center crop, as torchvision's reference.

The other datasets' (digits, CIFAR-10, synthetic images and every dataset's SimCLR views): torchvision v2
transforms of one image in a loader worker, under RNGs seeded by the sample's seed
(:class:`~runner.sampling.SeededDataset`), as :class:`HostTransforms`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from runner.sampling import Transform

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Crop",
    "HostTransforms",
    "center_crop",
    "cifar10_transforms",
    "digits_transforms",
    "draw_crop",
    "folder_view_transforms",
    "normalize",
    "resized_crop",
    "synthetic_view_transforms",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

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


class HostTransforms(NamedTuple):
    """A dataset's per-image transforms in the loader workers: training's random ones (``augment``, which
    the view transform replaces for SimCLR), evaluation's (``evaluate``), then ``finish`` for both (to a
    normalized float tensor)."""

    augment: list[Transform]
    evaluate: list[Transform]
    finish: Transform


def _to_normalized_tensor(mean: Sequence[float], std: Sequence[float]) -> Transform:
    """PIL image or [0, 1] tensor -> normalized float tensor."""
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def digits_transforms(train_images: torch.Tensor, augment: bool) -> HostTransforms:
    """The digits (float images in [0, 1]): a small random affine transform, normalized by the training
    images' mean and std."""
    # Augment before normalizing so the affine fill (0) is the background colour.
    affine = [v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))] if augment else []
    return HostTransforms(affine, [], v2.Normalize([train_images.mean().item()], [train_images.std().item()]))


def cifar10_transforms(image_size: int) -> HostTransforms:
    """CIFAR-10 (PIL images): a random crop of the image padded by 4 and a flip, resized where
    ``image_size`` is not 32."""
    resize = [v2.Resize(image_size)] if image_size != 32 else []
    return HostTransforms(
        [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *resize],
        resize,
        _to_normalized_tensor(CIFAR10_MEAN, CIFAR10_STD),
    )


def folder_view_transforms(image_size: int) -> HostTransforms:
    """An image folder's PIL images under a view transform: evaluation resizes to ``image_size / 0.875`` and
    center crops, as torchvision's reference."""
    return HostTransforms(
        [],
        [v2.Resize(round(image_size / 0.875), antialias=True), v2.CenterCrop(image_size)],
        _to_normalized_tensor(IMAGENET_MEAN, IMAGENET_STD),
    )


def synthetic_view_transforms(in_channels: int) -> HostTransforms:
    """Synthetic images in [0, 1] (uniform) under a view transform: normalized to mean 0, std 1."""
    return HostTransforms([], [], v2.Normalize([0.5] * in_channels, [1 / 12**0.5] * in_channels))
