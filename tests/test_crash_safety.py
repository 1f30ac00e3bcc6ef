"""Crash safety: train.py killed with SIGKILL at several moments always leaves a last.ckpt that loads,
and resuming from it finishes with exactly the result of a run that was never interrupted.

One run directory is killed three times, each time resumed with the same command plus ``ckpt_path``:
half-way through writing a step checkpoint, between two checkpoints in the middle of an epoch, and
half-way through writing an epoch-end checkpoint. ``tests/crash_harness.py`` makes the process pause at
those moments (a half-written file flushed to disk, or a batch not yet trained) and signal through a
file; the test then kills it. Oracle: the same run made in one go, compared bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning_helpers import (
    ROOT,
    SMALL_RUN,
    STEPS_PER_EPOCH,
    assert_identical,
    final_state,
    last_checkpoint,
    run_train_py,
)

from lightning_fusedsgd.checkpoint import read_checkpoint_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,  # four train.py processes, over a minute: make test-all runs it
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness reads /proc/self/fd"),
]

RUN = [*SMALL_RUN, "schedule.milestones=[3]", "trainer.max_epochs=4"]
# last.ckpt also every 2 steps: writes at steps 2, 3 (epoch end), 4, 6, 6 (epoch end), 8, 9 (epoch end)...
STEP_CHECKPOINTS = "callbacks.step_checkpoint.every_n_train_steps=2"


def kill_when_paused(pause: str, args: list[str], tmp_path: Path) -> None:
    """Run train.py ARGS under the crash harness, SIGKILL it once it pauses at PAUSE."""
    signal_file = tmp_path / f"paused_{pause.replace(':', '_')}"
    log = tmp_path / f"{signal_file.name}.log"
    command = [sys.executable, str(ROOT / "tests" / "crash_harness.py"), pause, str(signal_file), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not signal_file.exists():
            assert process.poll() is None, (
                f"train.py ended before pausing at {pause}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no pause at {pause} within 300 s"
            time.sleep(0.1)
        process.kill()
        assert process.wait(timeout=60) == -signal.SIGKILL


def load_last(run_dir: Path) -> dict:
    """The run's last.ckpt, which must load (CRCs checked) after any kill."""
    return read_checkpoint_file(last_checkpoint(run_dir))


def temp_files(run_dir: Path) -> list[Path]:
    """Temporary files of last.ckpt writes (see save_checkpoint_file)."""
    return sorted(last_checkpoint(run_dir).parent.glob(".last.ckpt.*.tmp"))


def test_killed_runs_resume_from_the_last_good_checkpoint_to_the_uninterrupted_result(tmp_path: Path) -> None:
    straight = run_train_py([*RUN, f"hydra.run.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]

    run = tmp_path / "run"
    command = [*RUN, STEP_CHECKPOINTS, f"hydra.run.dir={run}"]
    resume = f"ckpt_path={last_checkpoint(run)}"

    # 1. Killed while writing the step-4 checkpoint: last.ckpt is still the complete epoch-end one.
    kill_when_paused("write:3", command, tmp_path)
    assert load_last(run)["global_step"] == 3
    assert len(temp_files(run)) == 1  # the half-written file the kill interrupted

    # 2. Resumed, then killed between checkpoints, before step 6: the mid-epoch step-4 checkpoint.
    kill_when_paused("step:5", [*command, resume], tmp_path)
    checkpoint = load_last(run)
    assert checkpoint["global_step"] == 4
    assert checkpoint["DigitsDataModule"] == {"epoch": 1, "batches": 1}
    assert temp_files(run) == []  # the next save of last.ckpt removed the dead writer's leftover

    # 3. Resumed mid-epoch, then killed while writing the epoch-end checkpoint at step 9
    #    (this run's 4th write: steps 6, 6, 8, 9): the step-8 checkpoint remains.
    kill_when_paused("write:4", [*command, resume], tmp_path)
    assert load_last(run)["global_step"] == 8

    # 4. Resumed once more, the run finishes: the very result of the uninterrupted run.
    finished = run_train_py([*command, resume])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_identical(final_state(run), final_state(tmp_path / "straight"))
    assert final_state(run)["global_step"] == 4 * STEPS_PER_EPOCH
    assert temp_files(run) == []
