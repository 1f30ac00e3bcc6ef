"""bench/gpu.py, the GPU benchmark, run whole on small sizes (``--smoke``) wherever the suite runs, so that
it is complete when a GPU is lent: every section ends (the captured one needs CUDA) and states its ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
# A benchmark's readiness, not the product's behaviour: make test-all runs it (before a GPU session).
@pytest.mark.heavy
def test_the_gpu_benchmark_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, "gpu.py", "--smoke", "--out", str(out)],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    captured = "title" if torch.cuda.is_available() else "skipped"
    assert {name: next(iter(section)) for name, section in sections.items()} == {
        "resnet50": "title",
        "flat": "title",
        "captured": captured,
        "train": "title",
    }
    for name in ("resnet50", "flat"):
        assert set(sections[name]["ratios"]) == {
            "FusedSGD / copy floor",
            "torch fused / FusedSGD",
            "torch foreach / FusedSGD",
            "FusedSGD + average / FusedSGD",
            "torch fused + _foreach_lerp_ / FusedSGD + average",
            "FusedSGDScheduleFree / copy floor",
            "schedulefree (foreach) / FusedSGDScheduleFree",
            "FusedLARS / FusedSGD",
            "timm Lars / FusedLARS",
        }
    assert all(value > 0 for value in sections["train"]["training"].values())
