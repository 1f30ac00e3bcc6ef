"""The structure holds: layers that point down (import-linter's contracts in pyproject.toml), the op contract
written once, the library's own dependencies, and a documentation site that builds without a warning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_fusedsgd"


def test_every_import_points_down():
    lint = shutil.which("lint-imports")
    assert lint is not None, "import-linter is part of the dev extra"
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def _sources() -> str:
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.h"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.cu")]
    return "\n".join(path.read_text() for path in files)


def test_the_sgd_step_signature_is_written_three_times():
    """The schema, the one C++ entry of both kernels, and the reference: nothing else restates it. The step
    path hands a bucket the step's scalars as one object (``StepScalars``), which the two kinds of bucket
    spell out once each, for the op and for the kept plan's C++ call."""
    text = _sources()
    written = {
        "schema": len(re.findall(r'"sgd_step\(Tensor\(a!\)\[\] params', text)),
        "C++": len(
            re.findall(r"at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers", text)
        ),
        "Python": len(re.findall(r"def sgd_step\(\s*params", text)),
        "a bucket's step, taking the scalars": len(
            re.findall(r"def sgd_step\(\s*self,\s*scalars: StepScalars,\s*grad_sq_sum", text)
        ),
        "a bucket's step, restating the scalars": len(re.findall(r"def sgd_step\(\s*self,\s*table", text)),
    }
    assert written == {
        "schema": 1,
        "C++": 1,
        "Python": 1,
        "a bucket's step, taking the scalars": 3,  # the protocol, a planned bucket, a kept one
        "a bucket's step, restating the scalars": 0,
    }, written


def test_the_library_needs_torch_and_lightning_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(re.split(r"[<>=!~ ]", dependency)[0] for dependency in project["dependencies"]) == [
        "lightning",
        "torch",
    ]
    assert {"recipes", "jit", "docs", "dev"} <= set(project["optional-dependencies"])


@pytest.mark.slow
def test_the_documentation_builds_in_strict_mode(tmp_path):
    """A broken link, a missing page or a docstring mkdocstrings cannot render fails the build."""
    subprocess.run([sys.executable, "docs/gen_benchmarks.py"], cwd=ROOT, check=True)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "FusedSGD" in api and "max_grad_norm" in api  # the reference is generated from the docstrings
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "bench/results/step.json" in benchmarks


def test_the_committed_benchmark_page_is_the_one_the_results_give():
    """docs/benchmarks.md is committed (the README links it) and generated from bench/results: a result
    changed without regenerating the page fails here."""
    result = subprocess.run(
        [sys.executable, "docs/gen_benchmarks.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for link in re.findall(r"\]\((img/[^)]+)\)", (ROOT / "docs" / "benchmarks.md").read_text()):
        assert (ROOT / "docs" / link).is_file(), link
