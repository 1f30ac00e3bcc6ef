"""``ckpt_path=auto`` and ``ckpt_path=last``: which checkpoint a run resumes, found among the run directories.

Oracle: run directories laid out by hand (files with set modification times) and the one a user would pick:
the newest ``last.ckpt`` (or Lightning's ``hpc_ckpt_<n>.ckpt``) of the run's own directory, else of the
directories its ``hydra.run.dir`` makes at other times, the same recipe.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from lightning_helpers import compose_train
from lightning_utilities.core import rank_zero as lightning_utilities_rank_zero

from lightning_fusedsgd.lightning import ConfigError
from runner.auto_resume import resolve_ckpt_path
from runner.run import train

TIMESTAMPED = "hydra.run.dir={root}/outputs/${{name}}/${{now:%Y-%m-%d_%H-%M-%S}}"


@pytest.fixture
def info_lines():
    """The runner's rank-zero log lines (the logger lightning_utilities' rank_zero_info writes to)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = lightning_utilities_rank_zero.log
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def checkpoint(path: Path, age_s: float) -> Path:
    """An (empty) checkpoint file written ``age_s`` seconds ago: only its place and time matter here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    modified = path.stat().st_mtime - age_s
    os.utime(path, (modified, modified))
    return path


def resolved(overrides: list[str], run_dir: Path) -> str | None:
    return resolve_ckpt_path(compose_train(["debug=tiny", *overrides], run_dir))


def test_auto_resumes_the_newest_checkpoint_of_the_recipes_run_dirs(tmp_path: Path, info_lines) -> None:
    runs = tmp_path / "outputs" / "quickstart"
    checkpoint(runs / "2025-01-01_10-00-00" / "checkpoints" / "last.ckpt", age_s=300)
    newest = checkpoint(runs / "2025-01-02_10-00-00" / "hpc_ckpt_2.ckpt", age_s=100)  # Lightning's requeue
    checkpoint(runs / "2025-01-02_10-00-00" / "checkpoints" / "last.ckpt", age_s=200)
    checkpoint(runs / "2025-01-03_10-00-00" / "checkpoints" / ".last.ckpt.123.tmp", age_s=0)  # a killed write
    checkpoint(tmp_path / "outputs" / "simclr" / "2025-01-04_10-00-00" / "checkpoints" / "last.ckpt", age_s=0)
    this_run = runs / "2025-01-05_10-00-00"

    overrides = ["ckpt_path=auto", TIMESTAMPED.format(root=tmp_path)]
    assert resolved(overrides, this_run) == str(newest)
    assert resolved(["ckpt_path=last", *overrides[1:]], this_run) == str(newest)
    assert info_lines[-1] == (
        f"ckpt_path=last: resuming {newest}, the newest checkpoint in {this_run} or {runs}/*"
    )

    # The run's own checkpoints first, however new the others are: a fixed run dir resumed again.
    own = checkpoint(this_run / "checkpoints" / "last.ckpt", age_s=1000)
    assert resolved(overrides, this_run) == str(own)


def test_a_fixed_run_dir_resumes_its_own_checkpoints_only(tmp_path: Path, info_lines) -> None:
    checkpoint(tmp_path / "other" / "checkpoints" / "last.ckpt", age_s=0)
    fixed = tmp_path / "fixed"
    overrides = [f"hydra.run.dir={fixed}"]
    assert resolved(["ckpt_path=auto", *overrides], fixed) is None
    nothing = f"no checkpoint (checkpoints/last.ckpt, hpc_ckpt_*.ckpt) in {fixed}"
    assert info_lines[-1] == f"ckpt_path=auto: {nothing}: starting a new run"
    with pytest.raises(ConfigError) as refused:
        resolved(["ckpt_path=last", *overrides], fixed)
    assert str(refused.value) == (
        f"ckpt_path=last: nothing to resume: {nothing}; ckpt_path=auto starts a new run then"
    )
    own = checkpoint(fixed / "checkpoints" / "last.ckpt", age_s=0)
    assert resolved(["ckpt_path=last", *overrides], fixed) == str(own)


def test_a_job_of_a_sweep_resumes_its_own_checkpoints_only(tmp_path: Path) -> None:
    """The other jobs of a sweep (and of earlier sweeps) ran other overrides."""
    checkpoint(tmp_path / "sweep" / "0" / "checkpoints" / "last.ckpt", age_s=0)
    job = tmp_path / "sweep" / "1"
    overrides = ["ckpt_path=auto", "hydra.mode=MULTIRUN", TIMESTAMPED.format(root=tmp_path)]
    assert resolved(overrides, job) is None
    own = checkpoint(job / "checkpoints" / "last.ckpt", age_s=0)
    assert resolved(overrides, job) == str(own)


def test_last_with_nothing_to_resume_is_refused_before_training(tmp_path: Path) -> None:
    """Lightning's own ckpt_path="last" looked in the new run dir, found nothing and trained from scratch,
    with only a warning."""
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^ckpt_path=last: nothing to resume: no checkpoint"):
        train(compose_train(["debug=tiny", "ckpt_path=last", f"hydra.run.dir={run_dir}"], run_dir))
    assert not list(tmp_path.rglob("*.ckpt"))
