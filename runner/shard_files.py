"""An image folder converted to litdata shards (``python -m runner.shards``), read as the folder is: each
sample's original bytes, its label and the path it was converted from, handed to the same pipeline stages
(``runner.image_pipeline``) as the folder's files, so the same sample seeds give the same crops and batches.

The shards are read by index (litdata's ``StreamingDataset`` as a map-style dataset), in the order the
runner's :class:`~runner.sampling.EpochSampler` draws: the order, the ranks' shares and the exact resume are
the folder's, and litdata's own shuffle and loader state are not used. A local root is read in place; a remote
one (``s3://``, ``gs://``) fetches whole chunks into ``cache_dir`` and reads them there."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_fusedsgd.lightning import ConfigError
from runner.datamodule import DataNotFoundError
from runner.files import EncodedImage, SplitFiles, UnreadableImage
from runner.image_folder import ImageFolderDataModule

__all__ = ["FIELDS", "ImageShardsDataModule", "ShardedFiles", "litdata"]

#: What each sample of the shards holds: the file's bytes, its label (ImageFolder's), its path under the
#: folder converted (``train/<class>/<file>``) and why it could not be read ("" where it was).
FIELDS = ("data", "label", "path", "unreadable")


def litdata() -> Any:
    """The litdata module, imported without its check of PyPI for a newer release (a request a process,
    which a cluster node without internet access waits out)."""
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    try:
        import litdata
    except ImportError:
        raise ConfigError(
            "reading or writing image shards needs litdata: pip install 'litdata>=0.2.76,<0.3' (the shards "
            "extra: pip install -e '.[shards]')"
        ) from None
    return litdata


class ShardedFiles(Dataset):
    """One split of converted shards (``root/split``) as :class:`~runner.files.SplitFiles`: sample ``index``
    is the folder's sample ``index`` (ImageFolder's order), named by the path it was converted from under
    ``root``.

    Args:
        root: The shards' root (a local folder or a URL litdata reads).
        split: ``train`` or ``val``.
        cache_dir: Where litdata keeps a remote root's index and chunks (``None``: litdata's default).
    """

    def __init__(self, root: str, split: str, cache_dir: str | None = None) -> None:
        self.root = root
        self.shards = litdata().StreamingDataset(os.path.join(root, split), cache_dir=cache_dir)
        # litdata 0.2.76's on-demand range reads of a remote sample parse the chunk's older layout and return
        # empty items from the chunks its own writer makes: whole chunks are fetched into the cache instead.
        self.shards._on_demand_bytes = False
        # Every rank reads every sample by its index: the whole split's length, not litdata's share of it.
        self.length = sum(end - start for start, end in self.shards.region_of_interest)
        first = self.shards[0]
        if not isinstance(first, dict) or sorted(first) != sorted(FIELDS):
            held = sorted(first) if isinstance(first, dict) else type(first).__name__
            raise ConfigError(
                f"{os.path.join(root, split)} holds litdata shards of other samples ({held}), not an image "
                f"folder's ({', '.join(FIELDS)}): convert the folder with python -m runner.shards OUT --from "
                "FOLDER"
            )
        #: The class count: ImageFolder's labels are the sorted class folders, each holding a sample.
        self.num_classes = self.label(self.length - 1) + 1

    def __len__(self) -> int:
        return self.length

    def label(self, index: int) -> int:
        return self.shards[index]["label"]

    def __getitem__(self, index: int) -> EncodedImage:
        """The bytes of sample ``index``.

        Raises:
            UnreadableImage: its file could not be read when the folder was converted (why, as the folder's
                reader said it).
        """
        sample = self.shards[index]
        path = os.path.join(self.root, sample["path"])
        if sample["unreadable"]:
            raise UnreadableImage(path, sample["unreadable"])
        data = sample["data"]
        return EncodedImage(
            path,
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8),
            sample["label"],
        )


class ImageShardsDataModule(ImageFolderDataModule):
    """An image folder converted to shards (``python -m runner.shards``): the folder's DataModule, the same
    batches, read from ``root/train`` and ``root/val``.

    Args:
        root: The shards' root: a local folder or a URL litdata reads (``s3://``, ``gs://``; credentials as
            litdata's clients find them).
        cache_dir: Where litdata keeps a remote root's index and chunks; ``None``: litdata's default.
        folder: :class:`~runner.image_folder.ImageFolderDataModule`'s ``decode`` and ``skip_unreadable``, and
            the shared arguments; ``num_classes``: the converted folder's class count (checked).
    """

    LAYOUT = (
        "<root>/train and <root>/val, each litdata shards (index.json, chunk-*.bin) written from an image "
        "folder by python -m runner.shards <root> --from <folder>"
    )

    def __init__(
        self, root: str = "data/imagenet_shards", cache_dir: str | None = None, **folder: Any
    ) -> None:
        super().__init__(root=root, **folder)  # a URL as given; a path with ~ in the home folder
        self.cache_dir = cache_dir

    def check_data(self) -> None:
        if "://" in self.root:  # a remote root: litdata names what it cannot find
            return
        for split in ("train", "val"):
            if not os.path.isfile(os.path.join(self.root, split, "index.json")):
                raise DataNotFoundError(
                    "image shards", os.path.join(os.path.abspath(self.root), split), self.LAYOUT
                )

    def split_files(self) -> tuple[SplitFiles, SplitFiles]:
        self.check_data()
        train, val = (ShardedFiles(self.root, split, self.cache_dir) for split in ("train", "val"))
        if train.num_classes != self.num_classes:
            raise ConfigError(
                f"{os.path.join(self.root, 'train')} holds {train.num_classes} classes, the config declares "
                f"data.num_classes={self.num_classes}: set data.num_classes={train.num_classes}"
            )
        if val.num_classes != train.num_classes:
            raise ConfigError(
                f"{os.path.join(self.root, 'val')} holds {val.num_classes} classes and "
                f"{os.path.join(self.root, 'train')} {train.num_classes}: convert the folder again"
            )
        return train, val
