"""Loading the kernels: the fallback and CI's switch, the build cache (unwritable, damaged, keyed by what a
build
depends on), ``python -m lightning_fusedsgd``, the CUDA architectures a library runs on, and the CUDA toolkit
behind an nvcc wrapper. The GPU-dependent paths run with the CUDA checks mocked."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import STEP_TWICE_ON_THE_REFERENCE
from torch import nn

from lightning_fusedsgd import FusedSGD, _abi, ops
from lightning_fusedsgd.ops import KernelBuildError, _build, _loader, load
from lightning_fusedsgd.optim import _backends


@pytest.fixture
def broken_toolchain(monkeypatch):
    def fail(device_type="cpu", verbose=False):
        raise ops.KernelBuildError("could not build the lightning_fusedsgd kernel: g++ not found")

    monkeypatch.setattr(ops, "load", fail)
    _backends._warn_fallback.cache_clear()
    yield
    _backends._warn_fallback.cache_clear()


def test_fallback_warns_once_and_still_steps(broken_toolchain, monkeypatch):
    monkeypatch.delenv(ops.REQUIRE_COMPILED_ENV, raising=False)
    p = nn.Parameter(torch.ones(4))
    opt = FusedSGD([p], lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p.grad = torch.ones(4)
            opt.step()
    fallback_warnings = [w for w in caught if "reference backend" in str(w.message)]
    assert len(fallback_warnings) == 1
    assert opt.last_backends == {"cpu/float32": "reference"}
    torch.testing.assert_close(p.detach(), torch.full((4,), -0.5))


def test_ci_switch_turns_the_fallback_into_an_error(broken_toolchain, monkeypatch):
    monkeypatch.setenv(ops.REQUIRE_COMPILED_ENV, "1")
    p = nn.Parameter(torch.ones(4))
    opt = FusedSGD([p], lr=0.5)
    p.grad = torch.ones(4)
    with pytest.raises(ops.KernelBuildError, match="g\\+\\+ not found"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4))


def test_explicit_compiled_backend_never_falls_back(broken_toolchain, monkeypatch):
    monkeypatch.delenv(ops.REQUIRE_COMPILED_ENV, raising=False)
    with pytest.raises(ops.KernelBuildError):
        _backends.implementation("compiled", torch.device("cpu"))
    assert _backends.implementation("auto", torch.device("meta"))[0] == "reference"
    with pytest.raises(RuntimeError, match="runs on CPU and CUDA tensors"):
        _backends.implementation("compiled", torch.device("meta"))
    with pytest.raises(ops.KernelBuildError, match="no compiled kernel for mps"):
        _loader.load("mps")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_build_key_changes_with_the_sources(monkeypatch, tmp_path, device_type):
    parts = ("torch", "python", "machine")
    key = _build.build_key(device_type, *parts)
    source = shutil.copytree(_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(_build, "CSRC", source)
    assert _build.build_key(device_type, *parts) == key
    assert _build.build_key(device_type, "torch", "python", "another machine") != key
    (source / "sgd_math.h").write_text("// changed\n", encoding="utf-8")
    assert _build.build_key(device_type, *parts) != key
    assert _build.build_key("cpu", *parts) != _build.build_key("cuda", *parts)


def test_a_new_environment_with_the_same_torch_reuses_the_cached_build(monkeypatch):
    """The cache entry follows torch's release and commit, not where it is installed: a new virtual
    environment (CI makes one per run) loads the library another built; another torch builds its own."""
    entry = _loader.cache_entry("cpu")
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/site-packages/torch/__init__.py")
    assert _loader.cache_entry("cpu") == entry
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    assert _loader.cache_entry("cpu")[1] != entry[1]


def test_a_build_key_covers_the_files_its_library_is_compiled_from(monkeypatch, tmp_path):
    """Each library's key changes with the files it includes, directly or not, and with no other: a change to
    the CUDA source or its emulation rebuilds neither the CPU library nor, for the emulation, the CUDA one."""
    source = shutil.copytree(_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(_build, "CSRC", source)
    keys = {kind: _build.build_key(kind) for kind in _build.EXTENSIONS}
    changes = {
        "fused_sgd_cuda.cu": {"cuda", "cuda_emulated"},
        "emulation/emulated_memory.h": {"cuda", "cuda_emulated"},  # device.h includes both devices' headers
        "emulation/op_call.h": {"cuda_emulated"},
        "emulation/fused_sgd_cuda_emulated.cpp": {"cuda_emulated"},
        "plan_arguments.h": {"cpu"},
        "vec_math.h": {"cpu", "cuda", "cuda_emulated"},  # through sgd_math.h
    }
    for name, rebuilt in changes.items():
        original = (source / name).read_bytes()
        (source / name).write_bytes(original + b"// changed\n")
        assert {kind for kind in keys if _build.build_key(kind) != keys[kind]} == rebuilt, name
        (source / name).write_bytes(original)


def _run(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != ops.REQUIRE_COMPILED_ENV}
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_an_unusable_cache_warns_and_falls_back_as_promised(tmp_path):
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"  # a cache under a file
    env = {_build.CACHE_ENV: str(cache)}
    result = _run(STEP_TWICE_ON_THE_REFERENCE, env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("RuntimeWarning: lightning_fusedsgd: the compiled kernel is unavailable") == 1
    assert _build.CACHE_ENV in result.stderr and "Traceback" not in result.stderr
    # The command that prebuilds the kernel says the same, with no traceback, and fails.
    command = subprocess.run(
        [sys.executable, "-m", "lightning_fusedsgd"],
        env={**os.environ, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert command.returncode == 1
    assert f"set {_build.CACHE_ENV} to a writable directory" in command.stderr
    assert "Traceback" not in command.stderr


def test_a_read_only_cache_is_a_build_error_naming_the_fix(monkeypatch):
    """On a read-only filesystem (which root cannot write either), the cache's OSError becomes the
    KernelBuildError the fallback turns into one warning."""
    monkeypatch.setenv(_build.CACHE_ENV, "/sys/lightning_fusedsgd_cache")
    with pytest.raises(ops.KernelBuildError, match=f"cannot be used .*set {_build.CACHE_ENV} to a writable"):
        _loader._build_and_load("cpu", verbose=False)


@pytest.mark.slow
def test_a_truncated_cached_library_is_never_mapped(tmp_path):
    """A library cut short (a full disk) with its build record in place would kill the process with SIGBUS at
    dlopen: its size and hash are checked first, and it is rebuilt (here no compiler is on PATH, so the step
    falls back with one message saying why)."""
    ops.load("cpu")
    _, library, record = _loader.cache_entry("cpu")
    cache = tmp_path / "cache"
    copied = cache / library.parent.name
    shutil.copytree(library.parent, copied)
    data = (copied / library.name).read_bytes()
    (copied / library.name).write_bytes(data[: len(data) // 3])
    empty = tmp_path / "bin"
    empty.mkdir()
    result = _run(STEP_TWICE_ON_THE_REFERENCE, {_build.CACHE_ENV: str(cache), "PATH": str(empty)}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        f"the cached library is damaged ({copied / library.name} has {len(data) // 3} bytes" in result.stderr
    )
    assert "RuntimeWarning: lightning_fusedsgd: the compiled kernel is unavailable" in result.stderr
    assert not (copied / library.name).exists()  # removed: never loaded again


def test_the_prebuild_command_loads_each_library_once(monkeypatch):
    """``python -m lightning_fusedsgd`` on a machine with a GPU: the CPU library, then the CUDA one, each
    once."""
    loaded = []

    def fake_load(device_type, verbose):
        loaded.append(device_type)
        return Path(f"/libraries/{device_type}.so")

    monkeypatch.setattr(_loader, "OUTCOMES", {})
    monkeypatch.setattr(_loader, "_load", fake_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _loader.main([]) == 0
    assert loaded == ["cpu", "cuda"]


@pytest.mark.parametrize(
    "arch_list, capabilities, runs",
    [
        ("8.0;9.0+PTX", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)], True),
        ("8.0;9.0+PTX", [(9, 0), (7, 5)], False),
        ("8.0 8.6", [(9, 0)], False),  # machine code runs on its major version only
        ("9.0a", [(9, 0)], True),  # architecture-specific: that version only
        ("9.0a", [(10, 0)], False),
        ("10.0f", [(10, 3)], True),  # family-specific: its major version, same or later minor
        ("10.0f", [(12, 0)], False),
        ("10.0f;12.0f+PTX", [(12, 1), (10, 0)], True),
    ],
)
def test_cuda_architectures_a_library_runs_on(arch_list, capabilities, runs):
    problem = _loader.cuda_arch_problem(arch_list, capabilities)
    assert (problem is None) == runs, problem


def test_an_unreadable_architecture_is_a_reason_to_build_not_an_error(monkeypatch):
    assert "'sm_90' cannot be read" in _loader.cuda_arch_problem("8.0;sm_90", [(9, 0)])
    # The wheel's CUDA library on a GPU its list does not cover: not used, with the reason, and no exception.
    info = {
        "torch": torch.__version__,
        "libraries": {"cuda": {"path": "ops/_lib/cuda.so"}},
        "cuda_arch_list": "9.0a",
    }
    monkeypatch.setattr(_loader, "_build_info", lambda: info)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (10, 0))
    assert _loader._prebuilt_library("cuda") == (
        None,
        "it was built for CUDA architectures 9.0a, this GPU is 10.0",
    )


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"torch": "2.', "cannot be read (Unterminated string"),  # cut short
        (b"\xff\xfe{}", "cannot be read ('utf-8' codec"),
        (b"[]", "is not laid out as setup.py writes it"),
        (b'{"torch": "TORCH", "libraries": {"cpu_default": {"size": 1}}}', "is not laid out as setup.py"),
        (b'{"torch": "TORCH", "libraries": {"cuda": {"path": "a.so"}}}', "is not laid out as setup.py"),
    ],
)
def test_a_damaged_wheel_build_record_is_a_reason_to_build_not_an_error(
    monkeypatch, tmp_path, content, problem
):
    """The wheel's build.json damaged or cut short: its libraries are not used, with the reason (the first-use
    build is tried next), and nothing raises."""
    (tmp_path / "build.json").write_bytes(content.replace(b"TORCH", torch.__version__.encode()))
    monkeypatch.setattr(_loader, "PREBUILT", tmp_path)
    monkeypatch.setenv(ops.CPU_CAPABILITY_ENV, "default")
    for device_type in ("cpu", "cuda"):
        library, why = _loader._prebuilt_library(device_type)
        assert library is None
        assert why.startswith(f"its build record is damaged: {tmp_path / 'build.json'} ") and problem in why


def test_an_unreadable_wheel_library_is_a_reason_to_build_not_an_error(monkeypatch, tmp_path):
    library = tmp_path / "cpu_default.so"
    library.write_bytes(b"\x7fELF")
    info = {"torch": torch.__version__, "libraries": {"cpu_default": {"path": str(library), "size": 4}}}
    (tmp_path / "build.json").write_text(json.dumps(info))
    monkeypatch.setattr(_loader, "PREBUILT", tmp_path)
    monkeypatch.setenv(ops.CPU_CAPABILITY_ENV, "default")
    monkeypatch.setattr(
        Path, "read_bytes", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
    )
    assert _loader._prebuilt_library("cpu") == (
        None,
        f"its library is damaged: {library} cannot be read ([Errno 13] Permission denied)",
    )


def test_the_cpu_capability_can_only_be_lowered(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delenv(ops.CPU_CAPABILITY_ENV, raising=False)
    assert ops.cpu_capability() == "avx2"
    monkeypatch.setenv(ops.CPU_CAPABILITY_ENV, "default")
    assert ops.cpu_capability() == "default"
    monkeypatch.setenv(ops.CPU_CAPABILITY_ENV, "avx512")
    with pytest.raises(ops.KernelBuildError, match="runs at most 'avx2'"):
        ops.cpu_capability()
    monkeypatch.setenv(ops.CPU_CAPABILITY_ENV, "sse9")
    with pytest.raises(ops.KernelBuildError, match="use one of default, avx2, avx512"):
        ops.cpu_capability()


def _fake_nvcc(directory: Path, top: Path) -> None:
    """An nvcc wrapper script outside the toolkit, as on the development machines; its --dryrun names
    ``top``."""
    directory.mkdir(parents=True)
    nvcc = directory / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "#$ _HERE_={top}/bin"\necho "#$ TOP={top}/bin/.."\n')
    nvcc.chmod(0o755)


def test_the_toolkit_is_the_one_nvcc_belongs_to(monkeypatch, tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libcudart.so").write_text("")
    _fake_nvcc(tmp_path / "wrapper", toolkit)
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "wrapper"))
    found, how = _build.cuda_toolkit()
    assert found == toolkit.resolve() and "wrapper/nvcc" in how
    # A toolkit without the CUDA runtime is none: the wheel is built for the CPU, saying why.
    (toolkit / "lib64" / "libcudart.so").unlink()
    found, why = _build.cuda_toolkit()
    assert found is None and "has no CUDA runtime" in why
    monkeypatch.setenv("CUDA_HOME", str(toolkit))  # an explicit toolkit wins
    assert _build.cuda_toolkit() == (toolkit, "$CUDA_HOME")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert _build.cuda_toolkit() == (None, "no nvcc on PATH and CUDA_HOME is not set")


def test_every_kernel_table_is_read_in_the_abis_order_and_checked_at_load(monkeypatch):
    """Each table the kernels read (hyperparameter columns, decays, update roundings, the schedule row, the
    LARS sums) is exported by the library in its C++ order and compared with _abi's when it loads; a column
    swapped on one side is an error that names both orders."""
    ops = load("cpu")
    for op, python, _ in _abi.kernel_tables():
        assert tuple(getattr(ops, op)()) == python, op
    library = _loader.OUTCOMES["cpu"]
    for index, (op, python, what) in enumerate(_abi.kernel_tables()):
        swapped = (python[1], python[0], *python[2:])
        tables = list(_abi.kernel_tables())
        tables[index] = (op, swapped, what)
        monkeypatch.setattr(_abi, "kernel_tables", lambda tables=tuple(tables): tables)
        with pytest.raises(
            KernelBuildError, match=re.escape(f"reads the {what} as {python} ({op}), _abi.py says")
        ):
            _loader._registered("cpu", library)
        monkeypatch.undo()


@pytest.mark.parametrize(
    "rule, changed",
    [
        ("held", lambda slot: lambda group, dtype: not slot.held(group, dtype)),
        ("dtype", lambda slot: lambda group, dtype: torch.float64),
    ],
)
@pytest.mark.parametrize("key", _abi.slot_keys())
def test_each_slots_held_and_dtype_rules_are_compared_at_load(monkeypatch, key, rule, changed):
    """The kernels' held and dtype rules of every slot (LFSGD_SLOTS) are compared with _abi.SLOTS' when the
    library loads, over every param dtype and combination of the plan options: one rule changed on the Python
    side is an error naming the slot."""
    load("cpu")
    library = _loader.OUTCOMES["cpu"]
    _loader._registered("cpu", library)
    slots = tuple(dataclasses.replace(s, **{rule: changed(s)}) if s.key == key else s for s in _abi.SLOTS)
    monkeypatch.setattr(_abi, "SLOTS", slots)
    with pytest.raises(KernelBuildError, match=f"for {key}, _abi.SLOTS says"):
        _loader._registered("cpu", library)


def test_the_plan_options_examples_take_each_decision_once():
    """The grid the slot rules are compared over: every option that decides a plan names valid examples, one
    for each of its decisions (update_rounding: each rounding; the others: off and on)."""
    for option in _abi.options():
        if option.plan is None:
            assert option.examples == (), option.key
            continue
        decisions = [option.plan(value) for value in option.examples]
        assert len(set(decisions)) == len(decisions) >= 2, option.key
        assert all(option.check is None or option.check(value) is None for value in option.examples), (
            option.key
        )
    assert {_abi.option("update_rounding").plan(v) for v in _abi.option("update_rounding").examples} == set(
        _abi.UPDATE_ROUNDINGS
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "capability",
    [
        pytest.param(name, marks=[pytest.mark.heavy] if name == "default" else [])
        for name in sorted(_build.CPU_CAPABILITIES)
    ],
)
def test_the_cpu_source_compiles_for_every_capability(capability):
    """A machine builds its own capability's library; the wheel builds them all (tests/test_wheel.py, heavy).
    The CPU source passes the compiler's front end with each other capability's flags, so that an AVX-512
    machine checks the AVX2 build and the other way round; the scalar loops of the default build, which no
    machine here runs, with the heavy tests."""
    if capability == _loader.cpu_capability():
        pytest.skip("this machine's own capability: its library is built and run by every kernel test")
    from torch.utils import cpp_extension

    includes = [_build.CSRC, *cpp_extension.include_paths()]
    flags = [
        "-fsyntax-only",
        "-std=c++20",
        *_build.cpu_flags(capability),
        *(f"-I{path}" for path in includes),
    ]
    command = ["g++", *flags, str(_build.CSRC / "fused_sgd.cpp")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
