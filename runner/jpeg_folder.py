"""A generated JPEG folder in the ImageNet layout, deterministic, for the benchmarks and the tests:
``python -m runner.jpeg_folder OUT [--classes 10] [--train 50] [--val 10]`` in a checkout, or from any
directory ``python <checkout>/runner/jpeg_folder.py OUT ...`` (as ``python <checkout>/train.py``); it ends
with the command that trains a recipe on the folder.

Each image is a pure function of ``(seed, split, class, index)``: about ImageNet's sizes (the long side
400-500, the short 300-375, a quarter portrait) and its JPEG quality (85-95, 4:2:0), smooth colour fields with
edges and grain, so that it compresses like a photograph (~65 KB) rather than like noise, which decodes
slower.
"""

from __future__ import annotations

import argparse
import io
import shlex
import shutil
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run by its path: Python put runner/ first on sys.path, where the runner's modules would shadow the
    # libraries' of the same names; the checkout instead, as for train.py.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision.datasets.folder import find_classes  # noqa: E402

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"

__all__ = ["make_jpeg_folder"]


def _image(rng: np.random.Generator) -> tuple[Image.Image, int]:
    long, short = int(rng.integers(400, 501)), int(rng.integers(300, 376))
    width, height = (short, long) if rng.random() < 0.25 else (long, short)
    # A coarse random colour field, upsampled: the smooth regions of a photograph.
    coarse = rng.integers(0, 256, size=(int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.int16)
    # A few hard-edged rectangles (object boundaries) and grain (texture, sensor noise).
    for _ in range(int(rng.integers(2, 6))):
        top, left = int(rng.integers(0, height - 20)), int(rng.integers(0, width - 20))
        bottom, right = top + int(rng.integers(20, height // 2)), left + int(rng.integers(20, width // 2))
        field[top:bottom, left:right] = rng.integers(0, 256, size=3)
    field += rng.integers(-24, 25, size=field.shape, dtype=np.int16)
    return Image.fromarray(np.clip(field, 0, 255).astype(np.uint8)), int(rng.integers(85, 96))


def make_jpeg_folder(
    root: str | Path, classes: int = 10, train: int = 50, val: int = 10, seed: int = 0
) -> Path:
    """Writes ``root/{train,val}/class_NNN/NNNNN.JPEG`` (``classes`` folders of ``train`` and ``val``
    images; no ``val/`` for ``val=0``); the same arguments give the same bytes. Returns ``root``.

    Raises:
        ValueError: ``classes`` or ``train`` below 1, or ``val`` or ``seed`` below 0 (before anything is
            written).
    """
    for name, count, least in (
        ("classes", classes, 1),
        ("train", train, 1),
        ("val", val, 0),
        ("seed", seed, 0),
    ):
        if count < least:
            raise ValueError(f"{name}={count} must be >= {least}")
    root = Path(root)
    for split_index, (split, count) in enumerate((("train", train), ("val", val))):
        for label in range(classes if count else 0):
            folder = root / split / _class_folder(label)
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                rng = np.random.default_rng([seed, split_index, label, index])
                image, quality = _image(rng)
                buffer = io.BytesIO()
                image.save(buffer, "JPEG", quality=quality)
                (folder / f"{index:05d}.JPEG").write_bytes(buffer.getvalue())
    return root


def _class_folder(label: int) -> str:
    return f"class_{label:03d}"


def _count(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "root", help="the folder to write (ImageNet layout: root/train/<class>, root/val/<class>)"
    )
    parser.add_argument("--classes", type=_count(1), default=10)
    parser.add_argument("--train", type=_count(1), default=50, help="training images per class")
    # At least one: a class folder without images is refused by the runner (train.py validates every class).
    parser.add_argument("--val", type=_count(1), default=10, help="validation images per class")
    parser.add_argument("--seed", type=_count(0), default=0)
    args = parser.parse_args()
    root = make_jpeg_folder(args.root, args.classes, args.train, args.val, args.seed)
    written = args.classes * (args.train + args.val)
    held = sum(path.is_file() for path in root.rglob("*"))
    before = f"; it holds {held - written} other file(s) from before" if held != written else ""
    # The runner's classes are the class folders in train/, those of an earlier run into the folder too.
    classes = find_classes(str(root / "train"))[0]
    stale = sorted(set(classes) - {_class_folder(label) for label in range(args.classes)})
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        before += f"; train/ holds {len(stale)} class folder(s) it did not write ({shown}), which the runner "
        before += "reads too"
    print(
        f"wrote {written} JPEGs to {root}: {args.classes} classes of {args.train} training and {args.val} "
        f"validation images{before}. To train an ImageNet recipe on them (debug=tiny: a one-minute run on "
        "the CPU; without it, the recipe's own epochs):"
    )
    print(train_command(root, len(classes)))


def train_command(root: Path, classes: int) -> str:
    """The command that trains ``recipe=resnet50`` on the folder at ``root``, from any directory."""
    python = sys.executable
    on_path = shutil.which("python")
    if on_path is not None and Path(on_path).resolve() == Path(python).resolve():
        python = "python"
    words = [python, str(TRAIN_PY), "recipe=resnet50", f"data.root={root.resolve()}"]
    return shlex.join([*words, f"data.num_classes={classes}", "debug=tiny"])


if __name__ == "__main__":
    main()
