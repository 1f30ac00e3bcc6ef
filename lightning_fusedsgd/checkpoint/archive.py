"""torch.save's zip archive, checked as torch.load will read it, before it reads it.

``torch.load`` reads the archive with miniz (caffe2's ``PyTorchStreamReader``), built without miniz's CRC
checks, and trusts what the central directory says: a record marked as a directory, or of size 0, is "read"
by copying nothing into the buffer torch allocated for it, so its tensors hold whatever that memory held. So
the archive is read here as miniz reads it (the end records, the zip64 records, each central-directory entry
and the local header it points to), and every record must be one miniz hands over whole: a regular file,
stored uncompressed, not encrypted, inside the file, its bytes those whose CRC-32 the writer recorded (an
archive torch.save wrote without CRCs, every one 0, has none to check: damage inside its records loads, as
it does with torch.load). Names
are looked up as miniz does (ASCII case folded), so they must be unique that way. Then each storage the
pickle references must be a record of exactly the bytes its tensors are rebuilt from. What passes is read by
``torch.load`` as it was written; anything else is refused with the reason (:class:`ArchiveDamage`).

Where miniz would read a damaged archive some way of its own (an end record not at the end, records on other
disks), this refuses rather than guess which way: a refused file never loads, one that passes loads exactly.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import torch

ZIP_MAGIC = b"PK\x03\x04"  # torch.load reads a file as an archive when it starts with this

_END = struct.Struct("<4sHHHHIIH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_END_SIG, _ZIP64_LOCATOR_SIG, _ZIP64_END_SIG = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_CENTRAL_SIG = b"PK\x01\x02"
_UINT32_MAX = 0xFFFFFFFF
_ZIP64_EXTRA_ID = 0x0001
_DOS_DIRECTORY = 0x10
# Encrypted, compressed patch data, strong encryption, masked local headers: miniz reads none of them.
_UNREADABLE_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
_MAX_NAME = 511  # torch lists the names through a 512-byte buffer (MZ_ZIP_MAX_ARCHIVE_FILENAME_SIZE)
_CHUNK = 1 << 22


class ArchiveDamage(ValueError):
    """The archive is not one ``torch.load`` would read exactly as written; the message says where."""


class TorchScriptArchive(ValueError):
    """The archive is a TorchScript module (``torch.jit.save``), which torch.load hands to ``torch.jit``."""


@dataclass(frozen=True)
class _Entry:
    """A central-directory entry, with sizes and offset as miniz reads them (zip64 fields applied)."""

    name: bytes
    flags: int
    method: int
    crc: int
    compressed: int
    size: int
    disk: int
    external: int
    local_offset: int


def check_archive(file: BinaryIO) -> None:
    """Check that ``torch.load`` reads from ``file`` (a torch.save zip archive) exactly what was written.

    Raises:
        ArchiveDamage: Naming the structure or record that is damaged.
        TorchScriptArchive: If it is a TorchScript module, not a checkpoint.
    """
    size = file.seek(0, io.SEEK_END)
    entries = _central_directory(file, size)
    prefix = _prefix(entries)
    if any(entry.name == prefix + b"constants.pkl" for entry in entries):  # how torch.load tells
        raise TorchScriptArchive("it is a TorchScript module (torch.jit.save): load it with torch.jit.load")
    # torch.save with serialization.config.save.compute_crc32 = False records a CRC of 0 for every record:
    # such an archive has no CRCs to check. One record's CRC of 0 among others' is checked (0, or damage).
    crcs = any(entry.crc != 0 for entry in entries)
    records: dict[bytes, tuple[int, int]] = {}  # by name in ASCII lower case: (data offset, size)
    for entry in entries:
        if entry.name.lower() in records:
            raise ArchiveDamage(f"two records are named {_shown(entry.name)}, ASCII case aside")
        records[entry.name.lower()] = _checked_data(file, size, entry, crcs)
    pickle_name = prefix + b"data.pkl"
    if pickle_name.lower() not in records:
        raise ArchiveDamage(f"it has no record {_shown(pickle_name)}, the pickle torch.load reads")
    for key, nbytes in _storages(_read(file, *records[pickle_name.lower()])):
        name = prefix + b"data/" + key.encode()
        record = records.get(name.lower())
        if record is None:
            raise ArchiveDamage(
                f"its pickle references storage {key!r}, and there is no record {_shown(name)}"
            )
        if record[1] != nbytes:
            raise ArchiveDamage(
                f"record {_shown(name)} holds {record[1]} bytes, its pickle rebuilds tensors from {nbytes}"
            )


def _shown(name: bytes) -> str:
    return repr(name.decode("utf-8", "backslashreplace"))


def _read(file: BinaryIO, offset: int, length: int) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise ArchiveDamage(f"the file ends inside the {length} bytes at offset {offset}")
    return data


def _end_records(file: BinaryIO, size: int) -> tuple[int, int, int]:
    """(entries, central directory offset, its size), from the end records as miniz reads them."""
    if size < _END.size:
        raise ArchiveDamage(f"it has {size} bytes, fewer than a zip archive's end record")
    end_offset = size - _END.size
    signature, disk, cdir_disk, disk_entries, entries, cdir_size, cdir_offset, _ = _END.unpack(
        _read(file, end_offset, _END.size)
    )
    # miniz scans back from the end for this signature; torch.save writes the record last, with no comment.
    if signature != _END_SIG:
        raise ArchiveDamage("its end-of-archive record is not at the end of the file")
    locator_offset = end_offset - _ZIP64_LOCATOR.size
    if locator_offset >= _ZIP64_END.size:
        locator = _ZIP64_LOCATOR.unpack(_read(file, locator_offset, _ZIP64_LOCATOR.size))
        if locator[0] == _ZIP64_LOCATOR_SIG:
            _, zip64_disk, zip64_offset, disks = locator
            if zip64_disk != 0 or disks != 1:
                raise ArchiveDamage(f"its zip64 locator says the archive spans disks ({zip64_disk}, {disks})")
            if zip64_offset + _ZIP64_END.size > locator_offset:
                raise ArchiveDamage(f"its zip64 locator points past the end records (offset {zip64_offset})")
            zip64 = _ZIP64_END.unpack(_read(file, zip64_offset, _ZIP64_END.size))
            # Without this signature miniz takes the 32-bit record's values, as done here.
            if zip64[0] == _ZIP64_END_SIG:
                if zip64[1] < _ZIP64_END.size - 12:
                    raise ArchiveDamage(f"its zip64 end record gives its own size as {zip64[1]} bytes")
                disk, cdir_disk, disk_entries, entries, cdir_size, cdir_offset = zip64[4:]
    if disk != 0 or cdir_disk != 0 or disk_entries != entries:
        raise ArchiveDamage(
            f"its end record says the archive spans disks (this is disk {disk}, the central directory is "
            f"on {cdir_disk}, {disk_entries} of its {entries} entries here)"
        )
    if entries == 0:
        raise ArchiveDamage("its central directory lists no records")
    if cdir_size > _UINT32_MAX or cdir_offset + cdir_size > size or cdir_size < entries * _CENTRAL.size:
        raise ArchiveDamage(
            f"its central directory ({entries} entries in {cdir_size} bytes at offset {cdir_offset}) does "
            f"not fit in the file's {size} bytes"
        )
    return entries, cdir_offset, cdir_size


def _zip64_values(extra: bytes, values: list[int], where: str) -> list[int]:
    """``values`` (size, compressed size, local header offset: miniz's order) with those that are 0xFFFFFFFF
    taken from the zip64 field of ``extra``, whose fields must all be well formed."""
    fields: dict[int, bytes] = {}
    position = 0
    while position < len(extra):
        if position + 4 > len(extra):
            raise ArchiveDamage(f"{where} has a damaged extra field")
        field_id, length = struct.unpack_from("<HH", extra, position)
        if position + 4 + length > len(extra):
            raise ArchiveDamage(f"{where} has a damaged extra field")
        fields.setdefault(field_id, extra[position + 4 : position + 4 + length])  # miniz takes the first
        position += 4 + length
    zip64 = fields.get(_ZIP64_EXTRA_ID)
    if zip64 is None:
        return values
    replaced, position = [], 0
    for value in values:
        if value == _UINT32_MAX:
            if position + 8 > len(zip64):
                raise ArchiveDamage(f"{where} has a zip64 field too short for its sizes and offset")
            (value,) = struct.unpack_from("<Q", zip64, position)
            position += 8
        replaced.append(value)
    return replaced


def _central_directory(file: BinaryIO, size: int) -> list[_Entry]:
    """The central directory's entries in their order, as miniz reads them."""
    count, cdir_offset, cdir_size = _end_records(file, size)
    directory = _read(file, cdir_offset, cdir_size)
    entries, position = [], 0
    for index in range(count):
        if position + _CENTRAL.size > len(directory):
            raise ArchiveDamage(f"central directory entry {index} lies outside the central directory")
        fields = _CENTRAL.unpack_from(directory, position)
        name_length, extra_length, comment_length = fields[10:13]
        name_end = position + _CENTRAL.size + name_length
        end = name_end + extra_length + comment_length
        if fields[0] != _CENTRAL_SIG or end > len(directory):
            raise ArchiveDamage(f"central directory entry {index} is damaged")
        name = directory[position + _CENTRAL.size : name_end]
        extra = directory[name_end : name_end + extra_length]
        record_size, compressed, local_offset = _zip64_values(
            extra, [fields[9], fields[8], fields[16]], f"record {_shown(name)}"
        )
        flags, method, crc, disk, external = fields[3], fields[4], fields[7], fields[13], fields[15]
        entries.append(
            _Entry(name, flags, method, crc, compressed, record_size, disk, external, local_offset)
        )
        position = end
    return entries


def _prefix(entries: list[_Entry]) -> bytes:
    """The folder of every record, which torch takes from the first record's name and prefixes to lookups."""
    first = entries[0].name
    if b"/" not in first:
        raise ArchiveDamage(f"its first record {_shown(first)} is not in a folder")
    prefix = first[: first.index(b"/") + 1]
    for entry in entries:
        if not entry.name.startswith(prefix) or b"\0" in entry.name or len(entry.name) > _MAX_NAME:
            raise ArchiveDamage(
                f"record {_shown(entry.name)} has a name torch cannot list in {_shown(prefix)}"
            )
    return prefix


def _checked_data(file: BinaryIO, size: int, entry: _Entry, crcs: bool) -> tuple[int, int]:
    """(offset, size) of the bytes miniz copies out for ``entry``, which must be the whole record as written:
    a regular file, stored, unencrypted, inside the file, of the CRC-32 the writer recorded (where the
    archive records CRCs: ``crcs``)."""
    where = f"record {_shown(entry.name)}"
    if entry.disk != 0:
        raise ArchiveDamage(f"{where} says it starts on disk {entry.disk}")
    if entry.flags & _UNREADABLE_FLAGS:
        raise ArchiveDamage(f"{where} is flagged as encrypted or as patch data (flags {entry.flags:#06x})")
    if entry.method != 0:
        raise ArchiveDamage(f"{where} is compressed (method {entry.method}); torch.save stores records as is")
    if entry.name.endswith(b"/") or entry.external & _DOS_DIRECTORY:
        raise ArchiveDamage(f"{where} is marked as a directory, whose bytes torch.load skips")
    if entry.compressed != entry.size:
        raise ArchiveDamage(
            f"{where} has two sizes, {entry.compressed} and {entry.size} bytes, for stored data"
        )
    if entry.local_offset + _LOCAL.size > size:
        raise ArchiveDamage(f"{where} points past the end of the file (offset {entry.local_offset})")
    local = _LOCAL.unpack(_read(file, entry.local_offset, _LOCAL.size))
    if local[0] != ZIP_MAGIC:
        raise ArchiveDamage(f"{where} points to no local header (offset {entry.local_offset})")
    data_offset = entry.local_offset + _LOCAL.size + local[9] + local[10]  # past its name and extra field
    if data_offset + entry.size > size:
        raise ArchiveDamage(f"{where} runs past the end of the file")
    if crcs and _crc32(file, data_offset, entry.size) != entry.crc:
        raise ArchiveDamage(f"{where} fails its CRC check: its bytes changed after it was written")
    return data_offset, entry.size


def _crc32(file: BinaryIO, offset: int, length: int) -> int:
    file.seek(offset)
    crc, buffer = 0, memoryview(bytearray(min(length, _CHUNK)))
    while length:
        read = file.readinto(buffer[: min(length, _CHUNK)])
        if not read:
            raise ArchiveDamage(f"the file ends inside the record at offset {offset}")
        crc = zlib.crc32(buffer[:read], crc)
        length -= read
    return crc


class _Placeholder(type):
    """The type of whatever a pickle names (classes, functions) or makes from them while its storages are
    listed: calling, building or filling one gives another placeholder, so nothing is imported or run."""

    def __call__(cls, *args: object, **kwargs: object) -> type:
        return _placeholder("result")

    def __setstate__(cls, state: object) -> None:
        pass

    def __setitem__(cls, key: object, value: object) -> None:
        pass

    def append(cls, item: object) -> None:
        pass

    def extend(cls, items: object) -> None:
        pass

    def add(cls, item: object) -> None:
        pass


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {"__new__": lambda cls, *args, **kwargs: _placeholder("result")})


class _StorageLister(pickle.Unpickler):
    """Reads a checkpoint's pickle as torch.load's unpicklers do, every global a placeholder, listing the
    storages it references (persistent ids ``("storage", storage type, key, location, numel)``)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")  # torch.load's encoding
        self.storages: list[tuple[str, int]] = []

    def find_class(self, module: str, name: str) -> type:
        return _placeholder(name)

    def persistent_load(self, pid: object) -> type:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise ArchiveDamage(f"its pickle references {pid!r}, which is not a storage")
        _, storage_type, key, _, numel = pid
        if not (isinstance(key, str) and type(numel) is int and numel >= 0):
            raise ArchiveDamage(f"its pickle references a storage as {pid!r}")
        self.storages.append((key, numel * _itemsize(getattr(storage_type, "__name__", repr(storage_type)))))
        return _placeholder("storage")


def _itemsize(storage_type: str) -> int:
    """Bytes per element of a pickled storage type, which torch.load maps to a dtype by its name."""
    if storage_type == "UntypedStorage":
        return 1
    try:
        return torch.serialization.StorageType(storage_type).dtype.itemsize
    except (KeyError, AttributeError) as error:
        raise ArchiveDamage(f"its pickle references a storage of unknown type {storage_type!r}") from error


def _storages(data: bytes) -> list[tuple[str, int]]:
    """(key, bytes) of each storage the pickle ``data`` references."""
    lister = _StorageLister(data)
    try:
        lister.load()
    except ArchiveDamage:
        raise
    except Exception as error:  # a pickle that cannot be read raises any type
        raise ArchiveDamage(f"its pickle cannot be read ({type(error).__name__}: {error})") from error
    return lister.storages
