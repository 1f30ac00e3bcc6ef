"""Shared fixtures: the devices the kernel tests run on (CUDA where a GPU is present), so the CUDA kernel
is checked by the same tests, helpers and oracles as the CPU one."""

from __future__ import annotations

import sys

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


# torch's config modules: their options are served by the module, not held in its own __dict__, so a tool
# that patches one as an attribute may lose it on undo (pytest 9.2's monkeypatch deletes an attribute it did
# not find in the target's __dict__: the option is hidden then, and every later torch.save fails).
_TORCH_CONFIGS = (
    "torch.utils.serialization.config",
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._functorch.config",
)


def _torch_configs() -> dict[str, tuple[dict[str, object], set[str]]]:
    """Each loaded config module's option values and the options it hides (unreadable)."""
    loaded = {name: sys.modules[name] for name in _TORCH_CONFIGS if name in sys.modules}
    return {
        name: (config.get_config_copy(), {key for key, entry in config._config.items() if entry.hide})
        for name, config in loaded.items()
    }


@pytest.fixture(autouse=True)
def torch_configs_kept():
    """Fails the test that leaves an option of torch's config changed or hidden: use ``config.patch(...)``."""
    before = _torch_configs()
    yield
    after = _torch_configs()
    changed = [name for name, state in before.items() if after[name] != state]
    if changed:
        pytest.fail(
            f"the test left torch's config changed or an option hidden in {changed}: use config.patch"
        )
