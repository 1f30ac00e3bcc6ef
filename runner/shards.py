"""Converting an image folder (ImageNet's layout) to litdata shards, once:
``python -m runner.shards OUT --from FOLDER [--workers N] [--chunk-bytes 64MB]``.

Each split (``FOLDER/train``, ``FOLDER/val``) becomes ``OUT/train`` and ``OUT/val``: chunks holding each
file's original bytes, its label (ImageFolder's) and its path, in ImageFolder's order (``runner.shard_files``
reads them; ``data=imagenet_shards data.root=OUT`` trains on them). The workers read the files in parallel,
each a contiguous slice of the split, with litdata's progress bar and checkpoints: a conversion interrupted is
resumed by running the same command again (with the same ``--workers``). A file that cannot be read is stored
with the reason the folder's reader gives, and training reports it as the folder's run would
(``data.skip_unreadable``). At the end every split is checked against the folder: each chunk the index lists
is on disk at its size and no other, and sample ``i`` has the folder's file ``i``'s path and label, so the
sample and per-class counts are the folder's."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout, as for train.py

from torch.utils.data import DataLoader, Dataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lightning_fusedsgd.lightning import ConfigError  # noqa: E402
from runner.files import EncodedFolder, UnreadableImage  # noqa: E402
from runner.image_folder import ImageFolderDataModule, class_folders  # noqa: E402
from runner.shard_files import ShardedFiles, litdata  # noqa: E402

__all__ = ["ShardsMismatchError", "check_shards", "convert", "train_command"]

SPLITS = ("train", "val")
TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
IMAGENET_CLASSES = 1000  # data=imagenet_shards's data.num_classes
_CHECKPOINTS = ".checkpoints"  # litdata's checkpoints of a conversion in progress


class ShardsMismatchError(ConfigError):
    """Shards that do not hold what the folder does: each difference named."""


class _Record:
    """What a conversion worker makes of the folder's sample ``index`` (a picklable callable)."""

    def __init__(self, files: EncodedFolder, folder: Path) -> None:
        self.files = files
        self.folder = folder

    def __call__(self, index: int) -> tuple[bytes, int, bytes, bytes]:
        path, label = self.files.samples[index]
        data, unreadable = b"", ""
        try:
            data = self.files[index].data.numpy().tobytes()
        except UnreadableImage as error:  # a worker that raises stops litdata's conversion without end
            unreadable = error.reason
        relative = os.path.relpath(path, self.folder)
        return data, label, relative.encode("utf-8"), unreadable.encode("utf-8")  # shard_files.FIELDS


def _state(split: Path) -> str:
    """``done`` (converted), ``interrupted`` (litdata's checkpoints of a conversion), ``empty`` (nothing yet)
    or ``other`` (files of something else)."""
    if (split / _CHECKPOINTS / "config.json").is_file():
        return "interrupted"
    if (split / "index.json").is_file():
        return "done"
    held = [path for path in split.iterdir() if path.name != _CHECKPOINTS] if split.is_dir() else []
    return "other" if held else "empty"


def _split_files(folder: Path) -> dict[str, EncodedFolder]:
    """The folder's splits, checked as the folder's DataModule checks them (layout, classes, no empty one)."""
    module = ImageFolderDataModule(str(folder), num_classes=max(len(class_folders(folder / "train")), 1))
    return dict(zip(SPLITS, module.split_files()))


def convert(out: str | Path, folder: str | Path, workers: int, chunk_bytes: str = "64MB") -> dict[str, int]:
    """Writes ``folder``'s splits to ``out`` as shards (resuming an interrupted conversion), then checks them
    (:func:`check_shards`). Returns each split's sample count.

    Raises:
        ConfigError: the folder is no image folder, ``out`` holds something else, or an interrupted
            conversion ran with other workers (before anything is written); ShardsMismatchError: the check.
    """
    out, folder = Path(out).expanduser().resolve(), Path(folder).expanduser().resolve()
    files = _split_files(folder)
    states = {split: _state(out / split) for split in SPLITS}
    for split, state in states.items():
        if state == "other":
            raise ConfigError(
                f"{out / split} holds files that are neither shards nor an interrupted conversion: give OUT "
                "an empty or new folder"
            )
        if state == "interrupted":
            config = json.loads((out / split / _CHECKPOINTS / "config.json").read_text())
            if config["num_workers"] != workers:
                raise ConfigError(
                    f"{out / split} holds a conversion interrupted with {config['num_workers']} workers: "
                    f"resume it with --workers {config['num_workers']}, or delete {out / split} to start over"
                )
    start = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    for split in SPLITS:
        if states[split] == "done":
            print(f"{out / split}: converted already; checking it")
            continue
        litdata().optimize(
            _Record(files[split], folder),
            list(range(len(files[split]))),
            str(out / split),
            chunk_bytes=chunk_bytes,
            num_workers=workers,
            start_method=start,  # the workers need only the file list: no module imported again
            use_checkpoint=True,  # resumable; and each worker converts a contiguous slice, in order
            keep_data_ordered=True,
        )
    return {split: check_shards(out, split, files[split], folder, workers) for split in SPLITS}


class _Labels(Dataset):
    def __init__(self, shards: ShardedFiles) -> None:
        self.shards = shards

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> tuple[str, int, str]:
        return self.shards.record(index)


def check_shards(out: Path, split: str, files: EncodedFolder, folder: Path, workers: int = 0) -> int:
    """That ``out/split`` holds ``folder``'s split ``files``: each chunk its index lists on disk at its size
    and no other chunk, and sample ``i`` the folder's file ``i`` (its path and label). Prints what it holds.
    Returns the sample count.

    Raises:
        ShardsMismatchError: a difference, named (with the per-class counts where they differ).
    """
    index = json.loads((out / split / "index.json").read_text())
    listed = {chunk["filename"]: chunk["chunk_bytes"] for chunk in index["chunks"]}
    on_disk = {path.name: path.stat().st_size for path in (out / split).glob("chunk-*.bin")}
    problems = [f"chunk {name} is missing" for name in sorted(set(listed) - set(on_disk))]
    problems += [f"chunk {name} is not in index.json" for name in sorted(set(on_disk) - set(listed))]
    problems += [
        f"chunk {name} holds {on_disk[name]} bytes, index.json says {size}"
        for name, size in sorted(listed.items())
        if name in on_disk and on_disk[name] != size
    ]
    if not problems:
        problems = _sample_problems(ShardedFiles(str(out), split), files, folder, workers)
    if problems:
        shown = "\n".join(f"  {problem}" for problem in problems[:10])
        more = f"\n  and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ShardsMismatchError(
            f"{out / split} does not hold {folder / split}:\n{shown}{more}\n  delete {out / split} and "
            "convert again"
        )
    print(
        f"{out / split}: {len(files)} samples of {len(set(label for _, label in files.samples))} classes "
        f"in {len(listed)} chunks, each sample the folder's file by path and label"
    )
    return len(files)


def _sample_problems(shards: ShardedFiles, files: EncodedFolder, folder: Path, workers: int) -> list[str]:
    expected = [(os.path.relpath(path, folder), label) for path, label in files.samples]
    found, unreadable = [], []
    loader = DataLoader(_Labels(shards), batch_size=None, num_workers=workers)
    for path, label, reason in tqdm(
        loader,
        total=len(shards),
        desc=f"checking {shards.where}",
        unit="sample",
    ):
        found.append((path, label))
        if reason:
            unreadable.append(f"{path}: {reason}")
    if unreadable:
        listing = "".join(f"\n  {line}" for line in unreadable)
        print(
            f"{len(unreadable)} file(s) could not be read, stored with the reason (training reports them as "
            f"the folder's run does, data.skip_unreadable):{listing}"
        )
    if found == expected:
        return []
    counts = Counter(label for _, label in found), Counter(label for _, label in expected)
    problems = (
        [f"{len(found)} samples, the folder has {len(expected)}"] if len(found) != len(expected) else []
    )
    problems += [
        f"class {label} has {counts[0][label]} samples, the folder {counts[1][label]}"
        for label in sorted(set(counts[0]) | set(counts[1]))
        if counts[0][label] != counts[1][label]
    ]
    at = (
        next(i for i, pair in enumerate(zip(found, expected)) if pair[0] != pair[1]) if not problems else None
    )
    if at is not None:
        problems.append(f"sample {at} is {found[at]}, the folder's file {at} is {expected[at]} (path, label)")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the shards' folder to write (OUT/train, OUT/val)")
    parser.add_argument("--from", dest="folder", required=True, help="the image folder (FOLDER/train, val)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="conversion processes")
    parser.add_argument("--chunk-bytes", default="64MB", help="the size of a chunk (litdata's chunk_bytes)")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers {args.workers} must be >= 1")
    try:
        convert(args.out, args.folder, args.workers, args.chunk_bytes)
    except ConfigError as error:
        sys.exit(f"error: {error}")
    print(f"to train on them: {train_command(args.out, args.folder)}")


def train_command(out: str | Path, folder: str | Path) -> str:
    """The command that trains ``recipe=resnet50`` on the shards at ``out`` (converted from ``folder``), from
    any directory: absolute paths, and the class count where it is not ImageNet's."""
    words = ["python", str(TRAIN_PY), "recipe=resnet50", "data=imagenet_shards"]
    words.append(f"data.root={Path(out).expanduser().resolve()}")
    classes = len(class_folders(Path(folder).expanduser() / "train"))
    return shlex.join(words + ([f"data.num_classes={classes}"] if classes != IMAGENET_CLASSES else []))


if __name__ == "__main__":
    main()
