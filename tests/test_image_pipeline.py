"""The image-folder pipeline against torchvision's own: RandomResizedCrop's boxes, the reference
transform's pixels (PIL, as torchvision's ImageFolder recipes run it), the files no decoder reads, the
generated folder, and the synthetic pool on the device. All on CPU tensors: the GPU path is the same code."""

from __future__ import annotations

import errno
import inspect
import io
import logging
import math
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from image_helpers import SIZE, first_batch, oriented_copy, pil_reference
from lightly.transforms import SimCLRTransform
from lightning_utilities.core.rank_zero import rank_zero_only
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import RandomResizedCrop, v2

import runner.decode
import runner.image_folder
from lightning_fusedsgd.lightning import ConfigError
from runner import jpeg_folder
from runner.augment import IMAGENET_MEAN, IMAGENET_STD, center_crop, draw_crop, normalize, resized_crop
from runner.data import (
    CIFAR10DataModule,
    DigitsDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
    UnreadableImagesError,
)
from runner.decode import JpegDecoder, decode_on_cpu, jpeg_decoder
from runner.files import EncodedFolder, EncodedImage, UnreadableImage, jpeg_size
from runner.jpeg_folder import make_jpeg_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("jpegs"), classes=3, train=6, val=2)


def test_crop_boxes_are_torchvisions_random_resized_crop_draws():
    """For a seed, the box torchvision's RandomResizedCrop.get_params draws from the global generator seeded
    alike, over image shapes that take the first attempt, later attempts and the fallback (a 12x700 strip)."""
    shapes = [(375, 500), (500, 333), (224, 224), (12, 700), (700, 12), (40, 90)]
    for seed in range(400):
        height, width = shapes[seed % len(shapes)]
        torch.manual_seed(seed)
        expected = RandomResizedCrop.get_params(torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3])
        assert tuple(draw_crop(height, width, seed)[:4]) == tuple(expected), (seed, height, width)


def _ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    points = torch.cat([a, b]).sort().values
    cdf_a = torch.searchsorted(a.sort().values, points, right=True) / len(a)
    cdf_b = torch.searchsorted(b.sort().values, points, right=True) / len(b)
    return (cdf_a - cdf_b).abs().max().item()


def test_crop_areas_and_ratios_follow_torchvisions_distribution_and_flip_half():
    """Against torchvision's own draws from other seeds (so not the same boxes): the areas and aspect ratios
    pass a two-sample Kolmogorov-Smirnov test at the 1% level, and half the crops flip."""
    count, height, width = 2000, 375, 500
    crops = [draw_crop(height, width, seed) for seed in range(count)]
    torch.manual_seed(12345)
    reference = [RandomResizedCrop.get_params(torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3])]
    reference += [
        RandomResizedCrop.get_params(torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3])
        for _ in range(count - 1)
    ]
    critical = 1.63 * math.sqrt(2 / count)  # the 1% level
    for measure in (lambda h, w: h * w / (height * width), lambda h, w: math.log(w / h)):
        ours = torch.tensor([measure(c.height, c.width) for c in crops])
        theirs = torch.tensor([measure(h, w) for _, _, h, w in reference])
        assert _ks_statistic(ours, theirs) < critical
    flips = sum(c.flip for c in crops)
    assert abs(flips - count / 2) < 4 * math.sqrt(count / 4)  # binomial(count, 1/2), 4 sigma


def test_training_pixels_equal_torchvisions_reference_for_the_same_box(folder):
    """Decode + crop + resize (torch's uint8 antialiased bilinear) + flip against PIL's, the reference
    pipeline's: at most one grey level apart, 0.3 levels on average (the two kernels round differently); and
    equal to torchvision's tensor transform, v2.RandomResizedCrop's kernel, exactly."""
    files = EncodedFolder(folder / "train")
    for index in range(len(files)):
        image = files[index]
        pixels = decode_on_cpu(image)
        crop = draw_crop(*pixels.shape[-2:], seed=index)
        ours = resized_crop(pixels, crop, SIZE)
        box = (crop.top, crop.left, crop.height, crop.width)
        difference = (ours.int() - pil_reference(image.path, box, crop.flip, SIZE).int()).abs()
        assert difference.max() <= 1 and difference.float().mean() <= 0.3, image.path
        tensor_reference = v2.functional.resized_crop(pixels, *box, [SIZE, SIZE], antialias=True)
        tensor_reference = tensor_reference.flip(-1) if crop.flip else tensor_reference
        assert torch.equal(ours, tensor_reference)


def test_validation_pixels_equal_torchvisions_resize_and_center_crop(folder):
    files = EncodedFolder(folder / "val")
    for index in range(len(files)):
        image = files[index]
        ours = center_crop(decode_on_cpu(image), SIZE, round(SIZE / 0.875))
        difference = (ours.int() - pil_reference(image.path, None, False, SIZE).int()).abs()
        assert ours.shape == (3, SIZE, SIZE) and difference.max() <= 1 and difference.float().mean() <= 0.3


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU"))],
)
def test_the_batch_is_normalized_as_torchvisions_normalize_channels_last_on_cuda(device):
    images = torch.randint(0, 256, (4, 3, 9, 7), dtype=torch.uint8, device=device)
    ours = normalize(images, IMAGENET_MEAN, IMAGENET_STD)
    reference = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(images))
    assert ours.is_contiguous(
        memory_format=torch.channels_last if device == "cuda" else torch.contiguous_format
    )
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)


def test_decoding_on_the_device_gives_the_workers_batches(folder):
    """data.decode=gpu's path (bytes to the device, decoded and augmented there) run on CPU tensors: the same
    boxes from the same sample seeds, the same pixels, labels and order as the workers' path (decode=cpu)."""
    batches = {}
    for on_device in (False, True):
        module = ImageFolderDataModule(
            str(folder), batch_size=5, image_size=SIZE, num_workers=0, num_classes=3
        )
        module.setup()
        for dataset in (module.train_set, module.val_set):
            dataset.decode_on_device = on_device
        batches[on_device] = (first_batch(module), first_batch(module, validation=True))
    for (images, labels), (device_images, device_labels) in zip(batches[False], batches[True]):
        assert images.shape == (5, 3, SIZE, SIZE)
        assert torch.equal(images, device_images) and torch.equal(labels, device_labels)


@pytest.fixture
def oriented(folder, tmp_path):
    return oriented_copy(folder, tmp_path / "oriented")


def test_labels_are_imagefolders(folder):
    module = ImageFolderDataModule(str(folder), batch_size=4, image_size=SIZE, num_workers=0, num_classes=3)
    module.setup()
    reference = ImageFolder(str(folder / "val"))
    _, labels = first_batch(module, validation=True)
    assert labels.tolist() == [target for _, target in reference.samples[:4]]


@pytest.mark.parametrize("change", ["lacks", "has"])
def test_a_validation_split_with_other_classes_than_training_is_refused(folder, tmp_path, change):
    """Validation is labelled by train/'s classes: a val/ lacking one would shift every later label by one
    (val/acc against the wrong labels), one with a class train/ lacks would index past the model's outputs."""
    root = tmp_path / "data"
    shutil.copytree(folder, root)
    if change == "lacks":
        shutil.rmtree(root / "val" / "class_001")
    else:
        shutil.copytree(root / "val" / "class_002", root / "val" / "class_003")
    module = ImageFolderDataModule(str(root), batch_size=4, image_size=SIZE, num_workers=0, num_classes=3)
    expected = (
        f"{root / 'val'} lacks class_001"
        if change == "lacks"
        else f"{root / 'val'} has class_003, which {root / 'train'} lacks"
    )
    for check in (module.check_data, module.setup):
        with pytest.raises(ConfigError) as refused:
            check()
        message = str(refused.value)
        assert expected in message and f"{root / 'val'} and {root / 'train'} must hold the same" in message


def test_a_header_gives_the_size_a_decoder_finds(folder, tmp_path):
    image = Image.open(next((folder / "train").rglob("*.JPEG"))).convert("RGB")
    for options in ({}, {"progressive": True}, {"subsampling": 0, "quality": 100}):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", **options)
        assert jpeg_size(buffer.getvalue()) == (image.height, image.width)
    png = io.BytesIO()
    image.save(png, "PNG")
    assert jpeg_size(png.getvalue()) is None and jpeg_size(b"") is None


def test_the_generated_folder_is_deterministic_and_imagenet_sized(folder, tmp_path):
    again = make_jpeg_folder(tmp_path / "again", classes=3, train=6, val=2)
    files = sorted(path.relative_to(folder) for path in folder.rglob("*.JPEG"))
    assert files == sorted(path.relative_to(again) for path in again.rglob("*.JPEG")) and len(files) == 24
    for name in files:
        assert (folder / name).read_bytes() == (again / name).read_bytes()
        width, height = Image.open(folder / name).size
        assert 300 <= min(width, height) <= 375 and 400 <= max(width, height) <= 500


def test_the_folder_script_refuses_bad_arguments_before_writing_and_says_what_it_wrote(
    tmp_path, capsys, monkeypatch
):
    def script(*args: str) -> None:  # python -m runner.jpeg_folder ARGS
        monkeypatch.setattr(sys, "argv", ["jpeg_folder", *args])
        jpeg_folder.main()

    refusals = {
        ("--classes", "-2", "--train", "-3"): "--classes: -2 must be >= 1",
        ("--train", "0"): "--train: 0 must be >= 1",
        ("--val", "0"): "--val: 0 must be >= 1",
        ("--seed", "-1"): "--seed: -1 must be >= 0",  # numpy's traceback, after making train/class_000
        ("--classes", "abc"): "--classes: 'abc' is not an integer",
    }
    for argv, reason in refusals.items():
        with pytest.raises(SystemExit) as stopped:
            script(str(tmp_path / "refused"), *argv)
        assert stopped.value.code == 2 and f"error: argument {reason}" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()  # nothing written
    for name, counts in (
        ("classes", (0, 1, 1)),
        ("train", (1, -1, 1)),
        ("val", (1, 1, -1)),
        ("seed", (1, 1, 1, -1)),
    ):
        with pytest.raises(ValueError, match=f"^{name}=-?[01] must be >= "):
            make_jpeg_folder(tmp_path / "refused", *counts)
    assert not (tmp_path / "refused").exists()
    script(str(tmp_path / "data"), "--classes", "2", "--train", "2", "--val", "1")
    assert len(list((tmp_path / "data").rglob("*.JPEG"))) == 6
    assert capsys.readouterr().out.startswith(
        f"wrote 6 JPEGs to {tmp_path / 'data'}: 2 classes of 2 training"
    )
    script(str(tmp_path / "data"), "--classes", "1", "--train", "1", "--val", "1")  # over the last one
    assert "wrote 2 JPEGs" in (out := capsys.readouterr().out) and "holds 4 other file(s) from before" in out
    # The class count to set is the one the runner finds: the earlier run's class folder too, named.
    classes = len(ImageFolder(str(tmp_path / "data" / "train")).classes)
    assert "train/ holds 1 class folder(s) it did not write (class_001), which the runner reads too" in out
    assert f"data.num_classes={classes} " in out.strip().splitlines()[-1] and classes == 2


@pytest.fixture
def damaged(folder, tmp_path):
    """The generated folder with the damage ImageNet-like data has: readable oddities (CMYK, grayscale, a PNG
    named .JPEG) and unreadable files (truncated, empty)."""
    root = tmp_path / "damaged"
    shutil.copytree(folder, root)
    source = Image.open(root / "train" / "class_000" / "00000.JPEG")
    odd = root / "train" / "class_001"
    source.convert("CMYK").save(odd / "cmyk.JPEG", "JPEG")
    source.convert("L").save(odd / "gray.JPEG", "JPEG")
    source.save(odd / "png.JPEG", "PNG")
    bad = root / "train" / "class_002"
    whole = (root / "train" / "class_000" / "00001.JPEG").read_bytes()
    (bad / "truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    (bad / "empty.JPEG").write_bytes(b"")
    return root


def test_cmyk_grayscale_and_a_png_named_jpeg_decode_as_pil_reads_them(damaged):
    files = EncodedFolder(damaged / "train")
    for image in (
        files[i] for i in range(len(files)) if files[i].path.split("/")[-1][:3] in ("cmy", "gra", "png")
    ):
        ours = decode_on_cpu(image)
        reference = torch.from_numpy(np.array(Image.open(image.path).convert("RGB"))).permute(2, 0, 1)
        assert ours.shape == reference.shape and (ours.int() - reference.int()).abs().float().mean() < 2.0


FORMATS = {  # file name: how PIL writes it (each a format torchvision's ImageFolder reads)
    "bmp.bmp": lambda image, path: image.save(path, "BMP"),
    "tiff.tif": lambda image, path: image.save(path, "TIFF"),
    "tiff_lzw.tiff": lambda image, path: image.save(path, "TIFF", compression="tiff_lzw"),
    "ppm.ppm": lambda image, path: image.save(path, "PPM"),
    "pgm.pgm": lambda image, path: image.convert("L").save(path, "PPM"),
    "rgba.png": lambda image, path: image.convert("RGBA").save(path, "PNG"),
    "palette.png": lambda image, path: image.quantize(16).save(path, "PNG", transparency=0),
    "webp.webp": lambda image, path: image.save(path, "WEBP", lossless=True),
    "bmp_named.JPEG": lambda image, path: image.save(path, "BMP"),
    "animated_gif_named.JPEG": lambda image, path: image.save(
        path, "GIF", save_all=True, append_images=[image.rotate(90)]
    ),
}


@pytest.fixture
def formats(folder, tmp_path):
    """The generated folder with an image of each format in train/class_001."""
    root = tmp_path / "formats"
    shutil.copytree(folder, root)
    image = Image.open(root / "train" / "class_000" / "00000.JPEG").convert("RGB").resize((150, 110))
    for name, write in FORMATS.items():
        write(image, root / "train" / "class_001" / name)
    return root


def test_every_format_imagefolder_reads_decodes_as_its_loader_reads_it(formats):
    """By the file's format, not its name: pixels equal to torchvision's ImageFolder loader's (PIL's)."""
    files = EncodedFolder(formats / "train")
    decoded = {
        files[i].path.rsplit("/", 1)[1]: (files[i], decode_on_cpu(files[i]))
        for i in range(len(files))
        if files[i].path.rsplit("/", 1)[1] in FORMATS
    }
    assert decoded.keys() == FORMATS.keys()  # the scan lists each
    for name, (image, ours) in decoded.items():
        reference = torch.from_numpy(np.array(pil_loader(image.path))).permute(2, 0, 1)
        assert ours.dtype == torch.uint8 and torch.equal(ours, reference), name


@pytest.mark.parametrize("on_device", [False, True])
def test_a_run_trains_on_every_format_the_scan_lists(formats, on_device):
    module = ImageFolderDataModule(str(formats), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3)
    module.setup()
    module.train_set.decode_on_device = on_device
    images, labels = first_batch(module)
    assert len(images) == len(module.train_set) == 18 + len(FORMATS)
    assert torch.bincount(labels).tolist() == [6, 6 + len(FORMATS), 6] and torch.isfinite(images).all()


@pytest.mark.parametrize("on_device", [False, True])
def test_unreadable_files_stop_the_run_naming_each(damaged, on_device):
    module = ImageFolderDataModule(str(damaged), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3)
    module.setup()
    module.train_set.decode_on_device = on_device
    with pytest.raises(UnreadableImagesError) as refused:
        first_batch(module)
    message = str(refused.value)
    assert (
        "2 file(s)" in message
        and "truncated.JPEG: " in message
        and "empty.JPEG: the file is empty" in message
    )
    assert "data.skip_unreadable=true" in message


@pytest.mark.parametrize("on_device", [False, True])
def test_skipped_unreadable_files_are_counted_and_leave_the_other_labels_right(damaged, on_device):
    module = ImageFolderDataModule(
        str(damaged), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3, skip_unreadable=True
    )
    module.setup()
    module.train_set.decode_on_device = on_device
    with pytest.warns(UserWarning, match=r"left out .*(truncated|empty)\.JPEG"):
        images, labels = first_batch(module)
    assert sorted(path.rsplit("/", 1)[1] for path in module.unreadable) == ["empty.JPEG", "truncated.JPEG"]
    assert len(images) == len(labels) == len(module.train_set) - 2
    # Every kept image carries its folder's label: the counts per class are the folder's.
    assert torch.bincount(labels).tolist() == [6, 6 + 3, 6]


@pytest.mark.parametrize("on_device", [False, True])
def test_a_batch_whose_every_file_is_unreadable_is_empty_not_a_crash(folder, tmp_path, on_device):
    root = tmp_path / "data"
    shutil.copytree(folder, root)
    for path in (root / "val" / "class_000").iterdir():  # validation's first batch, in its sequential order
        path.write_bytes(b"")
    module = ImageFolderDataModule(
        str(root), batch_size=2, image_size=SIZE, num_workers=0, num_classes=3, skip_unreadable=True
    )
    module.setup()
    module.val_set.decode_on_device = on_device
    with pytest.warns(UserWarning, match="left out"):
        images, labels = first_batch(module, validation=True)
    assert images.shape == (0, 3, SIZE, SIZE) and labels.shape == (0,) and len(module.unreadable) == 2


def test_a_file_met_again_is_counted_and_warned_once_on_any_rank(damaged, monkeypatch):
    """Each epoch meets the same unreadable files: they are counted and warned about once, by whichever rank
    reads them (each rank reads its own share, so rank 0 alone would not name them all)."""
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    module = ImageFolderDataModule(
        str(damaged), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3, skip_unreadable=True
    )
    module.setup()
    with pytest.warns(UserWarning, match="left out") as warned:
        for _ in range(2):  # two epochs
            first_batch(module)
    left_out = [w for w in warned if "left out" in str(w.message)]
    assert len(left_out) == 2
    # Said from the DataModule's hook that leaves them out, not its caller (Lightning's call.py in a run).
    assert {(w.filename, w.lineno) for w in left_out} == {
        (runner.image_folder.__file__, _line_leaving_files_out())
    }
    assert sorted(module.unreadable) == sorted(
        str(p) for p in (damaged / "train" / "class_002").glob("[et]*")
    )
    assert module.files_report()["unreadable_files"] == module.unreadable
    assert (
        module.unreadable[str(damaged / "train" / "class_002" / "empty.JPEG")]
        == "the file is empty (0 bytes)"
    )


def _line_leaving_files_out() -> int:
    """The line of the DataModule's on_after_batch_transfer that records and warns about a file left out."""
    source = inspect.getsource(ImageFolderDataModule.on_after_batch_transfer).splitlines()
    start = inspect.getsourcelines(ImageFolderDataModule.on_after_batch_transfer)[1]
    return start + next(i for i, line in enumerate(source) if "self._note(self.unreadable" in line)


def test_an_unreadable_file_in_a_loader_worker_is_named_not_a_worker_traceback(damaged):
    module = ImageFolderDataModule(str(damaged), batch_size=64, image_size=SIZE, num_workers=1, num_classes=3)
    module.setup()
    with pytest.raises(UnreadableImagesError, match="truncated.JPEG"):
        first_batch(module)


@pytest.mark.parametrize(("num_workers", "on_device"), [(0, False), (0, True), (1, False), (1, True)])
def test_a_file_that_cannot_be_opened_travels_as_the_other_unreadable_files(
    folder, tmp_path, num_workers, on_device
):
    """A link to a missing file (listed by the scan): named with its cause, refused, or left out and counted
    under skip_unreadable; never a loader worker's FileNotFoundError."""
    root = tmp_path / "data"
    shutil.copytree(folder, root)
    link = root / "train" / "class_001" / "link.JPEG"
    link.symlink_to(tmp_path / "moved.JPEG")
    for skip in (False, True):
        module = ImageFolderDataModule(
            str(root), batch_size=64, image_size=SIZE, num_workers=num_workers, num_classes=3,
            skip_unreadable=skip,
        )  # fmt: skip
        module.setup()
        module.train_set.decode_on_device = on_device
        if not skip:
            reason = f"cannot be read: No such file or directory \\(a link to {tmp_path / 'moved.JPEG'}\\)"
            with pytest.raises(UnreadableImagesError, match=f"{link}: {reason}"):
                first_batch(module)
            continue
        with pytest.warns(UserWarning, match="left out .*link.JPEG"):
            images, labels = first_batch(module)
        assert list(module.unreadable) == [str(link)]
        assert len(images) == 18 and torch.bincount(labels).tolist() == [6, 6, 6]


def test_a_link_that_cannot_be_opened_is_named_with_the_oss_cause(folder, tmp_path):
    """A missing target, a loop of links, a link to a link whose target is missing: each is the OS's own cause
    (every one was "which does not exist", a loop's and a chain's next link too)."""
    root = tmp_path / "links"
    shutil.copytree(folder / "train", root)
    links = root / "class_000"
    (links / "dangling.JPEG").symlink_to(tmp_path / "moved.JPEG")
    (links / "loop.JPEG").symlink_to(links / "loop_back.JPEG")
    (links / "loop_back.JPEG").symlink_to(links / "loop.JPEG")
    (links / "hop.JPEG").symlink_to(tmp_path / "moved.JPEG")
    (links / "chain.JPEG").symlink_to(links / "hop.JPEG")  # its next link exists; that one's target does not
    causes = {"dangling": errno.ENOENT, "loop": errno.ELOOP, "loop_back": errno.ELOOP, "chain": errno.ENOENT}
    files = EncodedFolder(root)
    reasons = {}
    for index, (path, _) in enumerate(files.samples):
        try:
            files[index]
        except UnreadableImage as unreadable:
            reasons[os.path.basename(path).removesuffix(".JPEG")] = unreadable.reason
    assert reasons == {
        name: f"cannot be read: {os.strerror(cause)} (a link to {os.readlink(links / f'{name}.JPEG')})"
        for name, cause in {**causes, "hop": errno.ENOENT}.items()
    }


def test_an_unreadable_files_reason_is_its_cause(folder, tmp_path, monkeypatch):
    jpeg = (folder / "train" / "class_000" / "00000.JPEG").read_bytes()
    png = io.BytesIO()
    Image.open(folder / "train" / "class_000" / "00000.JPEG").save(png, "PNG")
    files = {
        "truncated.JPEG": jpeg[: len(jpeg) // 2],
        "text.JPEG": b"This is no image, and it says so.",
        "truncated.png": png.getvalue()[: len(png.getvalue()) // 2],
    }
    reasons = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        image = EncodedImage(str(tmp_path / name), torch.frombuffer(bytearray(data), dtype=torch.uint8), 0)
        with pytest.raises(UnreadableImage) as refused:
            decode_on_cpu(image)
        reasons[name] = refused.value.reason
    assert reasons["truncated.JPEG"].startswith("Image is incomplete or truncated")  # libjpeg-turbo's words
    assert reasons["text.JPEG"] == (
        "not an image PIL or the JPEG decoder reads (the file starts with b'This is ')"
    )
    assert reasons["truncated.png"].startswith("image file is truncated")  # PIL's
    # A decoder's message is whole, commas included, without the place in its source.
    message = "decode_rows, /src/torchcodec/_core/DecodeJpeg.cpp:287, Corrupt data, marker 0xD9 found"
    monkeypatch.setattr(
        runner.decode, "jpeg_decoder", lambda: JpegDecoder("stub", _raises(message), _raises(message))
    )
    image = EncodedImage("corrupt.JPEG", torch.frombuffer(bytearray(jpeg), dtype=torch.uint8), 0)
    with pytest.raises(UnreadableImage, match=r"^corrupt.JPEG: Corrupt data, marker 0xD9 found$"):
        decode_on_cpu(image)


def _raises(message: str):
    def decode(*args, **kwargs):
        raise RuntimeError(message)

    return decode


@pytest.mark.parametrize("views", [None, "simclr"])
@pytest.mark.parametrize("splits", [("val",), ("train", "val")])
def test_an_empty_class_folder_is_refused_in_one_message_naming_it(folder, tmp_path, views, splits):
    """Every empty class folder is named in the one message, those of both splits (the training split's
    alone was named, and the validation's only once that was fixed)."""
    root = tmp_path / "data"
    shutil.copytree(folder, root)
    empty = [root / split / "class_001" for split in splits]
    for path in (path for folder in empty for path in folder.iterdir()):
        path.rename(path.with_suffix(".txt"))  # a file of no image extension: the scan lists none
    module = ImageFolderDataModule(
        str(root), image_size=SIZE, num_workers=0, num_classes=3, views=SimCLRTransform() if views else None
    )
    named = ", ".join(map(str, empty))
    with pytest.raises(
        ConfigError, match=rf"^{len(empty)} class folder\(s\) hold no image file .*: {named}; add"
    ):
        module.setup()


@pytest.mark.parametrize(
    ("build", "key"),
    [
        pytest.param(
            lambda **k: ImageFolderDataModule(num_classes=3, **k), "image_size", id="folder-image_size"
        ),
        pytest.param(DigitsDataModule, "image_size", id="digits-image_size"),
        pytest.param(CIFAR10DataModule, "image_size", id="cifar10-image_size"),
        pytest.param(SyntheticDataModule, "image_size", id="synthetic-image_size"),
        pytest.param(SyntheticDataModule, "train_samples", id="synthetic-train_samples"),
        pytest.param(SyntheticDataModule, "val_samples", id="synthetic-val_samples"),
        pytest.param(DigitsDataModule, "batch_size", id="digits-batch_size"),
        pytest.param(DigitsDataModule, "num_workers", id="digits-num_workers"),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(build, key):
    value = -1 if key == "num_workers" else 0
    with pytest.raises(ConfigError, match=rf"^data.{key}={value} must be >= {value + 1}"):
        build(**{key: value})


def test_a_digits_val_fraction_outside_zero_and_one_is_refused():
    for fraction in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match=f"data.val_fraction={fraction} must be between 0 and 1"):
            DigitsDataModule(val_fraction=fraction)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_simclrs_views_stop_at_a_file_that_cannot_be_read_naming_it(damaged, tmp_path, num_workers):
    """With a view transform the workers read PIL images: a truncated or empty file and a link to a missing
    file are named in one message, never a loader worker's traceback; skipping them is refused (SimCLR's
    batches stay whole)."""
    link = damaged / "train" / "class_000" / "link.JPEG"
    link.symlink_to(tmp_path / "moved.JPEG")
    module = ImageFolderDataModule(
        str(damaged), batch_size=64, image_size=SIZE, num_workers=num_workers, num_classes=3,
        views=SimCLRTransform(input_size=SIZE),
    )  # fmt: skip
    module.setup()
    with pytest.raises(UnreadableImagesError) as refused:
        first_batch(module)
    message = str(refused.value)
    assert message.startswith("3 file(s) of the data cannot be read or decoded")
    assert f"{link}: cannot be read: " in message and "empty.JPEG: the file is empty" in message
    assert "truncated.JPEG: image file is truncated" in message
    # The fix offered is one that works with views: skipping the files is refused there.
    assert message.endswith("remove or re-encode them (with data.views they cannot be left out: SimCLR's "
                            "batches stay whole)") and "skip_unreadable" not in message  # fmt: skip
    with pytest.raises(ConfigError, match="data.skip_unreadable=true with data.views: SimCLR's batches stay"):
        ImageFolderDataModule(str(damaged), num_classes=3, skip_unreadable=True, views=SimCLRTransform())


def test_a_root_under_the_home_folder_is_read_there(folder, tmp_path, monkeypatch):
    """data.root='~/...': the checks expanded it, the scan did not (FileNotFoundError: '~/data/train')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(folder, tmp_path / "data")
    module = ImageFolderDataModule("~/data", batch_size=4, image_size=SIZE, num_workers=0, num_classes=3)
    module.setup()
    assert module.train_set.files.root == str(tmp_path / "data" / "train")
    assert len(first_batch(module)[0]) == 4
    assert CIFAR10DataModule(root="~/cifar").root == str(tmp_path / "cifar")


def test_decode_gpu_on_a_cpu_run_is_refused_with_the_fix(folder):
    module = ImageFolderDataModule(str(folder), num_classes=3, decode="gpu")
    with pytest.raises(ConfigError, match="data.decode=gpu .* use data.decode=cpu"):
        module.setup()
    with pytest.raises(ConfigError, match="data.decode='jpeg': choose auto, gpu or cpu"):
        ImageFolderDataModule(str(folder), num_classes=3, decode="jpeg")


def test_synthetic_batches_come_from_a_seeded_uint8_pool_normalized_on_the_device():
    module = SyntheticDataModule(
        batch_size=4, image_size=8, num_classes=3, in_channels=2, pool_size=5, seed=1
    )
    module.setup()
    indices = next(iter(module.train_dataloader()))
    assert indices.dtype == torch.long and indices.shape == (4,)  # the loader carries indices only
    images, labels = module.on_after_batch_transfer(indices, 0)
    pool = module._pools[True]
    assert pool.images.dtype == torch.uint8 and pool.images.shape == (5, 2, 8, 8)
    rows = indices % 5
    assert torch.equal(labels, pool.labels[rows]) and labels.max() < 3
    expected = (pool.images[rows].float() / 255 - 0.5) / (((256**2 - 1) / 12) ** 0.5 / 255)
    torch.testing.assert_close(images, expected)
    again = SyntheticDataModule(batch_size=4, image_size=8, num_classes=3, in_channels=2, pool_size=5, seed=1)
    again.setup()
    assert torch.equal(again._pools[True].images, pool.images)
    assert not torch.equal(again._pools[False].images, pool.images)  # validation: its own images


@pytest.fixture
def fresh_choice():
    """jpeg_decoder() chooses afresh in the test (whatever it patches) and again after it."""
    jpeg_decoder.cache_clear()
    yield
    jpeg_decoder.cache_clear()


def _batches(root, on_device: bool) -> tuple:
    module = ImageFolderDataModule(str(root), batch_size=6, image_size=SIZE, num_workers=0, num_classes=3)
    module.setup()
    for dataset in (module.train_set, module.val_set):
        dataset.decode_on_device = on_device
    return first_batch(module), first_batch(module, validation=True)


@pytest.mark.parametrize("on_device", [False, True])
def test_where_torchcodec_does_not_load_torchvisions_decoders_give_the_same_batches(
    oriented, monkeypatch, fresh_choice, on_device
):
    """TorchCodec's image decoders need torch 2.11+, the library torch 2.6+: torchvision's own (CPU and
    nvJPEG) decode instead, the same pixels on either path (EXIF orientations included), without their
    deprecation warning."""
    assert jpeg_decoder().name.startswith("TorchCodec")
    expected = _batches(oriented, on_device)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)  # what a failed import leaves
    jpeg_decoder.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert jpeg_decoder().name.startswith("torchvision")
        batches = _batches(oriented, on_device)
    for (images, labels), (expected_images, expected_labels) in zip(batches, expected):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


def test_where_no_decoder_works_an_image_folder_stops_at_setup_with_the_fix(
    folder, monkeypatch, fresh_choice
):
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    module = ImageFolderDataModule(str(folder), num_classes=3, num_workers=0)
    with pytest.raises(
        ConfigError, match="needs TorchCodec or torchvision's image decoders.*pip install torchcodec"
    ):
        module.setup()


def _on_a_gpu(module: ImageFolderDataModule) -> ImageFolderDataModule:
    """``module`` as Lightning sets it up for a run on the first GPU (the device decode is a stub's)."""
    module.trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), global_rank=0
    )
    return module


def _decoder_whose_device(refuses) -> Callable[[], JpegDecoder]:
    """A JPEG decoder whose device decode ``refuses(batch)`` (raising as nvJPEG does), or decodes on the
    CPU."""
    real = runner.decode._torchcodec()

    def on_device(batch, device):
        if refuses(batch):
            raise RuntimeError(
                "decode_jpegs_cuda, /src/DecodeJpeg.cpp:42, nvJPEG is not available in this build"
            )
        return real.on_device(batch, torch.device("cpu"))

    return lambda: JpegDecoder("stub", real.on_cpu, on_device)


@pytest.mark.parametrize("works", [True, False])
def test_auto_tries_the_device_decode_once_and_says_which_decoder_runs_where(
    folder, monkeypatch, fresh_choice, caplog, works
):
    monkeypatch.setattr(runner.decode, "_torchcodec", _decoder_whose_device(lambda batch: not works))
    module = _on_a_gpu(ImageFolderDataModule(str(folder), num_classes=3, num_workers=0, decode="auto"))
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        module.setup()
    said = caplog.text
    assert module.train_set.decode_on_device is module.val_set.decode_on_device is works
    if works:
        assert "data.decode=auto: stub decodes the JPEGs on cuda:0, a batch a call" in said and not warned
    else:
        assert [str(w.message) for w in warned] == [
            "data.decode=auto: stub cannot decode JPEGs on cuda:0 (stub on cuda:0: nvJPEG is not available "
            "in this build)"
        ]
        assert "data.decode=auto: the loader workers decode on the CPU (stub for JPEGs, PIL" in said


def test_decode_gpu_where_the_device_cannot_decode_is_refused_with_the_fix(folder, monkeypatch, fresh_choice):
    monkeypatch.setattr(runner.decode, "_torchcodec", _decoder_whose_device(lambda batch: True))
    module = _on_a_gpu(ImageFolderDataModule(str(folder), num_classes=3, num_workers=0, decode="gpu"))
    with pytest.raises(
        ConfigError, match=r"data.decode=gpu: stub cannot decode JPEGs on cuda:0 \(.*use data"
    ):
        module.setup()


def test_a_jpeg_the_device_refuses_in_training_is_decoded_on_the_cpu_counted_and_warned_once(
    damaged, monkeypatch, fresh_choice
):
    """nvJPEG refusing a JPEG (CMYK, say) costs the batch a call per image and that image a CPU decode in the
    training process: it is warned about once, counted for the summary, and its pixels are the CPU path's."""
    cmyk = torch.frombuffer(
        bytearray((damaged / "train" / "class_001" / "cmyk.JPEG").read_bytes()), dtype=torch.uint8
    )
    refuses = lambda batch: any(data.numel() == cmyk.numel() and torch.equal(data, cmyk) for data in batch)  # noqa: E731
    monkeypatch.setattr(runner.decode, "_torchcodec", _decoder_whose_device(refuses))
    batches = {}
    for on_device in (False, True):
        module = ImageFolderDataModule(
            str(damaged), batch_size=64, image_size=SIZE, num_workers=0, num_classes=3, skip_unreadable=True
        )
        module.setup()
        module.train_set.decode_on_device = on_device
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            batches[on_device] = [first_batch(module) for _ in range(2)]  # two epochs
        notes = [str(w.message) for w in warned if "decoded on the CPU" in str(w.message)]
        if on_device:
            path = str(damaged / "train" / "class_001" / "cmyk.JPEG")
            assert module.decoded_on_host == {path: "stub on cpu: nvJPEG is not available in this build"}
            assert notes == [f"decoded on the CPU {path}: stub on cpu: nvJPEG is not available in this build "
                             "(1 such file(s) so far)"]  # fmt: skip
            assert module.files_report()["host_decoded_files"] == module.decoded_on_host
        else:
            assert not module.decoded_on_host and not notes
    for (images, labels), (device_images, device_labels) in zip(batches[False], batches[True]):
        assert torch.equal(images, device_images) and torch.equal(labels, device_labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu_check.sh runs it")
def test_the_cuda_path_decodes_and_augments_as_the_cpu_path(folder):
    """nvJPEG's batch against libjpeg-turbo, and the crops resized in float on the GPU against the CPU's
    uint8 kernel: the same boxes, pixels within 3 levels at most and 0.5 on average (IDCTs and rounding)."""
    batches = {}
    for device in ("cpu", "cuda"):
        module = ImageFolderDataModule(
            str(folder), batch_size=6, image_size=SIZE, num_workers=0, num_classes=3
        )
        module.setup()
        module.train_set.decode_on_device = device == "cuda"
        batches[device] = module.on_after_batch_transfer(next(iter(module.train_dataloader())).to(device), 0)
    (cpu_images, cpu_labels), (cuda_images, cuda_labels) = batches["cpu"], batches["cuda"]
    assert cuda_images.is_cuda and cuda_images.is_contiguous(memory_format=torch.channels_last)
    levels = (cuda_images.cpu() - cpu_images).abs() * 255 * max(IMAGENET_STD)
    assert levels.max() <= 3 and levels.mean() <= 0.5 and torch.equal(cuda_labels.cpu(), cpu_labels)
