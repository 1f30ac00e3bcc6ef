"""The wheel (setup.py): built once per session with its CPU kernels (no CUDA), installed into a fresh
directory, and run where no compiler, no ninja and no kernel cache exist, each CPU library giving torch's bits
at its capability; and how the loader picks, or
refuses, the wheel's libraries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import STEP_TWICE_ON_THE_REFERENCE

from lightning_fusedsgd import ops
from lightning_fusedsgd.ops import _build

# Builds a wheel (two minutes on 2 cores): make test-all runs it, make test and make test-fast not.
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("gcc", "g++", "cc", "c++", "clang", "clang++", "nvcc", "ninja")
TORCH_CAPABILITY = {"AVX512": "avx512", "AVX2": "avx2"}.get(
    torch.backends.cpu.get_cpu_capability(), "default"
)
RUNNABLE = list(_build.CPU_CAPABILITIES)[: list(_build.CPU_CAPABILITIES).index(TORCH_CAPABILITY) + 1]

# Run in the fresh process: FusedSGD against torch.optim.SGD (the oracle), from the installed package, on the
# compiled kernel, bit for bit (torch runs ATen's kernels of the same capability); prints the library that
# ran.
STEP_AGAINST_TORCH = """
import itertools, shutil, sys
from pathlib import Path
import torch
site, tools = Path(sys.argv[1]), sys.argv[2:]
assert not [tool for tool in tools if shutil.which(tool)], "a compiler is still on PATH"
import lightning_fusedsgd
from lightning_fusedsgd import FusedSGD
from lightning_fusedsgd.ops import _loader
assert Path(lightning_fusedsgd.__file__).is_relative_to(site), lightning_fusedsgd.__file__
for dtype, (momentum, dampening, nesterov) in itertools.product(
    (torch.float32, torch.float64), ((0.9, 0.0, True), (0.9, 0.3, False), (0.0, 0.0, False))
):
    torch.manual_seed(0)
    shapes = [(300, 200), (33,), (64, 3, 3, 3)]
    ours = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hparams = dict(lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=1e-4)
    optimizer, oracle = FusedSGD(ours, **hparams), torch.optim.SGD(theirs, **hparams)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, dtype=dtype)
            q.grad = p.grad.clone()
        optimizer.step()
        oracle.step()
        ran = optimizer.last_backends
        assert all(name.startswith("compiled") for name in ran.values()), ran
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs)), (dtype, hparams)
print(_loader.OUTCOMES["cpu"])
"""


def run_isolated(site: Path, tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    """Runs ``script`` with ``site`` as the package's only source: no compiler or ninja on PATH (an empty
    directory), an empty kernel cache, and a working directory outside the source tree."""
    empty = tmp_path / "empty_path"
    empty.mkdir(exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "CUDA_HOME", "CUDA_PATH")}
    for switch in (ops.CPU_CAPABILITY_ENV, ops.REQUIRE_COMPILED_ENV):  # CI sets the latter
        clean.pop(switch, None)
    clean.update(PATH=str(empty), PYTHONPATH=str(site), LIGHTNING_FUSEDSGD_CACHE=str(cache), **env)
    return subprocess.run(
        [sys.executable, "-c", script, str(site), *TOOLS],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU wheel, built once from a copy of the sources (so no build/ of the tree is reused) and
    installed with --target into a fresh directory."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "lightning_fusedsgd",
        source / "lightning_fusedsgd",
        ignore=shutil.ignore_patterns("__pycache__", "_lib"),
    )
    env = {**os.environ, "LIGHTNING_FUSEDSGD_BUILD_CUDA": "0"}  # CI builds no CUDA
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    dist, site = work / "dist", work / "site"
    wheel = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(source)]
    result = subprocess.run([*pip, *wheel], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = dist.glob("*.whl")
    install = ["install", "--no-deps", "--no-index", "--target", str(site), str(built)]
    result = subprocess.run([*pip, *install], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return site


@pytest.mark.parametrize(
    "capability",
    [
        pytest.param(
            name, marks=pytest.mark.skipif(name not in RUNNABLE, reason=f"this CPU cannot run {name}")
        )
        for name in _build.CPU_CAPABILITIES
    ],
)
def test_the_wheels_kernel_runs_without_a_compiler(site, tmp_path, capability):
    result = run_isolated(
        site,
        tmp_path,
        STEP_AGAINST_TORCH,
        LIGHTNING_FUSEDSGD_REQUIRE_COMPILED="1",
        LIGHTNING_FUSEDSGD_CPU_CAPABILITY=capability,
        ATEN_CPU_CAPABILITY=capability,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    library = Path(result.stdout.strip().splitlines()[-1])
    assert library.parent == site / "lightning_fusedsgd" / "ops" / "_lib"
    assert library.name.startswith(f"cpu_{capability}.")
    assert not any((tmp_path / "cache").iterdir()), "nothing is compiled"
    assert result.stderr == ""


def test_a_wheel_for_another_torch_falls_back_with_one_message(site, tmp_path):
    """A wheel's library is never loaded under another torch: the first-use build is tried instead (here it
    cannot compile), and one message says why, then the fallback warning; nothing crashes."""
    other = tmp_path / "site"
    shutil.copytree(site, other)
    info_path = other / "lightning_fusedsgd" / "ops" / "_lib" / "build.json"
    info = json.loads(info_path.read_text())
    info["torch"] = "0.0.0"
    info_path.write_text(json.dumps(info))
    result = run_isolated(other, tmp_path, STEP_TWICE_ON_THE_REFERENCE)
    assert result.returncode == 0, result.stdout + result.stderr
    why = f"built for torch 0.0.0, this is torch {torch.__version__}"
    notices = [line for line in result.stderr.splitlines() if line.startswith("lightning_fusedsgd:")]
    assert len(notices) == 1 and why in notices[0], result.stderr
    assert "RuntimeWarning: lightning_fusedsgd: the compiled kernel is unavailable" in result.stderr


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_each_cpu_library_keeps_to_its_instruction_set(site):
    """No -march=native or stray flag: the baseline library has no AVX register, the AVX2 one no AVX-512
    register (zmm, xmm16-31/ymm16-31, mask registers); the AVX-512 one uses them (its flags applied)."""
    build = json.loads((site / "lightning_fusedsgd" / "ops" / "_lib" / "build.json").read_text())
    libraries = {
        name: site / "lightning_fusedsgd" / entry["path"] for name, entry in build["libraries"].items()
    }
    avx = re.compile(r"%ymm|%zmm")
    avx512 = re.compile(r"%zmm|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|%k[0-7]\b")
    for name, forbidden in (("cpu_default", avx), ("cpu_avx2", avx512)):
        code = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(libraries[name])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert not forbidden.search(code), f"{name} uses instructions beyond its instruction set"
    code = subprocess.run(
        ["objdump", "-d", str(libraries["cpu_avx512"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "%zmm" in code


# Run in the fresh process: every layer of the library imported, and a step, loading none of the recipe
# runner's dependencies (lightning itself imports torchvision and matplotlib where they are installed).
LIBRARY_WITHOUT_THE_RECIPE_EXTRAS = """
import sys
from pathlib import Path
import torch
import lightning_fusedsgd.checkpoint, lightning_fusedsgd.lightning, lightning_fusedsgd.schedule
from lightning_fusedsgd import FusedSGD
p = torch.nn.Parameter(torch.ones(4))
optimizer = FusedSGD([p], lr=0.5, momentum=0.9)
p.grad = torch.ones(4)
optimizer.step()
assert torch.equal(p.detach(), torch.full((4,), 0.5)), p
assert optimizer.last_backends == {"cpu/float32": "compiled"}, optimizer.last_backends
loaded = sorted({"hydra", "omegaconf", "sklearn", "lightly", "timm"} & set(sys.modules))
assert not loaded, loaded
print(sorted(path.name for path in Path(sys.argv[1]).iterdir()))
"""


def test_the_wheel_is_the_library_alone(site, tmp_path):
    """The wheel ships the library, which needs torch and lightning only: no recipe runner (it stays beside
    train.py in a checkout), and every layer imports and steps without loading the recipe extras."""
    result = run_isolated(site, tmp_path, LIBRARY_WITHOUT_THE_RECIPE_EXTRAS)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = result.stdout.strip().splitlines()[-1]
    assert "'lightning_fusedsgd'" in installed and "runner" not in installed, installed
