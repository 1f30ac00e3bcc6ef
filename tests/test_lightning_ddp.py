"""DDP through Lightning's own strategy: 2 CPU processes (gloo) train the quickstart model."""

from __future__ import annotations

import json

import pytest
from lightning_helpers import run_train_py

pytestmark = pytest.mark.slow  # whole runs in subprocesses: make test runs them, make test-fast not


# A whole epoch on 2 processes: with the heavy tests. In make test, a 2-process DDP run goes through train.py
# in tests/test_skip_unreadable_runs.py, and the lr scaled by the world size (tests/test_slurm.py) and each
# rank's share of the samples (tests/test_lightning_data.py) are checked in-process.
@pytest.mark.heavy
def test_two_process_ddp_scales_lr_with_world_size(tmp_path):
    result = run_train_py(
        [
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "trainer.max_epochs=1",
            "trainer.limit_val_batches=1",
            "data.batch_size=32",
            "data.image_size=16",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    # 32 per process x 2 processes: peak lr = 0.2 x 64 / 256.
    assert "global batch 64 (32 per device x 2 processes x 1 accumulated)" in log
    assert "peak lr 0.05 = base_lr 0.2 x 64/256" in log
    # Each process sees half of the 1437 training digits: ceil(719 / 32) = 23 steps, not 45.
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 23
    assert result.stdout.strip().splitlines()[-1].startswith("summary: name=quickstart val_acc=")
