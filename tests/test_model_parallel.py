"""Lightning's ModelParallelStrategy (FSDP2 applied in configure_model) with configure_fused_sgd on 2 CPU
processes: it fits, saves a distributed checkpoint and resumes with weights, momentum (DTensors), the
schedule position and the clipping setting exactly as saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
pytestmark = [
    pytest.mark.slow,  # several processes: make test runs them, make test-fast not
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]


def torchrun(*args: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        str(HERE / "model_parallel_run.py"),
    ]
    result = subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_model_parallel_strategy_fits_saves_and_resumes_exactly(tmp_path):
    torchrun(str(tmp_path), "4")
    torchrun(str(tmp_path), "6", str(tmp_path / "step4.ckpt"))
    saved = torch.load(tmp_path / "snapshots4.pt")["end"]
    resumed = torch.load(tmp_path / "snapshots6.pt")
    assert saved["backends"] == {"cpu/float32": "compiled"}  # our kernel on the local shards
    assert saved["state_is_dtensor"] and resumed["start"]["state_is_dtensor"]
    assert saved["max_grad_norm"] == [0.5, 0.5]  # Lightning's gradient_clip_val, clipped in the step
    start = resumed["start"]
    assert start["global_step"] == saved["global_step"] == 4
    assert start["schedule_position"] == saved["schedule_position"] == 4
    assert start["lr"] == saved["lr"]
    for key in ("weights", "momentum"):
        assert start[key].keys() == saved[key].keys() and len(saved[key]) == 4
        for name, value in saved[key].items():
            assert torch.equal(start[key][name], value), (key, name)
    assert resumed["end"]["global_step"] == 6
    assert not torch.equal(resumed["end"]["weights"]["net.0.weight"], saved["weights"]["net.0.weight"])
