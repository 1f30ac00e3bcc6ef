"""Damaged checkpoint files: whatever byte of a checkpoint changes, ``read_checkpoint_file`` returns exactly
the checkpoint that was saved (the change was in a field torch.load ignores) or raises ``CheckpointError``
naming the file; never another exception, never other tensors.

Oracles: the checkpoint as saved (compared bit for bit, tensors as bytes), and where the zip structures lie
(``zip_layout``: Python's zipfile and the zip format's field offsets, not the code under test).
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.serialization
from torch import nn
from zip_layout import (
    CD_CRC,
    CD_FLAGS,
    CD_HEADER,
    CD_METHOD,
    central_entries,
    changed,
    data_offsets,
    storage_record,
    structure_offsets,
    with_central_field,
    with_directory_attribute,
    with_zip64_disk_count,
    with_zip64_fields,
)

from lightning_fusedsgd.checkpoint import (
    CheckpointError,
    files,
    read_checkpoint_file,
    read_start_checkpoint,
    save_checkpoint_file,
)
from lightning_fusedsgd.optim import FusedSGD


def saved_checkpoint(path: Path) -> None:
    """A small checkpoint as the project writes them: a model's weights and buffers (BatchNorm's int64 count
    too) and FusedSGD's state after two steps, saved with save_checkpoint_file."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    save_checkpoint_file({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def bit_equal(actual: Any, expected: Any) -> bool:
    """The same objects, tensors equal as bytes (dtype, shape and strides too)."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, torch.Tensor):
        return (actual.dtype, actual.shape, actual.stride()) == (
            expected.dtype,
            expected.shape,
            expected.stride(),
        ) and actual.reshape(-1).view(torch.uint8).tolist() == expected.reshape(-1).view(torch.uint8).tolist()
    if isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(bit_equal(actual[k], expected[k]) for k in expected)
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(bit_equal(a, e) for a, e in zip(actual, expected))
    return actual == expected


def loads_exactly_or_refuses(path: Path, data: bytes, expected: dict[str, Any]) -> str:
    """Write ``data`` to ``path`` and read it: "same" (bit-equal to ``expected``) or "refused"
    (CheckpointError naming the file). Anything else fails: other tensors here, another exception by
    propagating."""
    path.write_bytes(data)
    try:
        loaded = read_checkpoint_file(path)
    except CheckpointError as error:
        assert str(path) in str(error), error
        return "refused"
    assert bit_equal(loaded, expected), "a damaged checkpoint loaded other content"
    return "same"


def single_changes(data: bytes, exhaustive: bool) -> Iterator[tuple[str, bytes]]:
    """Damage one at a time: a bit flipped in each structure byte (every bit, or one per byte cycling through
    the eight), each structure byte zeroed and set to 0xFF (exhaustive), a sample of data bytes flipped, and
    the file cut short at a sample of lengths (every length, exhaustive)."""
    for offset in structure_offsets(data):
        bits = range(8) if exhaustive else [offset % 8]
        for bit in bits:
            yield f"bit {bit} at {offset}", changed(data, offset, data[offset] ^ 1 << bit)
        if exhaustive:
            for value in (0x00, 0xFF):
                yield f"{value:#04x} at {offset}", changed(data, offset, value)
    for offset in data_offsets(data)[:: 1 if exhaustive else 29]:
        yield f"data bit at {offset}", changed(data, offset, data[offset] ^ 1 << (offset % 8))
    for length in range(0, len(data), 1 if exhaustive else 97):
        yield f"cut to {length} bytes", data[:length]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, Any]]:
    path = tmp_path_factory.mktemp("original") / "last.ckpt"
    saved_checkpoint(path)
    return path.read_bytes(), read_checkpoint_file(path)


LAYOUTS = {"as_saved": lambda data: data, "zip64_fields": with_zip64_fields}


def check_every_change(original, layout: str, exhaustive: bool, tmp_path: Path) -> dict[str, int]:
    data, expected = LAYOUTS[layout](original[0]), original[1]
    path = tmp_path / "damaged.ckpt"
    assert loads_exactly_or_refuses(path, data, expected) == "same"
    outcomes = {"same": 0, "refused": 0}
    for what, damaged in single_changes(data, exhaustive):
        try:
            outcomes[loads_exactly_or_refuses(path, damaged, expected)] += 1
        except AssertionError as error:
            raise AssertionError(f"{layout}, {what}: {error}") from error
    return outcomes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_changed_byte_loads_the_saved_checkpoint_or_fails_naming_the_file(original, layout, tmp_path):
    outcomes = check_every_change(original, layout, exhaustive=False, tmp_path=tmp_path)
    # Both happen: many header fields are ignored by torch.load (times, versions, the local copies of sizes).
    assert outcomes["same"] > 0 and outcomes["refused"] > 0, outcomes


@pytest.mark.slow
@pytest.mark.heavy  # a minute or two
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_changed_bit_and_byte_loads_the_saved_checkpoint_or_fails_naming_the_file(
    original, layout, tmp_path
):
    check_every_change(original, layout, exhaustive=True, tmp_path=tmp_path)


# ---------------------------------------------------------------------------------------------------
# The damage the review found, one test each
# ---------------------------------------------------------------------------------------------------


def test_a_record_marked_as_a_directory_is_refused_not_loaded_uninitialized(original, tmp_path):
    """torch.load copies nothing out of a record whose entry has the DOS directory attribute, and returns the
    storage with whatever its memory held; the CRC of the bytes on disk still matches."""
    record = storage_record(original[0])
    path = tmp_path / "last.ckpt"
    path.write_bytes(with_directory_attribute(original[0], record))
    with pytest.raises(CheckpointError, match=rf"{path}.* is truncated or corrupted: record '{record}' is "):
        read_checkpoint_file(path)


def test_a_disk_count_in_the_zip64_locator_is_refused(original, tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(with_zip64_disk_count(original[0], 2))
    with pytest.raises(CheckpointError, match=rf"{path}.*zip64 locator says the archive spans disks"):
        read_checkpoint_file(path)


@pytest.mark.parametrize("method", [1, 8, 12])  # shrunk, deflated, bzip2: each a bit away from stored (0)
def test_a_compression_method_is_refused(original, method, tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(with_central_field(original[0], "archive/data.pkl", CD_METHOD, method))
    with pytest.raises(
        CheckpointError, match=rf"{path}.*'archive/data.pkl' is compressed \(method {method}\)"
    ):
        read_checkpoint_file(path)


@pytest.mark.parametrize("flag", [0x0001, 0x0040])  # encrypted, strongly encrypted
def test_the_encryption_flag_is_refused(original, flag, tmp_path):
    data = original[0]
    record = storage_record(data)
    flags = struct.unpack_from("<H", data, central_entries(data)[record] + CD_FLAGS)[0]
    path = tmp_path / "last.ckpt"
    path.write_bytes(with_central_field(data, record, CD_FLAGS, flags | flag))
    with pytest.raises(CheckpointError, match=rf"{path}.*'{record}' is flagged as encrypted"):
        read_checkpoint_file(path)


def test_a_name_that_is_not_utf8_under_the_utf8_flag_is_refused(original, tmp_path):
    """torch.save sets the UTF-8 flag (bit 11) on every entry; one name byte with its top bit flipped is not
    UTF-8, and the record torch.load looks for by that name is gone."""
    data = original[0]
    record = storage_record(data)
    position = central_entries(data)[record]
    assert struct.unpack_from("<H", data, position + CD_FLAGS)[0] & 0x0800
    offset = position + CD_HEADER + len(record) - 1
    path = tmp_path / "last.ckpt"
    path.write_bytes(changed(data, offset, data[offset] | 0x80))
    with pytest.raises(CheckpointError, match=rf"{path}.*references storage .*there is no record '{record}'"):
        read_checkpoint_file(path)


def test_a_storage_record_of_another_size_than_its_tensors_need_is_refused(original, tmp_path):
    """A record emptied in the central directory (sizes and CRC 0, a consistent entry): nothing to check a
    CRC against, and the pickle still rebuilds its tensors from bytes that are not there."""
    data = original[0]
    record = storage_record(data)
    out = bytearray(data)
    struct.pack_into("<III", out, central_entries(data)[record] + CD_CRC, 0, 0, 0)
    path = tmp_path / "last.ckpt"
    path.write_bytes(bytes(out))
    with pytest.raises(CheckpointError, match=rf"'{record}' holds 0 bytes, its pickle rebuilds tensors from"):
        read_checkpoint_file(path)


# ---------------------------------------------------------------------------------------------------
# What still loads, and what is no checkpoint
# ---------------------------------------------------------------------------------------------------


def test_checkpoints_of_other_writers_load(tmp_path):
    """torch's format before 1.6 (no archive: nothing to check, loaded as torch.load loads it), and an archive
    rewritten by Python's zipfile (stored records, no padding, no zip64 records)."""
    weights = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3)}
    torch.save(weights, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert bit_equal(read_checkpoint_file(tmp_path / "legacy.pt"), weights)
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(tmp_path / "rewritten.pt", "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert bit_equal(read_checkpoint_file(tmp_path / "rewritten.pt"), weights)


def test_a_checkpoint_saved_without_crcs_loads_as_torch_loads_it(original, tmp_path):
    """torch's own option to skip CRCs records 0 for each: the file loads exactly, as torch.load reads it, and
    structure damage is still refused; one record's CRC of 0 among recorded ones is still checked."""
    path = tmp_path / "archive.ckpt"
    # torch's own patch: monkeypatch would delete the option on undo (it is no attribute in the __dict__).
    with torch.utils.serialization.config.patch("save.compute_crc32", False):
        saved_checkpoint(path)
    data = path.read_bytes()
    assert {info.CRC for info in zipfile.ZipFile(path).infolist()} == {0}
    expected = torch.load(path, weights_only=True)
    assert loads_exactly_or_refuses(path, data, expected) == "same"
    assert bit_equal(expected, original[1])
    directory = with_central_field(data, storage_record(data), CD_METHOD, 8)  # "compressed"
    assert loads_exactly_or_refuses(tmp_path / "damaged.ckpt", directory, expected) == "refused"
    one_zeroed = with_central_field(original[0], storage_record(original[0]), CD_CRC, 0, "<I")
    assert loads_exactly_or_refuses(tmp_path / "one_zeroed.ckpt", one_zeroed, expected) == "refused"


@pytest.mark.filterwarnings("ignore:`torch.jit.s:FutureWarning")
def test_a_torchscript_module_is_named_as_such(tmp_path):
    path = tmp_path / "module.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError, match=rf"{path}' is not a checkpoint: it is a TorchScript module"):
        read_checkpoint_file(path)


def test_an_unreadable_file_is_named_with_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_checkpoint_file({"w": torch.ones(2)}, path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "open", denied, raising=False)
    unreadable = rf"cannot read checkpoint '{path}' \(Permission denied\); check that it is a readable"
    with pytest.raises(CheckpointError, match=unreadable):
        read_checkpoint_file(path)


LIGHTNING = {"pytorch-lightning_version": "2.4.0", "epoch": 0, "global_step": 1}


@pytest.mark.parametrize(
    "edit, fragment",
    [
        ({"state_dict": [1.0, 2.0]}, "whose 'state_dict' is not a dict of tensors"),
        (
            {"state_dict": {"weight": [[1.0, 2.0]], "bias": torch.zeros(1)}},
            "whose .state_dict. is not a dict",
        ),
        ({"optimizer_states": 3}, "whose 'optimizer_states' is a int, not a list"),
    ],
)
def test_a_lightning_checkpoint_of_another_layout_is_refused_naming_it(tmp_path, edit, fragment):
    """Content the archive check cannot see (a file written so): refused by name, not an AttributeError."""
    module = nn.Linear(2, 1)
    path = tmp_path / "edited.ckpt"
    torch.save({**LIGHTNING, "state_dict": module.state_dict(), **edit}, path)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' is a Lightning checkpoint {fragment}"):
        read_start_checkpoint(path, module)
