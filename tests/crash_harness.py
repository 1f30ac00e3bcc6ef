"""``train.py`` that pauses at a chosen moment, so that ``test_crash_safety.py`` can SIGKILL it there.

Usage: ``python tests/crash_harness.py PAUSE SIGNAL_FILE TRAIN_ARGS...`` where PAUSE is

* ``write:N``: the N-th write of ``last.ckpt`` stops half-way, with those bytes flushed to disk;
* ``step:N``: training stops just before optimizer step N + 1 (when ``global_step`` is N).

Once paused it creates SIGNAL_FILE and sleeps. The pause points are patched in from here, so the
package carries no test hooks.
"""

from __future__ import annotations

import io
import os
import runpy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # train.py's directory, as when it runs itself: the recipe runner is there


def _pause(signal_file: str) -> None:
    Path(signal_file).touch()
    time.sleep(600)
    raise SystemExit("crash_harness: paused and not killed within 600 s")


def _file_name(file: object) -> str:
    """The name of the file behind an open file object (save_checkpoint_file opens it by descriptor)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{file.fileno()}")).name  # type: ignore[attr-defined]
    except (AttributeError, OSError, io.UnsupportedOperation):
        return ""


def _pause_in_checkpoint_write(number: int, signal_file: str) -> None:
    real_save = torch.save
    writes = 0

    def save(obj, file, *args, **kwargs):
        nonlocal writes
        if _file_name(file).startswith(".last.ckpt."):  # save_checkpoint_file's temporary file
            writes += 1
            if writes == number:
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                file.write(buffer.getvalue()[: buffer.tell() // 2])
                file.flush()
                os.fsync(file.fileno())
                _pause(signal_file)
        return real_save(obj, file, *args, **kwargs)

    torch.save = save


def _pause_before_step(number: int, signal_file: str) -> None:
    from runner.model import ImageClassifier

    real_training_step = ImageClassifier.training_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == number:
            _pause(signal_file)
        return real_training_step(self, batch, batch_idx)

    ImageClassifier.training_step = training_step


def main() -> None:
    pause, signal_file, train_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    kind, _, number = pause.partition(":")
    {"write": _pause_in_checkpoint_write, "step": _pause_before_step}[kind](int(number), signal_file)
    sys.argv = [str(ROOT / "train.py"), *train_args]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
