"""An image folder converted to litdata shards (``python -m runner.shards``), read as the folder is: each
sample's original bytes, its label and the path it was converted from, handed to the same pipeline stages
(``runner.image_pipeline``) as the folder's files, so the same sample seeds give the same crops and batches.

The shards are read by index, in the order the runner's :class:`~runner.sampling.EpochSampler` draws: the
order, the ranks' shares and the exact resume are the folder's, and litdata's own shuffle, loader and loader
state are not used. litdata writes the shards (its ``optimize``) and fetches a remote root's files (its
downloaders, into ``cache_dir``); the samples are read here, from the layout litdata gives a chunk of tuples
(``num_items`` uint32, ``num_items + 1`` uint32 offsets, the items; an item: its fields' sizes as uint32, then
the fields), each chunk mapped once a process. litdata's own reader, at litdata 0.2.76, maps a chunk anew at
each change of chunk, which a shuffled order makes at nearly every sample: about 3x slower than the folder."""

from __future__ import annotations

import bisect
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_fusedsgd.lightning import ConfigError
from runner.datamodule import DataNotFoundError
from runner.files import EncodedImage, SplitFiles, UnreadableImage
from runner.image_folder import ImageFolderDataModule

__all__ = ["FIELDS", "ImageShardsDataModule", "ShardedFiles", "litdata"]

#: What each sample of the shards holds, in order, and how litdata stores each field: the file's bytes, its
#: label (ImageFolder's), its path under the folder converted (``train/<class>/<file>``, UTF-8) and why it
#: could not be read (UTF-8, empty where it was). A tuple, not a dict: litdata 0.2.76 stores a dict of plain
#: fields as an Arrow table after the items where pyarrow is installed (not otherwise), a tuple always as the
#: items. The texts as bytes: litdata stores a ``str`` that names an existing file (a relative path, converted
#: from inside the folder) as that file's contents.
FIELDS = (("data", "bytes"), ("label", "int"), ("path", "bytes"), ("unreadable", "bytes"))
_SPEC = {"type": "builtins.tuple", "context": "null"}  # litdata's pytree spec of such a tuple, less children
_OFFSET = struct.Struct("<I")  # a chunk's count, and an item's start
_SIZES = struct.Struct(f"<{len(FIELDS)}I")  # an item's fields' sizes
_LABEL = struct.Struct("<q")  # litdata's int: an int64

#: ``read(offset, size)``: ``size`` bytes of a chunk from ``offset``, as a buffer.
_ChunkBytes = Callable[[int, int], Any]


class _Sample(NamedTuple):
    """Where a sample's bytes lie in its chunk, and what else it holds."""

    data: int
    size: int
    label: int
    path: str
    unreadable: str


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
        root: The shards' root (a local folder, read in place, or a URL litdata reads).
        split: ``train`` or ``val``.
        cache_dir: Where a remote root's index and chunks are fetched, whole, by litdata's downloaders
            (``None``: litdata's default), under the folder litdata gives that URL.

    Raises:
        ConfigError: the split's index cannot be read, or it lists other samples than an image folder's
            (:data:`FIELDS`) or stores them otherwise (compressed, encrypted); a chunk is damaged or missing
            (also when a sample of it is read).
    """

    def __init__(self, root: str, split: str, cache_dir: str | None = None) -> None:
        self.root = root
        #: Where the split is: a folder, or a URL whose files are fetched into :attr:`local`.
        self.where = os.path.join(root, split)
        self.remote = "://" in root
        self.local = _fetched_index(self.where, cache_dir) if self.remote else self.where
        index = json.loads(Path(self.local, "index.json").read_text(encoding="utf-8"))
        _check_layout(index["config"], self.where)
        self._chunks = index["chunks"]
        self._starts = [0]
        for chunk in self._chunks:
            self._starts.append(self._starts[-1] + chunk["chunk_size"])
        self._mapped: dict[int, np.ndarray] = {}
        self._downloader: Any = None
        #: The class count: ImageFolder's labels are the sorted class folders, each holding a sample. Read
        #: from a remote root by range reads: the main process fetching a chunk would start litdata's obstore
        #: client, and loader workers forked after that fall back to a slower one.
        self.num_classes = self.label(len(self) - 1) + 1

    def __getstate__(self) -> dict[str, Any]:
        """A loader worker started by spawn maps the chunks and makes a downloader of its own (one forked
        shares the main process's maps, read-only, and litdata's downloader handles the fork)."""
        return {**self.__dict__, "_mapped": {}, "_downloader": None}

    def __len__(self) -> int:
        return self._starts[-1]

    def _chunk_of(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)} in {self.where}")
        return bisect.bisect_right(self._starts, index) - 1

    def _sample(self, index: int, chunk: int, read: _ChunkBytes) -> _Sample:
        """Sample ``index``, from the bytes ``read`` of its chunk, ``chunk``."""
        start, end = struct.unpack("<2I", read(4 * (1 + index - self._starts[chunk]), 8))
        sizes = _SIZES.unpack(read(start, _SIZES.size))
        if start + _SIZES.size + sum(sizes) != end:
            raise self._damaged(chunk)
        data_size, label_size, path_size, reason_size = sizes
        data = start + _SIZES.size
        path = data + data_size + label_size
        texts = bytes(read(path, path_size + reason_size))  # UTF-8: split as bytes, then decoded
        label = _LABEL.unpack(read(data + data_size, label_size))[0]
        return _Sample(
            data, data_size, label, texts[:path_size].decode("utf-8"), texts[path_size:].decode("utf-8")
        )

    def _chunk_bytes(self, chunk: int) -> _ChunkBytes:
        """How to read chunk ``chunk``: a remote one's (until fetched here) by range reads."""
        if self.remote and chunk not in self._mapped:
            url = self._url(chunk)
            return lambda offset, size: _store(
                lambda: self._download().download_bytes(url, offset, size, self._local_chunk(chunk)), url
            )
        mapped = self._mapped_chunk(chunk)
        return lambda offset, size: mapped[offset : offset + size]

    def _mapped_chunk(self, chunk: int) -> np.ndarray:
        mapped = self._mapped.get(chunk)
        if mapped is None:
            mapped = self._mapped[chunk] = self._map(chunk)
        return mapped

    def _local_chunk(self, chunk: int) -> str:
        return os.path.join(self.local, self._chunks[chunk]["filename"])

    def _url(self, chunk: int) -> str:
        """Where chunk ``chunk`` is: its URL, or its path under a local root."""
        return f"{self.where}/{self._chunks[chunk]['filename']}"

    def _download(self) -> Any:
        if self._downloader is None:
            self._downloader = _downloader(self.where, self.local, self._chunks)
        return self._downloader

    def _map(self, chunk: int) -> np.ndarray:
        """Chunk ``chunk`` mapped (fetched first from a remote root), its size and item count checked. Mapped
        by torch, which keeps no file open for a mapping: a worker maps each chunk it reads."""
        path = self._local_chunk(chunk)
        if self.remote:
            url = self._url(chunk)
            _store(lambda: _fetch(self._download(), url, path), url)
        size, count = self._chunks[chunk]["chunk_bytes"], self._chunks[chunk]["chunk_size"]
        header = 4 * (count + 2)  # the count and the offsets: the first item starts there, the last ends
        if (os.path.getsize(path) if os.path.isfile(path) else None) == size >= header:
            mapped = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).numpy()
            offsets = np.frombuffer(mapped, dtype="<u4", count=count + 2)
            if (offsets[0], offsets[1], offsets[-1]) == (count, header, size):
                return mapped
        raise self._damaged(chunk)

    def _damaged(self, chunk: int) -> ConfigError:
        count = self._chunks[chunk]["chunk_size"]
        fix = (
            f"delete the copy fetched, {self._local_chunk(chunk)}, or convert and upload the folder again"
            if self.remote
            else "convert the folder again (python -m runner.shards OUT --from FOLDER)"
        )
        return ConfigError(
            f"{self._url(chunk)} is missing or not the chunk its index.json lists ({count} samples in "
            f"{self._chunks[chunk]['chunk_bytes']} bytes): {fix}"
        )

    def record(self, index: int) -> tuple[str, int, str]:
        """Sample ``index``'s path under the folder converted, label, and why it could not be read ("" where
        it was), without its bytes."""
        chunk = self._chunk_of(index)
        sample = self._sample(index, chunk, self._chunk_bytes(chunk))
        return sample.path, sample.label, sample.unreadable

    def label(self, index: int) -> int:
        return self.record(index)[1]

    def __getitem__(self, index: int) -> EncodedImage:
        """The bytes of sample ``index``.

        Raises:
            UnreadableImage: its file could not be read when the folder was converted (why, as the folder's
                reader said it).
        """
        chunk = self._chunk_of(index)
        mapped = self._mapped_chunk(chunk)  # a remote one fetched whole
        sample = self._sample(index, chunk, lambda offset, size: mapped[offset : offset + size])
        path = os.path.join(self.root, sample.path)
        if sample.unreadable:
            raise UnreadableImage(path, sample.unreadable)
        data = torch.from_numpy(mapped[sample.data : sample.data + sample.size].copy())
        return EncodedImage(path, data, sample.label)


def _store(call: Callable[[], Any], url: str) -> Any:
    """``call``'s result; a store's error (its client's own types) as a ConfigError naming ``url``."""
    try:
        return call()
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"cannot fetch {url} ({type(error).__name__}: {error})") from error


def _fetched_index(url: str, cache_dir: str | None) -> str:
    """The local folder of a remote split, its ``index.json`` fetched there: litdata's cache folder for the
    URL (a folder of its own for each ``updated_at`` of the index, an older one cleared, under a lock: the
    ranks of a node share it).

    Raises:
        ConfigError: the index cannot be read (not there, no access: the store's own words).
    """
    litdata()  # the install's check, and no version request
    from filelock import FileLock
    from litdata.utilities.dataset_utilities import _try_create_cache_dir, get_default_cache_dir

    root = cache_dir or get_default_cache_dir()
    os.makedirs(root, exist_ok=True)
    try:
        with FileLock(os.path.join(root, ".lightning_fusedsgd.lock")):
            local = _try_create_cache_dir(input_dir=url, cache_dir=cache_dir)
        _fetch(_downloader(url, local, []), f"{url}/index.json", os.path.join(local, "index.json"))
    except Exception as error:  # the store's client's errors, of its own types
        raise ConfigError(
            f"cannot read {url}/index.json ({type(error).__name__}: {error}); expected there: "
            f"{ImageShardsDataModule.LAYOUT}"
        ) from error
    return local


def _downloader(url: str, local: str, chunks: list[dict[str, Any]]) -> Any:
    """litdata's downloader of ``url``'s files (its ``chunks``) into ``local``, for this process."""
    from litdata.streaming.downloader import get_downloader

    return get_downloader(url, local, chunks)


def _fetch(downloader: Any, url: str, path: str) -> None:
    """The file at ``url`` fetched whole to ``path``, by this process or another. litdata's downloaders
    hold ``path.lock`` while one process fetches the file and return to the others without it (at once, or
    after a second for an index); where the store has no such file, obstore's client says so with an error
    they pass over, and they return without it too.

    Raises:
        ConfigError: the file is still missing once no other process is fetching it, after a last try.
    """
    from filelock import FileLock, Timeout

    tries_with_the_lock_free = 0
    while not os.path.exists(path):
        downloader.download_file(url, path)
        try:
            with FileLock(f"{path}.lock", timeout=0):
                if os.path.exists(path):
                    return
                tries_with_the_lock_free += 1
        except Timeout:  # another process is fetching it
            time.sleep(0.05)
            continue
        if tries_with_the_lock_free == 2:
            raise ConfigError(
                f"cannot fetch {url} to {path}: it is missing from the store (the shards were not all "
                "uploaded), or the process that fetched it failed; upload the shards again, or see that "
                "process's error"
            )


def _check_layout(config: dict[str, Any], where: str) -> None:
    """That the shards hold :data:`FIELDS` tuples, as :mod:`runner.shards` writes them.

    Raises:
        ConfigError: they hold other samples, or store them otherwise (compressed, encrypted).
    """
    spec = json.loads(config.get("data_spec") or "null")
    tree = spec[1] if isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], dict) else {}
    stored = {
        "fields": config.get("data_format"),
        "sample": {key: tree.get(key) for key in _SPEC},
        "item_loader": config.get("item_loader"),
        "compression": config.get("compression"),
        "encryption": config.get("encryption"),
    }
    expected = {
        "fields": [kind for _, kind in FIELDS],
        "sample": _SPEC,
        "item_loader": "PyTreeLoader",
        "compression": None,
        "encryption": None,
    }
    if stored != expected or len(tree.get("children_spec") or ()) != len(FIELDS):
        raise ConfigError(
            f"{where} holds litdata shards of other samples or in another layout ({stored}), not the image "
            f"folder's samples python -m runner.shards writes ({expected}, the fields "
            f"{', '.join(name for name, _ in FIELDS)}): convert the folder with python -m runner.shards OUT "
            "--from FOLDER"
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
        if "://" in self.root:  # a remote root: ShardedFiles names what it cannot fetch
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
