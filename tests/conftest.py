"""Shared fixtures: the devices the kernel tests run on (CUDA where a GPU is present), so the CUDA kernel
is checked by the same tests, helpers and oracles as the CPU one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs a worker per core) each worker, and the processes its tests
    start, take their share of the cores: torch's threads in every worker would contend for all of them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each kernel test runs once per device: cpu, and cuda where present."""
    return torch.device(request.param)


# torch's config modules: their options are served by the module, not held in its own __dict__, so a tool
# that patches one as an attribute may lose it on undo (pytest 9.2's monkeypatch deletes an attribute it did
# not find in the target's __dict__: the option is hidden then, and every later torch.save fails).
_TORCH_CONFIGS = (
    "torch.utils.serialization.config",
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._functorch.config",
)


def _hidden_torch_options() -> dict[str, set[str]]:
    """Each loaded config module's hidden options (unreadable: what such an undo leaves). Values are not
    compared: importing a peer may set one (timm raises dynamo's recompile_limit)."""
    loaded = {name: sys.modules[name] for name in _TORCH_CONFIGS if name in sys.modules}
    return {
        name: {key for key, entry in config._config.items() if entry.hide} for name, config in loaded.items()
    }


@pytest.fixture(autouse=True)
def torch_config_options_kept():
    """Fails the test that leaves an option of torch's config hidden: use ``config.patch(...)``."""
    before = _hidden_torch_options()
    yield
    after = _hidden_torch_options()
    hidden = sorted(f"{name}.{key}" for name, keys in before.items() for key in after[name] - keys)
    if hidden:
        pytest.fail(
            f"the test left torch's config options {hidden} hidden: patch them with config.patch(...)"
        )
