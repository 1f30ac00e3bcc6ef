"""Images per second of the recipes' input pipeline (on the CPU) and of their training runs (on a GPU).

CPU (the default): the input pipeline alone, in one thread (images/s per core), on the generated JPEG folder
(``python -m runner.jpeg_folder``): ours as a loader worker runs it with ``data.decode=cpu`` (read the bytes,
decode with TorchCodec, the per-image random resized crop and flip, uint8 at 224; the batch is normalized on
the training device), ours with that normalization done on the CPU too, against torchvision's reference
pipeline (``ImageFolder`` + PIL ``RandomResizedCrop``, flip, ``ToTensor``, ``Normalize``). Passes over the
same images, interleaved; medians. Writes ``bench/results/recipe_throughput.json``.

The read row: what a loader worker does with ``data.decode=gpu`` (each file's bytes read, the crop drawn from
its JPEG header, handed on to the device's decode), in bytes per second per core, from the folder and from the
same folder converted to shards (``python -m runner.shards``, chunks of 2 MB so that, as ImageNet's 64 MB ones
do, nearly every next sample of a shuffled order lies in another chunk); the files in a shuffled order, passes
interleaved, medians. ``--read`` runs it alone and prints it, writing nothing.

``--gpu``: ``python train.py recipe=resnet50`` (batch 256 per GPU, bf16-mixed) on synthetic data and on the
generated folder (``data.decode=gpu`` and ``cpu``) and on its shards (``data=imagenet_shards``,
``data.decode=gpu``), each run's ``train/images_per_sec`` over its last 20
steps, against the bare training step (ResNet-50, batch 256, bf16 autocast, channels-last, FusedSGD) eager and
with ``torch.compile``. Each row is written as it is measured (``recipe_throughput_gpu.json``), so a deadline
that stops the script keeps the rows before it. ``bench/gpu_check.sh`` runs it.

Usage: ``python bench/recipe_throughput.py [--images 240] [--repeats 7] [--read] [--gpu [ROW ...]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, machine_info, time_interleaved, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the recipe runner sits beside train.py, in the checkout, not installed

from runner.augment import normalize  # noqa: E402
from runner.data import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from runner.files import EncodedFolder, SplitFiles  # noqa: E402
from runner.image_pipeline import FolderSamples  # noqa: E402
from runner.jpeg_folder import make_jpeg_folder  # noqa: E402
from runner.shard_files import ShardedFiles  # noqa: E402
from runner.shards import convert  # noqa: E402

SIZE = 224
GPU_ROWS = ("bare", "compiled", "synthetic", "decode=gpu", "shards", "decode=cpu")
READ_CHUNK = "2MB"  # ~30 of the generated JPEGs a chunk
READ_PASSES = 5  # the read row's passes per repeat: a pass is ~25 ms, and one median of 7 swung 0.96-1.18x


def _ours(folder: Path, count: int, normalize_here: bool):
    samples = FolderSamples(EncodedFolder(folder), SIZE, decode_on_device=False)

    def one_pass() -> None:
        batch = []
        for index in range(count):
            batch.append(samples[(index, index)][0])
            if normalize_here and len(batch) == 32:
                normalize(torch.stack(batch), IMAGENET_MEAN, IMAGENET_STD)
                batch = []

    return one_pass


def _torchvision_reference(folder: Path, count: int):
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(
        str(folder),
        transforms.Compose(
            [
                transforms.RandomResizedCrop(SIZE),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
    )

    def one_pass() -> None:
        for index in range(count):
            dataset[index]

    return one_pass


def _read_stage(files: SplitFiles, order: list[int]):
    """A loader worker's work with ``data.decode=gpu``, each file of ``order`` in turn: its bytes read and the
    crop drawn from its JPEG header, handed on (to the device's decode). A pass returns the bytes it hands
    on."""
    samples = FolderSamples(files, SIZE, decode_on_device=True)

    def one_pass() -> int:
        return sum(len(samples[(index, index)][0].image.data) for index in order)

    return one_pass


def read_row(folder: SplitFiles, shards: SplitFiles, order: list[int], repeats: int) -> dict[str, object]:
    """Bytes per second per core of the read stage (one thread: the caller's), the files ``order`` names
    (JPEGs), from a training folder and from its shards."""
    contenders = {"folder": _read_stage(folder, order), "shards": _read_stage(shards, order)}
    handed_on = {name: one_pass() for name, one_pass in contenders.items()}  # warm up: the page cache
    if len(set(handed_on.values())) != 1:
        raise RuntimeError(f"the folder and its shards handed on other bytes: {handed_on}")
    size = handed_on["folder"]
    rates = {name: size / median for name, median in time_interleaved(contenders, repeats, warmup=0).items()}
    for name, rate in rates.items():
        print(
            f"read for the decode stage, {name}: {rate / 1e6:.0f} MB/s per core "
            f"({rate / rates['folder']:.2f}x the folder)",
            flush=True,
        )
    return {
        "images": len(order),
        "bytes": size,
        "repeats": repeats,
        "chunk_bytes": READ_CHUNK,
        "bytes_per_s": rates,
    }


def cpu_pipeline(images: int, repeats: int, read_only: bool = False) -> dict[str, object]:
    """The CPU rows (``read_only``: the read row alone) on a generated folder of ``images`` training JPEGs."""
    torch.set_num_threads(1)  # images/s per core: one thread, as one loader worker
    with tempfile.TemporaryDirectory() as directory:
        classes = 8
        # One validation image a class: the shards' conversion takes both splits.
        root = make_jpeg_folder(
            Path(directory) / "folder", classes=classes, train=-(-images // classes), val=1
        )
        folder = root / "train"
        count = min(images, len(EncodedFolder(folder)))
        shards = Path(directory) / "shards"
        convert(shards, root, workers=1, chunk_bytes=READ_CHUNK)
        order = torch.randperm(
            count, generator=torch.Generator().manual_seed(0)
        ).tolist()  # shuffled, as an epoch
        read = read_row(
            EncodedFolder(folder), ShardedFiles(str(shards), "train"), order, repeats * READ_PASSES
        )
        if read_only:
            return {"read": read}
        contenders = {
            "ours (uint8, normalized on the device)": _ours(folder, count, normalize_here=False),
            "ours, normalized on the CPU": _ours(folder, count, normalize_here=True),
            "torchvision reference (PIL)": _torchvision_reference(folder, count),
        }
        # One warm-up pass each: the files in the page cache, the decoders loaded.
        medians = time_interleaved(contenders, repeats, warmup=1)
    rates = {name: count / median for name, median in medians.items()}
    reference = rates["torchvision reference (PIL)"]
    for name, rate in rates.items():
        print(f"{name}: {rate:.0f} images/s per core ({rate / reference:.2f}x the reference)", flush=True)
    return {"images": count, "repeats": repeats, "size": SIZE, "images_per_s": rates, "read": read}


def _bare_step(compiled: bool, steps: int = 30, warmup: int = 10) -> float:
    import torchvision

    from lightning_fusedsgd import FusedSGD

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    forward = torch.compile(model) if compiled else model
    images = torch.randn(256, 3, SIZE, SIZE, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(1000, (256,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return 256 * steps / (time.perf_counter() - start)


def _train_py(overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as directory:
        command = [
            sys.executable,
            "train.py",
            "recipe=resnet50",
            "data.batch_size=256",
            "trainer.precision=bf16-mixed",
            "trainer.devices=1",
            "trainer.max_steps=60",
            "trainer.max_epochs=-1",
            "trainer.limit_val_batches=0",
            "callbacks.checkpoint=null",
            "callbacks.last_checkpoint=null",
            "callbacks.step_checkpoint=null",
            "+trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false",
            *overrides,
            f"hydra.run.dir={directory}",
        ]
        subprocess.run(command, cwd=ROOT, check=True)
        return json.loads((Path(directory) / "metrics.json").read_text())["metrics"]["train/images_per_sec"]


def gpu_rows(rows: list[str], folder: Path, shards: Path) -> None:
    path = RESULTS_DIR / "recipe_throughput_gpu.json"
    result: dict[str, object] = {"machine": machine_info(), "images_per_s": {}}
    workers = str(min(12, os.cpu_count() or 1))
    folder_run = [f"data.root={folder}", "data.num_classes=20", f"data.num_workers={workers}"]
    shards_run = ["data=imagenet_shards", f"data.root={shards}", *folder_run[1:]]
    runs = {
        "bare": lambda: _bare_step(compiled=False),
        "compiled": lambda: _bare_step(compiled=True),
        "synthetic": lambda: _train_py(["data=synthetic", "data.train_samples=20480", "data.num_workers=2"]),
        "decode=gpu": lambda: _train_py([*folder_run, "data.decode=gpu"]),
        "shards": lambda: _train_py([*shards_run, "data.decode=gpu"]),
        "decode=cpu": lambda: _train_py([*folder_run, "data.decode=cpu"]),
    }
    for row in rows:
        rate = runs[row]()
        result["images_per_s"][row] = rate  # type: ignore[index]
        print(f"{row}: {rate:.0f} images/s", flush=True)
        RESULTS_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=240, help="images per pass (the CPU pipeline)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--read", action="store_true", help="only the read row, folder against shards (printed, not written)"
    )
    parser.add_argument("--gpu", nargs="*", choices=GPU_ROWS, help="the GPU rows to run (none named: all)")
    parser.add_argument(
        "--folder", type=Path, default=ROOT / "data" / "jpeg_folder", help="the --gpu rows' data"
    )
    parser.add_argument(
        "--shards",
        type=Path,
        default=ROOT / "data" / "jpeg_shards",
        help="the shards row's data: --folder converted, where absent",
    )
    args = parser.parse_args()
    if args.read:
        cpu_pipeline(args.images, args.repeats, read_only=True)
        return
    if args.gpu is None:
        print(f"wrote {write_json('recipe_throughput', cpu_pipeline(args.images, args.repeats))}")
        return
    if not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device")
    if not (args.folder / "train").is_dir():  # 20 classes x 100: 2,000 training images, ~130 MB
        make_jpeg_folder(args.folder, classes=20, train=100, val=5)
    rows = args.gpu or list(GPU_ROWS)
    if "shards" in rows and not (args.shards / "val" / "index.json").is_file():
        convert(args.shards, args.folder, workers=os.cpu_count() or 1)
    gpu_rows(rows, args.folder, args.shards)


if __name__ == "__main__":
    main()
