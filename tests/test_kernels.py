"""Backend selection: the compiled kernel, the one-warning fallback, and CI's switch that forbids it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_fusedsgd import FusedSGD, backends, kernels


@pytest.fixture
def broken_toolchain(monkeypatch):
    def fail(device_type="cpu"):
        raise kernels.KernelBuildError("could not build the lightning_fusedsgd kernel: g++ not found")

    monkeypatch.setattr(kernels, "load_extension", fail)
    backends._warn_fallback.cache_clear()
    yield
    backends._warn_fallback.cache_clear()


def test_fallback_warns_once_and_still_steps(broken_toolchain, monkeypatch):
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV, raising=False)
    p = nn.Parameter(torch.ones(4))
    opt = FusedSGD([p], lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p.grad = torch.ones(4)
            opt.step()
    fallback_warnings = [w for w in caught if "reference backend" in str(w.message)]
    assert len(fallback_warnings) == 1
    torch.testing.assert_close(p.detach(), torch.full((4,), -0.5))


def test_ci_switch_turns_the_fallback_into_an_error(broken_toolchain, monkeypatch):
    monkeypatch.setenv(kernels.REQUIRE_COMPILED_ENV, "1")
    p = nn.Parameter(torch.ones(4))
    opt = FusedSGD([p], lr=0.5)
    p.grad = torch.ones(4)
    with pytest.raises(kernels.KernelBuildError, match="g\\+\\+ not found"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4))


def test_explicit_compiled_backend_never_falls_back(broken_toolchain, monkeypatch):
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV, raising=False)
    with pytest.raises(kernels.KernelBuildError):
        backends.compiled_or_fallback("compiled")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_build_key_changes_with_the_sources(monkeypatch, tmp_path, device_type):
    key = kernels._build_key(device_type)
    source = tmp_path / "csrc"
    source.mkdir()
    for name in kernels.EXTENSIONS[device_type].sources + kernels._HEADERS:
        (source / name).write_bytes((kernels._CSRC / name).read_bytes())
    monkeypatch.setattr(kernels, "_CSRC", source)
    assert kernels._build_key(device_type) == key
    (source / kernels._HEADERS[0]).write_text("// changed\n", encoding="utf-8")
    assert kernels._build_key(device_type) != key


def test_cpu_and_cuda_kernels_are_built_apart():
    assert kernels._build_key("cpu") != kernels._build_key("cuda")


def test_devices_without_a_kernel_run_the_reference():
    assert backends.compiled_or_fallback("auto", "mps") == "torch"
    with pytest.raises(kernels.KernelBuildError, match="no compiled kernel for mps"):
        backends.compiled_or_fallback("compiled", "mps")
