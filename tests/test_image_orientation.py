"""A JPEG's EXIF orientation against the image folders' rule, pixels as stored (PIL's, as torchvision's
ImageFolder reads them): written as cameras and tools write it (each tag type, both byte orders, the block
after the start-of-frame or between a progressive JPEG's scans), and a decoder that turns an image all the
same. All on CPU tensors: the GPU path is the same code."""

from __future__ import annotations

import io
import shutil
import warnings

import pytest
import torch
from image_helpers import (
    ENCODINGS,
    SIZE,
    first_batch,
    oriented_copy,
    pil_pixels,
    pil_reference,
    progressive,
    with_orientation,
)
from PIL import Image

import runner.decode
from runner.augment import IMAGENET_MEAN, IMAGENET_STD, draw_crop
from runner.data import ImageFolderDataModule
from runner.decode import decode_on_cpu, jpeg_decoder
from runner.files import EncodedFolder, EncodedImage, UnreadableImage, as_stored, jpeg_size
from runner.jpeg_folder import make_jpeg_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("jpegs"), classes=3, train=6, val=2)


@pytest.fixture
def oriented(folder, tmp_path):
    return oriented_copy(folder, tmp_path / "oriented")


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_the_exif_blocks_are_written_as_torchcodec_reads_them(folder):
    """The encodings the tests write are ones TorchCodec's CPU decoder turns an image by (a rotation by 90
    degrees swaps its sides), where PIL reads the stored pixels: each is a case the rule must hold in."""
    jpeg = (folder / "train" / "class_000" / "00000.JPEG").read_bytes()
    height, width = jpeg_size(jpeg)
    turned = []
    for kind, byteorder, place in ENCODINGS:
        source = progressive(jpeg) if place == "between_scans" else jpeg
        data = with_orientation(source, 6, byteorder, kind, place)
        assert Image.open(io.BytesIO(data)).size == (width, height)
        if jpeg_decoder().on_cpu(_tensor(data)).shape[-2:] == (width, height):
            turned.append((kind, byteorder, place))
    # TorchCodec reads the first two bytes of the value whatever its type: a big-endian LONG's or BYTE's are
    # not 6 (it leaves the image), a little-endian one's are.
    assert turned == [
        enc for enc in ENCODINGS if enc not in (("LONG", "big", "start"), ("BYTE", "big", "start"))
    ]


def test_as_stored_gives_the_jpeg_without_its_exif_blocks(folder):
    """Wherever the block sits and however its tag is written, the decoders are handed the JPEG as it was
    before the block was inserted, byte for byte; a JPEG without one is handed on as it is (no copy)."""
    jpeg = (folder / "train" / "class_000" / "00000.JPEG").read_bytes()
    for kind, byteorder, place in ENCODINGS:
        source = progressive(jpeg) if place == "between_scans" else jpeg
        data = with_orientation(source, 6, byteorder, kind, place)
        assert as_stored(_tensor(data)).numpy().tobytes() == source, (kind, byteorder, place)
    twice = with_orientation(with_orientation(jpeg, 3, "big"), 6, "little", "LONG", "after_frame")
    assert as_stored(_tensor(twice)).numpy().tobytes() == jpeg
    plain = _tensor(jpeg)
    assert as_stored(plain) is plain


def test_a_jpegs_exif_orientation_is_not_applied_as_pil_reads_it(oriented):
    """Pixels as stored, PIL's (torchvision's ImageFolder loader): TorchCodec alone would turn each image."""
    for split in ("train", "val"):
        files = EncodedFolder(oriented / split)
        for index in range(len(files)):
            image = files[index]
            ours, reference = decode_on_cpu(image), pil_pixels(image.path)
            assert ours.shape == reference.shape, image.path
            assert (ours.int() - reference.int()).abs().float().mean() < 0.5, image.path


def test_both_decode_paths_crop_an_oriented_jpeg_as_torchvisions_reference(oriented):
    """decode=cpu and the device path (on CPU tensors) give the same batches of oriented JPEGs, and each
    training crop is the reference pipeline's on PIL's unrotated image, for the box drawn from the stored
    size."""
    batches = {}
    for on_device in (False, True):
        module = ImageFolderDataModule(
            str(oriented), batch_size=18, image_size=SIZE, num_workers=0, num_classes=3
        )
        module.setup()
        for dataset in (module.train_set, module.val_set):
            dataset.decode_on_device = on_device
        batches[on_device] = (first_batch(module), first_batch(module, validation=True))
        assert not module.decoded_on_host  # the device decoded every JPEG: none was turned
    for (images, labels), (device_images, device_labels) in zip(batches[False], batches[True]):
        assert torch.equal(images, device_images) and torch.equal(labels, device_labels)
    module.train_set.decode_on_device = False
    sampler_keys = list(module.train_dataloader().sampler)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    for (index, seed), image in zip(sampler_keys, batches[False][0][0]):
        path = module.train_set.files.samples[index][0]
        height, width = pil_pixels(path).shape[-2:]
        crop = draw_crop(height, width, seed)
        reference = pil_reference(path, (crop.top, crop.left, crop.height, crop.width), crop.flip, SIZE)
        levels = ((image * std + mean) * 255 - reference).abs()
        assert levels.max() <= 1.01 and levels.mean() <= 0.3, path


@pytest.fixture
def turned(folder, tmp_path, monkeypatch):
    """The folder with a wide JPEG (400x60) whose orientation turns it upright, in both splits, and decoders
    handed the bytes as they are: what a decoder that reads an orientation where none is left would do."""
    root = tmp_path / "turned"
    shutil.copytree(folder, root)
    buffer = io.BytesIO()
    Image.open(folder / "train" / "class_000" / "00000.JPEG").resize((400, 60)).save(buffer, "JPEG")
    for split in ("train", "val"):
        (root / split / "class_000" / "wide.JPEG").write_bytes(with_orientation(buffer.getvalue(), 6))
    monkeypatch.setattr(runner.decode, "as_stored", lambda data: data)
    return root


def test_a_jpeg_a_decoder_turns_all_the_same_is_pils_on_either_path(turned):
    """The safety net: a JPEG decoded in another size than its header's is decoded by PIL instead (as
    stored), never cropped by a box drawn from its header's size (out of bounds: a crash). The device path
    counts and names it as decoded on the CPU; both paths give the same batches."""
    wide = turned / "train" / "class_000" / "wide.JPEG"
    image = EncodedImage(str(wide), _tensor(wide.read_bytes()), 0)
    assert torch.equal(decode_on_cpu(image), pil_pixels(wide))
    batches = {}
    for on_device in (False, True):
        module = ImageFolderDataModule(
            str(turned), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3
        )
        module.setup()
        for dataset in (module.train_set, module.val_set):
            dataset.decode_on_device = on_device
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            batches[on_device] = (first_batch(module), first_batch(module, validation=True))
        notes = [str(w.message) for w in warned if "decoded on the CPU" in str(w.message)]
        if not on_device:
            assert not module.decoded_on_host and not notes
            continue
        reason = f"{jpeg_decoder().name} on cpu decodes it to 400x60 pixels, its header says 60x400"
        reason += " (height x width)"
        val_wide = str(turned / "val" / "class_000" / "wide.JPEG")
        assert module.decoded_on_host == {str(wide): reason, val_wide: reason}
        assert notes == [f"decoded on the CPU {str(wide)}: {reason} (1 such file(s) so far)",
                         f"decoded on the CPU {val_wide}: {reason} (2 such file(s) so far)"]  # fmt: skip
    for (images, labels), (device_images, device_labels) in zip(batches[False], batches[True]):
        assert len(images) in (19, 7)
        assert torch.equal(images, device_images) and torch.equal(labels, device_labels)


def test_a_jpeg_pil_too_decodes_to_another_size_than_its_header_is_unreadable(turned, monkeypatch):
    """Where PIL too gives another size than the header's, no box drawn from the header fits: the file is
    named as unreadable, with the sizes."""
    monkeypatch.setattr(runner.decode, "pil_image", lambda image: Image.new("RGB", (60, 400)))
    wide = turned / "train" / "class_000" / "wide.JPEG"
    with pytest.raises(
        UnreadableImage, match=r"wide.JPEG: PIL decodes it to 400x60 pixels, its header says 60x400"
    ):
        decode_on_cpu(EncodedImage(str(wide), _tensor(wide.read_bytes()), 0))
