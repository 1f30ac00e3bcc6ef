"""Where the zip structures of a torch.save archive lie, and edits of them, for the tests of damaged
checkpoints: found with Python's ``zipfile`` and the zip format's field offsets (APPNOTE.TXT 4.3),
independently of the code under test."""

from __future__ import annotations

import io
import struct
import zipfile

# Central directory entry: field offsets (APPNOTE.TXT 4.3.12).
CD_FLAGS, CD_METHOD, CD_CRC, CD_COMPRESSED, CD_SIZE = 8, 10, 16, 20, 24
CD_NAME_LENGTH, CD_EXTERNAL_ATTR, CD_LOCAL_OFFSET, CD_HEADER = 28, 38, 42, 46
END_RECORD, ZIP64_LOCATOR, ZIP64_END = 22, 20, 56


def central_entries(data: bytes) -> dict[str, int]:
    """Offset of each record's central directory entry, by name."""
    position, entries = zipfile.ZipFile(io.BytesIO(data)).start_dir, {}
    while data[position : position + 4] == b"PK\x01\x02":
        name_length, extra_length, comment_length = struct.unpack_from(
            "<HHH", data, position + CD_NAME_LENGTH
        )
        entries[data[position + CD_HEADER : position + CD_HEADER + name_length].decode()] = position
        position += CD_HEADER + name_length + extra_length + comment_length
    return entries


def with_zip64_fields(data: bytes) -> bytes:
    """The archive with every central entry's sizes and local header offset moved into a zip64 extra field
    (0xFFFFFFFF in the 32-bit fields), as torch.save writes the entries of records past 4 GiB."""
    start, zip64_end = zipfile.ZipFile(io.BytesIO(data)).start_dir, data.rindex(b"PK\x06\x06")
    directory = bytearray()
    for position in central_entries(data).values():
        name_length, extra_length, comment_length = struct.unpack_from(
            "<HHH", data, position + CD_NAME_LENGTH
        )
        entry = bytearray(data[position : position + CD_HEADER + name_length + extra_length])
        compressed, size = struct.unpack_from("<II", entry, CD_COMPRESSED)
        (local_offset,) = struct.unpack_from("<I", entry, CD_LOCAL_OFFSET)
        struct.pack_into("<II", entry, CD_COMPRESSED, 0xFFFFFFFF, 0xFFFFFFFF)
        struct.pack_into("<H", entry, CD_NAME_LENGTH + 2, extra_length + 28)
        struct.pack_into("<I", entry, CD_LOCAL_OFFSET, 0xFFFFFFFF)
        entry += struct.pack("<HHQQQ", 1, 24, size, compressed, local_offset)
        entry += data[position + CD_HEADER + name_length + extra_length :][:comment_length]
        directory += entry
    ends = bytearray(data[zip64_end:])
    moved = start + len(directory)  # the zip64 end record's new offset
    struct.pack_into("<Q", ends, 40, len(directory))  # central directory size, zip64 end record
    struct.pack_into("<Q", ends, ZIP64_END + 8, moved)  # the locator's offset of the zip64 end record
    struct.pack_into("<I", ends, ZIP64_END + ZIP64_LOCATOR + 12, len(directory))  # and in the 32-bit record
    return bytes(data[:start] + directory + ends)


def structure_offsets(data: bytes) -> list[int]:
    """Offsets of every byte that is not record data: local headers (name and padding included), the data
    descriptors after the data, the central directory, the zip64 end record and locator, the end record."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    offsets = []
    for info in archive.infolist():
        name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
        data_start = info.header_offset + 30 + name_length + extra_length
        offsets += range(info.header_offset, data_start)
        offsets += range(data_start + info.compress_size, data_start + info.compress_size + 16)
    return sorted(set(offsets) | set(range(archive.start_dir, len(data))))


def data_offsets(data: bytes) -> list[int]:
    archive = zipfile.ZipFile(io.BytesIO(data))
    offsets = []
    for info in archive.infolist():
        name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
        start = info.header_offset + 30 + name_length + extra_length
        offsets += range(start, start + info.compress_size)
    return offsets


def with_central_field(data: bytes, record: str, field: int, value: int, width: str = "<H") -> bytes:
    """``data`` with one field of ``record``'s central directory entry set to ``value``."""
    out = bytearray(data)
    struct.pack_into(width, out, central_entries(data)[record] + field, value)
    return bytes(out)


def storage_record(data: bytes) -> str:
    return next(name for name in central_entries(data) if name.startswith("archive/data/"))


def changed(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


def with_directory_attribute(data: bytes, record: str) -> bytes:
    """``data`` with ``record``'s central entry carrying the DOS directory attribute (its bytes unchanged)."""
    (external,) = struct.unpack_from("<I", data, central_entries(data)[record] + CD_EXTERNAL_ATTR)
    return with_central_field(data, record, CD_EXTERNAL_ATTR, external | 0x10, "<I")


def with_zip64_disk_count(data: bytes, disks: int) -> bytes:
    """``data`` with the zip64 locator's total number of disks set to ``disks`` (torch.save writes 1)."""
    out = bytearray(data)
    struct.pack_into("<I", out, len(data) - END_RECORD - ZIP64_LOCATOR + 16, disks)
    return bytes(out)
