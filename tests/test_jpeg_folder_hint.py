"""python runner/jpeg_folder.py from any directory, and the command it ends with, which trains on it."""

from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys

import pytest
from hydra.utils import instantiate
from lightning_helpers import ROOT, compose_train

from runner.overrides import refused_key

CONF = ROOT / "conf"


def _jpeg_folder_hint(tmp_path) -> list[str]:
    """python <checkout>/runner/jpeg_folder.py run from a directory outside the checkout, with no PYTHONPATH:
    its last line, the command it hints at."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    script = ROOT / "runner" / "jpeg_folder.py"
    result = subprocess.run(
        [sys.executable, str(script), "jpegs", "--classes", "2", "--train", "2", "--val", "1"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert len(list((cwd / "jpegs").rglob("*.JPEG"))) == 6
    return shlex.split(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_jpeg_folder_runs_from_any_directory_and_hints_a_command_that_composes(tmp_path, monkeypatch):
    """`python -m runner.jpeg_folder` runs in a checkout only; by its path it runs from anywhere, as train.py
    does, and its last line is a command (absolute paths) whose run finds the data from any directory."""
    python, script, *overrides = _jpeg_folder_hint(tmp_path)
    assert script == str(ROOT / "train.py") and python in ("python", sys.executable)
    assert f"data.root={tmp_path / 'elsewhere' / 'jpegs'}" in overrides and "data.num_classes=2" in overrides
    monkeypatch.chdir(tmp_path)
    datamodule = instantiate(compose_train(overrides, tmp_path / "run").data)
    assert refused_key(overrides, CONF, "train", "1.3") is None
    datamodule.check_data()


@pytest.mark.heavy
def test_the_jpeg_folders_hint_trains_from_another_directory(tmp_path):
    """The hint as typed (a ResNet-50 on the CPU: ~20-40 s): it ends with the summary line, and its run logs
    every step."""
    command = _jpeg_folder_hint(tmp_path)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("summary: name=resnet50 val_acc=")
    [metrics] = (tmp_path / "outputs" / "resnet50").glob("*/csv/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [int(row["step"]) for row in rows if row.get("train/loss")] == [0, 1]
