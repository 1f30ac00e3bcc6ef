"""Shared fixtures: the devices the kernel tests run on (CUDA where a GPU is present), so the CUDA kernel
is checked by the same tests, helpers and oracles as the CPU one."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each kernel test runs once per device: cpu, and cuda where present."""
    return torch.device(request.param)
