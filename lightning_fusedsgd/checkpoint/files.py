"""Checkpoint files and what is in them: read only what torch.load will read as written, write atomically,
and check that an optimizer state dict is one."""

from __future__ import annotations

import argparse
import glob
import math
import os
import pickle
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_fusedsgd._abi import SLOTS
from lightning_fusedsgd.checkpoint.archive import ZIP_MAGIC, ArchiveDamage, TorchScriptArchive, check_archive
from lightning_fusedsgd.checkpoint.errors import CheckpointError, InvalidOptimizerStateError

# torchvision's reference script stores its argparse namespace under "args".
_SAFE_GLOBALS = [argparse.Namespace]
# FusedSGD's state that is a count, one number (``Slot.count``), rather than a tensor shaped as its param.
_COUNTS = frozenset(slot.key for slot in SLOTS if slot.count)


def count_problem(value: torch.Tensor) -> str | None:
    """Why ``value`` cannot be a count (``Slot.count``): one whole number >= 0 (shape (), an integer or
    whole-valued float dtype); ``None`` where it can."""
    if value.dim() != 0:
        return f"has shape {tuple(value.shape)}, but it is a count, one number (shape ())"
    if value.dtype == torch.bool or value.is_complex():
        return f"is a {value.dtype} tensor, but it is a count, a whole number >= 0"
    number = value.item()
    if not (math.isfinite(number) and number >= 0 and float(number).is_integer()):
        return f"is {number}, but it is a count, a whole number >= 0"
    return None


_USE_INTACT = "Nothing was loaded; use an intact checkpoint, e.g. an earlier one from the same directory."


def _unreadable(path: str, exc: BaseException) -> CheckpointError:
    """The error for a file ``torch.load`` could not read, telling unsafe content from corruption."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, pickle.UnpicklingError) and message.startswith("Weights only load failed"):
        # torch's message is long; the line naming the refused object is the useful part.
        detail = next(
            (line.strip() for line in str(exc).splitlines() if "Unsupported global" in line), message
        )
        return CheckpointError(
            f"checkpoint {path!r} holds pickled Python objects that a weights-only load refuses "
            f"({detail}). Nothing was loaded; if you trust the file's source, load it without that "
            "restriction (trusted=True here, Trainer.fit(..., weights_only=False) for a ckpt_path)."
        )
    return CheckpointError(
        f"cannot read checkpoint {path!r}: it is truncated or corrupted ({type(exc).__name__}: "
        f"{message}). {_USE_INTACT}"
    )


def read_checkpoint_file(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    trusted: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint file after checking that ``torch.load`` will read it as it was written (for a zip
    archive, as torch.save writes: :func:`~lightning_fusedsgd.checkpoint.archive.check_archive`).

    Args:
        path: The checkpoint file.
        map_location: Passed to ``torch.load``.
        trusted: Allow arbitrary pickled objects (``weights_only=False``). Only for files from a
            source you trust; the default also accepts torchvision's ``args`` namespace.

    Returns:
        The checkpoint dict.

    Raises:
        CheckpointError: If the file is missing, unreadable, truncated, corrupted, holds objects a
            weights-only load refuses, or is not a dict. The message names the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist or is not a file; check the path")
    try:
        # One open file for the check and the load: what was checked is what is loaded.
        with open(path, "rb") as file:
            # torch.load reads a file as a zip archive when it starts as one; others (torch's format before
            # 1.6) have no checksums to check.
            if file.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                check_archive(file)
            file.seek(0)
            with torch.serialization.safe_globals(_SAFE_GLOBALS):
                checkpoint = torch.load(file, map_location=map_location, weights_only=not trusted)
    except ArchiveDamage as exc:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted: {exc}. {_USE_INTACT}") from exc
    except TorchScriptArchive as exc:
        raise CheckpointError(f"{path!r} is not a checkpoint: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path!r} ({exc.strerror or exc}); check that it is a readable file"
        ) from exc
    except Exception as exc:  # torch.load raises many types for damaged files; all mean "unreadable"
        raise _unreadable(path, exc) from exc
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"checkpoint {path!r} holds a {type(checkpoint).__name__}, not a checkpoint dict; expected a "
            "Lightning checkpoint, a torchvision reference checkpoint or a state dict"
        )
    return checkpoint


def _temp_name(target: Path) -> Path:
    # Hidden and not ending in .ckpt, so ModelCheckpoint never mistakes it for a checkpoint; the pid
    # lets a later save tell a dead writer's leftover from a live one.
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _remove_stale_temps(target: Path) -> None:
    """Delete temporary files of ``target`` left by writers that were killed mid-write."""
    for temp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        pid = temp.name[len(target.name) + 2 :].split(".")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            temp.unlink(missing_ok=True)
        except PermissionError:  # alive, owned by someone else
            continue


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a local ``path`` so that it is always either the old or the new complete file.

    Writes a hidden temporary file next to ``path`` (same filesystem, so the rename is atomic), flushes
    and fsyncs it, renames it over ``path`` with ``os.replace`` and fsyncs the directory, so the rename
    survives a power loss too. A failed write removes its temporary file; one left by a killed process
    is removed by the next save of the same file.

    Args:
        obj: What to save (a checkpoint dict).
        path: The target file; its directory is created if needed.

    Raises:
        OSError: If writing fails (disk full...); ``path`` then still holds the previous checkpoint.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    temp = _temp_name(target)
    try:
        # O_EXCL never clobbers; mode 0o666 leaves permissions to the umask, as a plain open() would.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)


def check_optimizer_state_dict(state_dict: Any, source: str = "the optimizer state dict") -> None:
    """Checks that ``state_dict`` is laid out as ``Optimizer.state_dict()`` makes it, with usable tensors, and
    FusedSGD's counts (``Slot.count``) one number each; the other state's shapes are checked against the
    params where those are known (the loader, name matching).

    Raises:
        InvalidOptimizerStateError: Naming what is wrong (and the parameter, where it has a name).
    """
    fix = (
        "load what optimizer.state_dict() returned "
        "(for a Lightning checkpoint: checkpoint['optimizer_states'][0])"
    )
    if not isinstance(state_dict, Mapping):
        raise InvalidOptimizerStateError(f"{source} is a {type(state_dict).__name__}, not a dict: {fix}.")
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        raise InvalidOptimizerStateError(f"{source} has no {' or '.join(map(repr, missing))} entry: {fix}.")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(state, Mapping) or not isinstance(groups, Sequence):
        raise InvalidOptimizerStateError(
            f"{source}: 'state' must be a dict and 'param_groups' a list: {fix}."
        )
    names = {}
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise InvalidOptimizerStateError(
                f"{source}: param_groups[{index}] has no 'params' list of parameter ids: {fix}."
            )
        names.update(zip(group["params"], group.get("param_names") or ()))
    for saved_id, entry in state.items():
        label = f"'{names[saved_id]}'" if saved_id in names else f"parameter {saved_id!r}"
        if not isinstance(entry, Mapping):
            raise InvalidOptimizerStateError(
                f"{source}: the state of {label} is a {type(entry).__name__}, not a dict: {fix}."
            )
        for key, value in entry.items():
            if key == "step" or value is None:  # other optimizers' step counts; torch's absent buffer
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidOptimizerStateError(
                    f"{source}: the {key} of {label} is a {type(value).__name__}, not a tensor: the state "
                    f"is damaged or not an optimizer's; {fix}."
                )
            if value.is_meta:
                raise InvalidOptimizerStateError(
                    f"{source}: the {key} of {label} is on the meta device and holds no values: load the "
                    "checkpoint with its data (torch.load(path, map_location='cpu')), not a meta-device copy."
                )
            problem = count_problem(value) if key in _COUNTS else None
            if problem is not None:
                raise InvalidOptimizerStateError(
                    f"{source}: the {key} of {label} {problem}: the state is damaged or was not saved by "
                    "FusedSGD; load the state the run saved (optimizer.state_dict()), or drop the optimizer "
                    "state to start it anew."
                )
