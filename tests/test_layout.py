"""The structure holds: layers that point down (import-linter's contracts in pyproject.toml), the op contract
written once, the library's own dependencies, and a documentation site that builds without a warning."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from lightning_fusedsgd import ops
from lightning_fusedsgd.ops import reference

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_fusedsgd"


def test_every_import_points_down():
    # Beside this Python first: `make test-latest` runs its environment's Python without activating it.
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "import-linter is part of the dev extra"
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def _sources() -> str:
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.h"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.cu")]
    return "\n".join(path.read_text() for path in files)


@pytest.mark.parametrize("op", ["sgd_step", "lars_sq_sums"])
def test_the_op_contract_is_written_once_per_language(op):
    """Python: the schema (ops/__init__.py), whose arguments the reference takes (checked here, so it cannot
    drift), and which nothing else restates: the step path hands a bucket the table and the step row. C++: one
    signature per op (bucket.h), shared by both kernels and by PlanArguments' typed call. The state slots
    and the step row: declared in _abi and in one X-macro each (their order is compared when the library
    loads)."""
    schema = getattr(ops.load("cpu"), op).default._schema
    assert list(inspect.signature(getattr(reference, op)).parameters) == [a.name for a in schema.arguments]
    text = _sources()
    written = {
        "schema": len(re.findall(rf'"{op}\(Tensor', text)),
        "Python": len(re.findall(rf"def {op}\(\s*params", text)),
        "C++": len(
            re.findall(rf"{op}_op\(at::TensorList params, at::TensorList grads, at::TensorList state", text)
        ),
        "slots": len(re.findall(r"#define LFSGD_SLOTS\(", text)),
        "step row": len(re.findall(r"#define LFSGD_STEP_ROW\(", text)),
    }
    assert written == dict.fromkeys(written, 1), written
    # A bucket's step takes the table and the step row as one list (and the sum a reported norm is added to),
    # in the protocol and both kinds of bucket.
    signature = (
        r"def sgd_step\(\s*self, table: Tensor, step: list\[Tensor \| None\], "
        r"unscaled_grad_sq_sum: Tensor \| None\s*\)"
    )
    assert len(re.findall(signature, text)) == 3


@pytest.mark.parametrize(
    "op", ["grad_sq_sum", "schedule_lrs", "schedule_free_scalars", "schedule_free_switch"]
)
def test_the_reference_takes_every_ops_schema_arguments(op):
    schema = getattr(ops.load("cpu"), op).default._schema
    assert list(inspect.signature(getattr(reference, op)).parameters) == [a.name for a in schema.arguments]


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
